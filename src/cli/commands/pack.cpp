// pack: re-lay a Hugging Face checkpoint for expert streaming (io/pack.h has the layout);
// verify: check every pack file against the manifest's SHA-256.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <tuple>

#include "cli/commands/commands.h"
#include "core/sha256.h"
#include "io/mapped_file.h"
#include "io/pack.h"
#include "model/hparams.h"
#include "model/weights.h"

namespace ts::cli {
namespace {

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Writes one layer's expert file; returns its SHA-256.
Result<std::string> write_expert_file(const std::string& path,
                                      const std::vector<model::ExpertWeights>& experts,
                                      const io::PackExpertLayer& layout) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) return make_error("cannot write " + tmp);
  Sha256 sha;
  std::vector<uint8_t> blob(layout.stride);
  bool ok = true;
  for (const model::ExpertWeights& e : experts) {
    std::fill(blob.begin(), blob.end(), 0);
    std::memcpy(blob.data() + layout.gate.offset, e.gate.data, e.gate.n_bytes());
    std::memcpy(blob.data() + layout.up.offset, e.up.data, e.up.n_bytes());
    std::memcpy(blob.data() + layout.down.offset, e.down.data, e.down.n_bytes());
    sha.update(blob.data(), blob.size());
    if (std::fwrite(blob.data(), 1, blob.size(), f) != blob.size()) {
      ok = false;
      break;
    }
  }
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return make_error("writing " + path + " failed (disk full?)");
  }
  return sha.hex_digest();
}

}  // namespace

Status cmd_pack(const Args& args) {
  TS_ASSIGN(std::string src, args.str("model"));
  TS_ASSIGN(std::string out, args.str("out"));
  const std::string experts_quant = args.str_or("experts-quant", "none");
  const std::string dense_quant = args.str_or("dense-quant", "none");
  TS_TRY(args.check_all_used());
  for (const auto& [flag, q] : {std::pair{"experts-quant", experts_quant}, {"dense-quant", dense_quant}})
    if (q != "none")
      return make_error(std::string("--") + flag + " " + q + ": quantized packs are not built yet");
  if (io::is_pack_dir(src)) return make_error(src + " is already a pack");
  std::error_code ec;
  if (!std::filesystem::is_directory(src, ec))
    return make_error("model directory " + src + " does not exist");
  TS_ASSIGN(model::HParams hp, model::load_hparams(src));
  TS_ASSIGN(std::unique_ptr<io::TensorSet> set, io::TensorSet::open_dir(src));
  TS_ASSIGN(model::BoundWeights w, model::bind_weights(hp, *set));
  std::filesystem::create_directories(out, ec);
  if (ec) return make_error("cannot create " + out + ": " + ec.message());

  io::PackManifest m;
  m.family = std::string(model::family_name(hp.family));
  {
    std::ifstream cf(src + "/config.json");
    m.config = nlohmann::json::parse(cf, nullptr, false);
  }
  // Expert layout per MoE layer, and the set of expert tensor names (left out of dense).
  const model::FamilyNames& names = model::family_names(hp.family);
  std::set<const void*> expert_data;
  for (int l = 0; l < hp.n_layers; ++l) {
    const auto& experts = w.experts[size_t(l)];
    if (experts.empty()) continue;
    for (const auto& e : experts)
      for (const model::Matrix* x : {&e.gate, &e.up, &e.down}) expert_data.insert(x->data);
    io::PackExpertLayer L;
    L.layer = l;
    char file[32];
    std::snprintf(file, sizeof file, "experts-L%03d.bin", l);
    L.file = file;
    const std::string prefix =
        "model.layers." + std::to_string(l) + "." + names.moe_block + ".experts.{E}.";
    uint64_t at = 0;
    for (auto [t, mat, n] : {std::tuple{&L.gate, &experts[0].gate, names.expert_gate},
                             std::tuple{&L.up, &experts[0].up, names.expert_up},
                             std::tuple{&L.down, &experts[0].down, names.expert_down}}) {
      *t = {.name = prefix + n + ".weight", .dtype = mat->dtype, .shape = {mat->rows, mat->cols},
            .offset = at, .n_bytes = mat->n_bytes()};
      at = align_up(at + mat->n_bytes(), 64);
    }
    L.stride = align_up(at, io::kPackAlign);
    for (size_t e = 0; e < experts.size(); ++e) L.offsets.push_back(e * L.stride);
    m.expert_layers.push_back(L);
  }
  // dense.safetensors: every other tensor, as stored.
  std::vector<io::TensorToWrite> dense;
  for (const auto& [name, v] : set->tensors())
    if (!expert_data.count(v.data)) dense.push_back({name, v.dtype, v.shape, v.data, v.n_bytes});
  const bool tty = isatty(fileno(stderr));
  if (tty) std::fprintf(stderr, "pack: dense weights (%zu tensors)\n", dense.size());
  TS_TRY(io::write_safetensors(out + "/dense.safetensors", dense));
  TS_ASSIGN(std::string dense_sha, io::sha256_file(out + "/dense.safetensors"));
  m.files.push_back({"dense.safetensors", std::filesystem::file_size(out + "/dense.safetensors"),
                     dense_sha});
  for (size_t i = 0; i < m.expert_layers.size(); ++i) {
    const io::PackExpertLayer& L = m.expert_layers[i];
    if (tty) {
      const int width = 40, done = int(width * (i + 1) / m.expert_layers.size());
      std::fprintf(stderr, "\rpack: experts [%.*s%*s] %zu/%zu layers", done,
                   "########################################", width - done, "", i + 1,
                   m.expert_layers.size());
    }
    TS_ASSIGN(std::string sha,
              write_expert_file(out + "/" + L.file, w.experts[size_t(L.layer)], L));
    m.files.push_back({L.file, L.stride * L.offsets.size(), sha});
  }
  if (tty) std::fprintf(stderr, "\n");
  const std::string text = io::manifest_to_json(m).dump(1) + "\n";
  TS_TRY(io::write_file_atomic(out + "/manifest.json", {io::ConstBytes{text.data(), text.size()}}));
  uint64_t total = 0;
  for (const io::PackFile& f : m.files) total += f.bytes;
  std::printf("wrote pack %s: %zu files, %.3f GB\n", out.c_str(), m.files.size(),
              double(total) / 1e9);
  return {};
}

Status cmd_verify(const Args& args) {
  TS_TRY(args.check_all_used());
  if (args.positional().size() != 1) return make_error("usage: turbospark verify PACK_DIR");
  const std::string dir = args.positional()[0];
  TS_ASSIGN(io::PackManifest m, io::read_pack_manifest(dir));
  TS_TRY(io::verify_pack(dir, m, isatty(fileno(stderr))));
  std::printf("ok: %s, %zu files match manifest.json\n", dir.c_str(), m.files.size());
  return {};
}

}  // namespace ts::cli
