// Session: tokens -> logits, the CPU backend. Owns the KV cache (F32, paged: blocks of
// kKvBlock positions, a block table per sequence) and the scratch buffers; runs prefill in
// chunks of `prefill_chunk` tokens and decode one token at a time through the same layer
// code, for the Engine interface's one sequence (sequence 0) or for a step over many
// (continuous batching: Engine::step). The routed-expert pass reduces expert outputs in the
// router's rank order, so results do not depend on where an expert's weights came from, and
// every row is computed on its own, so not on the other sequences of a step either.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/status.h"
#include "experts/expert_cache.h"
#include "runtime/engine.h"
#include "runtime/interventions.h"
#include "runtime/kv_blocks.h"
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
  // CPU: KV positions over all sequences (the pool Engine::open_sequence reserves from);
  // 0 = n_ctx, one full-length sequence.
  int64_t kv_tokens = 0;
  bool quantize_q8_0 = false;  // CUDA: float matrices -> Q8_0 at load (CPU: use a pack)
  GpuExpertOptions gpu_experts;  // CUDA only
  Interventions interventions;  // steering, residual capture, router trace
  // CUDA: after each layer's weights are on the device (layers done, layers, GPU bytes so far).
  experts::LayerProgress on_layer;
};

class Session final : public Engine {
 public:
  Session(const LoadedModel& model, ThreadPool& pool, SessionOptions options);

  static constexpr int kKvBlock = KvBlocks::kTokens;  // positions per KV block

  int position() const override { return seqs_[0].pos; }
  int n_ctx() const override { return n_ctx_; }
  void reset() override;
  // The KV rows from n on are overwritten by later tokens. A recurrent state cannot go back:
  // with gated DeltaNet layers, anything short of the whole sequence starts again from 0.
  void truncate(int n) override;
  Status forward(std::span<const int> tokens, std::vector<float>* all_logits) override;
  bool batches() const override { return true; }
  int step_tokens() const override { return chunk_; }
  int64_t free_kv_tokens() const override { return blocks_.available() * kKvBlock; }
  Result<int> open_sequence(int max_tokens, std::span<const int> prefix = {}) override;
  void close_sequence(int seq) override;
  int sequence_position(int seq) const override;
  KvStats kv_stats() const override;
  Status step(std::span<const SeqInput> inputs, std::vector<float>* logits) override;
  std::span<const float> last_logits() const override { return last_logits_; }
  const PhaseTimes& phases() const override { return phases_; }
  std::vector<uint64_t> router_hist() const override { return router_hist_; }
  // In options.interventions.capture_layers order.
  const std::vector<std::vector<float>>& captures() const override { return captures_; }
  int64_t captured_positions() const override;
  const std::vector<RouterTraceEntry>& router_trace() const override { return trace_; }
  std::string device_name() const override { return "cpu"; }

 private:
  struct Sequence {
    std::vector<int> blocks;  // KV block table: position p lies in blocks[p / kKvBlock]
    int pos = 0;
    int reserve = 0;  // positions reserved at open (step sequences); 0: grows on demand
    bool open = false;
    std::vector<int> tokens;  // step sequences: the tokens at positions [0, pos)
    // Gated DeltaNet layers' recurrent state (conv inputs, then S), one run per such layer.
    std::vector<float> state;
  };
  // One sequence's rows [row0, row0 + n) of a pass, at positions pos0 ...
  struct Span {
    int seq, row0, n, pos0;
    bool all_logits;
  };
  // Runs tokens[0, n) as the rows of spans_ (each sequence's KV blocks already there),
  // advances each sequence, and writes the logits of the rows asked for (all of a span's
  // with all_logits, else its last one), in span order, to logits_out when it is given, and
  // the last span's last row to last_logits_.
  Status run_rows(const int* tokens, int n, float* logits_out, bool last_chunk);
  Status grow_blocks(Sequence& s, int positions);  // blocks for positions [0, positions)
  void release_blocks(Sequence& s);
  cpu::KvRows kv_rows(int seq) const { return {seqs_[size_t(seq)].blocks.data(), kKvBlock}; }
  // The cache row of `pos` of sequence `seq` at `layer` (K, or MLA's latent rows).
  float* kv_row(float* cache, int layer, int seq, int pos, int row_floats);
  float* kv_layer(float* cache, int layer, int row_floats) const;  // the layer's first row
  void layer_boundary(int layer, int n, bool last_chunk);  // steering + capture
  void attention_block(int layer, int n);  // by hp.attention: gqa_attention or mla_attention
  void gqa_attention(int layer, int n);
  void mla_attention(int layer, int n);
  void deltanet(int layer, int n);  // writes att_ [n, value_dim] for deltanet.out
  void clear_state(Sequence& s) const;  // a fresh recurrent state (zeros), or none
  // RoPE of hp.rope over heads `head_stride` floats apart, from `offset` in each.
  cpu::RopeTable rope_table(int head_stride, int offset) const;
  Status moe_block(int layer, int n);
  void dense_mlp_block(const model::ExpertWeights& mlp, int n, int d_hidden, float* out);

  const LoadedModel& model_;
  ThreadPool& pool_;
  int n_ctx_;
  int chunk_;
  int n_blocks_;
  // [n_layers, n_blocks * kKvBlock, cache_row]: K and V rows (GQA), or MLA's latent rows in
  // k_cache_ alone.
  std::unique_ptr<float[]> k_cache_, v_cache_;
  KvBlocks blocks_;
  uint64_t prefix_tokens_ = 0, reused_tokens_ = 0;  // open_sequence's prefixes, and found
  std::vector<Sequence> seqs_;    // [0]: the Engine interface's sequence (forward)
  std::vector<Span> spans_;       // the pass being run
  std::vector<int> row_pos_;      // each row's position in its sequence
  bool capturing_ = false;        // forward() captures residuals; step() does not
  // Scratch, sized for one chunk.
  std::vector<float> x_, xn_, q_, k_, v_, att_, tmp_, router_, slots_, gather_, h1_, h2_, h3_;
  std::vector<float> lat_;  // MLA: the q LoRA's and the KV latent's rows
  std::vector<float> qg_, gate_;  // attention output gate: q|gate rows, then the gates
  // Gated DeltaNet: the projections' q|k|v (conv input), z, b, a rows, a grouped projection's
  // rows before they are put in that order, the conv output.
  std::vector<float> dn_qkv_, dn_z_, dn_b_, dn_a_, dn_proj_, dn_x_;
  std::vector<int> dn_index_;  // [n_layers]: the layer's place in Sequence::state, or -1
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
