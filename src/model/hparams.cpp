// config.json -> HParams: the keys every family shares, then the family's own parser
// (model/families/), then RoPE. Both rope spellings are accepted: top-level rope_theta /
// rope_scaling (transformers <= 4) and rope_parameters (transformers 5).
#include "model/hparams.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/config_reader.h"
#include "model/families/family.h"

namespace ts::model {
namespace {

using json = nlohmann::json;

// A number inside the rope object `obj` (named `where` in errors), or fallback.
Result<double> rope_number(const ConfigReader& c, const json& obj, const std::string& where,
                           const char* key, double fallback) {
  if (!obj.contains(key) || obj.at(key).is_null()) return fallback;
  if (!obj.at(key).is_number()) return c.err(where + "." + key, "must be a number");
  return obj.at(key).get<double>();
}

// transformers' YaRN (modeling_rope_utils._compute_yarn_parameters): inv_freq blended
// between interpolation and extrapolation over a linear ramp, and the cos/sin factor.
void yarn_frequencies(RopeSpec& r, double factor, double beta_fast, double beta_slow,
                      double original_max, bool truncate, double mscale, double mscale_all_dim,
                      std::optional<double> attention_factor) {
  const int dim = r.dim;
  const double base = r.theta;
  auto get_mscale = [](double scale, double m) {
    return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
  };
  if (attention_factor) {
    r.attention_factor = float(*attention_factor);
  } else if (mscale != 0 && mscale_all_dim != 0) {
    r.attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim));
  } else {
    r.attention_factor = float(get_mscale(factor, 1.0));
  }
  auto correction_dim = [&](double rotations) {
    return (dim * std::log(original_max / (rotations * 2 * M_PI))) / (2 * std::log(base));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, double(dim - 1));
  if (low == high) high += 0.001;  // as transformers: no division by zero
  r.inv_freq.clear();
  for (int i = 0; i < dim / 2; ++i) {
    // pos_freqs = base ** (arange(0, dim, 2) / dim) in float32
    const float pos_freq = std::pow(float(base), float(2 * i) / float(dim));
    const float extrapolation = 1.0f / pos_freq;
    const float interpolation = 1.0f / (float(factor) * pos_freq);
    float ramp = (float(i) - float(low)) / (float(high) - float(low));
    ramp = std::clamp(ramp, 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    r.inv_freq.push_back(interpolation * (1.0f - extrapolation_factor) +
                         extrapolation * extrapolation_factor);
  }
}

// RoPE from either spelling. `base_dim` is the width RoPE applies to before a partial factor
// (head_dim, or MLA's qk_rope_head_dim); hp.rope.dim, when a family set it, is its default.
Status read_rope(const ConfigReader& c, HParams& hp, int base_dim) {
  RopeSpec& r = hp.rope;
  const json* params = nullptr;
  std::string where;
  if (c.has("rope_parameters")) {
    params = &c.j.at("rope_parameters");
    where = "rope_parameters";
    if (!params->is_object()) return c.err(where, "must be an object");
  }
  if (c.has("rope_scaling")) {
    const json& s = c.j.at("rope_scaling");
    if (!s.is_object()) return c.err("rope_scaling", "must be an object");
    if (!params) {
      params = &s;
      where = "rope_scaling";
    }
  }
  std::string type = "default";
  if (params) {
    for (const char* key : {"rope_type", "type"})
      if (params->contains(key) && params->at(key).is_string()) {
        type = params->at(key).get<std::string>();
        break;
      }
  }
  if (type != "default" && type != "yarn")
    return c.err(where + ".rope_type", "= \"" + type + "\" is not supported (default, yarn)");

  std::optional<double> from_params, from_top;
  if (params && params->contains("rope_theta")) {
    TS_ASSIGN(double t, rope_number(c, *params, where, "rope_theta", 0));
    from_params = t;
  }
  if (c.has("rope_theta")) {
    TS_ASSIGN(double t, c.number_or("rope_theta", 0));
    from_top = t;
  }
  if (from_params && from_top && *from_params != *from_top)
    return c.err("rope_theta", "contradicts " + where + ".rope_theta");
  const double theta = from_params ? *from_params : from_top ? *from_top : 10000.0;
  if (!(theta > 1.0) || !std::isfinite(theta))
    return c.err("rope_theta", "must be a finite number > 1");
  r.theta = float(theta);

  std::optional<double> partial;
  if (params && params->contains("partial_rotary_factor")) {
    TS_ASSIGN(double p, rope_number(c, *params, where, "partial_rotary_factor", 1.0));
    partial = p;
  } else if (c.has("partial_rotary_factor")) {
    TS_ASSIGN(double p, c.number_or("partial_rotary_factor", 1.0));
    partial = p;
  }
  if (partial) {
    if (!(*partial > 0 && *partial <= 1))
      return c.err("partial_rotary_factor", "must be in (0, 1]");
    r.dim = int(base_dim * *partial);
  } else if (r.dim == 0) {
    r.dim = base_dim;
  }
  if (r.dim <= 0 || r.dim > base_dim || r.dim % 2)
    return c.err("partial_rotary_factor",
                 "gives " + std::to_string(r.dim) + " rotary dims of " + std::to_string(base_dim) +
                     "; they must be even and at most the head's");

  if (type == "yarn") {
    r.yarn = true;
    TS_ASSIGN(double factor, rope_number(c, *params, where, "factor", 0));
    TS_ASSIGN(double original, rope_number(c, *params, where, "original_max_position_embeddings", 0));
    if (!(original > 0)) return c.err(where + ".original_max_position_embeddings", "is missing");
    if (factor == 0) factor = double(hp.max_positions) / original;
    if (!(factor >= 1) || !std::isfinite(factor)) return c.err(where + ".factor", "must be >= 1");
    TS_ASSIGN(double beta_fast, rope_number(c, *params, where, "beta_fast", 32));
    TS_ASSIGN(double beta_slow, rope_number(c, *params, where, "beta_slow", 1));
    if (beta_fast == 0) beta_fast = 32;  // transformers: `get("beta_fast") or 32`
    if (beta_slow == 0) beta_slow = 1;
    TS_ASSIGN(double mscale, rope_number(c, *params, where, "mscale", 0));
    TS_ASSIGN(double mscale_all_dim, rope_number(c, *params, where, "mscale_all_dim", 0));
    std::optional<double> attention_factor;
    if (params->contains("attention_factor") && !params->at("attention_factor").is_null()) {
      TS_ASSIGN(double a, rope_number(c, *params, where, "attention_factor", 1));
      attention_factor = a;
    }
    bool truncate = true;
    if (params->contains("truncate")) {
      if (!params->at("truncate").is_boolean()) return c.err(where + ".truncate", "must be true or false");
      truncate = params->at("truncate").get<bool>();
    }
    r.factor = float(factor);
    r.mscale_all_dim = float(mscale_all_dim);
    yarn_frequencies(r, factor, beta_fast, beta_slow, original, truncate, mscale, mscale_all_dim,
                     attention_factor);
  } else {
    // transformers: inv_freq = 1 / theta ** (arange(0, dim, 2) / dim), in float32.
    for (int i = 0; i < r.dim / 2; ++i)
      r.inv_freq.push_back(1.0f / std::pow(r.theta, float(2 * i) / float(r.dim)));
  }
  return {};
}

std::string supported_list() {
  std::string out;
  for (const FamilyDef* d : all_families())
    for (std::string_view t : d->model_types) out += (out.empty() ? "" : ", ") + std::string(t);
  return out;
}

}  // namespace

