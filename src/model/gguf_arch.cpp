// One config function per GGUF architecture (model/gguf_arch.h). Line references are to
// llama.cpp de3ff81: conversion/*.py (the converter), src/models/*.cpp (the reader).
#include "model/gguf_arch.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace ts::model::gguf {

Result<int64_t> Meta::integer(const std::string& key) const {
  TS_ASSIGN(std::optional<int64_t> v, g.integer(k(key)));
  if (!v) return err(k(key), "is missing");
  if (*v <= 0 || *v > (int64_t(1) << 30))
    return err(k(key), "must be positive, got " + std::to_string(*v));
  return *v;
}

Result<std::optional<int64_t>> Meta::opt_integer(const std::string& key) const {
  TS_ASSIGN(std::optional<int64_t> v, g.integer(k(key)));
  if (v && (*v < 0 || *v > (int64_t(1) << 30)))
    return err(k(key), "must be in [0, 2^30], got " + std::to_string(*v));
  return v;
}

Result<std::optional<double>> Meta::opt_number(const std::string& key) const {
  TS_ASSIGN(std::optional<double> v, g.number(k(key)));
  if (v && !std::isfinite(*v)) return err(k(key), "is not finite");
  return v;
}

Result<std::optional<bool>> Meta::opt_boolean(const std::string& key) const {
  return g.boolean(k(key));
}

