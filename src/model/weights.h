// Weight views of a loaded model. Matrices point into memory-mapped checkpoint files (or
// other owned storage) and keep their dtype; small vectors (norms, biases) are converted to
// F32 at load. Shapes follow PyTorch nn.Linear: [out_features, in_features], row-major.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "model/hparams.h"

namespace ts::io {
class TensorSet;
struct TensorView;
}

namespace ts::model {

struct Matrix {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t n_bytes() const { return size_t(rows) * dtype_row_bytes(dtype, cols); }
  bool present() const { return data != nullptr; }
};

struct ExpertWeights {
  Matrix gate;  // [d_expert, d_model]
  Matrix up;    // [d_expert, d_model]
  Matrix down;  // [d_model, d_expert]
};

struct LayerWeights {
  std::vector<float> attn_norm;  // [d_model]
  Matrix wq;                     // [q_dim, d_model] (MLA without q LoRA too)
  Matrix wk;                     // [n_kv_heads * head_dim, d_model]
  Matrix wv;                     // [n_kv_heads * head_dim, d_model]
  Matrix wo;                     // [d_model, attn_out_dim]
  // MLA (AttentionKind::kMla); the query through wq or q_a -> q_a_norm -> q_b.
  Matrix q_a;                    // [q_lora_rank, d_model]
  std::vector<float> q_a_norm;   // [q_lora_rank]
  Matrix q_b;                    // [q_dim, q_lora_rank]
  Matrix kv_a;                   // [kv_lora_rank + rope_dim, d_model]
  std::vector<float> kv_a_norm;  // [kv_lora_rank]
  Matrix kv_b;                   // [n_heads * (nope_dim + v_dim), kv_lora_rank]: per head,
                                 // nope_dim rows of W_UK then v_dim rows of W_UV
  // Gated DeltaNet (MixerKind::kGatedDeltaNet): the input projections (qkvz + ba grouped per
  // key head, or qkv, z, b, a), conv taps [conv_dim * conv_kernel], A_log and dt_bias
  // [n_v_heads], the output norm [v_dim], out [d_model, value_dim].
  struct DeltaNet {
    Matrix qkvz, ba, qkv, z, b, a, out;
    std::vector<float> conv, a_log, dt_bias, norm;
  } deltanet;
  std::vector<float> bq, bk, bv;  // biases when qkv_bias, else empty
  std::vector<float> bo;          // [d_model] when o_bias, else empty
  std::vector<float> sinks;       // [n_heads] when attention_sinks, else empty
  std::vector<float> q_norm;     // [head_dim] per head, or [q_dim] full projection, or empty
  std::vector<float> k_norm;     // [head_dim] or [kv_dim] or empty
  std::vector<float> ffn_norm;   // [d_model]

  bool is_moe = false;
  Matrix router;                 // [n_experts, d_model]
  std::vector<float> router_bias;  // [n_experts] selection-only correction bias, or empty
  std::vector<float> router_logit_bias;  // [n_experts] when router.logit_bias, else empty
  // Routed experts' biases when expert_bias (else empty), expert e's at e * width: small, so
  // kept with the dense weights rather than in the expert store.
  std::vector<float> expert_gate_bias;  // [n_experts * d_expert]
  std::vector<float> expert_up_bias;    // [n_experts * d_expert]
  std::vector<float> expert_down_bias;  // [n_experts * d_model]
  ExpertWeights shared;          // shared expert (d_shared), absent if none
  Matrix shared_gate;            // [1, d_model] sigmoid gate on the shared expert
  ExpertWeights dense;           // dense MLP (d_ff) on layers without experts

  // Every dense matrix of the layer (absent ones included; check present()).
  std::vector<const Matrix*> matrices() const {
    return {&wq,          &wk,          &wv,          &wo,          &q_a,         &q_b,
            &kv_a,        &kv_b,        &router,      &shared.gate, &shared.up,   &shared.down,
            &shared_gate, &dense.gate,  &dense.up,    &dense.down,  &deltanet.qkvz, &deltanet.ba,
            &deltanet.qkv, &deltanet.z, &deltanet.b,  &deltanet.a,  &deltanet.out};
  }
};

struct DenseWeights {
  Matrix embed;                  // [vocab, d_model]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [d_model]
  Matrix lm_head;                // [vocab, d_model]; the embedding when tied
};

// Routed expert weights per layer: experts[layer][expert]; empty for dense layers.
using ExpertTable = std::vector<std::vector<ExpertWeights>>;

struct BoundWeights {
  DenseWeights dense;
  ExpertTable experts;
};

// Binds every tensor the family needs from `tensors`, checking names, dtypes and shapes
// against hp. Errors name the tensor and what was expected.
// The tensor `name` of `set` with exactly `shape`; errors name the tensor, its file and the
// shape `implied_by` (a config) gives.
Result<const io::TensorView*> find_tensor(const io::TensorSet& set, const std::string& name,
                                          const std::vector<int64_t>& shape,
                                          const std::string& implied_by);

Result<BoundWeights> bind_weights(const HParams& hp, const io::TensorSet& tensors);

// Parameter and byte counts for `inspect` and `bench`.
struct WeightCounts {
  int64_t params_total = 0;
  int64_t params_active = 0;      // per token: dense + top_k experts per MoE layer
  uint64_t dense_bytes = 0;       // everything but routed experts
  uint64_t routed_bytes = 0;      // all routed experts
  uint64_t decode_bytes = 0;      // bytes read per decode token (one embedding row, top_k experts)
};
WeightCounts count_weights(const HParams& hp, const BoundWeights& w);

// The bytes of the random weights `bench --synthetic` generates on the GPU for hp, from the
// tensor table: matrices in `dtype` — the embedding, router and shared-expert gate in BF16
// where `dtype` is quantized, the lm head the embedding's where hp ties them and `dtype` is not
// quantized —, the routed experts' down matrices in `down`, norms and biases as F32 vectors
// (the CUDA synthesize makes no q/k/v biases: a bound, a few KB over). Dense and routed as
// count_weights splits them, so a synthetic model's size can be checked against the device
// before any of it is made. An error, naming the config field (or the tensor), where a
// matrix's width is not a whole number of `dtype`'s (or `down`'s) blocks.
struct WeightBytes {
  uint64_t dense = 0;
  uint64_t routed = 0;
};
Result<WeightBytes> synthetic_weight_bytes(const HParams& hp, DType dtype, DType down);

}  // namespace ts::model
