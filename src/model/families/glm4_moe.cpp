// GLM-4.5 / 4.5-Air / 4.6 (glm4_moe): GQA with q/k/v biases and optional per-head q/k norm,
// RoPE on the first half of each head (partial_rotary_factor, 0.5 when absent); dense lead
// layers (first_k_dense_replace); MoE layers with the sigmoid router (correction bias,
// groups, routed_scaling_factor) and ungated shared experts.
#include "model/families/family.h"

namespace ts::model {
namespace {

Status parse_glm4_moe(const ConfigReader& c, HParams& hp) {
  TS_TRY(read_expert_counts(c, hp, "n_routed_experts"));
  TS_ASSIGN(hp.d_expert, c.integer("moe_intermediate_size"));
  TS_ASSIGN(int n_shared, c.count_or("n_shared_experts", 1));
  hp.d_shared = n_shared * hp.d_expert;
  TS_TRY(mark_dense_lead_layers(c, hp));
  TS_TRY(read_sigmoid_router(c, hp));
  TS_ASSIGN(hp.qkv_bias, c.boolean_or("attention_bias", false));
  TS_ASSIGN(bool qk_norm, c.boolean_or("use_qk_norm", false));
  if (qk_norm) hp.qk_norm = QkNorm::kPerHead;
  hp.rope.dim = hp.head_dim / 2;  // partial_rotary_factor 0.5 unless the config says otherwise
  TS_ASSIGN(hp.n_nextn_layers, c.count_or("num_nextn_predict_layers", 0));
  return {};
}

constexpr std::string_view kTypes[] = {"glm4_moe"};

}  // namespace

extern const FamilyDef kGlm4MoeFamily{.name = "glm4_moe",
                                      .model_types = kTypes,
                                      .family = Family::kGlm4Moe,
                                      .names = {.shared = "shared_experts"},
                                      .parse = parse_glm4_moe};

}  // namespace ts::model
