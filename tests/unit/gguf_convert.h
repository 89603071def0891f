// Test helper: writes GGUF files the way llama.cpp's convert_hf_to_gguf.py lays them out
// (metadata key names and value types, tensor names, ggml dim order, stacked experts, the
// llama-arch q/k row permutation, F32 norms / routers / biases, the tokenizer's tokens,
// token types, merges or scores), from a Hugging Face fixture directory. The layout facts
// come from llama.cpp's converter and gguf-py (constants.py, gguf_writer.py), written out
// here independently of the reader under test (src/model/gguf_model.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/quant.h"
#include "core/dtype.h"
#include "io/safetensors.h"
#include "model/hparams.h"

namespace ts_test {

class GgufWriter {
 public:
  // gguf_type ids.
  enum : uint32_t { kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7, kStr = 8, kArr = 9 };

  void u32(const std::string& k, uint32_t v) {
    add(k, kU32, [&](Out& o) { o.pod(v); });
  }
  void f32(const std::string& k, float v) {
    add(k, kF32, [&](Out& o) { o.pod(v); });
  }
  void boolean(const std::string& k, bool v) {
    add(k, kBool, [&](Out& o) { o.pod(uint8_t(v)); });
  }
  void str(const std::string& k, const std::string& v) {
    add(k, kStr, [&](Out& o) { o.s(v); });
  }
  void strs(const std::string& k, const std::vector<std::string>& v) {
    add(k, kArr, [&](Out& o) {
      o.pod(uint32_t(kStr)).pod(uint64_t(v.size()));
      for (const std::string& x : v) o.s(x);
    });
  }
  void i32s(const std::string& k, const std::vector<int32_t>& v) {
    add(k, kArr, [&](Out& o) {
      o.pod(uint32_t(kI32)).pod(uint64_t(v.size()));
      for (int32_t x : v) o.pod(x);
    });
  }
  void f32s(const std::string& k, const std::vector<float>& v) {
    add(k, kArr, [&](Out& o) {
      o.pod(uint32_t(kF32)).pod(uint64_t(v.size()));
      for (float x : v) o.pod(x);
    });
  }
  // ne: ggml order (ne[0] contiguous); type: ggml type id.
  void tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, std::string bytes) {
    tensors_.push_back({name, std::move(ne), type, std::move(bytes)});
  }
  void write(const std::string& path) const { write_file(path, kvs_, tensors_); }

  // As llama.cpp's gguf-split: PREFIX-0000i-of-0000N.gguf, tensors dealt round-robin, the
  // metadata in the first file, split.no / split.count (u16) and split.tensors.count (i32)
  // in every file.
  void write_split(const std::string& prefix, int n) const {
    for (int i = 0; i < n; ++i) {
      std::vector<std::string> kvs = i == 0 ? kvs_ : std::vector<std::string>{};
      for (auto [key, type, v] :
           {std::tuple{"split.no", 2u, i}, std::tuple{"split.count", 2u, n}}) {
        Out o;
        o.s(key).pod(uint32_t(type)).pod(uint16_t(v));
        kvs.push_back(o.b);
      }
      Out c;
      c.s("split.tensors.count").pod(uint32_t(kI32)).pod(int32_t(tensors_.size()));
      kvs.push_back(c.b);
      std::vector<T> part;
      for (size_t t = size_t(i); t < tensors_.size(); t += size_t(n)) part.push_back(tensors_[t]);
      char name[64];
      std::snprintf(name, sizeof name, "-%05d-of-%05d.gguf", i + 1, n);
      write_file(prefix + name, kvs, part);
    }
  }

