#include "io/pack.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/sha256.h"

namespace ts::io {
namespace {

using json = nlohmann::json;

Result<PackTensor> tensor_from_json(const json& j, const std::string& where) {
  PackTensor t;
  if (!j.is_object() || !j.contains("name") || !j.contains("dtype") || !j.contains("shape") ||
      !j.contains("offset") || !j.contains("bytes"))
    return make_error(where + ": needs name, dtype, shape, offset, bytes");
  try {
    t.name = j.at("name").get<std::string>();
    TS_ASSIGN(t.dtype, parse_safetensors_dtype(j.at("dtype").get<std::string>()));
    t.shape = j.at("shape").get<std::vector<int64_t>>();
    t.offset = j.at("offset").get<uint64_t>();
    t.n_bytes = j.at("bytes").get<uint64_t>();
  } catch (const std::exception& e) {
    return make_error(where + ": " + e.what());
  }
  if (t.shape.size() != 2 || t.shape[0] <= 0 || t.shape[1] <= 0)
    return make_error(where + ": shape must be [rows, cols]");
  if (!dtype_row_ok(t.dtype, t.shape[1]))
    return make_error(where + ": " + std::string(dtype_name(t.dtype)) + " cols " +
                      std::to_string(t.shape[1]) + " are not a multiple of its " +
                      std::to_string(dtype_block_elems(t.dtype)) + "-weight block");
  if (t.n_bytes != uint64_t(t.shape[0]) * dtype_row_bytes(t.dtype, t.shape[1]))
    return make_error(where + ": bytes " + std::to_string(t.n_bytes) + " disagree with " +
                      std::string(dtype_name(t.dtype)) + " [" + std::to_string(t.shape[0]) +
                      ", " + std::to_string(t.shape[1]) + "]");
  if (t.name.find("{E}") == std::string::npos) return make_error(where + ": name lacks {E}");
  return t;
}

json tensor_to_json(const PackTensor& t) {
  return {{"name", t.name},       {"dtype", std::string(dtype_name(t.dtype))},
          {"shape", t.shape},     {"offset", t.offset},
          {"bytes", t.n_bytes}};
}

}  // namespace

bool is_pack_dir(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(dir + "/manifest.json", ec);
}

json manifest_to_json(const PackManifest& m) {
  json files = json::array(), layers = json::array();
  for (const PackFile& f : m.files)
    files.push_back({{"path", f.path}, {"bytes", f.bytes}, {"sha256", f.sha256}});
  for (const PackExpertLayer& l : m.expert_layers)
    layers.push_back({{"layer", l.layer},
                      {"file", l.file},
                      {"stride", l.stride},
                      {"offsets", l.offsets},
                      {"gate", tensor_to_json(l.gate)},
                      {"up", tensor_to_json(l.up)},
                      {"down", tensor_to_json(l.down)}});
  return {{"format", "turbospark-pack"}, {"format_version", m.format_version},
          {"family", m.family},          {"experts_quant", m.experts_quant},
          {"dense_quant", m.dense_quant}, {"config", m.config},
          {"files", files},              {"expert_layers", layers}};
}

Result<PackManifest> read_pack_manifest(const std::string& dir) {
  const std::string path = dir + "/manifest.json";
  std::ifstream f(path, std::ios::binary);
  if (!f) return make_error("cannot read " + path);
  std::stringstream ss;
  ss << f.rdbuf();
  json j = json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return make_error(path + ": not a JSON object");
  PackManifest m;
  try {
    if (j.value("format", "") != "turbospark-pack")
      return make_error(path + ": key 'format' is not \"turbospark-pack\"");
    m.format_version = j.at("format_version").get<int>();
    if (m.format_version != kPackFormatVersion)
      return make_error(path + ": format_version " + std::to_string(m.format_version) +
                        " is not supported (this build reads " +
                        std::to_string(kPackFormatVersion) + "); re-run turbospark pack");
    m.family = j.at("family").get<std::string>();
    m.config = j.at("config");
    m.experts_quant = j.value("experts_quant", "none");
    m.dense_quant = j.value("dense_quant", "none");
    for (const json& fj : j.at("files")) {
      PackFile pf{fj.at("path").get<std::string>(), fj.at("bytes").get<uint64_t>(),
                  fj.at("sha256").get<std::string>()};
      if (pf.path.empty() || pf.path.find('/') != std::string::npos || pf.path[0] == '.')
        return make_error(path + ": file name '" + pf.path + "' is not a plain file name");
      m.files.push_back(pf);
    }
    for (const json& lj : j.at("expert_layers")) {
      PackExpertLayer l;
      l.layer = lj.at("layer").get<int>();
      l.file = lj.at("file").get<std::string>();
      l.stride = lj.at("stride").get<uint64_t>();
      l.offsets = lj.at("offsets").get<std::vector<uint64_t>>();
      std::string where = path + ": expert_layers[" + std::to_string(l.layer) + "]";
      TS_ASSIGN(l.gate, tensor_from_json(lj.at("gate"), where + ".gate"));
      TS_ASSIGN(l.up, tensor_from_json(lj.at("up"), where + ".up"));
      TS_ASSIGN(l.down, tensor_from_json(lj.at("down"), where + ".down"));
      m.expert_layers.push_back(std::move(l));
    }
  } catch (const std::exception& e) {
    return make_error(path + ": " + e.what());
  }
  // Sizes on disk must match the manifest: a truncated or swapped file fails here.
  for (const PackFile& pf : m.files) {
    std::error_code ec;
    const std::string fp = dir + "/" + pf.path;
    uint64_t size = std::filesystem::file_size(fp, ec);
    if (ec) return make_error("pack file " + fp + " is missing (" + ec.message() + ")");
    if (size != pf.bytes)
      return make_error("pack file " + fp + " has " + std::to_string(size) + " bytes, manifest says " +
                        std::to_string(pf.bytes) + " (truncated or altered; run turbospark verify)");
  }
  for (const PackExpertLayer& l : m.expert_layers) {
    const PackFile* pf = nullptr;
    for (const PackFile& f : m.files)
      if (f.path == l.file) pf = &f;
    if (!pf) return make_error(path + ": expert file " + l.file + " is not listed in files");
    const uint64_t blob_end =
        std::max({l.gate.offset + l.gate.n_bytes, l.up.offset + l.up.n_bytes,
                  l.down.offset + l.down.n_bytes});
    if (blob_end > l.stride) return make_error(path + ": layer " + std::to_string(l.layer) +
                                               " blob is larger than its stride");
    for (uint64_t off : l.offsets)
      if (off % kPackAlign || off + l.stride > pf->bytes)
        return make_error(path + ": layer " + std::to_string(l.layer) + " expert offset " +
                          std::to_string(off) + " is unaligned or past the end of " + l.file);
  }
  return m;
}

Result<std::string> sha256_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return make_error("cannot read " + path);
  Sha256 h;
  std::vector<uint8_t> buf(size_t(4) << 20);
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) h.update(buf.data(), n);
  bool err = std::ferror(f);
  std::fclose(f);
  if (err) return make_error("error reading " + path);
  return h.hex_digest();
}