std::string_view family_name(Family f) { return family_def(f).name; }

Result<HParams> parse_hparams(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return make_error(source + ": not valid JSON");
  if (!j.is_object()) return make_error(source + ": expected a JSON object");
  ConfigReader c{j, source};
  HParams hp;
  if (!c.has("model_type") || !j.at("model_type").is_string())
    return c.err("model_type", "is missing");
  hp.model_type = j.at("model_type").get<std::string>();
  const FamilyDef* def = find_family(hp.model_type);
  if (!def)
    return c.err("model_type",
                 "= \"" + hp.model_type + "\" is not supported (" + supported_list() + ")");
  hp.family = def->family;

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
  TS_ASSIGN(double eps, c.number_or("rms_norm_eps", 1e-6));
  if (!(eps > 0)) return c.err("rms_norm_eps", "must be > 0");
  hp.rms_eps = float(eps);
  TS_ASSIGN(hp.tie_word_embeddings, c.boolean_or("tie_word_embeddings", false));
  if (c.has("hidden_act") &&
      !(j.at("hidden_act").is_string() && j.at("hidden_act").get<std::string>() == "silu"))
    return c.err("hidden_act", "= " + j.at("hidden_act").dump() + " is not supported (silu)");

  hp.layer_is_moe.assign(size_t(hp.n_layers), true);
  hp.layer_mixer.assign(size_t(hp.n_layers), MixerKind::kAttention);
  hp.layer_window.assign(size_t(hp.n_layers), 0);
  TS_TRY(def->parse(c, hp));

  const bool mla = hp.attention == AttentionKind::kMla;
  if (!mla && hp.head_dim % 2 != 0) return c.err("head_dim", "must be even for RoPE");
  TS_TRY(read_rope(c, hp, mla ? hp.mla.rope_dim : hp.head_dim));
  if (mla) {
    // DeepSeek's yarn_apply_mscale: the softmax scale grows by mscale(factor, mscale_all_dim)^2.
    double scale = std::pow(double(hp.mla.qk_dim()), -0.5);
    if (hp.rope.yarn && hp.rope.mscale_all_dim != 0 && hp.rope.factor > 1) {
      const double m = 0.1 * hp.rope.mscale_all_dim * std::log(double(hp.rope.factor)) + 1.0;
      scale *= m * m;
    }
    hp.attn_scale = float(scale);
  } else {
    hp.attn_scale = 1.0f / std::sqrt(float(hp.head_dim));
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