 private:
  struct Out {
    std::string b;
    template <class V>
    Out& pod(V v) {
      b.append(reinterpret_cast<const char*>(&v), sizeof v);
      return *this;
    }
    Out& s(const std::string& x) {
      pod(uint64_t(x.size()));
      b += x;
      return *this;
    }
    void pad() {
      while (b.size() % 32) b += '\0';
    }
  };
  struct T {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    std::string bytes;
  };
  static void write_file(const std::string& path, const std::vector<std::string>& kvs,
                         const std::vector<T>& tensors) {
    Out o;
    o.b = "GGUF";
    o.pod(uint32_t(3)).pod(uint64_t(tensors.size())).pod(uint64_t(kvs.size()));
    for (const std::string& k : kvs) o.b += k;
    uint64_t off = 0;
    for (const T& t : tensors) {
      o.s(t.name).pod(uint32_t(t.ne.size()));
      for (uint64_t d : t.ne) o.pod(d);
      o.pod(t.type).pod(off);
      off += (t.bytes.size() + 31) / 32 * 32;
    }
    o.pad();
    for (const T& t : tensors) {
      o.b += t.bytes;
      o.pad();
    }
    std::ofstream(path, std::ios::binary).write(o.b.data(), std::streamsize(o.b.size()));
  }
  void add(const std::string& k, uint32_t type, const std::function<void(Out&)>& value) {
    Out o;
    o.s(k).pod(type);
    value(o);
    kvs_.push_back(std::move(o.b));
  }
  std::vector<std::string> kvs_;
  std::vector<T> tensors_;
};

struct ConvertOptions {
  bool q8_0 = false;                 // 2-D weights but routers as Q8_0 (llama-quantize's rules)
  bool q6_k_experts = false;         // routed experts whose rows are 256-multiples as Q6_K
  bool iq4_xs_experts = false;       // ... or as IQ4_XS
  bool permute_qk = true;            // llama arch: convert_hf_to_gguf's q/k row permutation
  bool legacy_expert_names = false;  // blk.N.ffn_gate.E.weight instead of stacked *_exps
  bool write_weights_norm = true;    // expert_weights_norm where the config differs from
                                     // llama.cpp's default for the architecture
  std::string tokenizer_dir;         // a directory whose tokenizer.json to embed ("" = the model's)
  std::string pre = "qwen2";         // tokenizer.ggml.pre for byte-level BPE tokenizers
  std::function<void(GgufWriter&)> extra;  // more keys / tensors, before writing
  int split = 0;                           // > 1: write OUT as gguf-split shards, OUT the prefix
};

