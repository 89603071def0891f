// Next-token sampling. Order: logit biases and repetition penalties on the logits (OpenAI's
// logit_bias, presence and frequency penalties, over the tokens this sampler has returned so
// far), then greedy at
// temperature 0 (lowest id on ties), else temperature -> top-k -> top-p (nucleus) -> min-p
// -> a draw from a seeded generator, so a seed reproduces a run.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ts {
class ThreadPool;
}

namespace ts::runtime {

struct SamplerOptions {
  float temperature = 0.0f;
  int top_k = 0;       // 0 = all
  float top_p = 1.0f;  // 1 = all
  float min_p = 0.0f;  // drop tokens below min_p * (the most likely token's probability)
  // logit[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t], where
  // count[t] is how often this sampler has returned t (OpenAI's definition).
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;
  // logit[id] += bias before everything else (OpenAI's logit_bias: -100 in effect bans a
  // token, +100 in effect forces it); ids past the logits are ignored.
  std::vector<std::pair<int, float>> logit_bias;
  // Greedy on the logits as they are: sample() is runtime::argmax.
  bool plain_greedy() const {
    return temperature <= 0.0f && presence_penalty == 0.0f && frequency_penalty == 0.0f &&
           logit_bias.empty();
  }
  // The first logit_bias id at or past `vocab` (what the CLI and the server refuse), or -1.
  int bias_outside(int64_t vocab) const {
    for (const auto& [id, bias] : logit_bias)
      if (id >= vocab) return id;
    return -1;
  }
};

class Sampler {
 public:
  explicit Sampler(SamplerOptions options) : opt_(options), rng_(options.seed) {}
  const SamplerOptions& options() const { return opt_; }
  // Picks the next token and counts it for the penalties.
  int sample(std::span<const float> logits);
  // Threads for the passes over the vocabulary at temperature > 0 (by default the calling
  // thread alone; the same draws either way). The pool must be idle while sample() runs.
  void set_pool(ThreadPool* pool) { pool_ = pool; }

 private:
  int pick(std::span<const float> logits);
  SamplerOptions opt_;
  std::mt19937_64 rng_;
  std::unordered_map<int, int> counts_;  // returned tokens, for the penalties
  std::vector<float> penalized_;         // the logits with biases and penalties
  std::vector<int> order_;               // token ids by rank, sorted where looked at
  std::vector<double> weights_;          // top-k: the kept tokens' weights
  std::vector<uint16_t> bins_;           // each token's bin (no top-k)
  std::vector<uint32_t> bin_start_, bin_fill_, chunk_count_;
  std::vector<double> chunk_weight_;
  ThreadPool* pool_ = nullptr;
  std::vector<double> bin_weight_;
  std::vector<bool> bin_sorted_;
};

int argmax(std::span<const float> v);

}  // namespace ts::runtime
