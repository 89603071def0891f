// Binding checkpoint tensors to the forward pass's weight views, with the Hub names of each
// family (per-expert tensors model.layers.N.mlp.experts.E.gate_proj.weight, or Mixtral's
// block_sparse_moe.experts.E.w1/w2/w3).
#include "model/weights.h"

#include "io/safetensors.h"

namespace ts::model {
namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

struct Binder {
  const io::TensorSet& tensors;

  Result<const io::TensorView*> get(const std::string& name, std::vector<int64_t> shape) const {
    const io::TensorView* t = tensors.find(name);
    if (!t) return make_error("tensor " + name + " is missing from the checkpoint");
    if (t->shape != shape)
      return make_error("tensor " + name + " in " + t->file + " has shape " + shape_str(t->shape) +
                        ", the config (config.json or GGUF metadata) implies " + shape_str(shape));
    return t;
  }
  Result<Matrix> matrix(const std::string& name, int64_t rows, int64_t cols) const {
    TS_ASSIGN(const io::TensorView* t, get(name, {rows, cols}));
    return Matrix{t->data, t->dtype, rows, cols};
  }
  Result<std::vector<float>> vec(const std::string& name, int64_t n) const {
    TS_ASSIGN(const io::TensorView* t, get(name, {n}));
    // Packs keep norms and biases in their float type; a quantized one is a foreign file.
    if (dtype_is_quantized(t->dtype))
      return make_error("tensor " + name + " in " + t->file + " is " +
                        std::string(dtype_name(t->dtype)) + "; vectors must be F32, F16 or BF16");
    std::vector<float> out(static_cast<size_t>(n));
    float_row_to_f32(t->data, t->dtype, out.data(), n);
    return out;
  }
  Result<ExpertWeights> mlp(const std::string& prefix, const char* g, const char* u,
                            const char* d, int64_t d_model, int64_t d_hidden) const {
    ExpertWeights e;
    TS_ASSIGN(e.gate, matrix(prefix + g + ".weight", d_hidden, d_model));
    TS_ASSIGN(e.up, matrix(prefix + u + ".weight", d_hidden, d_model));
    TS_ASSIGN(e.down, matrix(prefix + d + ".weight", d_model, d_hidden));
    return e;
  }
};

}  // namespace

const FamilyNames& family_names(Family f) {
  static const FamilyNames kMixtral{"block_sparse_moe", "w1", "w3", "w2"};
  static const FamilyNames kHub{"mlp", "gate_proj", "up_proj", "down_proj"};
  return f == Family::kMixtral ? kMixtral : kHub;
}

