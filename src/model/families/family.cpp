// The family registry and the config pieces several families share.
#include "model/families/family.h"

#include <cmath>

namespace ts::model {

extern const FamilyDef kMixtralFamily, kQwen2MoeFamily, kQwen3MoeFamily, kOlmoeFamily,
    kDeepseekV2Family, kDeepseekV3Family, kGlm4MoeFamily, kMinimaxM2Family, kQwen3NextFamily,
    kGptOssFamily;

std::span<const FamilyDef* const> all_families() {
  static const FamilyDef* const kAll[] = {&kMixtralFamily, &kQwen2MoeFamily,   &kQwen3MoeFamily,
                                          &kOlmoeFamily,   &kDeepseekV2Family, &kDeepseekV3Family,
                                          &kGlm4MoeFamily, &kMinimaxM2Family, &kQwen3NextFamily,
                                          &kGptOssFamily};
  return kAll;
}

const FamilyDef& family_def(Family f) {
  for (const FamilyDef* d : all_families())
    if (d->family == f) return *d;
  TS_CHECK(false, "every Family has a FamilyDef");
  return *all_families()[0];
}

const FamilyDef* find_family(std::string_view model_type) {
  for (const FamilyDef* d : all_families())
    for (std::string_view t : d->model_types)
      if (t == model_type) return d;
  return nullptr;
}

Status read_expert_counts(const ConfigReader& c, HParams& hp, const std::string& key) {
  TS_ASSIGN(hp.n_experts, c.integer(key));
  TS_ASSIGN(hp.top_k, c.integer("num_experts_per_tok"));
  if (hp.top_k > hp.n_experts)
    return c.err("num_experts_per_tok", "= " + std::to_string(hp.top_k) + " exceeds " + key +
                                            " = " + std::to_string(hp.n_experts));
  return {};
}

Status mark_dense_lead_layers(const ConfigReader& c, HParams& hp) {
  TS_ASSIGN(int step, c.integer_or("decoder_sparse_step", 1));
  TS_ASSIGN(int first_moe, c.count_or("first_k_dense_replace", 0));
  TS_ASSIGN(std::set<int> dense, c.int_set("mlp_only_layers"));
  for (int l : dense)
    if (l < 0 || l >= hp.n_layers)
      return c.err("mlp_only_layers",
                   "names layer " + std::to_string(l) + " of " + std::to_string(hp.n_layers));
  bool any_dense = false;
  for (int l = 0; l < hp.n_layers; ++l) {
    hp.layer_is_moe[size_t(l)] = l >= first_moe && !dense.count(l) && (l + 1) % step == 0;
    any_dense |= !hp.layer_is_moe[size_t(l)];
  }
  if (any_dense) {
    TS_ASSIGN(hp.d_ff, c.integer("intermediate_size"));
  }
  return {};
}

Status read_sigmoid_router(const ConfigReader& c, HParams& hp, RouterDefaults defaults) {
  RouterSpec& r = hp.router;
  r.scoring = ScoreFn::kSigmoid;
  r.correction_bias = true;
  TS_ASSIGN(r.n_group, c.integer_or("n_group", defaults.n_group));
  TS_ASSIGN(r.topk_group, c.integer_or("topk_group", defaults.topk_group));
  TS_ASSIGN(r.renormalize, c.boolean_or("norm_topk_prob", true));
  TS_ASSIGN(double scale, c.number_or("routed_scaling_factor", defaults.scale));
  if (!(scale > 0) || !std::isfinite(scale))
    return c.err("routed_scaling_factor", "must be a finite number > 0");
  r.scale = float(scale);
  if (hp.n_experts % r.n_group != 0)
    return c.err("n_group", "= " + std::to_string(r.n_group) + " does not divide the " +
                                std::to_string(hp.n_experts) + " routed experts");
  if (r.topk_group > r.n_group)
    return c.err("topk_group", "= " + std::to_string(r.topk_group) +
                                   " exceeds n_group = " + std::to_string(r.n_group));
  const int group_size = hp.n_experts / r.n_group;
  if (r.n_group > 1 && group_size < 2 && r.group_score == GroupScore::kTop2Sum)
    return c.err("n_group", "leaves groups of one expert; a group's score needs two");
  if (hp.top_k > r.topk_group * group_size)
    return c.err("num_experts_per_tok",
                 "= " + std::to_string(hp.top_k) + " exceeds the " +
                     std::to_string(r.topk_group * group_size) +
                     " experts of the topk_group groups that may be selected");
  return {};
}

}  // namespace ts::model
