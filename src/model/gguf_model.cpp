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
#include "model/families/family.h"
#include "model/ggml_dequant.h"
#include "model/gguf_arch.h"
#include "model/hparams.h"
#include "model/weights.h"

namespace ts::model {
namespace {

using json = nlohmann::ordered_json;

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

using gguf::GgufArch;
using gguf::Meta;
using gguf::TensorFacts;

// What a tensor tells about the model (TensorFacts), by its GGUF name.
enum class Fact : uint8_t {
  kNone,
  kEmbed,
  kOutput,
  kDenseGate,
  kSharedGate,
  kRouter,
  kQBias,
  kProbsB,
  kQNorm,
  kQa
};

// What a GGUF tensor name means: a Hub name, or a stacked / per-expert projection, or one
// half of MLA's kv_b_proj.
struct Mapped {
  std::string hub;       // Hub name (for stacked experts: the part after "experts.E.")
  int layer = -1;        // blk.N
  bool stacked = false;  // ffn_*_exps: one view per expert
  int expert = -1;       // ffn_gate.E.weight (older Mixtral files)
  char qk = 0;           // 'q' / 'k': llama's permuted attention rows
  char kv_b = 0;         // 'k' / 'v': attn_k_b / attn_v_b, joined back into kv_b_proj
  Fact fact = Fact::kNone;
};

// N of a "blk.N." name; nullopt for other names.
std::optional<int> block_of(const std::string& name) {
  constexpr std::string_view kBlk = "blk.";
  if (name.rfind(kBlk, 0) != 0) return std::nullopt;
  const size_t dot = name.find('.', kBlk.size());
  if (dot == std::string::npos || dot == kBlk.size() || dot - kBlk.size() > 6) return std::nullopt;
  int layer = 0;
  for (size_t i = kBlk.size(); i < dot; ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    layer = layer * 10 + (name[i] - '0');
  }
  return layer;
}

// GGUF names (gguf-py constants.py TENSOR_NAMES) -> Hub names (tensor_mapping.py, read
// backwards), the Hub side from the family's FamilyNames.
std::optional<Mapped> map_name(const std::string& name, const GgufArch& arch,
                               const FamilyNames& fam) {
  if (name == "token_embd.weight")
    return Mapped{.hub = "model.embed_tokens.weight", .fact = Fact::kEmbed};
  if (name == "output_norm.weight") return Mapped{.hub = "model.norm.weight"};
  if (name == "output.weight") return Mapped{.hub = "lm_head.weight", .fact = Fact::kOutput};
  const std::optional<int> block = block_of(name);
  if (!block) return std::nullopt;
  const int layer = *block;
  const std::string rest = name.substr(name.find('.', 4) + 1);
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const std::string a = p + "self_attn.";
  const std::string moe = p + fam.moe_block + ".";
  const std::string shared = moe + fam.shared + ".";
  if (rest == arch.ffn_norm)
    return Mapped{.hub = p + "post_attention_layernorm.weight", .layer = layer};
  struct Entry {
    const char* gguf;
    std::string hub;
    Fact fact = Fact::kNone;
  };
  const Entry kFixed[] = {
      {"attn_norm.weight", p + "input_layernorm.weight"},
      {"attn_v.weight", a + "v_proj.weight"},
      {"attn_v.bias", a + "v_proj.bias"},
      {"attn_output.weight", a + "o_proj.weight"},
      {"attn_q_norm.weight", a + "q_norm.weight", Fact::kQNorm},
      {"attn_k_norm.weight", a + "k_norm.weight"},
      // MLA (deepseek2)
      {"attn_q_a.weight", a + "q_a_proj.weight", Fact::kQa},
      {"attn_q_a_norm.weight", a + "q_a_layernorm.weight"},
      {"attn_q_b.weight", a + "q_b_proj.weight"},
      {"attn_kv_a_mqa.weight", a + "kv_a_proj_with_mqa.weight"},
      {"attn_kv_a_norm.weight", a + "kv_a_layernorm.weight"},
      {"attn_kv_b.weight", a + "kv_b_proj.weight"},  // files from before the k_b / v_b split
      {"ffn_gate.weight", p + "mlp.gate_proj.weight", Fact::kDenseGate},
      {"ffn_up.weight", p + "mlp.up_proj.weight"},
      {"ffn_down.weight", p + "mlp.down_proj.weight"},
      {"ffn_gate_inp.weight", moe + "gate.weight", Fact::kRouter},
      {"exp_probs_b.bias", moe + fam.correction_bias, Fact::kProbsB},
      {"ffn_gate_inp_shexp.weight", moe + "shared_expert_gate.weight"},
      {"ffn_gate_shexp.weight", shared + "gate_proj.weight", Fact::kSharedGate},
      {"ffn_up_shexp.weight", shared + "up_proj.weight"},
      {"ffn_down_shexp.weight", shared + "down_proj.weight"},
  };
  for (const Entry& e : kFixed)
    if (rest == e.gguf) return Mapped{.hub = e.hub, .layer = layer, .fact = e.fact};
  if (rest == "attn_q.weight" || rest == "attn_q.bias" || rest == "attn_k.weight" ||
      rest == "attn_k.bias")
    return Mapped{.hub = a + rest.substr(5, 1) + "_proj." + rest.substr(7),
                  .layer = layer,
                  .qk = arch.permuted_qk ? rest[5] : char(0),
                  .fact = rest == "attn_q.bias" ? Fact::kQBias : Fact::kNone};
  if (rest == "attn_k_b.weight" || rest == "attn_v_b.weight")
    return Mapped{.hub = a + "kv_b_proj.weight", .layer = layer, .kv_b = rest[5]};
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

// Memory the set owns (converted or rearranged tensors) and its views.
struct Owned {
  std::unique_ptr<uint8_t[]> bytes;
  std::vector<io::TensorView> views;
};

// One half of MLA's kv_b_proj as the file holds it.
struct KvbPart {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> dims;  // ggml order
  const uint8_t* data = nullptr;
};

// `rows` rows of `cols` values of a tensor in `dt`, widened to F32.
std::vector<float> rows_to_f32(DType dt, const uint8_t* data, int64_t rows, int64_t cols) {
  std::vector<float> out(size_t(rows * cols));
  const size_t rb = dtype_row_bytes(dt, cols);
  for (int64_t r = 0; r < rows; ++r) {
    if (dtype_is_quantized(dt))
      cpu::dequantize_row(dt, data + size_t(r) * rb, out.data() + r * cols, cols);
    else
      float_row_to_f32(data + size_t(r) * rb, dt, out.data() + r * cols, cols);
  }
  return out;
}

// kv_b_proj [n_heads * (nope + v), kv_lora] back from the converter's split
// (conversion/deepseek.py:433-449): kv_b viewed [n_heads, nope + v, kv_lora], split on dim 1,
// the k part transposed, so attn_k_b is ggml {nope, kv_lora, n_heads} (head h's k rows
// transposed) and attn_v_b ggml {kv_lora, v, n_heads} (its v rows as they were). Float halves
// of one type are rearranged element by element (the checkpoint's bytes again); otherwise
// both are widened to F32 and the result quantized to Q8_0 (rows of kv_lora, whole blocks)
// or kept F32. `*requantized` says which happened.
Result<Owned> join_kv_b(const KvbPart& k, const KvbPart& v, const std::string& hub,
                        const std::string& path, int64_t n_heads, bool* requantized) {
  auto bad = [&](const KvbPart& t, const std::string& want) {
    return make_error(path + ": tensor '" + t.name + "' has dims " + dims_str(t.dims) +
                      "; expected " + want);
  };
  if (k.dims.size() != 3 || k.dims[2] != n_heads)
    return bad(k, "[qk_nope, kv_lora_rank, " + std::to_string(n_heads) + "]");
  const int64_t nope = k.dims[0], kv_lora = k.dims[1];
  if (v.dims.size() != 3 || v.dims[0] != kv_lora || v.dims[2] != n_heads)
    return bad(v, "[" + std::to_string(kv_lora) + ", v_head_dim, " + std::to_string(n_heads) + "]");
  const int64_t vd = v.dims[1], rows = n_heads * (nope + vd);
  const std::vector<int64_t> shape = {rows, kv_lora};
  const bool exact = k.dtype == v.dtype && !dtype_is_quantized(k.dtype);
  *requantized = !exact;
  if (exact) {
    const size_t es = dtype_size(k.dtype), n = size_t(rows * kv_lora) * es;
    auto out = std::make_unique<uint8_t[]>(n);
    for (int64_t h = 0; h < n_heads; ++h) {
      uint8_t* dst = out.get() + size_t(h * (nope + vd) * kv_lora) * es;
      const uint8_t* kh = k.data + size_t(h * kv_lora * nope) * es;
      for (int64_t i = 0; i < nope; ++i)
        for (int64_t j = 0; j < kv_lora; ++j)
          std::memcpy(dst + size_t(i * kv_lora + j) * es, kh + size_t(j * nope + i) * es, es);
      std::memcpy(dst + size_t(nope * kv_lora) * es, v.data + size_t(h * vd * kv_lora) * es,
                  size_t(vd * kv_lora) * es);
    }
    Owned o{std::move(out), {}};
    o.views.push_back({.name = hub,
                       .dtype = k.dtype,
                       .shape = shape,
                       .data = o.bytes.get(),
                       .n_bytes = n,
                       .file = path});
    return o;
  }
  const std::vector<float> kf = rows_to_f32(k.dtype, k.data, n_heads * kv_lora, nope);
  const std::vector<float> vf = rows_to_f32(v.dtype, v.data, n_heads * vd, kv_lora);
  std::vector<float> f(size_t(rows * kv_lora));
  for (int64_t h = 0; h < n_heads; ++h) {
    float* dst = f.data() + h * (nope + vd) * kv_lora;
    for (int64_t i = 0; i < nope; ++i)
      for (int64_t j = 0; j < kv_lora; ++j)
        dst[i * kv_lora + j] = kf[size_t((h * kv_lora + j) * nope + i)];
    std::memcpy(dst + nope * kv_lora, vf.data() + h * vd * kv_lora, size_t(vd * kv_lora) * 4);
  }
  const DType dt = dtype_row_ok(DType::kQ8_0, kv_lora) ? DType::kQ8_0 : DType::kF32;
  const size_t rb = dtype_row_bytes(dt, kv_lora), n = size_t(rows) * rb;
  auto out = std::make_unique<uint8_t[]>(n);
  for (int64_t r = 0; r < rows; ++r) {
    if (dt == DType::kQ8_0)
      cpu::quantize_row(dt, f.data() + r * kv_lora, out.get() + size_t(r) * rb, kv_lora);
    else
      std::memcpy(out.get() + size_t(r) * rb, f.data() + r * kv_lora, rb);
  }
  Owned o{std::move(out), {}};
  o.views.push_back({.name = hub,
                     .dtype = dt,
                     .shape = shape,
                     .data = o.bytes.get(),
                     .n_bytes = n,
                     .file = path});
  return o;
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
  TS_ASSIGN(std::optional<std::string> arch_name, g.string("general.architecture"));
  if (!arch_name) return m.err("general.architecture", "is missing (is this a model file?)");
  m.arch = *arch_name;
  const GgufArch* arch = gguf::find_arch(m.arch);
  if (!arch)
    return m.err("general.architecture",
                 "= '" + m.arch + "' is not supported (" + gguf::supported_archs() + ")");
  const FamilyNames& fam = family_def(arch->names).names;

  auto read_expert_count = [&]() -> Result<int64_t> {
    TS_ASSIGN(std::optional<int64_t> n, m.opt_integer("expert_count"));
    if (!n || *n == 0)
      return m.err(m.k("expert_count"),
                   "is missing or 0: a dense model (turbospark runs "
                   "Mixture-of-Experts models)");
    return *n;
  };
  if (arch->names_dense_models) TS_TRY(read_expert_count());
  TS_ASSIGN(int64_t d_model, m.integer("embedding_length"));
  TS_ASSIGN(int64_t block_count, m.integer("block_count"));
  TS_ASSIGN(int64_t n_heads, m.integer("attention.head_count"));

  // RoPE as transformers 5's rope_parameters.
  json rope = json::object();
  rope["rope_type"] = "default";
  TS_ASSIGN(std::optional<std::string> scaling, g.string(m.k("rope.scaling.type")));
  if (scaling && *scaling != "none") {
    if (*scaling != "yarn" || !arch->yarn)
      return m.err(m.k("rope.scaling.type"),
                   "= '" + *scaling + "' is not supported (" +
                       (arch->yarn ? "none, yarn" : "only plain RoPE for " + m.arch) + ")");
    // conversion/base.py:1421-1446 writes these from the config's rope_parameters.
    rope["rope_type"] = "yarn";
    TS_ASSIGN(std::optional<double> factor, m.opt_number("rope.scaling.factor"));
    if (!factor) return m.err(m.k("rope.scaling.factor"), "is missing (YaRN)");
    rope["factor"] = *factor;
    TS_ASSIGN(rope["original_max_position_embeddings"],
              m.integer("rope.scaling.original_context_length"));
    TS_ASSIGN(std::optional<double> fast, m.opt_number("rope.scaling.yarn_beta_fast"));
    TS_ASSIGN(std::optional<double> slow, m.opt_number("rope.scaling.yarn_beta_slow"));
    TS_ASSIGN(std::optional<double> attn, m.opt_number("rope.scaling.yarn_attn_factor"));
    TS_ASSIGN(std::optional<double> ext, m.opt_number("rope.scaling.yarn_ext_factor"));
    if (fast) rope["beta_fast"] = *fast;
    if (slow) rope["beta_slow"] = *slow;
    if (attn) rope["attention_factor"] = *attn;
    if (ext && *ext != 1.0)
      return m.err(m.k("rope.scaling.yarn_ext_factor"), "is not 1 (not supported)");
  }
  TS_ASSIGN(std::optional<int64_t> ctx, g.integer(m.k("context_length")));
  TS_ASSIGN(std::optional<double> eps, g.number(m.k("attention.layer_norm_rms_epsilon")));
  TS_ASSIGN(std::optional<double> theta, g.number(m.k("rope.freq_base")));
  TS_ASSIGN(const int64_t n_experts, read_expert_count());
  TS_ASSIGN(int64_t top_k, m.integer("expert_used_count"));
  TS_ASSIGN(std::optional<int64_t> n_kv, m.opt_integer("attention.head_count_kv"));
  // Multi-token-prediction blocks follow the model's (glm.py:121 counts them in
  // block_count); they are skipped and named in the note.
  TS_ASSIGN(std::optional<int64_t> nextn, m.opt_integer("nextn_predict_layers"));
  const int64_t n_layers = block_count - nextn.value_or(0);
  if (n_layers <= 0)
    return m.err(m.k("nextn_predict_layers"), "= " + std::to_string(*nextn) +
                                                  " leaves no blocks of " + m.k("block_count") +
                                                  " = " + std::to_string(block_count));

  // Tensors under their Hub names.
  auto set = std::make_unique<io::TensorSet>();
  uint64_t converted_bytes = 0;
  std::unique_ptr<ThreadPool> pool;  // made for the first tensor that needs converting
  std::map<std::string, int> converted_types;
  std::vector<Owned> owned;
  std::vector<std::unique_ptr<uint8_t[]>> scratch;  // converted k_b / v_b halves, until joined
  std::map<int, std::pair<KvbPart, KvbPart>> kv_b;  // layer -> (attn_k_b, attn_v_b)
  int skipped_nextn = 0;
  TensorFacts facts;
  facts.has_router.assign(size_t(n_layers), false);
  std::vector<std::vector<io::TensorView>> shard_views(shards.size());
  for (size_t si = 0; si < shards.size(); ++si) {
    const io::GgufFile& sg = shards[si];
    const std::string& spath = sg.file->path();
    std::vector<io::TensorView>& views = shard_views[si];
    for (const io::GgufTensorInfo& t : sg.tensors) {
      const std::optional<int> block = block_of(t.name);
      if (block && *block >= n_layers && *block < block_count) {
        ++skipped_nextn;
        continue;
      }
      std::optional<Mapped> mp = map_name(t.name, *arch, fam);
      if (!mp)
        return make_error(spath + ": tensor '" + t.name + "' is not one turbospark knows for " +
                          "architecture '" + m.arch + "'");
      if (mp->layer >= n_layers)
        return make_error(spath + ": tensor '" + t.name + "' names a block past " +
                          m.k("block_count") + " = " + std::to_string(block_count));
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
      if (mp->kv_b) {
        KvbPart part{.name = t.name, .dtype = dt, .dims = d, .data = data};
        auto& pair = kv_b[mp->layer];
        (mp->kv_b == 'k' ? pair.first : pair.second) = std::move(part);
        if (converted) scratch.push_back(std::move(converted));
        continue;
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
        facts.d_expert = down ? d[0] : d[1];
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
      switch (mp->fact) {
        case Fact::kEmbed:
          facts.vocab = shape[0];
          break;
        case Fact::kOutput:
          facts.has_output = true;
          break;
        case Fact::kDenseGate:
          facts.d_ff = shape[0];
          break;
        case Fact::kSharedGate:
          facts.d_shared = shape[0];
          break;
        case Fact::kRouter:
          facts.has_router[size_t(mp->layer)] = true;
          break;
        case Fact::kQBias:
          facts.qkv_bias = true;
          break;
        case Fact::kProbsB:
          facts.probs_b = true;
          break;
        case Fact::kQNorm:
          facts.q_norm = true;
          break;
        case Fact::kQa:
          facts.q_lora = shape[0];
          break;
        case Fact::kNone:
          break;
      }
      if (mp->expert >= 0 && t.name.find("ffn_gate.") != std::string::npos)
        facts.d_expert = shape[0];
      if (hub.ends_with("shared_expert_gate.weight") && d.size() == 1) shape = {1, d[0]};
      if (mp->qk) {
        // convert_hf_to_gguf (LlamaModel.permute) stores head h's rows as
        // w.reshape(heads, 2, hd / 2, ...).swapaxes(1, 2): GGUF row h*hd + 2j + s holds Hub row
        // h*hd + s*hd/2 + j. Undo it row by row.
        const int64_t rows = shape[0];
        const int64_t heads = mp->qk == 'q' ? n_heads : (n_kv && *n_kv > 0 ? *n_kv : n_heads);
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

  if (facts.vocab == 0) return make_error(path + ": tensor 'token_embd.weight' is missing");
  int requantized_kv_b = 0;
  for (auto& [layer, pair] : kv_b) {
    const std::string blk = "blk." + std::to_string(layer) + ".";
    if (!pair.first.data || !pair.second.data)
      return make_error(path + ": tensor '" + blk + (pair.first.data ? "attn_v_b" : "attn_k_b") +
                        ".weight' is missing (its other half is there)");
    bool requantized = false;
    TS_ASSIGN(Owned o,
              join_kv_b(pair.first, pair.second,
                        "model.layers." + std::to_string(layer) + ".self_attn.kv_b_proj.weight",
                        path, n_heads, &requantized));
    requantized_kv_b += requantized;
    owned.push_back(std::move(o));
  }
  scratch.clear();

  json cfg = json::object();
  cfg["hidden_size"] = d_model;
  cfg["num_hidden_layers"] = n_layers;
  cfg["num_attention_heads"] = n_heads;
  cfg["vocab_size"] = facts.vocab;
  if (ctx) cfg["max_position_embeddings"] = *ctx;
  if (eps) cfg["rms_norm_eps"] = *eps;
  if (theta) rope["rope_theta"] = *theta;
  cfg["rope_parameters"] = rope;
  cfg["tie_word_embeddings"] = !facts.has_output;
  cfg["hidden_act"] = "silu";
  cfg["num_experts_per_tok"] = top_k;
  // The key the families with such blocks (glm4_moe, deepseek) read; `inspect` names them.
  if (nextn.value_or(0) > 0) cfg["num_nextn_predict_layers"] = *nextn;
  TS_TRY(arch->config(
      {.m = m, .t = facts, .n_layers = n_layers, .n_heads = n_heads, .d_model = d_model}, cfg));

  for (size_t si = 0; si < shards.size(); ++si)
    TS_TRY(set->add_mapped(std::move(shards[si].file), std::move(shard_views[si])));
  for (Owned& o : owned) TS_TRY(set->add_owned(std::move(o.bytes), std::move(o.views)));
  std::vector<std::string> notes;
  if (converted_bytes > 0) {
    std::string types;
    for (const auto& [type, n] : converted_types)
      types += (types.empty() ? "" : ", ") + std::to_string(n) + " " + type;
    notes.push_back("converted " + types + " tensor(s) to Q8_0 at load (" +
                    std::to_string((converted_bytes + 500000) / 1000000) + " MB in memory)");
  }
  if (!kv_b.empty())
    notes.push_back("joined attn_k_b + attn_v_b into kv_b_proj for " + std::to_string(kv_b.size()) +
                    " block(s)" +
                    (requantized_kv_b ? " (" + std::to_string(requantized_kv_b) +
                                            " widened from quantized halves)"
                                      : std::string()));
  if (skipped_nextn > 0)
    notes.push_back("skipped " + std::to_string(skipped_nextn) +
                    " tensor(s) of the multi-token-prediction block(s) blk." +
                    std::to_string(n_layers) + (nextn.value_or(0) > 1 ? "+" : "") + " (" +
                    m.k("nextn_predict_layers") + " = " + std::to_string(*nextn) + ")");
  std::string note;
  for (const std::string& n : notes) note += (note.empty() ? "" : "; ") + n;
  TS_ASSIGN(HParams hp, parse_hparams(cfg.dump(), path + " (its metadata as config.json)"));
  return GgufModel{
      .hp = std::move(hp), .config_json = cfg.dump(), .tensors = std::move(set), .note = note};
}

}  // namespace ts::model
