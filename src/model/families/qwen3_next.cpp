// Qwen3-Next and Qwen3.5-MoE (text): layers of gated DeltaNet linear attention between full
// attention layers (layer_types, or every full_attention_interval-th), the full ones with an
// output gate from a doubled q projection, per-head q/k norm and partial RoPE; every RMSNorm
// but the DeltaNet's own stored zero-centred; a softmax router and a shared expert with a
// sigmoid gate. The two differ in the DeltaNet's input projections (DeltaNetSpec).
#include "model/families/family.h"

namespace ts::model {
namespace {

Status read_layer_mixers(const ConfigReader& c, HParams& hp) {
  TS_ASSIGN(std::vector<std::string> types, c.string_list("layer_types"));
  if (types.empty()) {
    // transformers' default: every full_attention_interval-th layer is full attention.
    TS_ASSIGN(int interval, c.integer_or("full_attention_interval", 4));
    for (int l = 0; l < hp.n_layers; ++l)
      hp.layer_mixer[size_t(l)] =
          (l + 1) % interval == 0 ? MixerKind::kAttention : MixerKind::kGatedDeltaNet;
    return {};
  }
  if (int(types.size()) != hp.n_layers)
    return c.err("layer_types", "has " + std::to_string(types.size()) + " entries for " +
                                    std::to_string(hp.n_layers) + " layers");
  for (size_t l = 0; l < types.size(); ++l) {
    if (types[l] == "linear_attention")
      hp.layer_mixer[l] = MixerKind::kGatedDeltaNet;
    else if (types[l] == "full_attention")
      hp.layer_mixer[l] = MixerKind::kAttention;
    else
      return c.err("layer_types", "entry " + std::to_string(l) + " \"" + types[l] +
                                      "\" is not linear_attention or full_attention");
  }
  return {};
}

Status parse_qwen3_next(const ConfigReader& c, HParams& hp) {
  TS_TRY(read_expert_counts(c, hp, experts_key(c)));
  TS_ASSIGN(hp.d_expert, c.integer("moe_intermediate_size"));
  // Qwen3.5's router always renormalises its top-k weights; Qwen3-Next's by norm_topk_prob.
  TS_ASSIGN(hp.router.renormalize, c.boolean_or("norm_topk_prob", true));
  if (hp.model_type != "qwen3_next") hp.router.renormalize = true;
  TS_TRY(mark_dense_lead_layers(c, hp));
  TS_ASSIGN(hp.d_shared, c.integer("shared_expert_intermediate_size"));
  hp.shared_expert_gate = true;
  TS_ASSIGN(hp.qkv_bias, c.boolean_or("attention_bias", false));
  hp.qk_norm = QkNorm::kPerHead;
  hp.attn_output_gate = true;
  hp.norm_plus_one = true;
  TS_TRY(read_layer_mixers(c, hp));
  DeltaNetSpec& dn = hp.deltanet;
  TS_ASSIGN(dn.n_k_heads, c.integer("linear_num_key_heads"));
  TS_ASSIGN(dn.n_v_heads, c.integer("linear_num_value_heads"));
  TS_ASSIGN(dn.k_dim, c.integer("linear_key_head_dim"));
  TS_ASSIGN(dn.v_dim, c.integer("linear_value_head_dim"));
  TS_ASSIGN(dn.conv_kernel, c.integer("linear_conv_kernel_dim"));
  if (dn.n_v_heads % dn.n_k_heads != 0)
    return c.err("linear_num_value_heads", "= " + std::to_string(dn.n_v_heads) +
                                               " is not a multiple of linear_num_key_heads = " +
                                               std::to_string(dn.n_k_heads));
  dn.grouped_projection = hp.model_type == "qwen3_next";
  return {};
}

constexpr std::string_view kTypes[] = {"qwen3_next", "qwen3_5_moe_text"};

}  // namespace

extern const FamilyDef kQwen3NextFamily{.name = "qwen3_next",
                                        .model_types = kTypes,
                                        .family = Family::kQwen3Next,
                                        .names = {},
                                        .parse = parse_qwen3_next};

}  // namespace ts::model