namespace gguf_detail {

inline std::string f32_bytes(const ts::io::TensorView& v) {
  std::vector<float> f(size_t(v.numel()));
  ts::float_row_to_f32(v.data, v.dtype, f.data(), v.numel());
  return std::string(reinterpret_cast<const char*>(f.data()), f.size() * 4);
}

inline std::string q8_0_bytes(const std::string& f32, int64_t rows, int64_t cols) {
  const size_t rb = ts::dtype_row_bytes(ts::DType::kQ8_0, cols);
  std::string out(size_t(rows) * rb, '\0');
  for (int64_t r = 0; r < rows; ++r)
    ts::cpu::quantize_row(ts::DType::kQ8_0, reinterpret_cast<const float*>(f32.data()) + r * cols,
                          out.data() + size_t(r) * rb, cols);
  return out;
}

// The f16 super-block scale of the Q6_K / IQ4_XS test encoders: the 256 weights' largest
// magnitude over 31 x 127 (a 6-bit sub-block scale times an 8-bit level).
inline uint16_t super_block_d(const float* v) {
  float amax = 0;
  for (int e = 0; e < 256; ++e) amax = std::max(amax, std::fabs(v[e]));
  return ts::f32_to_f16(amax / (31.0f * 127.0f));
}

// A valid Q6_K encoding (not llama.cpp's optimized one): per 256-weight block an f16 d from
// the block's largest magnitude, per 16-weight sub-block an int8 scale, 6-bit quants; laid
// out as ggml's block_q6_K {ql[128], qh[64], scales[16], d}.
inline std::string q6_k_bytes(const std::string& f32, int64_t rows, int64_t cols) {
  const float* x = reinterpret_cast<const float*>(f32.data());
  std::string out(size_t(rows * cols / 256) * 210, '\0');
  for (int64_t blk = 0; blk < rows * cols / 256; ++blk) {
    const float* v = x + blk * 256;
    uint8_t* b = reinterpret_cast<uint8_t*>(out.data()) + blk * 210;
    const uint16_t dh = super_block_d(v);
    std::memcpy(b + 208, &dh, 2);
    const float d = ts::f16_to_f32(dh);
    for (int s = 0; s < 16; ++s) {
      float sub = 0;
      for (int e = 16 * s; e < 16 * s + 16; ++e) sub = std::max(sub, std::fabs(v[e]));
      const int sc = d > 0 ? std::clamp(int(std::lround(sub / (31.0f * d))), 1, 127) : 1;
      b[192 + s] = uint8_t(int8_t(sc));
    }
    for (int e = 0; e < 256; ++e) {
      const float step = d * float(int8_t(b[192 + e / 16]));
      const int q = step > 0 ? std::clamp(int(std::lround(v[e] / step)), -32, 31) + 32 : 32;
      const int hh = e / 128, g = (e % 128) / 32, l = e % 32;
      uint8_t& lo = b[64 * hh + l + 32 * (g & 1)];
      lo = uint8_t(g < 2 ? (lo & 0xF0) | (q & 0xF) : (lo & 0x0F) | ((q & 0xF) << 4));
      b[128 + 32 * hh + l] = uint8_t(b[128 + 32 * hh + l] | (((q >> 4) & 3) << (2 * g)));
    }
  }
  return out;
}

// A valid IQ4_XS encoding (not llama.cpp's optimized one): per 256-weight block an f16 d from
// the block's largest magnitude, per 32-weight sub-block a positive 6-bit scale (stored biased
// by 32), each weight the nearest of the 16 non-linear levels; laid out as ggml's
// block_iq4_xs {d, scales_h, scales_l[4], qs[128]}.
inline std::string iq4_xs_bytes(const std::string& f32, int64_t rows, int64_t cols) {
  static constexpr int kLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};
  const float* x = reinterpret_cast<const float*>(f32.data());
  std::string out(size_t(rows * cols / 256) * 136, '\0');
  for (int64_t blk = 0; blk < rows * cols / 256; ++blk) {
    const float* v = x + blk * 256;
    uint8_t* b = reinterpret_cast<uint8_t*>(out.data()) + blk * 136;
    const uint16_t dh = super_block_d(v);
    std::memcpy(b, &dh, 2);
    const float d = ts::f16_to_f32(dh);
    unsigned scales_h = 0;
    for (int ib = 0; ib < 8; ++ib) {
      float sub = 0;
      for (int e = 32 * ib; e < 32 * ib + 32; ++e) sub = std::max(sub, std::fabs(v[e]));
      const int s = d > 0 ? std::clamp(int(std::lround(sub / (127.0f * d))), 1, 31) : 1;
      const int ls = s + 32;
      b[4 + ib / 2] = uint8_t(b[4 + ib / 2] | ((ls & 0xF) << (4 * (ib % 2))));
      scales_h |= unsigned(ls >> 4) << (2 * ib);
      const float step = d * float(s);
      for (int j = 0; j < 32; ++j) {
        int best = 0;
        for (int q = 1; q < 16; ++q)
          if (std::fabs(v[32 * ib + j] - step * float(kLevels[q])) <
              std::fabs(v[32 * ib + j] - step * float(kLevels[best])))
            best = q;
        uint8_t& byte = b[8 + 16 * ib + j % 16];
        byte = uint8_t(j < 16 ? (byte & 0xF0) | best : (byte & 0x0F) | (best << 4));
      }
    }
    b[2] = uint8_t(scales_h & 0xFF);
    b[3] = uint8_t(scales_h >> 8);
  }
  return out;
}

// LlamaModel.permute: w.reshape(heads, 2, hd / 2, cols).swapaxes(1, 2).reshape(w.shape).
inline std::string permute_rows(const std::string& f32, int64_t rows, int64_t cols, int64_t heads) {
  std::string out(f32.size(), '\0');
  const int64_t hd = rows / heads;
  const size_t rb = size_t(cols) * 4;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t s = 0; s < 2; ++s)
      for (int64_t j = 0; j < hd / 2; ++j)
        std::memcpy(out.data() + size_t(h * hd + 2 * j + s) * rb,
                    f32.data() + size_t(h * hd + s * hd / 2 + j) * rb, rb);
  return out;
}

inline nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

