// The Llama-style MoE families: GQA attention with full rotate-half RoPE and a softmax
// router. Mixtral, Qwen2-MoE (shared expert with a sigmoid gate, q/k/v biases, dense layers
// by mlp_only_layers / decoder_sparse_step), Qwen3-MoE (per-head q/k norm), OLMoE (q/k norm
// over the whole projection).
#include "model/families/family.h"

namespace ts::model {
namespace {

Status parse_mixtral(const ConfigReader& c, HParams& hp) {
  TS_TRY(read_expert_counts(c, hp, experts_key(c)));
  TS_ASSIGN(hp.d_expert, c.integer("intermediate_size"));
  hp.router.renormalize = true;  // Mixtral always renormalises its top-k weights
  if (c.has("sliding_window"))
    return c.err("sliding_window", "is set; sliding-window attention is not supported");
  return {};
}

Status parse_qwen_moe(const ConfigReader& c, HParams& hp) {
  TS_TRY(read_expert_counts(c, hp, experts_key(c)));
  TS_ASSIGN(hp.d_expert, c.integer("moe_intermediate_size"));
  TS_ASSIGN(hp.router.renormalize, c.boolean_or("norm_topk_prob", false));
  TS_ASSIGN(bool sliding, c.boolean_or("use_sliding_window", false));
  if (sliding) return c.err("use_sliding_window", "is true; not supported");
  TS_TRY(mark_dense_lead_layers(c, hp));
  if (hp.family == Family::kQwen2Moe) {
    TS_ASSIGN(hp.d_shared, c.integer("shared_expert_intermediate_size"));
    hp.shared_expert_gate = true;
    TS_ASSIGN(hp.qkv_bias, c.boolean_or("qkv_bias", true));
  } else {
    hp.qk_norm = QkNorm::kPerHead;
    TS_ASSIGN(hp.qkv_bias, c.boolean_or("attention_bias", false));
  }
  return {};
}

Status parse_olmoe(const ConfigReader& c, HParams& hp) {
  TS_TRY(read_expert_counts(c, hp, experts_key(c)));
  TS_ASSIGN(hp.d_expert, c.integer("intermediate_size"));
  TS_ASSIGN(hp.router.renormalize, c.boolean_or("norm_topk_prob", false));
  TS_ASSIGN(hp.qkv_bias, c.boolean_or("attention_bias", false));
  hp.qk_norm = QkNorm::kFullProjection;
  if (c.has("clip_qkv")) return c.err("clip_qkv", "is set; not supported");
  return {};
}

constexpr std::string_view kMixtralTypes[] = {"mixtral"};
constexpr std::string_view kQwen2Types[] = {"qwen2_moe"};
constexpr std::string_view kQwen3Types[] = {"qwen3_moe"};
constexpr std::string_view kOlmoeTypes[] = {"olmoe"};

}  // namespace

extern const FamilyDef kMixtralFamily{.name = "mixtral",
                                      .model_types = kMixtralTypes,
                                      .family = Family::kMixtral,
                                      .names = {.moe_block = "block_sparse_moe",
                                                .expert_gate = "w1",
                                                .expert_up = "w3",
                                                .expert_down = "w2"},
                                      .parse = parse_mixtral};
extern const FamilyDef kQwen2MoeFamily{.name = "qwen2_moe",
                                       .model_types = kQwen2Types,
                                       .family = Family::kQwen2Moe,
                                       .names = {},
                                       .parse = parse_qwen_moe};
extern const FamilyDef kQwen3MoeFamily{.name = "qwen3_moe",
                                       .model_types = kQwen3Types,
                                       .family = Family::kQwen3Moe,
                                       .names = {},
                                       .parse = parse_qwen_moe};
extern const FamilyDef kOlmoeFamily{.name = "olmoe",
                                    .model_types = kOlmoeTypes,
                                    .family = Family::kOlmoe,
                                    .names = {},
                                    .parse = parse_olmoe};

}  // namespace ts::model
