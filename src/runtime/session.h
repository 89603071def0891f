// Session: tokens -> logits for one sequence. Owns the KV cache (F32) and the scratch
// buffers; runs prefill in chunks of `prefill_chunk` tokens and decode one token at a time
// through the same layer code. The routed-expert pass reduces expert outputs in the router's
// rank order, so results do not depend on where an expert's weights came from.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/status.h"
#include "experts/expert_cache.h"
#include "runtime/engine.h"
#include "runtime/interventions.h"
#include "runtime/model.h"

namespace ts {
class ThreadPool;
}

namespace ts::runtime {

// --device cuda: where the routed experts live (--residency). resident: every expert in GPU
// memory; host: all in pinned host memory behind a GPU cache of expert slots per MoE layer;
// streamed: read from the model's files (the ExpertStore, streamed) into that GPU cache.
enum class GpuResidency : uint8_t { kResident, kHost, kStreamed };
struct GpuExpertOptions {
  GpuResidency residency = GpuResidency::kResident;
  int slots_per_layer = 0;  // --expert-cache-slots; 0: from cache_gb, else all that fits
  double cache_gb = 0;      // --gpu-expert-cache-gb (1e9 bytes) over all MoE layers
  experts::CachePolicy policy = experts::CachePolicy::kLru;
  // Prefill chunks that use most experts load each MoE layer's uncached experts whole while
  // the layer before computes (host residency); off: each expert as its GEMMs reach it.
  bool layer_prefetch = true;
  // --cache-warm: selection counts [n_layers][n_experts] (empty rows for dense layers); the
  // most selected experts of each layer fill its slots before the first token.
  std::vector<std::vector<uint64_t>> warm;
};

struct SessionOptions {
  int n_ctx = 0;           // KV cache length; 0 = min(max_position_embeddings, 4096)
  int prefill_chunk = 0;    // tokens per forward chunk during prefill; 0 = the backend's
                            // default (CPU 256; CUDA 4096, or 2048 where tight)
  bool quantize_q8_0 = false;  // CUDA: float matrices -> Q8_0 at load (CPU: use a pack)
  GpuExpertOptions gpu_experts;  // CUDA only
  Interventions interventions;  // steering, residual capture, router trace
  // CUDA: after each layer's weights are on the device (layers done, layers, GPU bytes so far).
  experts::LayerProgress on_layer;
};

class Session final : public Engine {
 public:
  Session(const LoadedModel& model, ThreadPool& pool, SessionOptions options);

  int position() const override { return pos_; }
  int n_ctx() const override { return n_ctx_; }
  void reset() override { pos_ = 0; }
  // The KV rows from n on are overwritten by later tokens.
  void truncate(int n) override { pos_ = std::min(pos_, std::max(0, n)); }
  Status forward(std::span<const int> tokens, std::vector<float>* all_logits) override;
  std::span<const float> last_logits() const override { return last_logits_; }
  const PhaseTimes& phases() const override { return phases_; }
  std::vector<uint64_t> router_hist() const override { return router_hist_; }
  // In options.interventions.capture_layers order.
  const std::vector<std::vector<float>>& captures() const override { return captures_; }
  int64_t captured_positions() const override;
  const std::vector<RouterTraceEntry>& router_trace() const override { return trace_; }
  std::string device_name() const override { return "cpu"; }

 private:
  Status forward_chunk(const int* tokens, int n, float* logits_out, bool last_chunk);
  void layer_boundary(int layer, int n, bool last_chunk);  // steering + capture
  void attention_block(int layer, int n);  // by hp.attention: gqa_attention or mla_attention
  void gqa_attention(int layer, int n);
  void mla_attention(int layer, int n);
  // RoPE of hp.rope over heads `head_stride` floats apart, from `offset` in each.
  cpu::RopeTable rope_table(int head_stride, int offset) const;
  Status moe_block(int layer, int n);
  void dense_mlp_block(const model::ExpertWeights& mlp, int n, int d_hidden, float* out);

  const LoadedModel& model_;
  ThreadPool& pool_;
  int n_ctx_;
  int chunk_;
  int pos_ = 0;
  // [n_layers, n_ctx, cache_row]: K and V rows (GQA), or MLA's latent rows in k_cache_ alone.
  std::vector<float> k_cache_, v_cache_;
  // Scratch, sized for one chunk.
  std::vector<float> x_, xn_, q_, k_, v_, att_, tmp_, router_, slots_, gather_, h1_, h2_, h3_;
  std::vector<float> lat_;  // MLA: the q LoRA's and the KV latent's rows
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