Result<BoundWeights> bind_weights(const HParams& hp, const io::TensorSet& tensors) {
  Binder b{tensors};
  const FamilyNames& names = family_names(hp.family);
  const int64_t d = hp.d_model;
  BoundWeights out;
  DenseWeights& w = out.dense;
  // A quantized embedding (GGUF files quantize token_embd) is dequantized row by row as the
  // forward pass gathers it: exactly, into F32.
  TS_ASSIGN(w.embed, b.matrix("model.embed_tokens.weight", hp.vocab, d));
  TS_ASSIGN(w.final_norm, b.vec("model.norm.weight", d));
  if (hp.tie_word_embeddings && !tensors.find("lm_head.weight")) {
    w.lm_head = w.embed;
  } else {
    TS_ASSIGN(w.lm_head, b.matrix("lm_head.weight", hp.vocab, d));
  }
  out.experts.resize(size_t(hp.n_layers));
  for (int l = 0; l < hp.n_layers; ++l) {
    LayerWeights L;
    std::string p = "model.layers." + std::to_string(l) + ".";
    std::string a = p + "self_attn.";
    TS_ASSIGN(L.attn_norm, b.vec(p + "input_layernorm.weight", d));
    TS_ASSIGN(L.ffn_norm, b.vec(p + "post_attention_layernorm.weight", d));
    TS_ASSIGN(L.wq, b.matrix(a + "q_proj.weight", hp.q_dim(), d));
    TS_ASSIGN(L.wk, b.matrix(a + "k_proj.weight", hp.kv_dim(), d));
    TS_ASSIGN(L.wv, b.matrix(a + "v_proj.weight", hp.kv_dim(), d));
    TS_ASSIGN(L.wo, b.matrix(a + "o_proj.weight", d, hp.q_dim()));
    if (hp.qkv_bias) {
      TS_ASSIGN(L.bq, b.vec(a + "q_proj.bias", hp.q_dim()));
      TS_ASSIGN(L.bk, b.vec(a + "k_proj.bias", hp.kv_dim()));
      TS_ASSIGN(L.bv, b.vec(a + "v_proj.bias", hp.kv_dim()));
    }
    if (hp.qk_norm == QkNorm::kPerHead) {
      TS_ASSIGN(L.q_norm, b.vec(a + "q_norm.weight", hp.head_dim));
      TS_ASSIGN(L.k_norm, b.vec(a + "k_norm.weight", hp.head_dim));
    } else if (hp.qk_norm == QkNorm::kFullProjection) {
      TS_ASSIGN(L.q_norm, b.vec(a + "q_norm.weight", hp.q_dim()));
      TS_ASSIGN(L.k_norm, b.vec(a + "k_norm.weight", hp.kv_dim()));
    }
    L.is_moe = hp.layer_is_moe[size_t(l)];
    if (L.is_moe) {
      std::string m = p + names.moe_block + ".";
      TS_ASSIGN(L.router, b.matrix(m + "gate.weight", hp.n_experts, d));
      auto& experts = out.experts[size_t(l)];
      experts.reserve(size_t(hp.n_experts));
      for (int e = 0; e < hp.n_experts; ++e) {
        TS_ASSIGN(ExpertWeights ew, b.mlp(m + "experts." + std::to_string(e) + ".",
                                          names.expert_gate, names.expert_up, names.expert_down,
                                          d, hp.d_expert));
        experts.push_back(ew);
      }
      if (hp.d_shared > 0) {
        TS_ASSIGN(L.shared, b.mlp(m + "shared_expert.", "gate_proj", "up_proj", "down_proj", d,
                                  hp.d_shared));
        if (hp.shared_expert_gate) {
          TS_ASSIGN(L.shared_gate, b.matrix(m + "shared_expert_gate.weight", 1, d));
        }
      }
    } else {
      TS_ASSIGN(L.dense, b.mlp(p + "mlp.", "gate_proj", "up_proj", "down_proj", d, hp.d_ff));
    }
    w.layers.push_back(std::move(L));
  }
  return out;
}

WeightCounts count_weights(const HParams& hp, const BoundWeights& bw) {
  WeightCounts c;
  auto add_dense = [&](const Matrix& m) {
    if (!m.present()) return;
    c.params_total += m.rows * m.cols;
    c.params_active += m.rows * m.cols;
    c.dense_bytes += m.n_bytes();
    c.decode_bytes += m.n_bytes();
  };
  auto add_vec = [&](const std::vector<float>& v) {
    c.params_total += int64_t(v.size());
    c.params_active += int64_t(v.size());
    c.dense_bytes += v.size() * 4;
    c.decode_bytes += v.size() * 4;
  };
  const DenseWeights& w = bw.dense;
  c.params_total += w.embed.rows * w.embed.cols;
  c.params_active += w.embed.cols;
  c.dense_bytes += w.embed.n_bytes();
  c.decode_bytes += dtype_row_bytes(w.embed.dtype, w.embed.cols);
  if (w.lm_head.data != w.embed.data) add_dense(w.lm_head);
  else c.decode_bytes += w.lm_head.n_bytes();
  add_vec(w.final_norm);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    for (const Matrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.router, &L.shared.gate, &L.shared.up,
                            &L.shared.down, &L.shared_gate, &L.dense.gate, &L.dense.up,
                            &L.dense.down})
      add_dense(*m);
    for (const auto* v : {&L.attn_norm, &L.ffn_norm, &L.bq, &L.bk, &L.bv, &L.q_norm, &L.k_norm})
      add_vec(*v);
    const auto& experts = bw.experts[l];
    for (size_t e = 0; e < experts.size(); ++e) {
      const ExpertWeights& ew = experts[e];
      int64_t n = ew.gate.rows * ew.gate.cols + ew.up.rows * ew.up.cols +
                  ew.down.rows * ew.down.cols;
      uint64_t bytes = ew.gate.n_bytes() + ew.up.n_bytes() + ew.down.n_bytes();
      c.params_total += n;
      c.routed_bytes += bytes;
      if (int(e) < hp.top_k) {  // all experts of a layer have the same shape
        c.params_active += n;
        c.decode_bytes += bytes;
      }
    }
  }
  return c;
}

