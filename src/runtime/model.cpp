#include "runtime/model.h"

#include <filesystem>
#include <map>
#include <optional>
#include <unordered_map>

#include "io/gguf.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "model/gguf_model.h"
#include "model/stacked_experts.h"

namespace ts::runtime {
namespace {

// Streaming source for a safetensors checkpoint: each expert is three tensors (three pieces),
// laid out gate | up | down in a slot at 4096-byte boundaries.
experts::ExpertSource safetensors_source(const io::TensorSet& set,
                                         const model::ExpertTable& table) {
  std::unordered_map<const void*, const io::TensorView*> by_data;
  for (const auto& [name, view] : set.tensors()) by_data[view.data] = &view;
  experts::ExpertSource src;
  std::map<std::string, int> file_index;
  auto file_of = [&](const std::string& f) {
    auto [it, inserted] = file_index.emplace(f, int(src.files.size()));
    if (inserted) src.files.push_back(f);
    return it->second;
  };
  src.layers.resize(table.size());
  for (size_t l = 0; l < table.size(); ++l) {
    for (const model::ExpertWeights& e : table[l]) {
      experts::ExpertLocation loc;
      loc.layout = e;
      uint64_t at = 0;
      for (auto [m, lm] : {std::pair{&e.gate, &loc.layout.gate}, std::pair{&e.up, &loc.layout.up},
                           std::pair{&e.down, &loc.layout.down}}) {
        const io::TensorView* v = by_data.at(m->data);
        loc.pieces.push_back({.file = file_of(v->file),
                              .file_offset = v->file_offset,
                              .n_bytes = v->n_bytes,
                              .slot_offset = at});
        lm->data = reinterpret_cast<const void*>(uintptr_t(at));
        at = (at + v->n_bytes + 4095) / 4096 * 4096;
      }
      loc.slot_bytes = at;
      src.layers[l].push_back(std::move(loc));
    }
  }
  return src;
}

// A pack's expert layers must each name one MoE layer of its config, once, with one offset
// per expert and tensor names of that layer: the streamed source places blobs by these fields,
// so a manifest that disagrees with itself is refused rather than read into the wrong layer.
Status check_pack_layers(const io::PackManifest& pack, const model::HParams& hp,
                         const std::string& path) {
  std::vector<bool> seen(size_t(hp.n_layers), false);
  for (size_t i = 0; i < pack.expert_layers.size(); ++i) {
    const io::PackExpertLayer& l = pack.expert_layers[i];
    const std::string where = path + ": expert_layers[" + std::to_string(i) + "]";
    if (l.layer < 0 || l.layer >= hp.n_layers || !hp.layer_is_moe[size_t(l.layer)])
      return make_error(where + ".layer = " + std::to_string(l.layer) +
                        " is not a MoE layer of the config (" + std::to_string(hp.n_layers) +
                        " layers)");
    if (seen[size_t(l.layer)])
      return make_error(where + ".layer = " + std::to_string(l.layer) + " appears twice");
    seen[size_t(l.layer)] = true;
    if (l.offsets.size() != size_t(hp.n_experts))
      return make_error(where + ".offsets has " + std::to_string(l.offsets.size()) +
                        " entries, the config has " + std::to_string(hp.n_experts) + " experts");
    const std::string tag = "layers." + std::to_string(l.layer) + ".";
    for (const io::PackTensor* t : {&l.gate, &l.up, &l.down})
      if (t->name.find(tag) == std::string::npos)
        return make_error(where + ": tensor name '" + t->name + "' is not of layer " +
                          std::to_string(l.layer));
  }
  return {};
}

// Streaming source for a pack: each expert is one 4096-aligned blob of `stride` bytes, so
// one read fills a slot and O_DIRECT works.
experts::ExpertSource pack_source(const std::string& dir, const io::PackManifest& pack,
                                  const model::ExpertTable& table) {
  experts::ExpertSource src;
  src.layers.resize(table.size());
  for (const io::PackExpertLayer& l : pack.expert_layers) {
    const int file = int(src.files.size());
    src.files.push_back(dir + "/" + l.file);
    for (size_t e = 0; e < l.offsets.size(); ++e) {
      experts::ExpertLocation loc;
      loc.layout = table[size_t(l.layer)][e];
      loc.layout.gate.data = reinterpret_cast<const void*>(uintptr_t(l.gate.offset));
      loc.layout.up.data = reinterpret_cast<const void*>(uintptr_t(l.up.offset));
      loc.layout.down.data = reinterpret_cast<const void*>(uintptr_t(l.down.offset));
      loc.pieces.push_back({.file = file, .file_offset = l.offsets[e], .n_bytes = l.stride,
                            .slot_offset = 0});
      loc.slot_bytes = l.stride;
      src.layers[size_t(l.layer)].push_back(std::move(loc));
    }
  }
  return src;
}

}  // namespace

LoadedModel::~LoadedModel() = default;

Result<std::unique_ptr<LoadedModel>> LoadedModel::load(const std::string& dir,
                                                       const LoadOptions& options) {
  std::error_code ec;
  const bool gguf = io::is_gguf_file(dir);
  if (!gguf && !std::filesystem::is_directory(dir, ec))
    return make_error(std::filesystem::exists(dir, ec)
                          ? dir + " is neither a model directory nor a GGUF file"
                          : "model directory " + dir + " does not exist");
  std::unique_ptr<LoadedModel> m(new LoadedModel());
  m->dir_ = dir;
  std::optional<io::PackManifest> pack;
  if (gguf) {
    TS_ASSIGN(model::GgufModel g, model::open_gguf_model(dir));
    m->hp_ = std::move(g.hp);
    m->tensors_ = std::move(g.tensors);
    m->note_ = std::move(g.note);
  } else if (io::is_pack_dir(dir)) {
    TS_ASSIGN(pack, io::read_pack_manifest(dir));
    TS_ASSIGN(m->hp_, model::parse_hparams(pack->config.dump(), dir + "/manifest.json (config)"));
    TS_TRY(check_pack_layers(*pack, m->hp_, dir + "/manifest.json"));
    TS_ASSIGN(m->tensors_, io::open_pack_tensors(dir, *pack));
  } else {
    TS_ASSIGN(m->hp_, model::load_hparams(dir));
    TS_ASSIGN(m->tensors_, io::TensorSet::open_dir(dir));
    TS_ASSIGN(m->note_, model::unstack_experts(m->hp_, *m->tensors_));
  }
  TS_ASSIGN(m->weights_, model::bind_weights(m->hp_, *m->tensors_));
  m->counts_ = model::count_weights(m->hp_, m->weights_);
  switch (options.residency) {
    case experts::Residency::kMapped:
      m->store_ = experts::TableStore::mapped(m->weights_.experts);
      break;
    case experts::Residency::kResident: {
      TS_ASSIGN(m->store_, experts::TableStore::resident(m->weights_.experts, options.on_layer));
      break;
    }
    case experts::Residency::kStreamed: {
      // Streaming reads experts' matrices from their file: a converted copy has no place
      // there (experts' biases are dense weights, never streamed).
      if (!pack)
        for (const auto& [name, view] : m->tensors_->tensors())
          if (view.owned && view.shape.size() == 2 && name.find(".experts.") != std::string::npos)
            return make_error(dir + ": tensor " + name + " was converted at load (" + m->note_ +
                              "), so it cannot be streamed from the file; use " +
                              "--residency mapped or resident, or make a pack (turbospark " +
                              "pack --model " + dir + ") and stream that");
      experts::StreamedOptions so = options.streamed;
      if (options.expert_cache_mb > 0) {
        int n_moe = 0;
        for (bool b : m->hp_.layer_is_moe) n_moe += b;
        const uint64_t expert_bytes = m->counts_.routed_bytes /
                                      uint64_t(std::max(1, n_moe * m->hp_.n_experts));
        so.slots_per_layer = int(std::max<uint64_t>(
            1, uint64_t(options.expert_cache_mb) * 1000000 / (expert_bytes * uint64_t(std::max(1, n_moe)))));
      }
      so.slots_per_layer = std::min(so.slots_per_layer, m->hp_.n_experts);
      m->slots_per_layer_ = so.slots_per_layer;
      TS_ASSIGN(m->store_,
                experts::open_streamed_store(
                    pack ? pack_source(dir, *pack, m->weights_.experts)
                         : safetensors_source(*m->tensors_, m->weights_.experts),
                    so));
      break;
    }
  }
  return m;
}

}  // namespace ts::runtime
