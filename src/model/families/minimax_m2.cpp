// MiniMax-M2 (minimax_m2): GQA with RMSNorm over the whole q and k projections, partial
// RoPE (rotary_dim of head_dim); every layer MoE with the sigmoid router and correction bias,
// no groups and no shared expert; Mixtral's tensor names (block_sparse_moe, w1/w3/w2).
#include "model/families/family.h"

namespace ts::model {
namespace {

Status parse_minimax_m2(const ConfigReader& c, HParams& hp) {
  TS_TRY(read_expert_counts(c, hp, experts_key(c)));
  TS_ASSIGN(hp.d_expert, c.integer("intermediate_size"));
  TS_TRY(read_sigmoid_router(c, hp));
  // transformers' MiniMax-M2 router always renormalises and neither groups nor scales.
  hp.router.n_group = hp.router.topk_group = 1;
  hp.router.renormalize = true;
  hp.router.scale = 1.0f;
  TS_ASSIGN(std::string scoring, c.string_or("scoring_func", "sigmoid"));
  if (scoring != "sigmoid")
    return c.err("scoring_func", "= \"" + scoring + "\" is not supported (sigmoid)");
  TS_ASSIGN(bool bias, c.boolean_or("use_routing_bias", true));
  if (!bias) return c.err("use_routing_bias", "is false; not supported");
  hp.qk_norm = QkNorm::kFullProjection;
  // The Hub configs give rotary_dim (and partial_rotary_factor, which wins when present).
  TS_ASSIGN(hp.rope.dim, c.integer_or("rotary_dim", 0));
  TS_ASSIGN(hp.n_nextn_layers, c.count_or("num_mtp_modules", 0));
  return {};
}

constexpr std::string_view kTypes[] = {"minimax_m2"};

}  // namespace

extern const FamilyDef kMinimaxM2Family{.name = "minimax_m2",
                                        .model_types = kTypes,
                                        .family = Family::kMinimaxM2,
                                        .names = {.moe_block = "block_sparse_moe",
                                                  .expert_gate = "w1",
                                                  .expert_up = "w3",
                                                  .expert_down = "w2",
                                                  .correction_bias = "e_score_correction_bias"},
                                        .parse = parse_minimax_m2};

}  // namespace ts::model
