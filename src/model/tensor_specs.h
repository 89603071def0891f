// The list of checkpoint tensors a family's config implies (Hub names and shapes), for
// writing synthetic checkpoints.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/hparams.h"

namespace ts::model {

enum class TensorKind : uint8_t { kEmbedding, kLinear, kRouter, kNorm, kBias, kExpert };

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  TensorKind kind;
};

std::vector<TensorSpec> checkpoint_tensors(const HParams& hp);

}  // namespace ts::model