inline void add_tokenizer(GgufWriter& w, const std::filesystem::path& dir, const std::string& pre) {
  using json = nlohmann::json;
  const json j = read_json(dir / "tokenizer.json");
  const json cfg = std::filesystem::exists(dir / "tokenizer_config.json")
                       ? read_json(dir / "tokenizer_config.json")
                       : json::object();
  const json& vocab = j["model"]["vocab"];
  int n = 0;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) n = std::max(n, it.value().get<int>() + 1);
  for (const json& a : j["added_tokens"]) n = std::max(n, a["id"].get<int>() + 1);
  std::vector<std::string> tokens(static_cast<size_t>(n));
  std::vector<int32_t> types(static_cast<size_t>(n), 5);  // UNUSED
  for (int i = 0; i < n; ++i) tokens[size_t(i)] = "[PAD" + std::to_string(i) + "]";
  const bool spm = j["model"].value("byte_fallback", false);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const int id = it.value().get<int>();
    tokens[size_t(id)] = it.key();
    const bool byte = it.key().size() == 6 && it.key().rfind("<0x", 0) == 0 && it.key()[5] == '>';
    types[size_t(id)] = spm && byte ? 6 : 1;
  }
  for (const json& a : j["added_tokens"]) {
    tokens[size_t(a["id"].get<int>())] = a["content"].get<std::string>();
    types[size_t(a["id"].get<int>())] = a.value("special", false) ? 3 : 4;
  }
  auto id_of = [&](const char* key) -> int {
    if (!cfg.contains(key)) return -1;
    const json& t = cfg[key];
    const std::string s = t.is_string()   ? t.get<std::string>()
                          : t.is_object() ? t["content"].get<std::string>()
                                          : std::string();
    for (int i = 0; i < n; ++i)
      if (!s.empty() && tokens[size_t(i)] == s) return i;
    return -1;
  };
  w.str("tokenizer.ggml.model", spm ? "llama" : "gpt2");
  w.str("tokenizer.ggml.pre", spm ? "default" : pre);
  w.strs("tokenizer.ggml.tokens", tokens);
  w.i32s("tokenizer.ggml.token_type", types);
  if (spm) {
    // SentencePiece scores as the tokenizer.model had them, recovered from the merges that
    // Hugging Face's converter derived from them: a piece built by merge rank r scored above
    // one built by a later merge. Pieces no merge builds (bytes, specials) score lowest.
    std::map<std::string, float> score;
    int rank = 0;
    for (const json& m : j["model"]["merges"]) {
      const std::string piece = m.is_string()
                                    ? m.get<std::string>()
                                    : m[0].get<std::string>() + " " + m[1].get<std::string>();
      const size_t sp = piece.find(' ', 1);
      score.emplace(piece.substr(0, sp) + piece.substr(sp + 1), -float(rank++));
    }
    std::vector<float> scores(static_cast<size_t>(n), 0.0f);
    for (int i = 0; i < n; ++i) {
      auto it = score.find(tokens[size_t(i)]);
      scores[size_t(i)] = it != score.end() ? it->second : -1e6f - float(i);
    }
    w.f32s("tokenizer.ggml.scores", scores);
  } else {
    std::vector<std::string> merges;
    for (const json& m : j["model"]["merges"])
      merges.push_back(m.is_string() ? m.get<std::string>()
                                     : m[0].get<std::string>() + " " + m[1].get<std::string>());
    w.strs("tokenizer.ggml.merges", merges);
  }
  if (int b = id_of("bos_token"); b >= 0) w.u32("tokenizer.ggml.bos_token_id", uint32_t(b));
  if (int e = id_of("eos_token"); e >= 0) w.u32("tokenizer.ggml.eos_token_id", uint32_t(e));
  if (int u = id_of("unk_token"); u >= 0) w.u32("tokenizer.ggml.unknown_token_id", uint32_t(u));
  if (cfg.contains("add_bos_token") && cfg["add_bos_token"].is_boolean())
    w.boolean("tokenizer.ggml.add_bos_token", cfg["add_bos_token"].get<bool>());
  if (cfg.contains("chat_template") && cfg["chat_template"].is_string())
    w.str("tokenizer.chat_template", cfg["chat_template"].get<std::string>());
}

}  // namespace gguf_detail

