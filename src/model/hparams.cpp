// config.json -> HParams for the four families. Both rope spellings are accepted:
// top-level rope_theta / rope_scaling (transformers <= 4) and rope_parameters (transformers 5).
#include "model/hparams.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace ts::model {
namespace {

using json = nlohmann::json;

struct ConfigReader {
  const json& j;
  const std::string& source;

  Error err(const std::string& key, const std::string& what) const {
    return make_error(source + ": key '" + key + "' " + what);
  }
  bool has(const std::string& key) const { return j.contains(key) && !j.at(key).is_null(); }

  Result<int> integer(const std::string& key) const {
    if (!has(key)) return err(key, "is missing");
    const json& v = j.at(key);
    if (!v.is_number_integer()) return err(key, "must be an integer");
    int64_t x = v.get<int64_t>();
    if (x <= 0 || x > (int64_t(1) << 30)) return err(key, "must be positive, got " + v.dump());
    return int(x);
  }
  Result<int> integer_or(const std::string& key, int fallback) const {
    if (!has(key)) return fallback;
    return integer(key);
  }
  Result<double> number_or(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    const json& v = j.at(key);
    if (!v.is_number()) return err(key, "must be a number");
    return v.get<double>();
  }
  Result<bool> boolean_or(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& v = j.at(key);
    if (!v.is_boolean()) return err(key, "must be true or false");
    return v.get<bool>();
  }
};

// rope theta from either spelling; other rope types than "default" are refused by name.
Result<float> read_rope_theta(const ConfigReader& c) {
  std::optional<double> from_params, from_top;
  if (c.has("rope_parameters")) {
    const json& p = c.j.at("rope_parameters");
    if (!p.is_object()) return c.err("rope_parameters", "must be an object");
    if (p.contains("rope_type") && p.at("rope_type").is_string() &&
        p.at("rope_type").get<std::string>() != "default")
      return c.err("rope_parameters.rope_type",
                   "= " + p.at("rope_type").dump() + " is not supported (only \"default\")");
    if (p.contains("rope_theta")) {
      if (!p.at("rope_theta").is_number())
        return c.err("rope_parameters.rope_theta", "must be a number");
      from_params = p.at("rope_theta").get<double>();
    }
  }
  if (c.has("rope_scaling")) {
    const json& s = c.j.at("rope_scaling");
    std::string type = s.is_object() && s.contains("rope_type") ? s.at("rope_type").dump()
                       : s.is_object() && s.contains("type") ? s.at("type").dump()
                                                             : s.dump();
    if (type != "\"default\"")
      return c.err("rope_scaling", "= " + type + " is not supported (only default RoPE)");
  }
  if (c.has("rope_theta")) {
    TS_ASSIGN(double t, c.number_or("rope_theta", 0));
    from_top = t;
  }
  if (from_params && from_top && *from_params != *from_top)
    return c.err("rope_theta", "contradicts rope_parameters.rope_theta");
  double theta = from_params ? *from_params : from_top ? *from_top : 10000.0;
  if (!(theta > 1.0) || !std::isfinite(theta))
    return c.err("rope_theta", "must be a finite number > 1");
  return float(theta);
}

Result<std::set<int>> read_int_set(const ConfigReader& c, const std::string& key) {
  std::set<int> out;
  if (!c.has(key)) return out;
  const json& v = c.j.at(key);
  if (!v.is_array()) return c.err(key, "must be a list of layer indices");
  for (const json& e : v) {
    if (!e.is_number_integer()) return c.err(key, "must be a list of layer indices");
    out.insert(e.get<int>());
  }
  return out;
}

}  // namespace

std::string_view family_name(Family f) {
  switch (f) {
    case Family::kMixtral: return "mixtral";
    case Family::kQwen2Moe: return "qwen2_moe";
    case Family::kQwen3Moe: return "qwen3_moe";
    case Family::kOlmoe: return "olmoe";
  }
  return "?";
}

