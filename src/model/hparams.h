// Model hyper-parameters read from a Hugging Face config.json. Family differences that the
// forward pass needs are data here (AttentionKind, RopeSpec, RouterSpec, QkNorm), never `if (family == ...)` in the
// shared layers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace ts::model {

enum class Family : uint8_t {
  kMixtral,
  kQwen2Moe,
  kQwen3Moe,
  kOlmoe,
  kDeepseekV2,
  kDeepseekV3,  // also kimi_k2
  kGlm4Moe,
  kMinimaxM2,
  kQwen3Next,  // also qwen3_5_moe_text (Qwen3.5 / 3.6 MoE)
  kGptOss,
};

// Where q/k RMSNorm is applied, if anywhere.
enum class QkNorm : uint8_t {
  kNone,
  kPerHead,         // qwen3_moe: over each head's head_dim, weight [head_dim]
  kFullProjection,  // olmoe: over the whole q (k) projection, weight [n_heads * head_dim]
};

// How a token's experts are chosen and weighted (model/router.h has the one reference).
enum class ScoreFn : uint8_t {
  kSoftmax,      // softmax over all experts' logits
  kSigmoid,      // a sigmoid per expert
  kTopkSoftmax,  // gpt-oss: the top_k logits win; the weights are a softmax over those k
};
enum class GroupScore : uint8_t {
  kTop2Sum,  // DeepSeek-V3 / GLM-4.5: sum of the group's two best (biased) scores
  kMax,      // DeepSeek-V2 group_limited_greedy: the group's best score
};
struct RouterSpec {
  ScoreFn scoring = ScoreFn::kSoftmax;
  bool logit_bias = false;       // the router's linear has a bias (gpt-oss): logits = W x + b
  bool correction_bias = false;  // a per-expert bias added to the scores for selection only
  int n_group = 1;               // experts split into n_group equal groups, of which only
  int topk_group = 1;            // the topk_group best groups may be selected
  GroupScore group_score = GroupScore::kTop2Sum;
  bool renormalize = false;      // divide the top-k weights by their sum
  float scale = 1.0f;            // routed_scaling_factor, applied to the final weights
};

// Rotary position embedding. The first `dim` values of each head's rotary part turn;
// inv_freq holds dim / 2 frequencies (YaRN's blend already applied) and cos / sin are
// multiplied by attention_factor (YaRN's mscale; 1 otherwise), as transformers does.
enum class RopeLayout : uint8_t {
  kHalf,         // pairs (i, i + dim/2): transformers' rotate_half
  kInterleaved,  // pairs (2i, 2i + 1): DeepSeek's rope_interleave, GPT-J style
};
struct RopeSpec {
  float theta = 10000.0f;
  int dim = 0;
  RopeLayout layout = RopeLayout::kHalf;
  std::vector<float> inv_freq;  // [dim / 2]
  float attention_factor = 1.0f;
  bool yarn = false;
  float factor = 1.0f;          // YaRN's scaling factor and mscale_all_dim, which MLA's
  float mscale_all_dim = 0.0f;  // softmax scale also reads
};

// The routed experts' activation between the gate|up and down projections.
enum class ExpertAct : uint8_t {
  kSiluMul,        // silu(gate) * up
  kClampedSwiglu,  // gpt-oss: g = min(gate, limit), u = clamp(up, -limit, limit),
                   // (u + 1) * g * sigmoid(alpha * g)
};
struct ExpertActSpec {
  ExpertAct kind = ExpertAct::kSiluMul;
  float limit = 0.0f;  // kClampedSwiglu's clamp
  float alpha = 0.0f;  // kClampedSwiglu's sigmoid slope
};

enum class AttentionKind : uint8_t {
  kGqa,  // q/k/v projections, KV cache of n_kv_heads * head_dim per position for K and V
  kMla,  // DeepSeek's multi-head latent attention: one cache row of kv_lora_rank + rope_dim
};
// MLA shapes (DeepSeek-V2/V3): q through an optional low-rank q_a -> norm -> q_b; the KV
// latent c (kv_lora_rank, normed) and one shared rotary key (rope_dim) are what is cached.
struct MlaSpec {
  int q_lora_rank = 0;  // 0: a full q_proj
  int kv_lora_rank = 0;
  int nope_dim = 0;     // per-head query/key dims without position
  int rope_dim = 0;     // per-head query dims (and the shared key) with RoPE
  int v_dim = 0;        // per-head value dims
  int qk_dim() const { return nope_dim + rope_dim; }
};

