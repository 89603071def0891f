// DeepSeek-V2 / V2-Lite (deepseek_v2) and DeepSeek-V3 / R1 / Kimi-K2 (deepseek_v3, kimi_k2):
// multi-head latent attention (optional q LoRA; a cached latent of kv_lora_rank values plus
// one rotary key of qk_rope_head_dim shared by all heads), interleaved RoPE with YaRN; dense
// lead layers (first_k_dense_replace), MoE layers with ungated shared experts. V2 routes by
// softmax (topk_method greedy, or group_limited_greedy: groups scored by their best expert);
// V3 by sigmoid with a correction bias and groups scored by their two best experts.
// Defaults for absent keys are transformers' (configuration_deepseek_v2/v3.py).
#include "model/families/family.h"

namespace ts::model {
namespace {

Status read_mla(const ConfigReader& c, HParams& hp) {
  hp.attention = AttentionKind::kMla;
  MlaSpec& m = hp.mla;
  TS_ASSIGN(m.q_lora_rank, c.count_or("q_lora_rank", 0));
  TS_ASSIGN(m.kv_lora_rank, c.integer("kv_lora_rank"));
  TS_ASSIGN(m.nope_dim, c.integer("qk_nope_head_dim"));
  TS_ASSIGN(m.rope_dim, c.integer("qk_rope_head_dim"));
  TS_ASSIGN(m.v_dim, c.integer("v_head_dim"));
  if (m.rope_dim % 2) return c.err("qk_rope_head_dim", "must be even for RoPE");
  TS_ASSIGN(bool bias, c.boolean_or("attention_bias", false));
  if (bias) return c.err("attention_bias", "is true; MLA with biases is not supported");
  // MLA has no KV heads: every query head reads the one latent.
  hp.n_kv_heads = hp.n_heads;
  hp.head_dim = m.qk_dim();
  hp.rope.dim = m.rope_dim;
  return {};
}

Status read_deepseek_common(const ConfigReader& c, HParams& hp, int default_shared,
                            int default_dense) {
  TS_TRY(read_expert_counts(c, hp, "n_routed_experts"));
  TS_ASSIGN(hp.d_expert, c.integer("moe_intermediate_size"));
  TS_ASSIGN(int n_shared, c.count_or("n_shared_experts", default_shared));
  hp.d_shared = n_shared * hp.d_expert;
  TS_ASSIGN(int first_dense, c.count_or("first_k_dense_replace", default_dense));
  TS_ASSIGN(int freq, c.integer_or("moe_layer_freq", 1));
  if (freq != 1)
    return c.err("moe_layer_freq", "= " + std::to_string(freq) + " is not supported (1)");
  for (int l = 0; l < hp.n_layers; ++l) hp.layer_is_moe[size_t(l)] = l >= first_dense;
  if (first_dense > 0) {
    TS_ASSIGN(hp.d_ff, c.integer("intermediate_size"));
  }
  TS_ASSIGN(hp.n_nextn_layers, c.count_or("num_nextn_predict_layers", 0));
  return read_mla(c, hp);
}

Status parse_deepseek_v2(const ConfigReader& c, HParams& hp) {
  TS_TRY(read_deepseek_common(c, hp, 2, 0));
  hp.rope.layout = RopeLayout::kInterleaved;  // V2 rotates complex pairs (2i, 2i + 1)
  RouterSpec& r = hp.router;
  TS_ASSIGN(std::string method, c.string_or("topk_method", "greedy"));
  if (method == "group_limited_greedy") {
    TS_ASSIGN(r.n_group, c.integer("n_group"));
    TS_ASSIGN(r.topk_group, c.integer("topk_group"));
    r.group_score = GroupScore::kMax;
    if (hp.n_experts % r.n_group)
      return c.err("n_group",
                   "= " + std::to_string(r.n_group) + " does not divide n_routed_experts");
    if (r.topk_group > r.n_group) return c.err("topk_group", "exceeds n_group");
    if (hp.top_k > r.topk_group * (hp.n_experts / r.n_group))
      return c.err("num_experts_per_tok", "exceeds the experts of the topk_group groups");
  } else if (method != "greedy") {
    return c.err("topk_method",
                 "= \"" + method + "\" is not supported (greedy, group_limited_greedy)");
  }
  // transformers' DeepseekV2TopkRouter does not renormalise, whatever norm_topk_prob says.
  TS_ASSIGN(double scale, c.number_or("routed_scaling_factor", 1.0));
  if (!(scale > 0) || !std::isfinite(scale))
    return c.err("routed_scaling_factor", "must be a finite number > 0");
  r.scale = float(scale);
  return {};
}

Status parse_deepseek_v3(const ConfigReader& c, HParams& hp) {
  TS_TRY(read_deepseek_common(c, hp, 1, 3));
  TS_ASSIGN(bool interleave, c.boolean_or("rope_interleave", true));
  hp.rope.layout = interleave ? RopeLayout::kInterleaved : RopeLayout::kHalf;
  // transformers' defaults when the keys are absent: 8 groups, 4 eligible, scale 2.5.
  return read_sigmoid_router(c, hp, {.n_group = 8, .topk_group = 4, .scale = 2.5});
}

constexpr std::string_view kV2Types[] = {"deepseek_v2"};
constexpr std::string_view kV3Types[] = {"deepseek_v3", "kimi_k2"};

}  // namespace

extern const FamilyDef kDeepseekV2Family{.name = "deepseek_v2",
                                         .model_types = kV2Types,
                                         .family = Family::kDeepseekV2,
                                         .names = {.shared = "shared_experts"},
                                         .parse = parse_deepseek_v2};
extern const FamilyDef kDeepseekV3Family{.name = "deepseek_v3",
                                         .model_types = kV3Types,
                                         .family = Family::kDeepseekV3,
                                         .names = {.shared = "shared_experts"},
                                         .parse = parse_deepseek_v3};

}  // namespace ts::model
