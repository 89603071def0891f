// Engine: the interface every backend's session implements — tokens in, logits out, one
// sequence, with its own KV cache. The CPU backend is runtime::Session; the CUDA backend is
// cuda::CudaSession (src/backend/cuda). Commands and the server hold an Engine and never
// learn the device.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"

namespace ts {
class ThreadPool;
}

namespace ts::runtime {

class LoadedModel;
struct SessionOptions;

// One token's selection at one layer, in rank order.
struct RouterTraceEntry {
  int position;
  int layer;
  std::vector<int> ids;
  std::vector<float> weights;
};

// Time per phase, microseconds, accumulated over the session's forward calls. A backend that
// runs asynchronously (CUDA) leaves the per-phase times it cannot see at 0 and reports the
// whole step in total_us.
struct PhaseTimes {
  double attention_us = 0;
  double router_us = 0;
  double expert_io_us = 0;
  double expert_compute_us = 0;
  double dense_ffn_us = 0;
  double lm_head_us = 0;
  double total_us = 0;
  uint64_t expert_requests = 0;  // (token, expert) selections
  // CUDA decode: the router's picks compared with the prediction made a layer ahead (whose
  // best ranks were prefetched into L2), and how many of them it named.
  uint64_t predicted_picks = 0;
  uint64_t predicted_right = 0;
  // What was counted after `base`, an earlier reading of the same session's times.
  PhaseTimes since(const PhaseTimes& b) const {
    return {attention_us - b.attention_us,
            router_us - b.router_us,
            expert_io_us - b.expert_io_us,
            expert_compute_us - b.expert_compute_us,
            dense_ffn_us - b.dense_ffn_us,
            lm_head_us - b.lm_head_us,
            total_us - b.total_us,
            expert_requests - b.expert_requests,
            predicted_picks - b.predicted_picks,
            predicted_right - b.predicted_right};
  }
};

// A backend's own expert cache (CUDA with --residency host|streamed): the GPU slots in front
// of pinned host memory or the model's files. Requests count distinct experts per layer per
// step, as the CPU's ExpertStore does.
struct ExpertCacheReport {
  std::string residency;  // "host" or "streamed"
  int slots_per_layer = 0;
  uint64_t requests = 0;
  uint64_t hits = 0;
  uint64_t copied_bytes = 0;  // host -> device
  double copy_ms = 0;         // time the copy stream spent copying
  double bind_ms = 0;         // host time planning each step's misses and issuing their copies
  // The counters gathered after `b`, an earlier reading of the same cache (its residency and
  // slots as now).
  ExpertCacheReport since(const ExpertCacheReport& b) const {
    return {residency,
            slots_per_layer,
            requests - b.requests,
            hits - b.hits,
            copied_bytes - b.copied_bytes,
            copy_ms - b.copy_ms,
            bind_ms - b.bind_ms};
  }
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual int position() const = 0;
  virtual int n_ctx() const = 0;
  virtual void reset() = 0;
  // Forgets every position from n on, to reuse a shared prefix. Precondition: 0 <= n. A
  // backend whose layers keep a recurrent state may forget more (position() says what stays).
  virtual void truncate(int n) = 0;
  // Runs `tokens` at the current position and advances it. If all_logits is given it is
  // resized to [tokens.size(), vocab] and filled; last_logits() always holds the last row.
  // Errors: empty input, a token id outside [0, vocab), or the context overflowing.
  virtual Status forward(std::span<const int> tokens, std::vector<float>* all_logits) = 0;
  virtual std::span<const float> last_logits() const = 0;
  // Greedy decoding: feeds `token`, then each step's argmax (argmax(): the first of the
  // largest logit) to the next step, and hands every new id to on_token in order, at most n;
  // on_token returns whether to go on. Afterwards the KV cache holds `token` and every id
  // on_token accepted except the last one given (what a loop of forward + argmax leaves:
  // the last id is never fed). The default is that loop; a backend may run steps ahead of
  // on_token (CUDA: steps queued on the device, the ids read back behind them) and takes back
  // any it ran past the stop, so the state and the ids are the same. last_logits() is
  // unspecified afterwards. Errors as forward's.
  virtual Status decode_greedy(int token, int n, const std::function<bool(int)>& on_token);
  virtual const PhaseTimes& phases() const = 0;
  // Selections per (layer, expert), [n_layers * n_experts], over the session's lifetime.
  virtual std::vector<uint64_t> router_hist() const = 0;
  // Captured residual rows per capture layer, each [captured_positions(), d_model].
  virtual const std::vector<std::vector<float>>& captures() const = 0;
  virtual int64_t captured_positions() const = 0;
  virtual const std::vector<RouterTraceEntry>& router_trace() const = 0;
  // "cpu" or the CUDA device's name, for reports.
  virtual std::string device_name() const = 0;
  // The backend's own expert cache, if it has one (the CPU's lives in the ExpertStore).
  virtual std::optional<ExpertCacheReport> expert_cache() const { return std::nullopt; }

  // Continuous batching: sequences beside the one above, each with its own KV rows, advanced
  // together by step(). A sequence's logits are the same bits alone or beside others, at any
  // place in a step (rows are computed independently: backend/cpu/kernels.h). A backend
  // that cannot batch keeps batches() false and the others' defaults (errors).
  virtual bool batches() const { return false; }
  // Most tokens, summed over the inputs, that one step() takes.
  virtual int step_tokens() const { return 0; }
  // KV positions not held by any sequence (cached prefix blocks count: they are given up
  // when needed).
  virtual int64_t free_kv_tokens() const { return 0; }
  // A new sequence with KV rows for `max_tokens` positions (at most n_ctx()). Where the cache
  // holds the KV rows of a run of `prefix`'s whole blocks (computed for an earlier or a
  // running sequence with those tokens), it starts with them shared: sequence_position() says
  // how many positions that saved (never the prefix's last token, whose logits the caller
  // needs). An error when the cache has not enough free positions (the caller waits).
  virtual Result<int> open_sequence(int max_tokens, std::span<const int> prefix = {});
  virtual void close_sequence(int seq) { (void)seq; }
  virtual int sequence_position(int seq) const {
    (void)seq;
    return 0;
  }
  // The KV pool's blocks: in use by sequences, cached (a finished prefix kept for reuse),
  // and the prompt positions open_sequence was given against those it found cached.
  struct KvStats {
    int64_t block_tokens = 0, blocks = 0, used = 0, cached = 0;
    uint64_t prefix_tokens = 0, reused_tokens = 0;
  };
  virtual KvStats kv_stats() const { return {}; }
  struct SeqInput {
    int seq;
    std::span<const int> tokens;  // not empty; appended at the sequence's position
    bool all_logits = false;      // every token's logits, not only the last one's
  };
  // Runs every input's tokens (at most step_tokens() in all) as one pass and resizes
  // `logits` to the rows asked for, in input order ([1 or tokens.size(), vocab] each).
  // Errors: as forward's, and a sequence's reserve exceeded; the step then changed nothing.
  virtual Status step(std::span<const SeqInput> inputs, std::vector<float>* logits);
};

enum class DeviceKind : uint8_t { kCpu, kCuda };
struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;  // CUDA device ordinal
};
// "cpu", "cuda", "cuda:N".
Result<Device> parse_device(const std::string& s);

// The session for `device`. CUDA errors (no GPU, a bad index, the model not fitting) come
// back as values naming the device and what was needed.
Result<std::unique_ptr<Engine>> make_engine(const LoadedModel& model, ThreadPool& pool,
                                            SessionOptions options, Device device);

}  // namespace ts::runtime
