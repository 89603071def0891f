// Binding checkpoint tensors to the forward pass's weight views: each entry of the model's
// tensor table (tensor_specs.h) is looked up, shape-checked and bound by its role.
#include "model/weights.h"

#include "io/safetensors.h"
#include "model/tensor_specs.h"

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
    return find_tensor(tensors, name, shape, "the config (config.json or GGUF metadata)");
  }
  Result<Matrix> matrix(const std::string& name, int64_t rows, int64_t cols) const {
    TS_ASSIGN(const io::TensorView* t, get(name, {rows, cols}));
    return Matrix{t->data, t->dtype, rows, cols};
  }
  // A vector (a norm, a bias; or a small tensor read whole, as the conv taps).
  Result<std::vector<float>> vec(const std::string& name, std::vector<int64_t> shape) const {
    TS_ASSIGN(const io::TensorView* t, get(name, shape));
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    // Packs keep norms and biases in their float type; a quantized one is a foreign file.
    if (dtype_is_quantized(t->dtype))
      return make_error("tensor " + name + " in " + t->file + " is " +
                        std::string(dtype_name(t->dtype)) + "; vectors must be F32, F16 or BF16");
    std::vector<float> out(static_cast<size_t>(n));
    float_row_to_f32(t->data, t->dtype, out.data(), n);
    return out;
  }
};

}  // namespace

Result<const io::TensorView*> find_tensor(const io::TensorSet& set, const std::string& name,
                                          const std::vector<int64_t>& shape,
                                          const std::string& implied_by) {
  const io::TensorView* t = set.find(name);
  if (!t) return make_error("tensor " + name + " is missing from the checkpoint");
  if (t->shape != shape)
    return make_error("tensor " + name + " in " + t->file + " has shape " + shape_str(t->shape) +
                      ", " + implied_by + " implies " + shape_str(shape));
  return t;
}