// Converts the fixture directory `dir` (config.json + safetensors, F32/F16/BF16) into `out`.
// Throws std::runtime_error on anything it does not handle.
inline void convert_hf_dir(const std::string& dir, const std::string& out,
                           const ConvertOptions& opt = {}) {
  using namespace gguf_detail;
  using ts::model::Family;
  auto fail = [&](const std::string& what) { throw std::runtime_error(dir + ": " + what); };
  auto hpr = ts::model::load_hparams(dir);
  if (!hpr.ok()) fail(hpr.error().message);
  const ts::model::HParams hp = hpr.value();
  auto setr = ts::io::TensorSet::open_dir(dir);
  if (!setr.ok()) fail(setr.error().message);
  const ts::io::TensorSet& set = *setr.value();
  const bool mixtral = hp.family == Family::kMixtral;
  const std::string arch = mixtral                          ? "llama"
                           : hp.family == Family::kQwen3Moe ? "qwen3moe"
                           : hp.family == Family::kQwen2Moe ? "qwen2moe"
                                                            : "olmoe";
  GgufWriter w;
  w.str("general.architecture", arch);
  w.str("general.name", "fixture");
  w.u32(arch + ".block_count", uint32_t(hp.n_layers));
  w.u32(arch + ".context_length", uint32_t(hp.max_positions));
  w.u32(arch + ".embedding_length", uint32_t(hp.d_model));
  w.u32(arch + ".feed_forward_length", uint32_t(hp.d_ff > 0 ? hp.d_ff : hp.d_expert));
  w.u32(arch + ".attention.head_count", uint32_t(hp.n_heads));
  w.u32(arch + ".attention.head_count_kv", uint32_t(hp.n_kv_heads));
  w.f32(arch + ".rope.freq_base", hp.rope.theta);
  w.f32(arch + ".attention.layer_norm_rms_epsilon", hp.rms_eps);
  w.u32(arch + ".expert_count", uint32_t(hp.n_experts));
  w.u32(arch + ".expert_used_count", uint32_t(hp.top_k));
  if (hp.head_dim * hp.n_heads != hp.d_model || hp.family == Family::kQwen3Moe) {
    w.u32(arch + ".attention.key_length", uint32_t(hp.head_dim));
    w.u32(arch + ".attention.value_length", uint32_t(hp.head_dim));
  }
  if (mixtral) {
    w.u32(arch + ".vocab_size", uint32_t(hp.vocab));
    w.u32(arch + ".rope.dimension_count", uint32_t(hp.head_dim));
  }
  if (hp.family == Family::kQwen2Moe || hp.family == Family::kQwen3Moe)
    w.u32(arch + ".expert_feed_forward_length", uint32_t(hp.d_expert));
  if (hp.family == Family::kQwen2Moe)
    w.u32(arch + ".expert_shared_feed_forward_length", uint32_t(hp.d_shared));
  const bool llama_cpp_norm = mixtral || hp.family == Family::kQwen3Moe;
  if (opt.write_weights_norm && !mixtral && hp.router.renormalize != llama_cpp_norm)
    w.boolean(arch + ".expert_weights_norm", hp.router.renormalize);

  // One tensor: HF name -> GGUF name, F32 (or Q8_0 for 2-D weights), ggml dims reversed.
  auto put = [&](const std::string& hf, const std::string& name, int64_t permute_heads = 0) {
    const ts::io::TensorView* v = set.find(hf);
    if (!v) fail("no tensor " + hf);
    std::string bytes = f32_bytes(*v);
    std::vector<uint64_t> ne(v->shape.rbegin(), v->shape.rend());
    if (permute_heads && opt.permute_qk)
      bytes =
          permute_rows(bytes, v->shape[0], v->shape.size() == 2 ? v->shape[1] : 1, permute_heads);
    const bool router = name.find("ffn_gate_inp") != std::string::npos;
    if (opt.q8_0 && v->shape.size() == 2 && !router && v->shape[1] % 32 == 0) {
      w.tensor(name, ne, 8, q8_0_bytes(bytes, v->shape[0], v->shape[1]));
    } else {
      w.tensor(name, ne, 0, bytes);
    }
  };
  put("model.embed_tokens.weight", "token_embd.weight");
  put("model.norm.weight", "output_norm.weight");
  if (set.find("lm_head.weight") && !hp.tie_word_embeddings) put("lm_head.weight", "output.weight");
  const char* blk = mixtral ? "block_sparse_moe" : "mlp";
  const char* g = mixtral ? "w1" : "gate_proj";
  const char* u = mixtral ? "w3" : "up_proj";
  const char* d = mixtral ? "w2" : "down_proj";
  for (int l = 0; l < hp.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const std::string b = "blk." + std::to_string(l) + ".";
    put(p + "input_layernorm.weight", b + "attn_norm.weight");
    put(p + "post_attention_layernorm.weight", b + "ffn_norm.weight");
    put(p + "self_attn.q_proj.weight", b + "attn_q.weight", mixtral ? hp.n_heads : 0);
    put(p + "self_attn.k_proj.weight", b + "attn_k.weight", mixtral ? hp.n_kv_heads : 0);
    put(p + "self_attn.v_proj.weight", b + "attn_v.weight");
    put(p + "self_attn.o_proj.weight", b + "attn_output.weight");
    if (hp.qkv_bias)
      for (const char* x : {"q", "k", "v"})
        put(p + "self_attn." + x + "_proj.bias", b + "attn_" + x + ".bias");
    if (hp.qk_norm != ts::model::QkNorm::kNone) {
      put(p + "self_attn.q_norm.weight", b + "attn_q_norm.weight");
      put(p + "self_attn.k_norm.weight", b + "attn_k_norm.weight");
    }
    if (!hp.layer_is_moe[size_t(l)]) {
      put(p + "mlp.gate_proj.weight", b + "ffn_gate.weight");
      put(p + "mlp.up_proj.weight", b + "ffn_up.weight");
      put(p + "mlp.down_proj.weight", b + "ffn_down.weight");
      continue;
    }
    const std::string m = p + blk + ".";
    put(m + "gate.weight", b + "ffn_gate_inp.weight");
    for (auto [hf, gg] : {std::pair{g, "gate"}, std::pair{u, "up"}, std::pair{d, "down"}}) {
      if (opt.legacy_expert_names) {
        for (int e = 0; e < hp.n_experts; ++e)
          put(m + "experts." + std::to_string(e) + "." + hf + ".weight",
              b + "ffn_" + gg + "." + std::to_string(e) + ".weight");
        continue;
      }
      // torch.stack of [out, in] experts: ggml {in, out, E}.
      std::string f32;
      std::vector<int64_t> shape;
      for (int e = 0; e < hp.n_experts; ++e) {
        const ts::io::TensorView* v =
            set.find(m + "experts." + std::to_string(e) + "." + hf + ".weight");
        if (!v) fail("no expert tensor");
        shape = v->shape;
        f32 += f32_bytes(*v);
      }
      const std::vector<uint64_t> ne = {uint64_t(shape[1]), uint64_t(shape[0]),
                                        uint64_t(hp.n_experts)};
      if (opt.q6_k_experts && shape[1] % 256 == 0)
        w.tensor(b + "ffn_" + gg + "_exps.weight", ne, 14,
                 q6_k_bytes(f32, shape[0] * hp.n_experts, shape[1]));
      else if (opt.iq4_xs_experts && shape[1] % 256 == 0)
        w.tensor(b + "ffn_" + gg + "_exps.weight", ne, 23,
                 iq4_xs_bytes(f32, shape[0] * hp.n_experts, shape[1]));
      else if (opt.q8_0 && shape[1] % 32 == 0)
        w.tensor(b + "ffn_" + gg + "_exps.weight", ne, 8,
                 q8_0_bytes(f32, shape[0] * hp.n_experts, shape[1]));
      else
        w.tensor(b + "ffn_" + gg + "_exps.weight", ne, 0, f32);
    }
    if (hp.d_shared > 0) {
      put(m + "shared_expert.gate_proj.weight", b + "ffn_gate_shexp.weight");
      put(m + "shared_expert.up_proj.weight", b + "ffn_up_shexp.weight");
      put(m + "shared_expert.down_proj.weight", b + "ffn_down_shexp.weight");
      if (hp.shared_expert_gate)
        put(m + "shared_expert_gate.weight", b + "ffn_gate_inp_shexp.weight");
    }
  }
  const std::filesystem::path tok = opt.tokenizer_dir.empty() ? dir : opt.tokenizer_dir;
  if (std::filesystem::exists(tok / "tokenizer.json")) add_tokenizer(w, tok, opt.pre);
  if (opt.extra) opt.extra(w);
  if (opt.split > 1)
    w.write_split(out, opt.split);
  else
    w.write(out);
}

}  // namespace ts_test
