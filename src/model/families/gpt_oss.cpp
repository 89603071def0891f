// gpt-oss (gpt_oss): GQA with biases on q, k, v and o, a learned sink logit per head, and
// layers of full or sliding-window attention by layer_types; YaRN RoPE (rotate-half). Every
// layer MoE: a router with a bias, the top_k logits chosen and weighted by a softmax over
// them; experts with biases and the clamped SwiGLU. The checkpoint stacks each layer's
// experts (FamilyNames::stacked: gate and up interleaved by column, x @ W). The rules and
// defaults are transformers' (modeling_gpt_oss.py, configuration_gpt_oss.py).
#include "model/families/family.h"

namespace ts::model {
namespace {

// transformers' GptOssExperts: alpha and limit are constants of the module, not config keys.
constexpr float kSwigluLimit = 7.0f;
constexpr float kSwigluAlpha = 1.702f;

// layer_types (or, absent, transformers' default: sliding on even layers) -> layer_window.
Status read_layer_types(const ConfigReader& c, HParams& hp) {
  std::vector<bool> sliding(size_t(hp.n_layers));
  if (c.has("layer_types")) {
    const nlohmann::json& v = c.j.at("layer_types");
    if (!v.is_array()) return c.err("layer_types", "must be a list of layer kinds");
    if (v.size() != size_t(hp.n_layers))
      return c.err("layer_types", "has " + std::to_string(v.size()) + " entries for " +
                                      std::to_string(hp.n_layers) + " layers (num_hidden_layers)");
    for (size_t l = 0; l < v.size(); ++l) {
      const std::string kind = v[l].is_string() ? v[l].get<std::string>() : v[l].dump();
      if (kind != "sliding_attention" && kind != "full_attention")
        return c.err("layer_types", "[" + std::to_string(l) + "] = \"" + kind +
                                        "\" is not supported (sliding_attention, full_attention)");
      sliding[l] = kind == "sliding_attention";
    }
  } else {
    for (int l = 0; l < hp.n_layers; ++l) sliding[size_t(l)] = (l + 1) % 2 == 1;
  }
  bool any = false;
  for (bool s : sliding) any |= s;
  if (!any) return {};
  if (c.j.contains("sliding_window") && c.j.at("sliding_window").is_null())
    return c.err("sliding_window", "is null, but layer_types has sliding_attention layers");
  TS_ASSIGN(int window, c.integer_or("sliding_window", 128));
  for (int l = 0; l < hp.n_layers; ++l)
    hp.layer_window[size_t(l)] = sliding[size_t(l)] ? window : 0;
  return {};
}

Status parse_gpt_oss(const ConfigReader& c, HParams& hp) {
  if (c.has("quantization_config"))
    return c.err("quantization_config",
                 "is set; quantized gpt-oss checkpoints (MXFP4) are not supported yet (use a "
                 "BF16 or F32 one)");
  TS_TRY(read_expert_counts(c, hp, "num_local_experts"));
  TS_ASSIGN(hp.d_expert, c.integer("intermediate_size"));
  hp.router.scoring = ScoreFn::kTopkSoftmax;
  hp.router.logit_bias = true;
  TS_ASSIGN(bool bias, c.boolean_or("attention_bias", true));
  hp.qkv_bias = hp.o_bias = bias;
  hp.attention_sinks = true;
  TS_TRY(read_layer_types(c, hp));
  TS_ASSIGN(double limit, c.number_or("swiglu_limit", kSwigluLimit));
  if (limit != kSwigluLimit)
    return c.err("swiglu_limit", "= " + std::to_string(limit) +
                                     " is not supported (transformers clamps at 7.0 whatever "
                                     "the config says)");
  hp.expert_bias = true;
  hp.expert_act = {.kind = ExpertAct::kClampedSwiglu, .limit = kSwigluLimit, .alpha = kSwigluAlpha};
  return {};
}

constexpr std::string_view kTypes[] = {"gpt_oss"};
constexpr StackedExperts kStacked{.gate_up = "gate_up_proj",
                                  .gate_up_bias = "gate_up_proj_bias",
                                  .down = "down_proj",
                                  .down_bias = "down_proj_bias"};

}  // namespace

extern const FamilyDef kGptOssFamily{.name = "gpt_oss",
                                     .model_types = kTypes,
                                     .family = Family::kGptOss,
                                     .names = {.router = "router", .stacked = &kStacked},
                                     .parse = parse_gpt_oss};

}  // namespace ts::model
