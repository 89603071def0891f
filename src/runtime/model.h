// A loaded model: hyper-parameters, dense weights (resident) and the expert store.
#pragma once

#include <memory>
#include <string>

#include "core/status.h"
#include "experts/expert_store.h"
#include "model/hparams.h"
#include "model/weights.h"

namespace ts::io {
class TensorSet;
}

namespace ts::runtime {

class LoadedModel {
 public:
  // DIR holds config.json and the safetensors (single or sharded). Errors name the file,
  // key or tensor.
  static Result<std::unique_ptr<LoadedModel>> load(const std::string& dir);
  ~LoadedModel();

  const model::HParams& hp() const { return hp_; }
  const model::DenseWeights& dense() const { return weights_.dense; }
  experts::ExpertStore& experts() const { return *store_; }
  const model::WeightCounts& counts() const { return counts_; }
  const std::string& dir() const { return dir_; }

 private:
  LoadedModel() = default;
  std::string dir_;
  model::HParams hp_;
  std::unique_ptr<io::TensorSet> tensors_;
  model::BoundWeights weights_;
  std::unique_ptr<experts::ExpertStore> store_;
  model::WeightCounts counts_;
};

}  // namespace ts::runtime