Status verify_pack(const std::string& dir, const PackManifest& m, bool progress) {
  for (size_t i = 0; i < m.files.size(); ++i) {
    const PackFile& pf = m.files[i];
    if (progress) std::fprintf(stderr, "\rverify: %zu/%zu %s", i + 1, m.files.size(), pf.path.c_str());
    TS_ASSIGN(std::string digest, sha256_file(dir + "/" + pf.path));
    if (digest != pf.sha256) {
      if (progress) std::fprintf(stderr, "\n");
      return make_error("pack file " + dir + "/" + pf.path + " does not match its SHA-256 in " +
                        "manifest.json (corrupt or altered)");
    }
  }
  if (progress) std::fprintf(stderr, "\n");
  return {};
}

Result<std::unique_ptr<TensorSet>> open_pack_tensors(const std::string& dir,
                                                     const PackManifest& m) {
  TS_ASSIGN(std::unique_ptr<TensorSet> set, TensorSet::open_file(dir + "/dense.safetensors"));
  for (const PackExpertLayer& l : m.expert_layers) {
    const std::string fp = dir + "/" + l.file;
    TS_ASSIGN(std::unique_ptr<MappedFile> file, MappedFile::open(fp));
    std::vector<TensorView> views;
    for (size_t e = 0; e < l.offsets.size(); ++e) {
      for (const PackTensor* t : {&l.gate, &l.up, &l.down}) {
        TensorView v;
        v.name = t->name;
        v.name.replace(v.name.find("{E}"), 3, std::to_string(e));
        v.dtype = t->dtype;
        v.shape = t->shape;
        v.file_offset = l.offsets[e] + t->offset;
        v.data = file->data() + v.file_offset;
        v.n_bytes = t->n_bytes;
        v.file = fp;
        views.push_back(std::move(v));
      }
    }
    TS_TRY(set->add_mapped(std::move(file), std::move(views)));
  }
  return set;
}

}  // namespace ts::io
