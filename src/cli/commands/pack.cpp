// pack: re-lay a Hugging Face checkpoint for expert streaming (io/pack.h has the layout),
// optionally quantizing weights; verify: check every pack file against the manifest's
// SHA-256.
//
// Quantization (--experts-quant, --dense-quant: q8_0 | q4_k; backend/cpu/quant.h):
// routed experts, and with --dense-quant the attention q/k/v/o, shared-expert and dense-MLP
// matrices and an untied lm_head, are quantized from their F32 / F16 / BF16 values. A
// matrix whose rows are not whole blocks (cols % 32 or % 256) keeps its source dtype, as
// llama.cpp falls back to a wider type; each tensor's actual dtype is in the manifest
// (experts) or in dense.safetensors' header. Embeddings, norms, biases, routers and the
// shared-expert gate stay as they are: they are small, and the forward pass reads them as
// floats.
#include "io/pack.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "backend/cpu/quant.h"
#include "cli/commands/commands.h"
#include "core/sha256.h"
#include "core/thread_pool.h"
#include "hub/hub_cache.h"
#include "io/gguf.h"
#include "io/mapped_file.h"
#include "model/families/family.h"
#include "model/gguf_model.h"
#include "model/hparams.h"
#include "model/stacked_experts.h"
#include "model/weights.h"
#include "tokenizer/gguf_vocab.h"
#include "tokenizer/tokenizer_json.h"

namespace ts::cli {
namespace {

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// --experts-quant / --dense-quant: nullopt for "none".
Result<std::optional<DType>> parse_quant(const std::string& flag, const std::string& v) {
  if (v == "none") return std::optional<DType>();
  if (v == "q8_0") return std::optional<DType>(DType::kQ8_0);
  if (v == "q4_k") return std::optional<DType>(DType::kQ4_K);
  return make_error("--" + flag + " " + v + ": expected none, q8_0 or q4_k");
}

// The dtype a matrix is packed with: the quant type when its rows are whole blocks, else
// its own. Already-quantized sources are copied as they are.
DType packed_dtype(const model::Matrix& m, std::optional<DType> quant) {
  if (!quant || dtype_is_quantized(m.dtype) || !dtype_row_ok(*quant, m.cols)) return m.dtype;
  return *quant;
}

// Row r of a float-typed matrix as F32.
void row_to_f32(const model::Matrix& m, int64_t r, float* out) {
  const auto* base = static_cast<const uint8_t*>(m.data) + uint64_t(r) * dtype_row_bytes(m.dtype, m.cols);
  for (int64_t c = 0; c < m.cols; ++c) {
    uint16_t h;
    switch (m.dtype) {
      case DType::kF32: std::memcpy(&out[c], base + 4 * c, 4); break;
      case DType::kF16: std::memcpy(&h, base + 2 * c, 2); out[c] = f16_to_f32(h); break;
      case DType::kBF16: std::memcpy(&h, base + 2 * c, 2); out[c] = bf16_to_f32(h); break;
      case DType::kQ8_0:
      case DType::kQ4_K: TS_CHECK(false, "quantized sources are copied, not converted");
    }
  }
}

// Writes m to dst (m.rows * dtype_row_bytes(t, m.cols) bytes) as dtype t: a copy when t is
// m's own dtype, else each row quantized (rows split across the pool).
void store_matrix(ThreadPool& pool, const model::Matrix& m, DType t, uint8_t* dst) {
  if (t == m.dtype) {
    std::memcpy(dst, m.data, m.n_bytes());
    return;
  }
  const uint64_t row_bytes = dtype_row_bytes(t, m.cols);
  pool.parallel_for(m.rows, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(size_t(m.cols));
    for (int64_t r = r0; r < r1; ++r) {
      row_to_f32(m, r, row.data());
      cpu::quantize_row(t, row.data(), dst + uint64_t(r) * row_bytes, m.cols);
    }
  });
}

// Writes one layer's expert file; returns its SHA-256.
Result<std::string> write_expert_file(ThreadPool& pool, const std::string& path,
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
    store_matrix(pool, e.gate, layout.gate.dtype, blob.data() + layout.gate.offset);
    store_matrix(pool, e.up, layout.up.dtype, blob.data() + layout.up.offset);
    store_matrix(pool, e.down, layout.down.dtype, blob.data() + layout.down.offset);
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

// The tokenizer files beside the weights, so run / chat / serve work from the pack: copied
// from a checkpoint directory (those present), or rebuilt from a GGUF file's metadata (when it
// carries a tokenizer). Each goes into the manifest with its digest.
Status write_tokenizer_files(const std::string& src, bool gguf, const std::string& out,
                             io::PackManifest& m) {
  std::vector<std::pair<std::string, std::string>> files;  // name, bytes
  if (gguf) {
    TS_ASSIGN(io::GgufFile g, io::read_gguf(src));
    if (!g.find("tokenizer.ggml.model")) return {};
    TS_ASSIGN(tokenizer::GgufVocab v, tokenizer::read_gguf_vocab(src));
    nlohmann::json tok = v.tokenizer.root;
    nlohmann::json vocab = nlohmann::json::object();
    for (const auto& [token, id] : v.tokenizer.vocab) vocab[token] = id;
    nlohmann::json merges = nlohmann::json::array();
    for (const auto& [a, b] : v.tokenizer.merges) merges.push_back({a, b});
    tok["model"]["vocab"] = std::move(vocab);
    tok["model"]["merges"] = std::move(merges);
    files.emplace_back("tokenizer.json", tok.dump());
    files.emplace_back("tokenizer_config.json", v.tokenizer_config.dump(1));
    files.emplace_back("generation_config.json", v.generation_config.dump(1));
  } else {
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                             "chat_template.jinja"}) {
      std::error_code ec;
      if (!std::filesystem::exists(src + "/" + name, ec)) continue;
      TS_ASSIGN(std::string bytes, tokenizer::read_file_bytes(src + "/" + name));
      files.emplace_back(name, std::move(bytes));
    }
  }
  for (const auto& [name, bytes] : files) {
    TS_TRY(io::write_file_atomic(out + "/" + name, {io::ConstBytes{bytes.data(), bytes.size()}}));
    TS_ASSIGN(std::string sha, io::sha256_file(out + "/" + name));
    m.files.push_back({name, bytes.size(), sha});
  }
  return {};
}

}  // namespace

