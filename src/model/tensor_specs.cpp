#include "model/tensor_specs.h"

#include "model/weights.h"

namespace ts::model {

std::vector<TensorSpec> checkpoint_tensors(const HParams& hp) {
  const FamilyNames& names = family_names(hp.family);
  const int64_t d = hp.d_model;
  std::vector<TensorSpec> out;
  auto add = [&](std::string name, std::vector<int64_t> shape, TensorKind kind) {
    out.push_back({std::move(name), std::move(shape), kind});
  };
  auto mlp = [&](const std::string& p, const char* g, const char* u, const char* dn,
                 int64_t hidden, TensorKind kind) {
    add(p + g + ".weight", {hidden, d}, kind);
    add(p + u + ".weight", {hidden, d}, kind);
    add(p + dn + ".weight", {d, hidden}, kind);
  };
  add("model.embed_tokens.weight", {hp.vocab, d}, TensorKind::kEmbedding);
  for (int l = 0; l < hp.n_layers; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    std::string a = p + "self_attn.";
    add(p + "input_layernorm.weight", {d}, TensorKind::kNorm);
    add(p + "post_attention_layernorm.weight", {d}, TensorKind::kNorm);
    add(a + "q_proj.weight", {hp.q_dim(), d}, TensorKind::kLinear);
    add(a + "k_proj.weight", {hp.kv_dim(), d}, TensorKind::kLinear);
    add(a + "v_proj.weight", {hp.kv_dim(), d}, TensorKind::kLinear);
    add(a + "o_proj.weight", {d, hp.q_dim()}, TensorKind::kLinear);
    if (hp.qkv_bias) {
      add(a + "q_proj.bias", {hp.q_dim()}, TensorKind::kBias);
      add(a + "k_proj.bias", {hp.kv_dim()}, TensorKind::kBias);
      add(a + "v_proj.bias", {hp.kv_dim()}, TensorKind::kBias);
    }
    if (hp.qk_norm == QkNorm::kPerHead) {
      add(a + "q_norm.weight", {hp.head_dim}, TensorKind::kNorm);
      add(a + "k_norm.weight", {hp.head_dim}, TensorKind::kNorm);
    } else if (hp.qk_norm == QkNorm::kFullProjection) {
      add(a + "q_norm.weight", {hp.q_dim()}, TensorKind::kNorm);
      add(a + "k_norm.weight", {hp.kv_dim()}, TensorKind::kNorm);
    }
    if (hp.layer_is_moe[size_t(l)]) {
      std::string m = p + names.moe_block + ".";
      add(m + "gate.weight", {hp.n_experts, d}, TensorKind::kRouter);
      for (int e = 0; e < hp.n_experts; ++e)
        mlp(m + "experts." + std::to_string(e) + ".", names.expert_gate, names.expert_up,
            names.expert_down, hp.d_expert, TensorKind::kExpert);
      if (hp.d_shared > 0) {
        mlp(m + "shared_expert.", "gate_proj", "up_proj", "down_proj", hp.d_shared,
            TensorKind::kLinear);
        if (hp.shared_expert_gate) add(m + "shared_expert_gate.weight", {1, d}, TensorKind::kRouter);
      }
    } else {
      mlp(p + "mlp.", "gate_proj", "up_proj", "down_proj", hp.d_ff, TensorKind::kLinear);
    }
  }
  add("model.norm.weight", {d}, TensorKind::kNorm);
  if (!hp.tie_word_embeddings) add("lm_head.weight", {hp.vocab, d}, TensorKind::kLinear);
  return out;
}

}  // namespace ts::model
