#include "model/gguf_model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "backend/cpu/quant.h"
#include "core/thread_pool.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "model/ggml_dequant.h"
#include "model/families/family.h"
#include "model/hparams.h"
#include "model/weights.h"

namespace ts::model {
namespace {

using json = nlohmann::ordered_json;

// The {arch}.* metadata through GgufFile's typed accessors; errors name the file and the key.
struct Meta {
  const io::GgufFile& g;
  const std::string& path;
  std::string arch;

  Error err(const std::string& key, const std::string& what) const {
    return make_error(path + ": metadata '" + key + "' " + what);
  }
  std::string k(const std::string& key) const { return arch + "." + key; }

  // A required positive integer (a count or a size).
  Result<int64_t> integer(const std::string& key) const {
    TS_ASSIGN(std::optional<int64_t> v, g.integer(key));
    if (!v) return err(key, "is missing");
    if (*v <= 0 || *v > (int64_t(1) << 30))
      return err(key, "must be positive, got " + std::to_string(*v));
    return *v;
  }
};

// The dtype the kernels read a ggml type as; nullopt for a type converted at load.
std::optional<DType> native_dtype(uint32_t ggml_type) {
  switch (ggml_type) {
    case io::kGgmlF32:
      return DType::kF32;
    case io::kGgmlF16:
      return DType::kF16;
    case io::kGgmlBF16:
      return DType::kBF16;
    case io::kGgmlQ8_0:
      return DType::kQ8_0;
    case io::kGgmlQ4_K:
      return DType::kQ4_K;
    default:
      return std::nullopt;
  }
}

// A tensor of a block type the kernels do not read (Q6_K, Q5_K, ...: a Q4_K_M file has some)
// requantized to Q8_0 row by row: ggml's reference dequantization, then Q8_0's (the rows
// must be finite; a non-finite value means a corrupt file). Rows split across the pool.
Result<std::unique_ptr<uint8_t[]>> convert_to_q8_0(ThreadPool& pool, const io::GgufTensorInfo& t,
                                                   const uint8_t* src, const std::string& path,
                                                   size_t* n_bytes) {
  const std::string what =
      path + ": tensor '" + t.name + "' (" + io::ggml_type_name(t.ggml_type) + ")";
  const int64_t cols = t.dims.empty() ? 1 : t.dims[0];
  if (!ggml_can_dequantize(t.ggml_type))
    return make_error(what + " is a type turbospark neither computes with nor converts " +
                      "(F32, F16, BF16, Q8_0, Q4_K natively; Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, " +
                      "Q3_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS converted to Q8_0 at load)");
  if (!dtype_row_ok(DType::kQ8_0, cols))
    return make_error(what + ": rows of " + std::to_string(cols) +
                      " values are not whole Q8_0 blocks of 32");
  int64_t block_elems = 0;
  uint64_t block_bytes = 0;
  io::ggml_type_block(t.ggml_type, &block_elems, &block_bytes);
  const int64_t rows = t.numel / cols;
  const size_t src_row = size_t(cols / block_elems) * block_bytes;
  const size_t dst_row = dtype_row_bytes(DType::kQ8_0, cols);
  *n_bytes = size_t(rows) * dst_row;
  auto out = std::make_unique<uint8_t[]>(*n_bytes);
  std::atomic<int64_t> bad_row{-1};
  pool.parallel_for(rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = r0; r < r1; ++r) {
      ggml_dequantize_row(t.ggml_type, src + size_t(r) * src_row, row.data(), cols);
      for (float v : row)
        if (!std::isfinite(v)) {
          bad_row = r;
          return;
        }
      cpu::quantize_row(DType::kQ8_0, row.data(), out.get() + size_t(r) * dst_row, cols);
    }
  });
  if (bad_row >= 0)
    return make_error(what + ": row " + std::to_string(bad_row.load()) +
                      " holds a non-finite value (a corrupt file?)");
  return out;
}

