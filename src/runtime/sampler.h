// Next-token sampling: greedy at temperature 0 (lowest id on ties), else temperature ->
// top-k -> top-p (nucleus) -> a draw from a seeded generator, so a seed reproduces a run.
#pragma once

#include <cstdint>
#include <random>
#include <span>

namespace ts::runtime {

struct SamplerOptions {
  float temperature = 0.0f;
  int top_k = 0;        // 0 = all
  float top_p = 1.0f;   // 1 = all
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(SamplerOptions options) : opt_(options), rng_(options.seed) {}
  int sample(std::span<const float> logits);

 private:
  SamplerOptions opt_;
  std::mt19937_64 rng_;
};

int argmax(std::span<const float> v);

}  // namespace ts::runtime
