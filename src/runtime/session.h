// Session: tokens -> logits for one sequence. Owns the KV cache (F32) and the scratch
// buffers; runs prefill in chunks of `prefill_chunk` tokens and decode one token at a time
// through the same layer code. The routed-expert pass reduces expert outputs in the router's
// rank order, so results do not depend on where an expert's weights came from.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "runtime/interventions.h"
#include "runtime/model.h"

namespace ts {
class ThreadPool;
}

namespace ts::runtime {

struct SessionOptions {
  int n_ctx = 0;           // KV cache length; 0 = min(max_position_embeddings, 4096)
  int prefill_chunk = 256;  // tokens per forward chunk during prefill
  Interventions interventions;  // steering, residual capture, router trace
};

// One token's selection at one layer, in rank order.
struct RouterTraceEntry {
  int position;
  int layer;
  std::vector<int> ids;
  std::vector<float> weights;
};

// Time per phase, microseconds, accumulated over the session's forward calls.
struct PhaseTimes {
  double attention_us = 0;
  double router_us = 0;
  double expert_io_us = 0;
  double expert_compute_us = 0;
  double dense_ffn_us = 0;
  double lm_head_us = 0;
  uint64_t expert_requests = 0;  // (token, expert) selections
};

class Session {
 public:
  Session(const LoadedModel& model, ThreadPool& pool, SessionOptions options);

  int position() const { return pos_; }
  int n_ctx() const { return n_ctx_; }
  void reset() { pos_ = 0; }
  // Forgets every position from n on (the KV rows are overwritten by later tokens), to reuse
  // a shared prefix between turns. Precondition: 0 <= n <= position().
  void truncate(int n) { pos_ = std::min(pos_, std::max(0, n)); }

  // Runs `tokens` at the current position and advances it. If all_logits is given it is
  // resized to [tokens.size(), vocab] and filled; last_logits() always holds the last row.
  // Errors: empty input, a token id outside [0, vocab), or the context overflowing.
  Status forward(std::span<const int> tokens, std::vector<float>* all_logits);
  std::span<const float> last_logits() const { return last_logits_; }
  const PhaseTimes& phases() const { return phases_; }
  // Selections per (layer, expert), [n_layers * n_experts], over the session's lifetime.
  const std::vector<uint64_t>& router_hist() const { return router_hist_; }
  // Captured residual rows per capture layer (options.interventions.capture_layers order),
  // each [captured_positions(), d_model] row-major.
  const std::vector<std::vector<float>>& captures() const { return captures_; }
  int64_t captured_positions() const;
  const std::vector<RouterTraceEntry>& router_trace() const { return trace_; }

 private:
  Status forward_chunk(const int* tokens, int n, float* logits_out, bool last_chunk);
  void layer_boundary(int layer, int n, bool last_chunk);  // steering + capture
  void attention_block(int layer, int n);
  Status moe_block(int layer, int n);
  void dense_mlp_block(const model::ExpertWeights& mlp, int n, int d_hidden, float* out);

  const LoadedModel& model_;
  ThreadPool& pool_;
  int n_ctx_;
  int chunk_;
  int pos_ = 0;
  std::vector<float> k_cache_, v_cache_;  // [n_layers, n_ctx, kv_dim]
  std::vector<float> inv_freq_;
  // Scratch, sized for one chunk.
  std::vector<float> x_, xn_, q_, k_, v_, att_, tmp_, router_, slots_, gather_, h1_, h2_, h3_;
  std::vector<int> sel_ids_;
  std::vector<float> sel_w_;
  std::vector<float> last_logits_;
  PhaseTimes phases_;
  std::vector<uint64_t> router_hist_;
  Interventions iv_;
  std::vector<int> capture_index_;  // [n_layers + 1]: slot in captures_ or -1 (index 0 = embedding)
  std::vector<std::vector<float>> captures_;
  std::vector<RouterTraceEntry> trace_;
};

}  // namespace ts::runtime