// ggml dims with trailing 1s dropped (a writer may keep them).
std::vector<int64_t> dims_of(const io::GgufTensorInfo& t) {
  std::vector<int64_t> d = t.dims;
  while (d.size() > 1 && d.back() == 1) d.pop_back();
  return d;
}

std::string dims_str(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// What a GGUF tensor name means: a Hub name, or a stacked / per-expert projection.
struct Mapped {
  std::string hub;       // Hub name (for stacked experts: the part after "experts.E.")
  int layer = -1;        // blk.N
  bool stacked = false;  // ffn_*_exps: one view per expert
  int expert = -1;       // ffn_gate.E.weight (older Mixtral files)
  char qk = 0;           // 'q' / 'k': llama's permuted attention rows
};

std::optional<Mapped> map_name(const std::string& name, const FamilyNames& fam) {
  if (name == "token_embd.weight") return Mapped{.hub = "model.embed_tokens.weight"};
  if (name == "output_norm.weight") return Mapped{.hub = "model.norm.weight"};
  if (name == "output.weight") return Mapped{.hub = "lm_head.weight"};
  constexpr std::string_view kBlk = "blk.";
  if (name.rfind(kBlk, 0) != 0) return std::nullopt;
  const size_t dot = name.find('.', kBlk.size());
  if (dot == std::string::npos || dot == kBlk.size() || dot - kBlk.size() > 6) return std::nullopt;
  int layer = 0;
  for (size_t i = kBlk.size(); i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    layer = layer * 10 + (name[i] - '0');
  }
  const std::string rest = name.substr(dot + 1);
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const std::string moe = p + fam.moe_block + ".";
  static const std::map<std::string, std::string> kFixed = {
      {"attn_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"attn_v.weight", "self_attn.v_proj.weight"},
      {"attn_v.bias", "self_attn.v_proj.bias"},
      {"attn_output.weight", "self_attn.o_proj.weight"},
      {"attn_q_norm.weight", "self_attn.q_norm.weight"},
      {"attn_k_norm.weight", "self_attn.k_norm.weight"},
      {"ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"},
      {"ffn_gate_shexp.weight", "mlp.shared_expert.gate_proj.weight"},
      {"ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"},
      {"ffn_down_shexp.weight", "mlp.shared_expert.down_proj.weight"},
      {"ffn_gate.weight", "mlp.gate_proj.weight"},
      {"ffn_up.weight", "mlp.up_proj.weight"},
      {"ffn_down.weight", "mlp.down_proj.weight"},
  };
  if (auto it = kFixed.find(rest); it != kFixed.end())
    return Mapped{.hub = p + it->second, .layer = layer};
  if (rest == "attn_q.weight" || rest == "attn_q.bias" || rest == "attn_k.weight" ||
      rest == "attn_k.bias")
    return Mapped{.hub = p + "self_attn." + rest.substr(5, 1) + "_proj." + rest.substr(7),
                  .layer = layer,
                  .qk = rest[5]};
  if (rest == "ffn_gate_inp.weight") return Mapped{.hub = moe + "gate.weight", .layer = layer};
  const std::pair<const char*, const char*> kProj[] = {
      {"gate", fam.expert_gate}, {"up", fam.expert_up}, {"down", fam.expert_down}};
  for (auto [g, hub] : kProj) {
    if (rest == "ffn_" + std::string(g) + "_exps.weight")
      return Mapped{.hub = std::string(hub) + ".weight", .layer = layer, .stacked = true};
    // ffn_gate.E.weight
    const std::string pre = "ffn_" + std::string(g) + ".";
    if (rest.rfind(pre, 0) == 0 && rest.size() > pre.size() + 7 &&
        rest.compare(rest.size() - 7, 7, ".weight") == 0) {
      const std::string digits = rest.substr(pre.size(), rest.size() - 7 - pre.size());
      if (digits.empty() || digits.size() > 5 ||
          digits.find_first_not_of("0123456789") != std::string::npos)
        return std::nullopt;
      const int e = std::stoi(digits);
      return Mapped{
          .hub = moe + "experts." + digits + "." + hub + ".weight", .layer = layer, .expert = e};
    }
  }
  return std::nullopt;
}

// The file, or every shard of a split model (llama.cpp's gguf-split: PREFIX-00001-of-0000N.gguf
// holds the metadata, each shard split.no / split.count and some of the tensors), in order.
Result<std::vector<io::GgufFile>> read_shards(const std::string& path) {
  std::vector<io::GgufFile> shards;
  TS_ASSIGN(io::GgufFile first, io::read_gguf(path));
  TS_ASSIGN(std::optional<int64_t> n, first.integer("split.count"));
  const int64_t count = n.value_or(1);
  if (count < 1 || count > 99999)
    return make_error(path + ": metadata 'split.count' = " + std::to_string(count) +
                      " is not in [1, 99999]");
  shards.push_back(std::move(first));
  if (count == 1) return shards;
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, "-00001-of-%05d.gguf", int(count));
  if (path.size() < std::strlen(suffix) ||
      path.compare(path.size() - std::strlen(suffix), std::string::npos, suffix) != 0)
    return make_error(path + ": a split model of " + std::to_string(count) +
                      " files; give its first file (PREFIX" + suffix + ")");
  const std::string prefix = path.substr(0, path.size() - std::strlen(suffix));
  for (int64_t i = 2; i <= count; ++i) {
    std::snprintf(suffix, sizeof suffix, "-%05d-of-%05d.gguf", int(i), int(count));
    const std::string shard = prefix + suffix;
    std::error_code ec;
    if (!std::filesystem::exists(shard, ec))
      return make_error(path + ": split shard " + shard + " is missing (" + std::to_string(count) +
                        " files)");
    TS_ASSIGN(io::GgufFile g, io::read_gguf(shard));
    TS_ASSIGN(std::optional<int64_t> no, g.integer("split.no"));
    if (no != i - 1)
      return make_error(shard + ": metadata 'split.no' is not " + std::to_string(i - 1));
    shards.push_back(std::move(g));
  }
  return shards;
}

}  // namespace