Status cmd_pack(const Args& args) {
  TS_ASSIGN(std::string model, args.str("model"));
  TS_ASSIGN(std::string src, hub::resolve_model_arg(model));
  TS_ASSIGN(std::string out, args.str("out"));
  const std::string experts_quant = args.str_or("experts-quant", "none");
  const std::string dense_quant = args.str_or("dense-quant", "none");
  TS_TRY(args.check_all_used());
  TS_ASSIGN(std::optional<DType> experts_q, parse_quant("experts-quant", experts_quant));
  TS_ASSIGN(std::optional<DType> dense_q, parse_quant("dense-quant", dense_quant));
  if (io::is_pack_dir(src)) return make_error(src + " is already a pack");
  std::error_code ec;
  const bool gguf = io::is_gguf_file(src);
  if (!gguf && !std::filesystem::is_directory(src, ec))
    return make_error("model directory " + src + " does not exist");
  model::HParams hp;
  std::unique_ptr<io::TensorSet> set;
  nlohmann::json config;
  if (gguf) {
    TS_ASSIGN(model::GgufModel g, model::open_gguf_model(src));
    hp = std::move(g.hp);
    set = std::move(g.tensors);
    config = nlohmann::json::parse(g.config_json);
    if (!g.note.empty())
      std::fprintf(stderr, "turbospark pack: %s: %s\n", src.c_str(), g.note.c_str());
  } else {
    TS_ASSIGN(hp, model::load_hparams(src));
    TS_ASSIGN(set, io::TensorSet::open_dir(src));
    TS_ASSIGN(std::string note, model::unstack_experts(hp, *set));
    if (!note.empty()) std::fprintf(stderr, "turbospark pack: %s: %s\n", src.c_str(), note.c_str());
    std::ifstream cf(src + "/config.json");
    config = nlohmann::json::parse(cf, nullptr, false);
  }
  TS_ASSIGN(model::BoundWeights w, model::bind_weights(hp, *set));
  std::filesystem::create_directories(out, ec);
  if (ec) return make_error("cannot create " + out + ": " + ec.message());

  ThreadPool pool(int(std::max(1u, std::thread::hardware_concurrency())));
  io::PackManifest m;
  m.family = std::string(model::family_name(hp.family));
  m.experts_quant = experts_quant;
  m.dense_quant = dense_quant;
  m.config = std::move(config);
  // Expert layout per MoE layer, and the set of expert tensor names (left out of dense).
  const model::FamilyNames& names = model::family_def(hp.family).names;
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
      const DType dt = packed_dtype(*mat, experts_q);
      const uint64_t bytes = uint64_t(mat->rows) * dtype_row_bytes(dt, mat->cols);
      *t = {.name = prefix + n + ".weight", .dtype = dt, .shape = {mat->rows, mat->cols},
            .offset = at, .n_bytes = bytes};
      at = align_up(at + bytes, 64);
    }
    L.stride = align_up(at, io::kPackAlign);
    for (size_t e = 0; e < experts.size(); ++e) L.offsets.push_back(e * L.stride);
    m.expert_layers.push_back(L);
  }
  // dense.safetensors: every other tensor, as stored or (--dense-quant) quantized.
  std::map<const void*, const model::Matrix*> dense_quantizable;
  if (dense_q) {
    for (const model::LayerWeights& L : w.dense.layers)
      for (const model::Matrix* x : L.matrices())
        if (x->present() && x != &L.router && x != &L.shared_gate) dense_quantizable[x->data] = x;
    if (w.dense.lm_head.data != w.dense.embed.data)  // a tied head is the embedding
      dense_quantizable[w.dense.lm_head.data] = &w.dense.lm_head;
  }
  std::vector<io::TensorToWrite> dense;
  std::vector<std::vector<uint8_t>> quantized;  // owns converted tensors until written
  for (const auto& [name, v] : set->tensors()) {
    if (expert_data.count(v.data)) continue;
    auto it = dense_quantizable.find(v.data);
    const DType dt = it == dense_quantizable.end() ? v.dtype : packed_dtype(*it->second, dense_q);
    if (dt == v.dtype) {
      dense.push_back({name, v.dtype, v.shape, v.data, v.n_bytes});
      continue;
    }
    const model::Matrix& mat = *it->second;
    quantized.emplace_back(uint64_t(mat.rows) * dtype_row_bytes(dt, mat.cols));
    store_matrix(pool, mat, dt, quantized.back().data());
    dense.push_back({name, dt, v.shape, quantized.back().data(), quantized.back().size()});
  }
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
              write_expert_file(pool, out + "/" + L.file, w.experts[size_t(L.layer)], L));
    m.files.push_back({L.file, L.stride * L.offsets.size(), sha});
  }
  if (tty) std::fprintf(stderr, "\n");
  TS_TRY(write_tokenizer_files(src, gguf, out, m));
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