// A layer's token mixer.
enum class MixerKind : uint8_t {
  kAttention,      // by AttentionKind, with a KV cache
  kGatedDeltaNet,  // linear attention with a recurrent state per sequence (DeltaNetSpec)
};
// Gated DeltaNet (Qwen3-Next, Qwen3.5): per token, q|k|v through a causal depthwise conv
// (conv_kernel taps, SiLU), q and k L2-normalised per head, then per value head a state
// S [k_dim, v_dim] decayed by exp(g), written with the delta rule at strength beta and read
// by q; the output RMS-normed per head and gated by SiLU(z). Each key head serves
// n_v_heads / n_k_heads value heads.
struct DeltaNetSpec {
  int n_k_heads = 0, n_v_heads = 0;
  int k_dim = 0, v_dim = 0;  // per head
  int conv_kernel = 0;
  // Qwen3-Next: in_proj_qkvz / in_proj_ba with rows grouped per key head; Qwen3.5: in_proj_qkv,
  // in_proj_z, in_proj_b, in_proj_a in flat order.
  bool grouped_projection = false;
  int key_dim() const { return n_k_heads * k_dim; }
  int value_dim() const { return n_v_heads * v_dim; }
  int conv_dim() const { return 2 * key_dim() + value_dim(); }
  // Floats of one layer's state: the conv's last conv_kernel - 1 inputs, then S per head.
  int64_t state_floats() const {
    return int64_t(conv_dim()) * (conv_kernel - 1) + int64_t(n_v_heads) * k_dim * v_dim;
  }
};

struct HParams {
  Family family = Family::kMixtral;
  std::string model_type;
  int d_model = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int vocab = 0;
  int n_experts = 0;
  int top_k = 0;
  int d_expert = 0;        // routed expert hidden size
  int d_ff = 0;            // dense MLP hidden size (layers without experts), 0 if none
  int d_shared = 0;        // shared expert hidden size, 0 if none
  bool shared_expert_gate = false;  // sigmoid gate on the shared expert (qwen2_moe)
  bool qkv_bias = false;
  bool o_bias = false;  // a bias on o_proj (gpt-oss)
  QkNorm qk_norm = QkNorm::kNone;
  AttentionKind attention = AttentionKind::kGqa;
  MlaSpec mla;
  // gpt-oss: a learned logit per query head that joins its softmax's denominator (and takes
  // a share of the probability that no value receives).
  bool attention_sinks = false;
  // [n_layers]: a query at position p sees the keys j with p - j < layer_window[l] (a sliding
  // window, as transformers' sliding_window_overlay), or every earlier key when 0.
  std::vector<int> layer_window;
  bool expert_bias = false;  // routed experts' gate, up and down projections have biases
  ExpertActSpec expert_act;
  float attn_scale = 0;    // softmax scale of q.k (1 / sqrt(head_dim), or MLA's with mscale)
  RouterSpec router;
  float rms_eps = 1e-6f;
  RopeSpec rope;
  int max_positions = 0;
  bool tie_word_embeddings = false;
  std::vector<bool> layer_is_moe;  // [n_layers]
  std::vector<MixerKind> layer_mixer;  // [n_layers]
  DeltaNetSpec deltanet;           // where a layer is kGatedDeltaNet
  // The q projection is twice as wide: per head, head_dim query values then head_dim gate
  // values; attention's output is multiplied by sigmoid(gate) before o_proj.
  bool attn_output_gate = false;
  // RMSNorm weights stored zero-centred (y = norm(x) * (1 + w)); the one is added at load,
  // so the backends see plain weights.
  bool norm_plus_one = false;
  int n_nextn_layers = 0;          // multi-token-prediction layers in the checkpoint, skipped

  // GQA widths; for MLA, q_dim is the query's n_heads * (nope + rope), and o_proj reads
  // n_heads * v_dim (attn_out_dim).
  int q_dim() const {
    return attention == AttentionKind::kMla ? n_heads * mla.qk_dim() : n_heads * head_dim;
  }
  int kv_dim() const { return n_kv_heads * head_dim; }
  int q_proj_rows() const { return q_dim() * (attn_output_gate ? 2 : 1); }
  bool has_deltanet() const {
    for (MixerKind k : layer_mixer)
      if (k == MixerKind::kGatedDeltaNet) return true;
    return false;
  }
  int attn_out_dim() const {
    return attention == AttentionKind::kMla ? n_heads * mla.v_dim : n_heads * head_dim;
  }
  // Floats cached per position and layer: K (and as many for V) for GQA, the latent for MLA.
  int cache_row() const {
    return attention == AttentionKind::kMla ? mla.kv_lora_rank + mla.rope_dim : kv_dim();
  }
};

std::string_view family_name(Family f);

// Reads DIR/config.json. Errors name the file and the key.
Result<HParams> load_hparams(const std::string& dir);
// Parses config.json text; `source` names it in errors.
Result<HParams> parse_hparams(const std::string& json_text, const std::string& source);

}  // namespace ts::model