namespace {

json dense_layers_of(const ArchInput& in) {
  json out = json::array();
  for (int64_t l = 0; l < in.n_layers; ++l)
    if (!in.t.has_router[size_t(l)]) out.push_back(l);
  return out;
}

// Every block routes (Mixtral, OLMoE, MiniMax-M2).
Status require_router_everywhere(const ArchInput& in) {
  const json dense = dense_layers_of(in);
  if (!dense.empty())
    return make_error(in.m.path + ": block " + dense[0].dump() +
                      " has no ffn_gate_inp.weight (every " + in.m.arch +
                      " block routes to experts)");
  return {};
}

// The first `lead` blocks are dense and the rest route: leading_dense_block_count must agree
// with the tensors.
Status check_dense_lead(const ArchInput& in, int64_t lead) {
  for (int64_t l = 0; l < in.n_layers; ++l)
    if (in.t.has_router[size_t(l)] != (l >= lead))
      return in.m.err(in.m.k("leading_dense_block_count"),
                      "= " + std::to_string(lead) + " but block " + std::to_string(l) +
                          (in.t.has_router[size_t(l)] ? " has" : " has no") +
                          " ffn_gate_inp.weight");
  return {};
}

// GQA heads: head_count_kv, key_length (= value_length). Returns head_dim and the rotary dims
// (rope.dimension_count, the whole head when absent); `partial_rope` says whether fewer
// rotary dims than head_dim are allowed.
struct GqaShape {
  int64_t head_dim = 0;
  int64_t rope_dims = 0;
};
Result<GqaShape> read_gqa(const ArchInput& in, bool partial_rope, json& cfg) {
  const Meta& m = in.m;
  TS_ASSIGN(std::optional<int64_t> n_kv, m.opt_integer("attention.head_count_kv"));
  TS_ASSIGN(std::optional<int64_t> key_len, m.opt_integer("attention.key_length"));
  TS_ASSIGN(std::optional<int64_t> value_len, m.opt_integer("attention.value_length"));
  const int64_t head_dim = key_len ? *key_len : in.d_model / in.n_heads;
  if (value_len && *value_len != head_dim)
    return m.err(m.k("attention.value_length"), "= " + std::to_string(*value_len) +
                                                    " differs from the key length " +
                                                    std::to_string(head_dim) + " (not supported)");
  TS_ASSIGN(std::optional<int64_t> rope_dims, m.opt_integer("rope.dimension_count"));
  if (rope_dims && *rope_dims != head_dim && !partial_rope)
    return m.err(m.k("rope.dimension_count"), "= " + std::to_string(*rope_dims) +
                                                  " rotates part of a " + std::to_string(head_dim) +
                                                  "-wide head (partial RoPE is not supported)");
  cfg["num_key_value_heads"] = n_kv && *n_kv > 0 ? *n_kv : in.n_heads;
  cfg["head_dim"] = head_dim;
  return GqaShape{head_dim, rope_dims.value_or(head_dim)};
}

// expert_gating_func: 1 softmax, 2 sigmoid (gguf-py constants.py ExpertGatingFuncType);
// nullopt when absent.
Result<std::optional<ScoreFn>> read_gating(const Meta& m) {
  TS_ASSIGN(std::optional<int64_t> f, m.opt_integer("expert_gating_func"));
  if (!f) return std::optional<ScoreFn>();
  if (*f == 1) return std::optional<ScoreFn>(ScoreFn::kSoftmax);
  if (*f == 2) return std::optional<ScoreFn>(ScoreFn::kSigmoid);
  return m.err(m.k("expert_gating_func"),
               "= " + std::to_string(*f) + " is not supported (1 softmax, 2 sigmoid)");
}

// The sigmoid router's keys as the converter writes them (conversion/base.py:1481-1486 groups;
// deepseek.py / glm.py weights scale and norm): absent keys mean what llama.cpp does without
// them — no groups, no scale (expert_weights_scale 0 = off), no renormalisation.
Status sigmoid_router_keys(const ArchInput& in, json& cfg) {
  const Meta& m = in.m;
  TS_ASSIGN(std::optional<int64_t> groups, m.opt_integer("expert_group_count"));
  TS_ASSIGN(std::optional<int64_t> used, m.opt_integer("expert_group_used_count"));
  TS_ASSIGN(std::optional<double> scale, m.opt_number("expert_weights_scale"));
  TS_ASSIGN(std::optional<bool> norm, m.opt_boolean("expert_weights_norm"));
  cfg["n_group"] = groups && *groups > 0 ? *groups : 1;
  cfg["topk_group"] = used && *used > 0 ? *used : 1;
  cfg["routed_scaling_factor"] = scale && *scale != 0 ? *scale : 1.0;
  cfg["norm_topk_prob"] = norm.value_or(false);
  return {};
}

Status mixtral_config(const ArchInput& in, json& cfg) {
  cfg["model_type"] = "mixtral";
  TS_TRY(read_gqa(in, false, cfg));
  TS_ASSIGN(cfg["num_local_experts"], in.m.integer("expert_count"));
  TS_TRY(require_router_everywhere(in));
  cfg["intermediate_size"] = in.t.d_expert;  // Mixtral always renormalises, whatever the key says
  return {};
}

// Qwen2-MoE / Qwen3-MoE: dense layers where a block has no router; top-k renormalisation from
// expert_weights_norm, else llama.cpp's default for the architecture (qwen3moe renormalises,
// qwen2moe does not).
Status qwen_config(const ArchInput& in, json& cfg, bool norm_default) {
  TS_TRY(read_gqa(in, false, cfg));
  TS_ASSIGN(cfg["num_experts"], in.m.integer("expert_count"));
  cfg["moe_intermediate_size"] = in.t.d_expert;
  cfg["mlp_only_layers"] = dense_layers_of(in);
  if (in.t.d_ff > 0) cfg["intermediate_size"] = in.t.d_ff;
  TS_ASSIGN(std::optional<bool> norm, in.m.opt_boolean("expert_weights_norm"));
  cfg["norm_topk_prob"] = norm.value_or(norm_default);
  return {};
}

Status qwen3moe_config(const ArchInput& in, json& cfg) {
  cfg["model_type"] = "qwen3_moe";
  TS_TRY(qwen_config(in, cfg, true));
  cfg["attention_bias"] = in.t.qkv_bias;
  return {};
}

Status qwen2moe_config(const ArchInput& in, json& cfg) {
  cfg["model_type"] = "qwen2_moe";
  TS_TRY(qwen_config(in, cfg, false));
  cfg["shared_expert_intermediate_size"] = in.t.d_shared;
  cfg["qkv_bias"] = in.t.qkv_bias;
  return {};
}

Status olmoe_config(const ArchInput& in, json& cfg) {
  cfg["model_type"] = "olmoe";
  TS_TRY(read_gqa(in, false, cfg));
  TS_ASSIGN(cfg["num_experts"], in.m.integer("expert_count"));
  TS_TRY(require_router_everywhere(in));
  cfg["intermediate_size"] = in.t.d_expert;
  TS_ASSIGN(std::optional<bool> norm, in.m.opt_boolean("expert_weights_norm"));
  cfg["norm_topk_prob"] = norm.value_or(false);
  cfg["attention_bias"] = in.t.qkv_bias;
  return {};
}

// deepseek2: DeepSeek-V2 / V2-Lite and DeepSeek-V3 / R1 / Kimi-K2 (conversion/deepseek.py
// DeepseekV2Model.set_gguf_parameters, :319-386; src/models/deepseek2.cpp:3-46).
//  - MLA shapes: attention.kv_lora_rank, q_lora_rank (absent: a full attn_q), key_length_mla
//    = qk_nope + qk_rope, value_length_mla = v_head_dim, rope.dimension_count = qk_rope.
//    key_length / value_length hold the MQA view (kv_lora + rope, kv_lora) and head_count_kv
//    is 1; files older than the _mla keys hold the head sizes in key_length / value_length.
//  - expert_gating_func 2 (sigmoid) is V3's router, 1 (softmax) V2's. Absent, llama.cpp
//    assumes softmax (deepseek2.cpp:22-31); a file with exp_probs_b biases is a V3 checkpoint
//    whose config had no scoring_func (transformers 5 writes none), so it is read as sigmoid,
//    which is what the checkpoint computes.
//  - V2 with groups (expert_group_count > 1) is group_limited_greedy: transformers scores a
//    group by its best expert, where llama.cpp sums the best two (llama-graph.cpp:2083-2101);
//    the checkpoint's rule is kept.
//  - YaRN: rope.scaling.yarn_log_multiplier holds 0.1 * mscale_all_dim (deepseek.py:382-386,
//    read back / 0.1 at deepseek2.cpp:34-38); mscale is not written, and llama.cpp's graph
//    (deepseek2.cpp:438-443) computes as if mscale == mscale_all_dim, so both are set to it.
Status deepseek2_config(const ArchInput& in, json& cfg) {
  const Meta& m = in.m;
  TS_ASSIGN(std::optional<ScoreFn> gating, read_gating(m));
  const ScoreFn scoring = gating.value_or(in.t.probs_b ? ScoreFn::kSigmoid : ScoreFn::kSoftmax);
  const bool v3 = scoring == ScoreFn::kSigmoid;
  cfg["model_type"] = v3 ? "deepseek_v3" : "deepseek_v2";

  TS_ASSIGN(int64_t kv_lora, m.integer("attention.kv_lora_rank"));
  TS_ASSIGN(std::optional<int64_t> q_lora, m.opt_integer("attention.q_lora_rank"));
  if (q_lora.value_or(0) != in.t.q_lora)
    return m.err(m.k("attention.q_lora_rank"),
                 (q_lora ? "= " + std::to_string(*q_lora) : std::string("is absent")) +
                     " but blk.*.attn_q_a.weight has " + std::to_string(in.t.q_lora) + " rows");
  TS_ASSIGN(int64_t rope, m.integer("rope.dimension_count"));
  TS_ASSIGN(std::optional<int64_t> k_mla, m.opt_integer("attention.key_length_mla"));
  const bool legacy = !k_mla;  // a file from before the k_b / v_b split
  const std::string k_key = legacy ? "attention.key_length" : "attention.key_length_mla";
  const std::string v_key = legacy ? "attention.value_length" : "attention.value_length_mla";
  TS_ASSIGN(int64_t qk, m.integer(k_key));
  TS_ASSIGN(int64_t v, m.integer(v_key));
  if (qk <= rope)
    return m.err(m.k(k_key), "= " + std::to_string(qk) + " leaves no non-rotary dims beside " +
                                 m.k("rope.dimension_count") + " = " + std::to_string(rope));
  cfg["kv_lora_rank"] = kv_lora;
  cfg["q_lora_rank"] = in.t.q_lora > 0 ? json(in.t.q_lora) : json(nullptr);
  cfg["qk_nope_head_dim"] = qk - rope;
  cfg["qk_rope_head_dim"] = rope;
  cfg["v_head_dim"] = v;
  cfg["head_dim"] = qk;  // MLA's query/key head; the family sets it again from the two parts
  cfg["num_key_value_heads"] = in.n_heads;  // MLA: every head reads the one latent

  TS_ASSIGN(cfg["n_routed_experts"], m.integer("expert_count"));
  cfg["moe_intermediate_size"] = in.t.d_expert;
  TS_ASSIGN(std::optional<int64_t> shared, m.opt_integer("expert_shared_count"));
  const int64_t n_shared = shared.value_or(0);
  if (n_shared * in.t.d_expert != in.t.d_shared)
    return m.err(m.k("expert_shared_count"),
                 "= " + std::to_string(n_shared) + " but ffn_gate_shexp has " +
                     std::to_string(in.t.d_shared) + " rows (experts of " +
                     std::to_string(in.t.d_expert) + ")");
  cfg["n_shared_experts"] = n_shared;
  TS_ASSIGN(std::optional<int64_t> lead, m.opt_integer("leading_dense_block_count"));
  TS_TRY(check_dense_lead(in, lead.value_or(0)));
  cfg["first_k_dense_replace"] = lead.value_or(0);
  if (in.t.d_ff > 0) cfg["intermediate_size"] = in.t.d_ff;

  if (v3) {
    TS_TRY(sigmoid_router_keys(in, cfg));
    cfg["rope_interleave"] = true;  // deepseek2's RoPE is LLAMA_ROPE_TYPE_NORM: pairs (2i, 2i+1)
  } else {
    TS_ASSIGN(std::optional<int64_t> groups, m.opt_integer("expert_group_count"));
    TS_ASSIGN(std::optional<int64_t> used, m.opt_integer("expert_group_used_count"));
    TS_ASSIGN(std::optional<double> scale, m.opt_number("expert_weights_scale"));
    TS_ASSIGN(std::optional<bool> norm, m.opt_boolean("expert_weights_norm"));
    if (norm.value_or(false))
      return m.err(m.k("expert_weights_norm"),
                   "is true with softmax gating: DeepSeek-V2 never renormalises its top-k "
                   "weights (transformers), so such a file is not supported");
    if (groups.value_or(1) > 1) {
      cfg["topk_method"] = "group_limited_greedy";
      cfg["n_group"] = *groups;
      cfg["topk_group"] = used.value_or(1);
    } else {
      cfg["topk_method"] = "greedy";
    }
    cfg["routed_scaling_factor"] = scale && *scale != 0 ? *scale : 1.0;
  }
  TS_ASSIGN(std::optional<double> log_mul, m.opt_number("rope.scaling.yarn_log_multiplier"));
  if (log_mul && cfg.contains("rope_parameters") && cfg["rope_parameters"]["rope_type"] == "yarn") {
    // gguf-py stored 0.1 * mscale_all_dim as an f32. Read as the 7-digit decimal it stands
    // for and divided in double, it gives back the config's value (0.707 -> 0.0707f ->
    // "0.0707" -> 0.707), so the softmax scale is the checkpoint's to the bit; llama.cpp's
    // float division (deepseek2.cpp:37) gives 0.70699996, one ulp off.
    char digits[32];
    std::snprintf(digits, sizeof digits, "%.7g", *log_mul);
    const double mscale_all_dim = std::strtod(digits, nullptr) / 0.1;
    cfg["rope_parameters"]["mscale"] = mscale_all_dim;
    cfg["rope_parameters"]["mscale_all_dim"] = mscale_all_dim;
  }
  return {};
}

// glm4moe: GLM-4.5 / 4.5-Air / 4.6 (conversion/glm.py Glm4MoeModel.set_gguf_parameters,
// :151-183; src/models/glm4-moe.cpp:3-26). Sigmoid gating (written as 2; llama.cpp's default
// too), rope.dimension_count = head_dim * partial_rotary_factor, q/k norm when the tensors
// are there, q/k/v biases when attn_q.bias is.
Status glm4moe_config(const ArchInput& in, json& cfg) {
  const Meta& m = in.m;
  cfg["model_type"] = "glm4_moe";
  TS_ASSIGN(std::optional<ScoreFn> gating, read_gating(m));
  if (gating.value_or(ScoreFn::kSigmoid) != ScoreFn::kSigmoid)
    return m.err(m.k("expert_gating_func"), "= 1 (softmax); glm4moe routes by sigmoid");
  TS_ASSIGN(GqaShape s, read_gqa(in, true, cfg));
  if (s.rope_dims * 2 != s.head_dim) {
    // The family's default is half the head; say the factor only when it is another and it
    // gives back the file's rotary dims exactly.
    const double p = double(s.rope_dims) / double(s.head_dim);
    if (int64_t(double(s.head_dim) * p) != s.rope_dims)
      return m.err(m.k("rope.dimension_count"),
                   "= " + std::to_string(s.rope_dims) + " is not a partial_rotary_factor of " +
                       std::to_string(s.head_dim) + " (not supported)");
    cfg["partial_rotary_factor"] = p;
  }
  TS_ASSIGN(cfg["n_routed_experts"], m.integer("expert_count"));
  cfg["moe_intermediate_size"] = in.t.d_expert;
  TS_ASSIGN(std::optional<int64_t> shared, m.opt_integer("expert_shared_count"));
  const int64_t n_shared = shared.value_or(0);
  if (n_shared * in.t.d_expert != in.t.d_shared)
    return m.err(m.k("expert_shared_count"), "= " + std::to_string(n_shared) +
                                                 " but ffn_gate_shexp has " +
                                                 std::to_string(in.t.d_shared) + " rows");
  cfg["n_shared_experts"] = n_shared;
  TS_ASSIGN(std::optional<int64_t> lead, m.opt_integer("leading_dense_block_count"));
  TS_TRY(check_dense_lead(in, lead.value_or(0)));
  cfg["first_k_dense_replace"] = lead.value_or(0);
  if (in.t.d_ff > 0) cfg["intermediate_size"] = in.t.d_ff;
  TS_TRY(sigmoid_router_keys(in, cfg));
  cfg["attention_bias"] = in.t.qkv_bias;
  cfg["use_qk_norm"] = in.t.q_norm;
  return {};
}

// minimax-m2: MiniMax-M2 (conversion/minimax.py MiniMaxM2Model.set_gguf_parameters, :128-132;
// src/models/minimax-m2.cpp:3-12, 137). Every block routes; the router is a sigmoid with a
// correction bias that always renormalises (build_moe_ffn's norm_w = true) and neither groups
// nor scales; rope.dimension_count = rotary_dim; q/k norm over the whole projection.
Status minimax_m2_config(const ArchInput& in, json& cfg) {
  const Meta& m = in.m;
  cfg["model_type"] = "minimax_m2";
  TS_ASSIGN(std::optional<ScoreFn> gating, read_gating(m));
  if (gating.value_or(ScoreFn::kSigmoid) != ScoreFn::kSigmoid)
    return m.err(m.k("expert_gating_func"), "= 1 (softmax); minimax-m2 routes by sigmoid");
  TS_ASSIGN(std::optional<double> scale, m.opt_number("expert_weights_scale"));
  if (scale && *scale != 0 && *scale != 1)
    return m.err(m.k("expert_weights_scale"),
                 "is set; MiniMax-M2's router does not scale its weights (not supported)");
  TS_ASSIGN(GqaShape s, read_gqa(in, true, cfg));
  cfg["rotary_dim"] = s.rope_dims;
  TS_ASSIGN(cfg["num_local_experts"], m.integer("expert_count"));
  TS_TRY(require_router_everywhere(in));
  cfg["intermediate_size"] = in.t.d_expert;
  return {};
}

constexpr GgufArch kArchs[] = {
    {"llama", Family::kMixtral, "ffn_norm.weight", true, false, true, mixtral_config},
    {"qwen3moe", Family::kQwen3Moe, "ffn_norm.weight", false, false, false, qwen3moe_config},
    {"qwen2moe", Family::kQwen2Moe, "ffn_norm.weight", false, false, false, qwen2moe_config},
    {"olmoe", Family::kOlmoe, "ffn_norm.weight", false, false, false, olmoe_config},
    // V2 and V3 name their tensors alike; the config function picks the family.
    {"deepseek2", Family::kDeepseekV3, "ffn_norm.weight", false, true, false, deepseek2_config},
    // GLM4_MOE has no FFN_NORM: post_attention_layernorm maps to ATTN_POST_NORM
    // (gguf-py constants.py MODEL_TENSORS[GLM4_MOE]; glm4-moe.cpp:72).
    {"glm4moe", Family::kGlm4Moe, "post_attention_norm.weight", false, false, false,
     glm4moe_config},
    {"minimax-m2", Family::kMinimaxM2, "ffn_norm.weight", false, false, false, minimax_m2_config},
};

}  // namespace

const GgufArch* find_arch(std::string_view arch) {
  for (const GgufArch& a : kArchs)
    if (a.arch == arch) return &a;
  return nullptr;
}

std::string supported_archs() {
  std::string out;
  for (const GgufArch& a : kArchs) out += (out.empty() ? "" : ", ") + std::string(a.arch);
  return out + "; llama only with experts (Mixtral)";
}

}  // namespace ts::model::gguf
