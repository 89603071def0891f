// Test helper: writes GGUF files the way llama.cpp's convert_hf_to_gguf.py lays them out
// (metadata key names and value types, tensor names, ggml dim order, stacked experts, the
// llama-arch q/k row permutation, MLA's kv_b_proj split into attn_k_b (transposed) and
// attn_v_b, F32 norms / routers / biases, the tokenizer's tokens,
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
  bool legacy_mla = false;           // deepseek2 as converted before the attn_k_b / attn_v_b
                                     // split: attn_kv_b whole, no *_mla keys, head sizes in
                                     // key_length / value_length, head_count_kv = heads
  bool write_weights_norm = true;    // expert_weights_norm where the config differs from
                                     // llama.cpp's default for the architecture
  std::string tokenizer_dir;         // a directory whose tokenizer.json to embed ("" = the model's)
  std::string pre = "qwen2";         // tokenizer.ggml.pre for byte-level BPE tokenizers
  std::function<void(GgufWriter&)> extra;  // more keys / tensors, before writing
  int split = 0;                           // > 1: write OUT as gguf-split shards, OUT the prefix
  bool no_mtp = false;                     // --no-mtp: block_count without the NextN blocks
  std::string drop_tensor;                 // a GGUF tensor name to leave out (for error tests)
  // Own-class converters (deepseek2, glm4moe, minimax-m2): metadata keys to set or replace,
  // and keys to leave out, after the converter's own (for error tests).
  std::vector<std::pair<std::string, uint32_t>> set_u32;
  std::vector<std::string> drop_keys;
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

// The families llama.cpp converts with its own classes (llama.cpp de3ff81,
// conversion/deepseek.py DeepseekV2Model, conversion/glm.py Glm4MoeModel,
// conversion/minimax.py MiniMaxM2Model over conversion/base.py TextModel), from config.json
// as those classes read it — present keys only, so a key the config lacks is absent here
// too. (The converter reads AutoConfig.from_pretrained(dir).to_dict() (base.py:1238), which
// for these transformers-5 fixtures holds the same keys as the file: it was written from it.)
// gguf-py overwrites a key written twice in place (gguf_writer.py add_key_value), so keys are
// staged and written once, in first-written order. Tensors as with `--outtype f32` (or `--outtype
// q8_0`: rows that are not whole 32-blocks fall back to F16, as gguf.quants.quantize's QuantError
// does; norms, 1-D tensors and routers stay F32).
inline bool converted_by_own_class(ts::model::Family f) {
  using ts::model::Family;
  return f == Family::kDeepseekV2 || f == Family::kDeepseekV3 || f == Family::kGlm4Moe ||
         f == Family::kMinimaxM2;
}

// Both converters' last steps: the tokenizer (when the directory, or opt.tokenizer_dir, has
// one), the caller's extra keys, then the file (split in opt.split parts when asked).
inline void finish_file(GgufWriter& w, const std::string& dir, const std::string& out,
                        const ConvertOptions& opt) {
  const std::filesystem::path tok = opt.tokenizer_dir.empty() ? std::filesystem::path(dir)
                                                              : std::filesystem::path(opt.tokenizer_dir);
  if (std::filesystem::exists(tok / "tokenizer.json")) gguf_detail::add_tokenizer(w, tok, opt.pre);
  if (opt.extra) opt.extra(w);
  if (opt.split > 1)
    w.write_split(out, opt.split);
  else
    w.write(out);
}

