// A loaded model: hyper-parameters, dense weights (resident) and the expert store chosen by
// the residency options.
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

struct LoadOptions {
  experts::Residency residency = experts::Residency::kMapped;
  experts::StreamedOptions streamed;  // slots_per_layer, policy, direct_io, io_threads
  int64_t expert_cache_mb = 0;        // if > 0, sets slots_per_layer from a total budget
  experts::LayerProgress on_layer;    // resident: after each layer's experts are copied
};

class LoadedModel {
 public:
  // DIR holds config.json and the safetensors (single or sharded), or is a pack, or is a GGUF
  // file (model/gguf_model.h). Errors name the file, key or tensor.
  static Result<std::unique_ptr<LoadedModel>> load(const std::string& dir,
                                                   const LoadOptions& options = {});
  ~LoadedModel();

  const model::HParams& hp() const { return hp_; }
  const model::DenseWeights& dense() const { return weights_.dense; }
  experts::ExpertStore& experts() const { return *store_; }
  const model::WeightCounts& counts() const { return counts_; }
  const std::string& dir() const { return dir_; }
  // Slot count per layer in streamed mode (0 otherwise) and bytes of one slot (largest expert).
  int slots_per_layer() const { return slots_per_layer_; }
  // What loading changed that a user should know ("" when nothing): a GGUF file's tensors
  // converted to Q8_0.
  const std::string& load_note() const { return note_; }

 private:
  LoadedModel() = default;
  std::string dir_;
  model::HParams hp_;
  std::unique_ptr<io::TensorSet> tensors_;
  model::BoundWeights weights_;
  std::unique_ptr<experts::ExpertStore> store_;
  model::WeightCounts counts_;
  int slots_per_layer_ = 0;
  std::string note_;
};

}  // namespace ts::runtime
