// synth: a random-weight checkpoint of any shape, in the Hugging Face layout (config.json +
// safetensors shards of at most 4 GiB with model.safetensors.index.json), streamed to disk
// tensor by tensor so models larger than RAM can be written.
//
// Scales keep activations healthy at any depth: linear weights uniform with std
// 1/sqrt(fan_in); routers std 2/sqrt(d_model) so routing is decisive; norms 1 +- 0.1;
// biases std 0.02; embeddings std 1.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands/commands.h"
#include "core/dtype.h"
#include "model/tensor_specs.h"

namespace ts::cli {
namespace {

constexpr uint64_t kMaxShardBytes = uint64_t(4) << 30;

struct Rng {  // splitmix64: fast, and the same stream on every platform for a seed
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return float(next() >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f; }  // [-1,1)
};

struct Shard {
  std::vector<size_t> tensors;  // indices into the spec list
  uint64_t bytes = 0;
};

Status write_shard(const std::string& path, const std::vector<model::TensorSpec>& specs,
                   const Shard& shard, DType dt, Rng& rng) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t off = 0;
  for (size_t i : shard.tensors) {
    int64_t n = 1;
    for (int64_t s : specs[i].shape) n *= s;
    uint64_t b = uint64_t(n) * dtype_size(dt);
    header[specs[i].name] = {{"dtype", std::string(dtype_name(dt))},
                             {"shape", specs[i].shape},
                             {"data_offsets", {off, off + b}}};
    off += b;
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string h = header.dump();
  while (h.size() % 8) h += ' ';
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) return make_error("cannot write " + tmp);
  uint64_t hl = h.size();
  bool ok = std::fwrite(&hl, 8, 1, f) == 1 && std::fwrite(h.data(), 1, h.size(), f) == h.size();
  std::vector<uint8_t> buf;
  for (size_t i : shard.tensors) {
    if (!ok) break;
    const model::TensorSpec& s = specs[i];
    int64_t n = 1;
    for (int64_t x : s.shape) n *= x;
    const int64_t fan_in = s.shape.size() == 2 ? s.shape[1] : 1;
    float scale = 0, center = 0;
    switch (s.kind) {
      case model::TensorKind::kEmbedding: scale = std::sqrt(3.0f); break;
      case model::TensorKind::kLinear:
      case model::TensorKind::kExpert: scale = std::sqrt(3.0f / float(fan_in)); break;
      case model::TensorKind::kRouter: scale = 2.0f * std::sqrt(3.0f / float(fan_in)); break;
      case model::TensorKind::kNorm: center = 1.0f; scale = 0.1f; break;
      case model::TensorKind::kBias: scale = 0.02f * std::sqrt(3.0f); break;
    }
    buf.resize(size_t(n) * dtype_size(dt));
    for (int64_t j = 0; j < n; ++j) {
      float v = center + scale * rng.uniform();
      switch (dt) {
        case DType::kF32: std::memcpy(&buf[size_t(j) * 4], &v, 4); break;
        case DType::kF16: { uint16_t x = f32_to_f16(v); std::memcpy(&buf[size_t(j) * 2], &x, 2); break; }
        case DType::kBF16: { uint16_t x = f32_to_bf16(v); std::memcpy(&buf[size_t(j) * 2], &x, 2); break; }
        case DType::kQ8_0:
        case DType::kQ4_K: TS_CHECK(false, "synth writes float dtypes only");
      }
    }
    ok = std::fwrite(buf.data(), 1, buf.size(), f) == buf.size();
  }
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return make_error("writing " + path + " failed (disk full?)");
  }
  return {};
}

}  // namespace

Status cmd_synth(const Args& args) {
  TS_ASSIGN(std::string config_path, args.str("config"));
  TS_ASSIGN(std::string out_dir, args.str("out"));
  std::string dtype_s = args.str_or("dtype", "bf16");
  TS_ASSIGN(int64_t seed, args.integer_or("seed", 0, 0, INT64_MAX));
  TS_TRY(args.check_all_used());
  DType dt;
  if (dtype_s == "bf16") dt = DType::kBF16;
  else if (dtype_s == "f16") dt = DType::kF16;
  else if (dtype_s == "f32") dt = DType::kF32;
  else return make_error("--dtype: '" + dtype_s + "' is not one of bf16, f16, f32");

  std::ifstream cf(config_path, std::ios::binary);
  if (!cf) return make_error("cannot read " + config_path);
  std::stringstream ss;
  ss << cf.rdbuf();
  const std::string config_text = ss.str();
  TS_ASSIGN(model::HParams hp, model::parse_hparams(config_text, config_path));

  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return make_error("cannot create " + out_dir + ": " + ec.message());
  {
    std::ofstream o(out_dir + "/config.json", std::ios::binary);
    o << config_text;
    if (!o) return make_error("cannot write " + out_dir + "/config.json");
  }
  const std::vector<model::TensorSpec> specs = model::checkpoint_tensors(hp);
  std::vector<Shard> shards(1);
  for (size_t i = 0; i < specs.size(); ++i) {
    int64_t n = 1;
    for (int64_t x : specs[i].shape) n *= x;
    uint64_t b = uint64_t(n) * dtype_size(dt);
    if (shards.back().bytes > 0 && shards.back().bytes + b > kMaxShardBytes) shards.emplace_back();
    shards.back().tensors.push_back(i);
    shards.back().bytes += b;
  }
  Rng rng{uint64_t(seed) * 0x2545f4914f6cdd1dull + 1};
  uint64_t total = 0;
  if (shards.size() == 1) {
    TS_TRY(write_shard(out_dir + "/model.safetensors", specs, shards[0], dt, rng));
    total = shards[0].bytes;
  } else {
    nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
    for (size_t s = 0; s < shards.size(); ++s) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
      TS_TRY(write_shard(out_dir + "/" + name, specs, shards[s], dt, rng));
      for (size_t i : shards[s].tensors) index["weight_map"][specs[i].name] = name;
      total += shards[s].bytes;
      if (isatty(fileno(stderr)))
        std::fprintf(stderr, "\rsynth: shard %zu/%zu written", s + 1, shards.size());
    }
    if (isatty(fileno(stderr))) std::fprintf(stderr, "\n");
    index["metadata"]["total_size"] = total;
    std::ofstream o(out_dir + "/model.safetensors.index.json");
    o << index.dump(2);
    if (!o) return make_error("cannot write " + out_dir + "/model.safetensors.index.json");
  }
  std::printf("wrote %s: %s, %zu tensors, %.3f GB (%s)\n", out_dir.c_str(),
              std::string(model::family_name(hp.family)).c_str(), specs.size(),
              double(total) / 1e9, std::string(dtype_name(dt)).c_str());
  return {};
}

}  // namespace ts::cli