Result<HParams> parse_hparams(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return make_error(source + ": not valid JSON");
  if (!j.is_object()) return make_error(source + ": expected a JSON object");
  ConfigReader c{j, source};
  HParams hp;
  if (!c.has("model_type") || !j.at("model_type").is_string())
    return c.err("model_type", "is missing");
  hp.model_type = j.at("model_type").get<std::string>();
  if (hp.model_type == "mixtral") {
    hp.family = Family::kMixtral;
  } else if (hp.model_type == "qwen2_moe") {
    hp.family = Family::kQwen2Moe;
  } else if (hp.model_type == "qwen3_moe") {
    hp.family = Family::kQwen3Moe;
  } else if (hp.model_type == "olmoe") {
    hp.family = Family::kOlmoe;
  } else {
    return c.err("model_type", "= \"" + hp.model_type +
                                   "\" is not supported (mixtral, qwen2_moe, qwen3_moe, olmoe)");
  }

  TS_ASSIGN(hp.d_model, c.integer("hidden_size"));
  TS_ASSIGN(hp.n_layers, c.integer("num_hidden_layers"));
  TS_ASSIGN(hp.n_heads, c.integer("num_attention_heads"));
  TS_ASSIGN(hp.n_kv_heads, c.integer_or("num_key_value_heads", hp.n_heads));
  TS_ASSIGN(hp.vocab, c.integer("vocab_size"));
  TS_ASSIGN(hp.max_positions, c.integer_or("max_position_embeddings", 4096));
  if (c.has("head_dim")) {
    TS_ASSIGN(hp.head_dim, c.integer("head_dim"));
  } else {
    if (hp.d_model % hp.n_heads != 0)
      return c.err("num_attention_heads", "= " + std::to_string(hp.n_heads) +
                                              " does not divide hidden_size = " +
                                              std::to_string(hp.d_model));
    hp.head_dim = hp.d_model / hp.n_heads;
  }
  if (hp.n_heads % hp.n_kv_heads != 0)
    return c.err("num_key_value_heads", "= " + std::to_string(hp.n_kv_heads) +
                                            " does not divide num_attention_heads = " +
                                            std::to_string(hp.n_heads));
  if (hp.head_dim % 2 != 0) return c.err("head_dim", "must be even for RoPE");
  TS_ASSIGN(double eps, c.number_or("rms_norm_eps", 1e-6));
  if (!(eps > 0)) return c.err("rms_norm_eps", "must be > 0");
  hp.rms_eps = float(eps);
  TS_ASSIGN(hp.rope_theta, read_rope_theta(c));
  TS_ASSIGN(hp.tie_word_embeddings, c.boolean_or("tie_word_embeddings", false));
  if (c.has("hidden_act") &&
      !(j.at("hidden_act").is_string() && j.at("hidden_act").get<std::string>() == "silu"))
    return c.err("hidden_act", "= " + j.at("hidden_act").dump() + " is not supported (silu)");

  // Expert counts: "num_local_experts" (mixtral, some qwen3_moe exports) or "num_experts".
  std::string experts_key = c.has("num_local_experts") ? "num_local_experts" : "num_experts";
  TS_ASSIGN(hp.n_experts, c.integer(experts_key));
  TS_ASSIGN(hp.top_k, c.integer("num_experts_per_tok"));
  if (hp.top_k > hp.n_experts)
    return c.err("num_experts_per_tok", "= " + std::to_string(hp.top_k) + " exceeds " +
                                            experts_key + " = " + std::to_string(hp.n_experts));

  hp.layer_is_moe.assign(size_t(hp.n_layers), true);
  switch (hp.family) {
    case Family::kMixtral: {
      TS_ASSIGN(hp.d_expert, c.integer("intermediate_size"));
      hp.moe.renormalize = true;  // Mixtral always renormalises its top-k weights
      if (c.has("sliding_window"))
        return c.err("sliding_window", "is set; sliding-window attention is not supported");
      break;
    }
    case Family::kQwen2Moe:
    case Family::kQwen3Moe: {
      TS_ASSIGN(hp.d_expert, c.integer("moe_intermediate_size"));
      TS_ASSIGN(hp.moe.renormalize, c.boolean_or("norm_topk_prob", false));
      TS_ASSIGN(bool sliding, c.boolean_or("use_sliding_window", false));
      if (sliding) return c.err("use_sliding_window", "is true; not supported");
      TS_ASSIGN(int step, c.integer_or("decoder_sparse_step", 1));
      TS_ASSIGN(std::set<int> dense, read_int_set(c, "mlp_only_layers"));
      for (int l : dense)
        if (l < 0 || l >= hp.n_layers)
          return c.err("mlp_only_layers", "names layer " + std::to_string(l) + " of " +
                                              std::to_string(hp.n_layers));
      bool any_dense = false;
      for (int l = 0; l < hp.n_layers; ++l) {
        hp.layer_is_moe[size_t(l)] = !dense.count(l) && (l + 1) % step == 0;
        any_dense |= !hp.layer_is_moe[size_t(l)];
      }
      if (any_dense) {
        TS_ASSIGN(hp.d_ff, c.integer("intermediate_size"));
      }
      if (hp.family == Family::kQwen2Moe) {
        TS_ASSIGN(hp.d_shared, c.integer("shared_expert_intermediate_size"));
        hp.shared_expert_gate = true;
        TS_ASSIGN(hp.qkv_bias, c.boolean_or("qkv_bias", true));
      } else {
        hp.qk_norm = QkNorm::kPerHead;
        TS_ASSIGN(hp.qkv_bias, c.boolean_or("attention_bias", false));
      }
      break;
    }
    case Family::kOlmoe: {
      TS_ASSIGN(hp.d_expert, c.integer("intermediate_size"));
      TS_ASSIGN(hp.moe.renormalize, c.boolean_or("norm_topk_prob", false));
      TS_ASSIGN(hp.qkv_bias, c.boolean_or("attention_bias", false));
      hp.qk_norm = QkNorm::kFullProjection;
      if (c.has("clip_qkv")) return c.err("clip_qkv", "is set; not supported");
      break;
    }
  }
  return hp;
}

Result<HParams> load_hparams(const std::string& dir) {
  std::string path = dir + "/config.json";
  std::ifstream f(path, std::ios::binary);
  if (!f) return make_error("cannot read " + path + " (is --model a model directory?)");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_hparams(ss.str(), path);
}

}  // namespace ts::model