Result<WeightBytes> synthetic_weight_bytes(const HParams& hp, DType dtype, DType down) {
  bool any_moe = false, any_dense = false;
  for (bool moe : hp.layer_is_moe) (moe ? any_moe : any_dense) = true;
  // The widths (columns) of the matrices made in `dtype` / `down`, by the field that sets them.
  const std::pair<const char*, int> widths[] = {
      {"hidden_size", hp.d_model},
      {"num_attention_heads x head_dim", hp.q_dim()},
      {"intermediate_size", any_dense ? hp.d_ff : 0},
      {"shared_expert_intermediate_size", any_moe ? hp.d_shared : 0}};
  for (const auto& [field, cols] : widths)
    if (!dtype_row_ok(dtype, cols))
      return make_error(std::string(field) + " " + std::to_string(cols) + " is not a multiple of " +
                        std::to_string(dtype_block_elems(dtype)) + ", the " +
                        std::string(dtype_name(dtype)) + " block");
  if (any_moe && !dtype_row_ok(down, hp.d_expert))
    return make_error("moe_intermediate_size " + std::to_string(hp.d_expert) +
                      " is not a multiple of " + std::to_string(dtype_block_elems(down)) +
                      ", the " + std::string(dtype_name(down)) + " block");
  const DType float_t = dtype_is_quantized(dtype) ? DType::kBF16 : dtype;
  const auto mat = [](DType t, int64_t rows, int64_t cols) {
    return uint64_t(rows) * dtype_row_bytes(t, cols);
  };
  const auto vec = [](int64_t n) { return uint64_t(n) * 4; };
  const int64_t d = hp.d_model;
  WeightBytes b;
  b.dense += mat(float_t, hp.vocab, d) + vec(d);  // embedding, final norm
  if (!hp.tie_word_embeddings || dtype_is_quantized(dtype)) b.dense += mat(dtype, hp.vocab, d);
  for (int l = 0; l < hp.n_layers; ++l) {
    b.dense += 2 * vec(d) + mat(dtype, hp.q_dim(), d) + 2 * mat(dtype, hp.kv_dim(), d) +
               mat(dtype, d, hp.q_dim());
    if (hp.qk_norm == QkNorm::kPerHead) b.dense += 2 * vec(hp.head_dim);
    if (hp.qk_norm == QkNorm::kFullProjection) b.dense += vec(hp.q_dim()) + vec(hp.kv_dim());
    if (!hp.layer_is_moe[size_t(l)]) {
      b.dense += 2 * mat(dtype, hp.d_ff, d) + mat(dtype, d, hp.d_ff);
      continue;
    }
    b.dense += mat(float_t, hp.n_experts, d);
    if (hp.d_shared > 0) {
      b.dense += 2 * mat(dtype, hp.d_shared, d) + mat(dtype, d, hp.d_shared);
      if (hp.shared_expert_gate) b.dense += mat(float_t, 1, d);
    }
    b.routed +=
        uint64_t(hp.n_experts) * (2 * mat(dtype, hp.d_expert, d) + mat(down, d, hp.d_expert));
  }
  return b;
}

}  // namespace ts::model
