// The one tensor table of a model: every checkpoint tensor its HParams imply, with its Hub
// name, shape, kind (for synth's random scales and the byte counts) and role (the weight
// field it binds to). bind_weights, synth, synthetic_weight_bytes and pack all read it, so a
// family's tensors are written out once, here, from its specs and FamilyNames.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/hparams.h"

namespace ts::model {

enum class TensorKind : uint8_t { kEmbedding, kLinear, kRouter, kNorm, kBias, kExpert };

// The roles grouped by layer part, on shared lines.
// clang-format off
enum class TensorRole : uint8_t {
  kEmbed, kFinalNorm, kLmHead,
  kAttnNorm, kFfnNorm,
  kWq, kWk, kWv, kWo, kBq, kBk, kBv, kBo, kQNorm, kKNorm, kSinks,  // GQA
  kQa, kQaNorm, kQb, kKva, kKvaNorm, kKvb,             // MLA (kWq when no q LoRA, kWo)
  kDnQkvz, kDnBa, kDnQkv, kDnZ, kDnB, kDnA,            // gated DeltaNet input projections
  kDnConv, kDnALog, kDnDtBias, kDnNorm, kDnOut,
  kRouter, kRouterBias, kRouterLogitBias,
  kExpertGateBias, kExpertUpBias, kExpertDownBias,  // one [d_expert] / [d_model] per expert
  // each MLP's gate, up, down in this order (checkpoint_tensors counts on it)
  kSharedGate, kSharedUp, kSharedDown, kSharedExpertGate,
  kDenseGate, kDenseUp, kDenseDown,
  kExpertGate, kExpertUp, kExpertDown,
};
// clang-format on

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  TensorKind kind;
  TensorRole role;
  int layer = -1;   // -1: not a layer's
  int expert = -1;  // routed expert index, else -1
};

// In checkpoint order: embedding, each layer's tensors, final norm, lm_head (absent when tied).
// Routed experts are listed one by one (`experts.E.<gate>.weight`, and `.bias` when
// expert_bias), also for a family whose checkpoint stacks them (FamilyNames::stacked):
// stacked_experts.h presents such a checkpoint under these names.
std::vector<TensorSpec> checkpoint_tensors(const HParams& hp);

}  // namespace ts::model