Result<BoundWeights> bind_weights(const HParams& hp, const io::TensorSet& tensors) {
  Binder b{tensors};
  BoundWeights out;
  DenseWeights& w = out.dense;
  w.layers.resize(size_t(hp.n_layers));
  out.experts.resize(size_t(hp.n_layers));
  for (int l = 0; l < hp.n_layers; ++l) {
    w.layers[size_t(l)].is_moe = hp.layer_is_moe[size_t(l)];
    if (hp.layer_is_moe[size_t(l)]) out.experts[size_t(l)].resize(size_t(hp.n_experts));
  }
  using R = TensorRole;
  for (const TensorSpec& s : checkpoint_tensors(hp)) {
    if (s.shape.size() != 2) {
      TS_ASSIGN(std::vector<float> v, b.vec(s.name, s.shape));
      // Zero-centred norm weights become plain ones: y = norm(x) * (1 + w), as transformers
      // computes it in F32.
      const bool norm = s.role == R::kFinalNorm || s.role == R::kAttnNorm ||
                        s.role == R::kFfnNorm || s.role == R::kQNorm || s.role == R::kKNorm;
      if (hp.norm_plus_one && norm)
        for (float& x : v) x = 1.0f + x;
      LayerWeights* L = s.layer >= 0 ? &w.layers[size_t(s.layer)] : nullptr;
      // An expert's bias goes to its place in the layer's array of all experts' biases.
      auto expert_row = [&](std::vector<float>& all) {
        all.resize(size_t(hp.n_experts) * v.size());
        std::copy(v.begin(), v.end(), all.begin() + long(size_t(s.expert) * v.size()));
      };
      switch (s.role) {
        case R::kDnConv: L->deltanet.conv = std::move(v); break;
        case R::kDnALog: L->deltanet.a_log = std::move(v); break;
        case R::kDnDtBias: L->deltanet.dt_bias = std::move(v); break;
        case R::kDnNorm: L->deltanet.norm = std::move(v); break;
        case R::kFinalNorm: w.final_norm = std::move(v); break;
        case R::kAttnNorm: L->attn_norm = std::move(v); break;
        case R::kFfnNorm: L->ffn_norm = std::move(v); break;
        case R::kBq: L->bq = std::move(v); break;
        case R::kBk: L->bk = std::move(v); break;
        case R::kBv: L->bv = std::move(v); break;
        case R::kQNorm: L->q_norm = std::move(v); break;
        case R::kKNorm: L->k_norm = std::move(v); break;
        case R::kQaNorm: L->q_a_norm = std::move(v); break;
        case R::kKvaNorm: L->kv_a_norm = std::move(v); break;
        case R::kRouterBias: L->router_bias = std::move(v); break;
        case R::kBo: L->bo = std::move(v); break;
        case R::kSinks: L->sinks = std::move(v); break;
        case R::kRouterLogitBias: L->router_logit_bias = std::move(v); break;
        case R::kExpertGateBias: expert_row(L->expert_gate_bias); break;
        case R::kExpertUpBias: expert_row(L->expert_up_bias); break;
        case R::kExpertDownBias: expert_row(L->expert_down_bias); break;
        default: TS_CHECK(false, "a vector role binds to a vector field");
      }
      continue;
    }
    TS_ASSIGN(Matrix m, b.matrix(s.name, s.shape[0], s.shape[1]));
    if (s.layer < 0) {
      (s.role == R::kEmbed ? w.embed : w.lm_head) = m;
      continue;
    }
    LayerWeights& L = w.layers[size_t(s.layer)];
    ExpertWeights* e = s.expert >= 0 ? &out.experts[size_t(s.layer)][size_t(s.expert)] : nullptr;
    switch (s.role) {
      case R::kWq: L.wq = m; break;
      case R::kWk: L.wk = m; break;
      case R::kWv: L.wv = m; break;
      case R::kWo: L.wo = m; break;
      case R::kQa: L.q_a = m; break;
      case R::kQb: L.q_b = m; break;
      case R::kKva: L.kv_a = m; break;
      case R::kKvb: L.kv_b = m; break;
      case R::kDnQkvz: L.deltanet.qkvz = m; break;
      case R::kDnBa: L.deltanet.ba = m; break;
      case R::kDnQkv: L.deltanet.qkv = m; break;
      case R::kDnZ: L.deltanet.z = m; break;
      case R::kDnB: L.deltanet.b = m; break;
      case R::kDnA: L.deltanet.a = m; break;
      case R::kDnOut: L.deltanet.out = m; break;
      case R::kRouter: L.router = m; break;
      case R::kSharedGate: L.shared.gate = m; break;
      case R::kSharedUp: L.shared.up = m; break;
      case R::kSharedDown: L.shared.down = m; break;
      case R::kSharedExpertGate: L.shared_gate = m; break;
      case R::kDenseGate: L.dense.gate = m; break;
      case R::kDenseUp: L.dense.up = m; break;
      case R::kDenseDown: L.dense.down = m; break;
      case R::kExpertGate: e->gate = m; break;
      case R::kExpertUp: e->up = m; break;
      case R::kExpertDown: e->down = m; break;
      default: TS_CHECK(false, "a matrix role binds to a matrix field");
    }
  }
  // A tied head is the embedding, unless the checkpoint holds an lm_head all the same.
  if (hp.tie_word_embeddings) {
    if (tensors.find("lm_head.weight")) {
      TS_ASSIGN(w.lm_head, b.matrix("lm_head.weight", hp.vocab, hp.d_model));
    } else {
      w.lm_head = w.embed;
    }
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
    for (const Matrix* m : L.matrices()) add_dense(*m);
    for (const auto* v :
         {&L.attn_norm, &L.ffn_norm, &L.bq, &L.bk, &L.bv, &L.bo, &L.sinks, &L.q_norm, &L.k_norm,
          &L.q_a_norm, &L.kv_a_norm, &L.router_bias, &L.router_logit_bias, &L.deltanet.conv,
          &L.deltanet.a_log, &L.deltanet.dt_bias, &L.deltanet.norm})
      add_vec(*v);
    // Experts' biases are resident (dense bytes); a token reads top_k experts' rows of them.
    for (const auto* v : {&L.expert_gate_bias, &L.expert_up_bias, &L.expert_down_bias}) {
      if (v->empty()) continue;
      const int64_t per_token = int64_t(v->size()) / hp.n_experts * hp.top_k;
      c.params_total += int64_t(v->size());
      c.params_active += per_token;
      c.dense_bytes += v->size() * 4;
      c.decode_bytes += uint64_t(per_token) * 4;
    }
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
  WeightBytes b;
  for (const TensorSpec& t : checkpoint_tensors(hp)) {
    if (t.shape.size() != 2) {  // norms, biases, conv taps: F32 vectors
      uint64_t n = 1;
      for (int64_t e : t.shape) n *= uint64_t(e);
      b.dense += n * 4;
      continue;
    }
    const DType dt = t.kind == TensorKind::kEmbedding || t.kind == TensorKind::kRouter ? float_t
                     : t.role == TensorRole::kExpertDown                               ? down
                                                                                       : dtype;
    if (!dtype_row_ok(dt, t.shape[1]))
      return make_error(t.name + " has rows of " + std::to_string(t.shape[1]) +
                        ", not a multiple of " + std::to_string(dtype_block_elems(dt)) +
                        ", the " + std::string(dtype_name(dt)) + " block");
    const uint64_t bytes = uint64_t(t.shape[0]) * dtype_row_bytes(dt, t.shape[1]);
    (t.kind == TensorKind::kExpert ? b.routed : b.dense) += bytes;
  }
  // A tied head is the embedding's bytes, but where the matrices are quantized it is its own.
  if (hp.tie_word_embeddings && dtype_is_quantized(dtype))
    b.dense += uint64_t(hp.vocab) * dtype_row_bytes(dtype, hp.d_model);
  return b;
}

}  // namespace ts::model