inline void convert_own_class(const std::string& dir, const std::string& out,
                              const ConvertOptions& opt) {
  using namespace gguf_detail;
  using json = nlohmann::json;
  auto fail = [&](const std::string& what) { throw std::runtime_error(dir + ": " + what); };
  const json c = read_json(std::filesystem::path(dir) / "config.json");
  auto setr = ts::io::TensorSet::open_dir(dir);
  if (!setr.ok()) fail(setr.error().message);
  const ts::io::TensorSet& set = *setr.value();
  auto has = [&](const char* k) { return c.contains(k) && !c[k].is_null(); };
  const std::string mt = c["model_type"].get<std::string>();
  const bool ds = mt == "deepseek_v2" || mt == "deepseek_v3" || mt == "kimi_k2";
  const bool glm = mt == "glm4_moe";
  const std::string arch = ds ? "deepseek2" : glm ? "glm4moe" : "minimax-m2";
  const int n_layers = c["num_hidden_layers"].get<int>();

  // Staged metadata: key -> writer, first-written order.
  std::vector<std::string> order;
  std::map<std::string, std::function<void(GgufWriter&)>> kv;
  auto put_kv = [&](const std::string& k, std::function<void(GgufWriter&)> f) {
    if (!kv.count(k)) order.push_back(k);
    kv[k] = std::move(f);
  };
  auto u32 = [&](const std::string& k, uint32_t v) {
    put_kv(arch + "." + k, [=, key = arch + "." + k](GgufWriter& w) { w.u32(key, v); });
  };
  auto f32 = [&](const std::string& k, double v) {
    put_kv(arch + "." + k, [=, key = arch + "." + k](GgufWriter& w) { w.f32(key, float(v)); });
  };
  auto boolean = [&](const std::string& k, bool v) {
    put_kv(arch + "." + k, [=, key = arch + "." + k](GgufWriter& w) { w.boolean(key, v); });
  };
  auto str = [&](const std::string& k, const std::string& v) {
    put_kv(arch + "." + k, [=, key = arch + "." + k](GgufWriter& w) { w.str(key, v); });
  };

  // base.py:1317-1335: rope_parameters (or rope_scaling) with the top-level keys mirrored.
  json rope = c.contains("rope_parameters") && c["rope_parameters"].is_object()
                  ? c["rope_parameters"]
              : c.contains("rope_scaling") && c["rope_scaling"].is_object() ? c["rope_scaling"]
                                                                            : json::object();
  if (!rope.contains("rope_theta") && has("rope_theta")) rope["rope_theta"] = c["rope_theta"];
  if (!rope.contains("rope_type") && rope.contains("type")) rope["rope_type"] = rope["type"];
  if (!rope.contains("partial_rotary_factor") && has("partial_rotary_factor"))
    rope["partial_rotary_factor"] = c["partial_rotary_factor"];
  auto rope_has = [&](const char* k) { return rope.contains(k) && !rope[k].is_null(); };

  // TextModel.set_gguf_parameters (base.py:1399-1503); DeepSeek first sets
  // num_key_value_heads = 1 and a default rms_norm_eps (deepseek.py:319-330).
  const int nextn = glm && has("num_nextn_predict_layers") && !opt.no_mtp
                        ? c["num_nextn_predict_layers"].get<int>()
                        : 0;
  u32("block_count", uint32_t(n_layers + nextn));
  if (has("max_position_embeddings")) u32("context_length", c["max_position_embeddings"]);
  u32("embedding_length", c["hidden_size"]);
  if (has("intermediate_size")) u32("feed_forward_length", c["intermediate_size"]);
  u32("attention.head_count", c["num_attention_heads"]);
  if (ds)
    u32("attention.head_count_kv", 1);
  else if (has("num_key_value_heads"))
    u32("attention.head_count_kv", c["num_key_value_heads"]);
  if (rope_has("rope_type") && rope["rope_type"] == "yarn" && rope_has("factor")) {
    str("rope.scaling.type", "yarn");
    f32("rope.scaling.factor", rope["factor"]);
    u32("rope.scaling.original_context_length", rope["original_max_position_embeddings"]);
    if (rope_has("extrapolation_factor"))
      f32("rope.scaling.yarn_ext_factor", rope["extrapolation_factor"]);
    if (rope_has("attention_factor"))
      f32("rope.scaling.yarn_attn_factor", rope["attention_factor"]);
    if (rope_has("beta_fast")) f32("rope.scaling.yarn_beta_fast", rope["beta_fast"]);
    if (rope_has("beta_slow")) f32("rope.scaling.yarn_beta_slow", rope["beta_slow"]);
  }
  if (rope_has("rope_theta")) f32("rope.freq_base", rope["rope_theta"]);
  f32("attention.layer_norm_rms_epsilon",
      has("rms_norm_eps") ? c["rms_norm_eps"].get<double>() : 1e-6);
  for (const char* k : {"num_local_experts", "num_experts", "n_routed_experts"})
    if (has(k)) {
      u32("expert_count", c[k]);
      break;
    }
  if (has("num_experts_per_tok")) u32("expert_used_count", c["num_experts_per_tok"]);
  if (has("n_group")) u32("expert_group_count", c["n_group"]);
  if (has("topk_group")) u32("expert_group_used_count", c["topk_group"]);
  if (has("scoring_func")) {
    const std::string f = c["scoring_func"];
    if (f != "sigmoid" && f != "softmax") fail("scoring_func " + f);
    u32("expert_gating_func", f == "sigmoid" ? 2 : 1);
  }
  if (has("head_dim")) {
    u32("attention.key_length", c["head_dim"]);
    u32("attention.value_length", c["head_dim"]);
  }
  put_kv("general.file_type", [](GgufWriter& w) { w.u32("general.file_type", 0); });

  if (ds) {  // deepseek.py:331-386
    u32("leading_dense_block_count", has("first_k_dense_replace")
                                         ? c["first_k_dense_replace"].get<int>()
                                         : (has("n_routed_experts") ? 0 : n_layers));
    const int kv_lora = has("kv_lora_rank") ? c["kv_lora_rank"].get<int>() : 512;
    u32("vocab_size", c["vocab_size"]);
    if (has("q_lora_rank")) u32("attention.q_lora_rank", c["q_lora_rank"]);
    const int rope_dim = c["qk_rope_head_dim"], nope = c["qk_nope_head_dim"];
    u32("attention.kv_lora_rank", uint32_t(kv_lora));
    u32("attention.key_length", uint32_t(kv_lora + rope_dim));
    u32("attention.value_length", uint32_t(kv_lora));
    u32("attention.key_length_mla", uint32_t(nope + rope_dim));
    u32("attention.value_length_mla", c["v_head_dim"]);
    u32("expert_feed_forward_length",
        has("moe_intermediate_size") ? c["moe_intermediate_size"] : c["intermediate_size"]);
    if (has("n_routed_experts")) u32("expert_count", c["n_routed_experts"]);
    u32("expert_shared_count", has("n_shared_experts") ? c["n_shared_experts"].get<int>() : 0);
    if (has("routed_scaling_factor")) f32("expert_weights_scale", c["routed_scaling_factor"]);
    if (has("norm_topk_prob") && c["norm_topk_prob"].get<bool>())
      boolean("expert_weights_norm", true);
    u32("rope.dimension_count", uint32_t(rope_dim));
    if (opt.legacy_mla) {
      u32("attention.head_count_kv", c["num_key_value_heads"]);
      u32("attention.key_length", uint32_t(nope + rope_dim));
      u32("attention.value_length", c["v_head_dim"]);
      for (const char* k : {"attention.key_length_mla", "attention.value_length_mla"}) {
        kv.erase(arch + "." + k);
        order.erase(std::remove(order.begin(), order.end(), arch + "." + k), order.end());
      }
    }
    if (rope_has("mscale_all_dim"))
      f32("rope.scaling.yarn_log_multiplier", 0.1 * rope["mscale_all_dim"].get<double>());
  } else if (glm) {  // glm.py:151-183
    const int hd = has("head_dim")
                       ? c["head_dim"].get<int>()
                       : c["hidden_size"].get<int>() / c["num_attention_heads"].get<int>();
    const double partial =
        rope_has("partial_rotary_factor") ? rope["partial_rotary_factor"].get<double>() : 0.5;
    u32("rope.dimension_count", uint32_t(int(hd * partial)));
    if (has("n_routed_experts")) u32("expert_count", c["n_routed_experts"]);
    if (has("moe_intermediate_size")) u32("expert_feed_forward_length", c["moe_intermediate_size"]);
    if (has("n_shared_experts")) u32("expert_shared_count", c["n_shared_experts"]);
    if (has("first_k_dense_replace")) u32("leading_dense_block_count", c["first_k_dense_replace"]);
    u32("expert_gating_func", 2);
    if (has("routed_scaling_factor")) f32("expert_weights_scale", c["routed_scaling_factor"]);
    if (has("norm_topk_prob")) boolean("expert_weights_norm", c["norm_topk_prob"].get<bool>());
    if (nextn > 0) u32("nextn_predict_layers", uint32_t(nextn));
  } else {  // minimax.py:128-132
    u32("expert_feed_forward_length", c["intermediate_size"]);
    u32("rope.dimension_count", c["rotary_dim"]);
  }

  for (const auto& [k, v] : opt.set_u32) put_kv(k, [k, v](GgufWriter& w) { w.u32(k, v); });
  for (const std::string& k : opt.drop_keys) {
    kv.erase(k);
    order.erase(std::remove(order.begin(), order.end(), k), order.end());
  }
  GgufWriter w;
  w.str("general.architecture", arch);
  w.str("general.name", "fixture");
  for (const std::string& k : order) kv[k](w);

  // Tensors: HF name -> GGUF name (tensor_mapping.py / constants.py for the arch).
  auto write = [&](const std::string& name, std::vector<int64_t> shape, std::string f32_bytes_,
                   bool keep_f32) {
    if (name == opt.drop_tensor) return;
    std::vector<uint64_t> ne(shape.rbegin(), shape.rend());
    const int64_t cols = shape.back(), rows = int64_t(f32_bytes_.size() / 4) / cols;
    if (!opt.q8_0 || keep_f32 || shape.size() < 2) {
      w.tensor(name, ne, 0, std::move(f32_bytes_));
    } else if (cols % 32 == 0) {
      w.tensor(name, ne, 8, q8_0_bytes(f32_bytes_, rows, cols));
    } else {  // QuantError -> F16 (base.py:1128-1131)
      std::string h(size_t(rows * cols) * 2, '\0');
      const float* x = reinterpret_cast<const float*>(f32_bytes_.data());
      for (int64_t i = 0; i < rows * cols; ++i) {
        const uint16_t v = ts::f32_to_f16(x[i]);
        std::memcpy(h.data() + i * 2, &v, 2);
      }
      w.tensor(name, ne, 1, std::move(h));
    }
  };
  const char* moe = mt == "minimax_m2" ? "block_sparse_moe" : "mlp";
  const std::map<std::string, std::string> kRest = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"post_attention_layernorm.weight", glm ? "post_attention_norm.weight" : "ffn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.q_proj.bias", "attn_q.bias"},
      {"self_attn.k_proj.bias", "attn_k.bias"},
      {"self_attn.v_proj.bias", "attn_v.bias"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"self_attn.q_norm.weight", "attn_q_norm.weight"},
      {"self_attn.k_norm.weight", "attn_k_norm.weight"},
      {"self_attn.q_a_proj.weight", "attn_q_a.weight"},
      {"self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"},
      {"self_attn.q_b_proj.weight", "attn_q_b.weight"},
      {"self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"},
      {"self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
      {std::string(moe) + ".gate.weight", "ffn_gate_inp.weight"},
      {"mlp.gate.e_score_correction_bias", "exp_probs_b.bias"},
      {"block_sparse_moe.e_score_correction_bias", "exp_probs_b.bias"},
      {"mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"},
      {"mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"},
      {"mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"},
  };
  // Routed experts, stacked per layer and projection: torch.stack of [out, in] -> {in, out, E}.
  std::map<std::pair<int, std::string>, std::map<int, const ts::io::TensorView*>> experts;
  for (const auto& [name, v] : set.tensors()) {
    if (name == "model.embed_tokens.weight") {
      write("token_embd.weight", v.shape, f32_bytes(v), false);
      continue;
    }
    if (name == "model.norm.weight") {
      write("output_norm.weight", v.shape, f32_bytes(v), true);
      continue;
    }
    if (name == "lm_head.weight") {
      if (!(ds && c.value("tie_word_embeddings", false)))
        write("output.weight", v.shape, f32_bytes(v), false);
      continue;
    }
    const std::string pre = "model.layers.";
    if (name.rfind(pre, 0) != 0) fail("can not map tensor " + name);
    const size_t dot = name.find('.', pre.size());
    const int bid = std::stoi(name.substr(pre.size(), dot - pre.size()));
    const std::string rest = name.substr(dot + 1);
    if (ds && bid >= n_layers) continue;  // deepseek.py:397-401 skip_mtp
    const std::string b = "blk." + std::to_string(bid) + ".";
    const std::string ex = std::string(moe) + ".experts.";
    if (rest.rfind(ex, 0) == 0) {
      const size_t d2 = rest.find('.', ex.size());
      const int e = std::stoi(rest.substr(ex.size(), d2 - ex.size()));
      experts[{bid, rest.substr(d2 + 1)}][e] = &v;
      continue;
    }
    if (rest == "self_attn.kv_b_proj.weight" && opt.legacy_mla) {
      write(b + "attn_kv_b.weight", v.shape, f32_bytes(v), false);
      continue;
    }
    if (rest == "self_attn.kv_b_proj.weight") {
      // deepseek.py:433-449: view [n_head_kv, nope + v, kv_lora], split, k part transposed.
      const int64_t heads = c["num_key_value_heads"], nope = c["qk_nope_head_dim"],
                    vd = c["v_head_dim"], kv_lora = v.shape[1];
      if (v.shape[0] != heads * (nope + vd)) fail("kv_b_proj rows");
      const std::string all = f32_bytes(v);
      const float* x = reinterpret_cast<const float*>(all.data());
      std::vector<float> kb(size_t(heads * kv_lora * nope)), vb(size_t(heads * vd * kv_lora));
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < nope; ++i)
          for (int64_t j = 0; j < kv_lora; ++j)
            kb[size_t((h * kv_lora + j) * nope + i)] = x[(h * (nope + vd) + i) * kv_lora + j];
        for (int64_t i = 0; i < vd; ++i)
          for (int64_t j = 0; j < kv_lora; ++j)
            vb[size_t((h * vd + i) * kv_lora + j)] = x[(h * (nope + vd) + nope + i) * kv_lora + j];
      }
      write(b + "attn_k_b.weight", {heads, kv_lora, nope},
            std::string(reinterpret_cast<const char*>(kb.data()), kb.size() * 4), false);
      write(b + "attn_v_b.weight", {heads, vd, kv_lora},
            std::string(reinterpret_cast<const char*>(vb.data()), vb.size() * 4), false);
      continue;
    }
    auto it = kRest.find(rest);
    if (it == kRest.end()) fail("can not map tensor " + name);
    const bool keep_f32 =
        it->second.find("_norm") != std::string::npos || it->second == "ffn_gate_inp.weight";
    write(b + it->second, v.shape, f32_bytes(v), keep_f32);
  }
  const std::map<std::string, std::string> kExp = {
      {"gate_proj.weight", "ffn_gate_exps.weight"}, {"up_proj.weight", "ffn_up_exps.weight"},
      {"down_proj.weight", "ffn_down_exps.weight"}, {"w1.weight", "ffn_gate_exps.weight"},
      {"w3.weight", "ffn_up_exps.weight"},          {"w2.weight", "ffn_down_exps.weight"}};
  for (const auto& [key, per_expert] : experts) {
    std::string bytes;
    std::vector<int64_t> shape;
    for (const auto& [e, v] : per_expert) {
      if (e != int(shape.empty() ? 0 : bytes.size() / 4 / (shape[0] * shape[1])))
        fail("expert " + std::to_string(e) + " out of order");
      shape = v->shape;
      bytes += f32_bytes(*v);
    }
    write("blk." + std::to_string(key.first) + "." + kExp.at(key.second),
          {int64_t(per_expert.size()), shape[0], shape[1]}, std::move(bytes), false);
  }
  finish_file(w, dir, out, opt);
}

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
  if (converted_by_own_class(hp.family)) return convert_own_class(dir, out, opt);
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
  finish_file(w, dir, out, opt);
}

}  // namespace ts_test