Result<GgufModel> open_gguf_model(const std::string& path) {
  TS_ASSIGN(std::vector<io::GgufFile> shards, read_shards(path));
  const io::GgufFile& g = shards[0];
  Meta m{g, path, ""};
  TS_ASSIGN(std::optional<std::string> arch, g.string("general.architecture"));
  if (!arch) return m.err("general.architecture", "is missing (is this a model file?)");
  m.arch = *arch;

  json cfg = json::object();
  Family family;
  if (m.arch == "qwen3moe") {
    family = Family::kQwen3Moe;
    cfg["model_type"] = "qwen3_moe";
  } else if (m.arch == "qwen2moe") {
    family = Family::kQwen2Moe;
    cfg["model_type"] = "qwen2_moe";
  } else if (m.arch == "olmoe") {
    family = Family::kOlmoe;
    cfg["model_type"] = "olmoe";
  } else if (m.arch == "llama") {
    TS_ASSIGN(std::optional<int64_t> n, g.integer(m.k("expert_count")));
    if (!n || *n == 0)
      return m.err("general.architecture",
                   "= 'llama' without llama.expert_count: a dense model (turbospark runs "
                   "Mixture-of-Experts models)");
    family = Family::kMixtral;
    cfg["model_type"] = "mixtral";
  } else {
    return m.err("general.architecture", "= '" + m.arch +
                                             "' is not supported (qwen3moe, qwen2moe, olmoe, "
                                             "llama with experts = Mixtral)");
  }
  const FamilyNames& fam = family_def(family).names;

  TS_ASSIGN(int64_t d_model, m.integer(m.k("embedding_length")));
  TS_ASSIGN(int64_t n_layers, m.integer(m.k("block_count")));
  TS_ASSIGN(int64_t n_heads, m.integer(m.k("attention.head_count")));
  TS_ASSIGN(std::optional<int64_t> n_kv, g.integer(m.k("attention.head_count_kv")));
  TS_ASSIGN(std::optional<int64_t> key_len, g.integer(m.k("attention.key_length")));
  TS_ASSIGN(std::optional<int64_t> value_len, g.integer(m.k("attention.value_length")));
  const int64_t head_dim = key_len ? *key_len : d_model / n_heads;
  if (value_len && *value_len != head_dim)
    return m.err(m.k("attention.value_length"), "= " + std::to_string(*value_len) +
                                                    " differs from the key length " +
                                                    std::to_string(head_dim) + " (not supported)");
  TS_ASSIGN(std::optional<int64_t> rope_dims, g.integer(m.k("rope.dimension_count")));
  if (rope_dims && *rope_dims != head_dim)
    return m.err(m.k("rope.dimension_count"), "= " + std::to_string(*rope_dims) +
                                                  " rotates part of a " + std::to_string(head_dim) +
                                                  "-wide head (partial RoPE is not supported)");
  TS_ASSIGN(std::optional<std::string> scaling, g.string(m.k("rope.scaling.type")));
  if (scaling && *scaling != "none")
    return m.err(m.k("rope.scaling.type"),
                 "= '" + *scaling + "' is not supported (only plain RoPE)");
  TS_ASSIGN(std::optional<int64_t> ctx, g.integer(m.k("context_length")));
  TS_ASSIGN(std::optional<double> eps, g.number(m.k("attention.layer_norm_rms_epsilon")));
  TS_ASSIGN(std::optional<double> theta, g.number(m.k("rope.freq_base")));
  TS_ASSIGN(int64_t n_experts, m.integer(m.k("expert_count")));
  TS_ASSIGN(int64_t top_k, m.integer(m.k("expert_used_count")));
  TS_ASSIGN(std::optional<bool> weights_norm, g.boolean(m.k("expert_weights_norm")));

  // Tensors under their Hub names.
  auto set = std::make_unique<io::TensorSet>();
  struct Owned {
    std::unique_ptr<uint8_t[]> bytes;
    std::vector<io::TensorView> views;
  };
  uint64_t converted_bytes = 0;
  std::unique_ptr<ThreadPool> pool;  // made for the first tensor that needs converting
  std::map<std::string, int> converted_types;
  std::vector<Owned> owned;
  std::vector<bool> has_router(size_t(n_layers), false);
  int64_t vocab = 0, d_expert = 0, d_shared = 0, d_ff = 0;
  bool has_output = false, qkv_bias = false;
  std::vector<std::vector<io::TensorView>> shard_views(shards.size());
  for (size_t si = 0; si < shards.size(); ++si) {
    const io::GgufFile& sg = shards[si];
    const std::string& spath = sg.file->path();
    std::vector<io::TensorView>& views = shard_views[si];
    for (const io::GgufTensorInfo& t : sg.tensors) {
      std::optional<Mapped> mp = map_name(t.name, fam);
      if (!mp)
        return make_error(spath + ": tensor '" + t.name + "' is not one turbospark knows for " +
                          "architecture '" + m.arch + "'");
      if (mp->layer >= n_layers)
        return make_error(spath + ": tensor '" + t.name + "' names a block past " +
                          m.k("block_count") + " = " + std::to_string(n_layers));
      const std::vector<int64_t> d = dims_of(t);
      const uint8_t* data = sg.tensor_data(t);
      const uint64_t file_offset = sg.data_offset + t.offset;
      size_t n_bytes = t.n_bytes;
      const std::optional<DType> native = native_dtype(t.ggml_type);
      const DType dt = native.value_or(DType::kQ8_0);
      std::unique_ptr<uint8_t[]> converted;
      if (!native) {
        if (!pool)
          pool =
              std::make_unique<ThreadPool>(int(std::max(1u, std::thread::hardware_concurrency())));
        TS_ASSIGN(converted, convert_to_q8_0(*pool, t, data, spath, &n_bytes));
        data = converted.get();
        converted_bytes += n_bytes;
        ++converted_types[io::ggml_type_name(t.ggml_type)];
      }
      auto view = [&](std::string hub, std::vector<int64_t> shape, const uint8_t* p, size_t n,
                      uint64_t off) {
        return io::TensorView{.name = std::move(hub),
                              .dtype = dt,
                              .shape = std::move(shape),
                              .data = p,
                              .n_bytes = n,
                              .file = spath,
                              .file_offset = off};
      };
      const bool is_vector = d.size() == 1 && !dtype_is_quantized(dt);
      // Views into the file, or into the converted copy (owned by the set).
      std::vector<io::TensorView> out;
      auto finish = [&] {
        if (converted) {
          owned.push_back({std::move(converted), std::move(out)});
        } else {
          for (io::TensorView& v : out) views.push_back(std::move(v));
        }
      };
      if (mp->stacked) {
        if (d.size() != 3 || d[2] != n_experts)
          return make_error(spath + ": tensor '" + t.name + "' has dims " + dims_str(d) +
                            "; expected [in, out, " + std::to_string(n_experts) + "]");
        const size_t bytes = size_t(d[1]) * dtype_row_bytes(dt, d[0]);
        for (int64_t e = 0; e < n_experts; ++e)
          out.push_back(view("model.layers." + std::to_string(mp->layer) + "." + fam.moe_block +
                                 ".experts." + std::to_string(e) + "." + mp->hub,
                             {d[1], d[0]}, data + size_t(e) * bytes, bytes,
                             file_offset + uint64_t(e) * bytes));
        const bool down = t.name.find("ffn_down_exps") != std::string::npos;
        d_expert = down ? d[0] : d[1];
        finish();
        continue;
      }
      if (mp->expert >= n_experts)
        return make_error(spath + ": tensor '" + t.name + "' names expert " +
                          std::to_string(mp->expert) + " of " + std::to_string(n_experts));
      if (d.size() > 2 || (d.size() == 1 && !is_vector))
        return make_error(spath + ": tensor '" + t.name + "' has dims " + dims_str(d) +
                          "; expected a matrix or a float vector");
      std::vector<int64_t> shape = d.size() == 2 ? std::vector<int64_t>{d[1], d[0]} : d;
      const std::string& hub = mp->hub;
      auto ends_with = [&](std::string_view s) {
        return hub.size() >= s.size() && hub.compare(hub.size() - s.size(), s.size(), s) == 0;
      };
      if (hub == "model.embed_tokens.weight") vocab = shape[0];
      if (hub == "lm_head.weight") has_output = true;
      if (ends_with("mlp.shared_expert_gate.weight") && d.size() == 1) shape = {1, d[0]};
      if (ends_with("shared_expert.gate_proj.weight")) d_shared = shape[0];
      if (ends_with(".mlp.gate_proj.weight") && !ends_with("shared_expert.gate_proj.weight"))
        d_ff = shape[0];
      if (mp->expert >= 0 && ends_with(std::string(fam.expert_gate) + ".weight"))
        d_expert = shape[0];
      if (ends_with("." + std::string(fam.moe_block) + ".gate.weight"))
        has_router[size_t(mp->layer)] = true;
      if (ends_with("q_proj.bias")) qkv_bias = true;
      if (mp->qk && family == Family::kMixtral) {
        // convert_hf_to_gguf (LlamaModel.permute) stores head h's rows as
        // w.reshape(heads, 2, hd / 2, ...).swapaxes(1, 2): GGUF row h*hd + 2j + s holds Hub row
        // h*hd + s*hd/2 + j. Undo it row by row.
        const int64_t rows = shape[0];
        const int64_t heads = mp->qk == 'q' ? n_heads : (n_kv ? *n_kv : n_heads);
        if (heads <= 0 || rows % heads != 0 || (rows / heads) % 2 != 0)
          return make_error(spath + ": tensor '" + t.name + "' has " + std::to_string(rows) +
                            " rows, not a whole number of even-sized heads (" +
                            std::to_string(heads) + ")");
        const int64_t hd = rows / heads;
        const size_t row_bytes = shape.size() == 2 ? dtype_row_bytes(dt, shape[1]) : dtype_size(dt);
        auto bytes = std::make_unique<uint8_t[]>(n_bytes);
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t s = 0; s < 2; ++s)
            for (int64_t j = 0; j < hd / 2; ++j)
              std::memcpy(bytes.get() + size_t(h * hd + s * hd / 2 + j) * row_bytes,
                          data + size_t(h * hd + 2 * j + s) * row_bytes, row_bytes);
        out.push_back(view(hub, shape, bytes.get(), n_bytes, 0));
        converted = std::move(bytes);
        finish();
        continue;
      }
      out.push_back(view(hub, shape, data, n_bytes, file_offset));
      finish();
    }
  }

  if (vocab == 0) return make_error(path + ": tensor 'token_embd.weight' is missing");

  cfg["hidden_size"] = d_model;
  cfg["num_hidden_layers"] = n_layers;
  cfg["num_attention_heads"] = n_heads;
  cfg["num_key_value_heads"] = n_kv ? *n_kv : n_heads;
  cfg["head_dim"] = head_dim;
  cfg["vocab_size"] = vocab;
  if (ctx) cfg["max_position_embeddings"] = *ctx;
  if (eps) cfg["rms_norm_eps"] = *eps;
  if (theta) cfg["rope_theta"] = *theta;
  cfg["tie_word_embeddings"] = !has_output;
  cfg["hidden_act"] = "silu";
  cfg[family == Family::kMixtral ? "num_local_experts" : "num_experts"] = n_experts;
  cfg["num_experts_per_tok"] = top_k;
  json dense_layers = json::array();
  for (int64_t l = 0; l < n_layers; ++l)
    if (!has_router[size_t(l)]) dense_layers.push_back(l);
  if (family == Family::kMixtral || family == Family::kOlmoe) {
    if (!dense_layers.empty())
      return make_error(path + ": block " + dense_layers[0].dump() +
                        " has no ffn_gate_inp.weight (every " + m.arch +
                        " block routes to experts)");
    cfg["intermediate_size"] = d_expert;
  } else {
    cfg["moe_intermediate_size"] = d_expert;
    cfg["mlp_only_layers"] = dense_layers;
    if (d_ff > 0) cfg["intermediate_size"] = d_ff;
  }
  // Top-k weight renormalization: the file's expert_weights_norm when it has one, else what
  // llama.cpp does for the architecture (qwen3moe renormalizes; qwen2moe and olmoe do not;
  // Mixtral always does, whatever the key says).
  if (family == Family::kQwen3Moe) cfg["norm_topk_prob"] = weights_norm.value_or(true);
  if (family == Family::kQwen2Moe || family == Family::kOlmoe)
    cfg["norm_topk_prob"] = weights_norm.value_or(false);
  if (family == Family::kQwen2Moe) {
    cfg["shared_expert_intermediate_size"] = d_shared;
    cfg["qkv_bias"] = qkv_bias;
  } else if (family != Family::kMixtral) {
    cfg["attention_bias"] = qkv_bias;
  }

  for (size_t si = 0; si < shards.size(); ++si)
    TS_TRY(set->add_mapped(std::move(shards[si].file), std::move(shard_views[si])));
  for (Owned& o : owned) TS_TRY(set->add_owned(std::move(o.bytes), std::move(o.views)));
  std::string note;
  if (converted_bytes > 0) {
    for (const auto& [type, n] : converted_types)
      note += (note.empty() ? "" : ", ") + std::to_string(n) + " " + type;
    note = "converted " + note + " tensor(s) to Q8_0 at load (" +
           std::to_string((converted_bytes + 500000) / 1000000) + " MB in memory)";
  }
  TS_ASSIGN(HParams hp, parse_hparams(cfg.dump(), path + " (its metadata as config.json)"));
  return GgufModel{
      .hp = std::move(hp), .config_json = cfg.dump(), .tensors = std::move(set), .note = note};
}

}  // namespace ts::model
