#include "runtime/model.h"

#include <filesystem>

#include "io/safetensors.h"

namespace ts::runtime {

LoadedModel::~LoadedModel() = default;

Result<std::unique_ptr<LoadedModel>> LoadedModel::load(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    return make_error("model directory " + dir + " does not exist");
  std::unique_ptr<LoadedModel> m(new LoadedModel());
  m->dir_ = dir;
  TS_ASSIGN(m->hp_, model::load_hparams(dir));
  TS_ASSIGN(m->tensors_, io::TensorSet::open_dir(dir));
  TS_ASSIGN(m->weights_, model::bind_weights(m->hp_, *m->tensors_));
  m->counts_ = model::count_weights(m->hp_, m->weights_);
  m->store_ = std::make_unique<experts::ResidentStore>(m->weights_.experts);
  return m;
}

}  // namespace ts::runtime
