#include "model/tensor_specs.h"

#include "model/families/family.h"

namespace ts::model {

std::vector<TensorSpec> checkpoint_tensors(const HParams& hp) {
  const FamilyNames& names = family_def(hp.family).names;
  const int64_t d = hp.d_model;
  using K = TensorKind;
  using R = TensorRole;
  std::vector<TensorSpec> out;
  int layer = -1, expert = -1;
  auto add = [&](std::string name, std::vector<int64_t> shape, K kind, R role) {
    out.push_back({std::move(name), std::move(shape), kind, role, layer, expert});
  };
  auto mlp = [&](const std::string& p, const char* g, const char* u, const char* dn, int64_t hidden,
                 K kind, R gate_role) {
    const R up_role = R(int(gate_role) + 1), down_role = R(int(gate_role) + 2);
    add(p + g + ".weight", {hidden, d}, kind, gate_role);
    add(p + u + ".weight", {hidden, d}, kind, up_role);
    add(p + dn + ".weight", {d, hidden}, kind, down_role);
  };
  add("model.embed_tokens.weight", {hp.vocab, d}, K::kEmbedding, R::kEmbed);
  for (layer = 0; layer < hp.n_layers; ++layer) {
    std::string p = "model.layers." + std::to_string(layer) + ".";
    std::string a = p + "self_attn.";
    add(p + "input_layernorm.weight", {d}, K::kNorm, R::kAttnNorm);
    add(p + "post_attention_layernorm.weight", {d}, K::kNorm, R::kFfnNorm);
    if (hp.layer_mixer[size_t(layer)] == MixerKind::kGatedDeltaNet) {
      const DeltaNetSpec& dn = hp.deltanet;
      const std::string n = p + "linear_attn.";
      if (dn.grouped_projection) {
        add(n + "in_proj_qkvz.weight", {2 * dn.key_dim() + 2 * dn.value_dim(), d}, K::kLinear,
            R::kDnQkvz);
        add(n + "in_proj_ba.weight", {2 * dn.n_v_heads, d}, K::kLinear, R::kDnBa);
      } else {
        add(n + "in_proj_qkv.weight", {dn.conv_dim(), d}, K::kLinear, R::kDnQkv);
        add(n + "in_proj_z.weight", {dn.value_dim(), d}, K::kLinear, R::kDnZ);
        add(n + "in_proj_b.weight", {dn.n_v_heads, d}, K::kLinear, R::kDnB);
        add(n + "in_proj_a.weight", {dn.n_v_heads, d}, K::kLinear, R::kDnA);
      }
      add(n + "conv1d.weight", {dn.conv_dim(), 1, dn.conv_kernel}, K::kNorm, R::kDnConv);
      add(n + "A_log", {dn.n_v_heads}, K::kNorm, R::kDnALog);
      add(n + "dt_bias", {dn.n_v_heads}, K::kNorm, R::kDnDtBias);
      add(n + "norm.weight", {dn.v_dim}, K::kNorm, R::kDnNorm);
      add(n + "out_proj.weight", {d, dn.value_dim()}, K::kLinear, R::kDnOut);
    } else if (hp.attention == AttentionKind::kMla) {
      const MlaSpec& m = hp.mla;
      if (m.q_lora_rank > 0) {
        add(a + "q_a_proj.weight", {m.q_lora_rank, d}, K::kLinear, R::kQa);
        add(a + "q_a_layernorm.weight", {m.q_lora_rank}, K::kNorm, R::kQaNorm);
        add(a + "q_b_proj.weight", {hp.q_dim(), m.q_lora_rank}, K::kLinear, R::kQb);
      } else {
        add(a + "q_proj.weight", {hp.q_dim(), d}, K::kLinear, R::kWq);
      }
      add(a + "kv_a_proj_with_mqa.weight", {m.kv_lora_rank + m.rope_dim, d}, K::kLinear, R::kKva);
      add(a + "kv_a_layernorm.weight", {m.kv_lora_rank}, K::kNorm, R::kKvaNorm);
      add(a + "kv_b_proj.weight", {int64_t(hp.n_heads) * (m.nope_dim + m.v_dim), m.kv_lora_rank},
          K::kLinear, R::kKvb);
      add(a + "o_proj.weight", {d, hp.attn_out_dim()}, K::kLinear, R::kWo);
    } else {
      add(a + "q_proj.weight", {hp.q_proj_rows(), d}, K::kLinear, R::kWq);
      add(a + "k_proj.weight", {hp.kv_dim(), d}, K::kLinear, R::kWk);
      add(a + "v_proj.weight", {hp.kv_dim(), d}, K::kLinear, R::kWv);
      add(a + "o_proj.weight", {d, hp.q_dim()}, K::kLinear, R::kWo);
      if (hp.qkv_bias) {
        add(a + "q_proj.bias", {hp.q_dim()}, K::kBias, R::kBq);
        add(a + "k_proj.bias", {hp.kv_dim()}, K::kBias, R::kBk);
        add(a + "v_proj.bias", {hp.kv_dim()}, K::kBias, R::kBv);
      }
      if (hp.o_bias) add(a + "o_proj.bias", {d}, K::kBias, R::kBo);
      if (hp.attention_sinks) add(a + "sinks", {hp.n_heads}, K::kBias, R::kSinks);
      if (hp.qk_norm == QkNorm::kPerHead) {
        add(a + "q_norm.weight", {hp.head_dim}, K::kNorm, R::kQNorm);
        add(a + "k_norm.weight", {hp.head_dim}, K::kNorm, R::kKNorm);
      } else if (hp.qk_norm == QkNorm::kFullProjection) {
        add(a + "q_norm.weight", {hp.q_dim()}, K::kNorm, R::kQNorm);
        add(a + "k_norm.weight", {hp.kv_dim()}, K::kNorm, R::kKNorm);
      }
    }
    if (hp.layer_is_moe[size_t(layer)]) {
      std::string m = p + names.moe_block + ".";
      const std::string router = m + names.router + ".";
      add(router + "weight", {hp.n_experts, d}, K::kRouter, R::kRouter);
      if (hp.router.logit_bias) add(router + "bias", {hp.n_experts}, K::kBias, R::kRouterLogitBias);
      if (hp.router.correction_bias)
        add(m + names.correction_bias, {hp.n_experts}, K::kBias, R::kRouterBias);
      for (expert = 0; expert < hp.n_experts; ++expert) {
        const std::string e = m + "experts." + std::to_string(expert) + ".";
        mlp(e, names.expert_gate, names.expert_up, names.expert_down, hp.d_expert, K::kExpert,
            R::kExpertGate);
        if (hp.expert_bias) {
          add(e + names.expert_gate + ".bias", {hp.d_expert}, K::kBias, R::kExpertGateBias);
          add(e + names.expert_up + ".bias", {hp.d_expert}, K::kBias, R::kExpertUpBias);
          add(e + names.expert_down + ".bias", {d}, K::kBias, R::kExpertDownBias);
        }
      }
      expert = -1;
      if (hp.d_shared > 0) {
        mlp(m + names.shared + ".", "gate_proj", "up_proj", "down_proj", hp.d_shared, K::kLinear,
            R::kSharedGate);
        if (hp.shared_expert_gate)
          add(m + "shared_expert_gate.weight", {1, d}, K::kRouter, R::kSharedExpertGate);
      }
    } else {
      mlp(p + "mlp.", "gate_proj", "up_proj", "down_proj", hp.d_ff, K::kLinear, R::kDenseGate);
    }
  }
  layer = -1;
  add("model.norm.weight", {d}, K::kNorm, R::kFinalNorm);
  if (!hp.tie_word_embeddings) add("lm_head.weight", {hp.vocab, d}, K::kLinear, R::kLmHead);
  return out;
}

}  // namespace ts::model
