// The families after the Llama-style four: config keys -> specs (MLA, sigmoid routing, groups,
// partial / interleaved RoPE, YaRN), the router's spec rules against a direct reference, the
// tensor table of an MLA model, and bad input naming the key or the tensor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "backend/cpu/ops.h"
#include "core/thread_pool.h"
#include "io/safetensors.h"
#include "model/hparams.h"
#include "model/router.h"
#include "model/tensor_specs.h"
#include "model/weights.h"
#include "test_data.h"

namespace {

using ts::model::parse_hparams;

std::string deepseek_v3(const std::string& extra) {
  return R"({"model_type":"deepseek_v3","hidden_size":64,"num_hidden_layers":3,
    "num_attention_heads":4,"vocab_size":256,"n_routed_experts":16,"num_experts_per_tok":4,
    "moe_intermediate_size":32,"intermediate_size":96,"q_lora_rank":24,"kv_lora_rank":32,
    "qk_nope_head_dim":16,"qk_rope_head_dim":8,"v_head_dim":12,"n_group":4,"topk_group":2,
    "first_k_dense_replace":1,"n_shared_experts":1,"routed_scaling_factor":2.5)" +
         extra + "}";
}

TEST(Families, DeepseekV3ConfigGivesMlaAndTheSigmoidRouter) {
  auto r = parse_hparams(deepseek_v3(""), "v3.json");
  ASSERT_TRUE(r.ok()) << r.error().message;
  const auto& hp = r.value();
  EXPECT_EQ(hp.attention, ts::model::AttentionKind::kMla);
  EXPECT_EQ(hp.mla.q_lora_rank, 24);
  EXPECT_EQ(hp.cache_row(), 32 + 8);  // the latent and the one rotary key
  EXPECT_EQ(hp.q_dim(), 4 * 24);
  EXPECT_EQ(hp.attn_out_dim(), 4 * 12);
  EXPECT_EQ(hp.rope.dim, 8);
  EXPECT_EQ(hp.rope.layout, ts::model::RopeLayout::kInterleaved);  // rope_interleave default
  EXPECT_EQ(hp.router.scoring, ts::model::ScoreFn::kSigmoid);
  EXPECT_TRUE(hp.router.correction_bias);
  EXPECT_EQ(hp.router.n_group, 4);
  EXPECT_EQ(hp.router.topk_group, 2);
  EXPECT_TRUE(hp.router.renormalize);
  EXPECT_EQ(hp.router.scale, 2.5f);
  EXPECT_EQ(hp.d_shared, 32);
  EXPECT_EQ(hp.layer_is_moe, (std::vector<bool>{false, true, true}));
  EXPECT_FLOAT_EQ(hp.attn_scale, 1.0f / std::sqrt(24.0f));
  // kimi_k2 configs are the same architecture.
  std::string kimi = deepseek_v3("");
  kimi.replace(kimi.find("deepseek_v3"), 11, "kimi_k2");
  auto k = parse_hparams(kimi, "kimi.json");
  ASSERT_TRUE(k.ok()) << k.error().message;
  EXPECT_EQ(k.value().family, ts::model::Family::kDeepseekV3);
}

// YaRN as transformers computes it (modeling_rope_utils._compute_yarn_parameters), written
// out here in double for a DeepSeek-V2-Lite-like rope: factor 40, mscale 0.707 both ways.
TEST(Families, YarnFrequenciesAndMlaSoftmaxScale) {
  auto r = parse_hparams(deepseek_v3(R"(,"rope_scaling":{"type":"yarn","factor":40,
      "original_max_position_embeddings":4096,"beta_fast":32,"beta_slow":1,"mscale":0.707,
      "mscale_all_dim":0.707},"rope_theta":10000)"),
                         "yarn.json");
  ASSERT_TRUE(r.ok()) << r.error().message;
  const auto& hp = r.value();
  ASSERT_TRUE(hp.rope.yarn);
  const int dim = 8;
  auto corr = [&](double rot) {
    return dim * std::log(4096 / (rot * 2 * M_PI)) / (2 * std::log(10000.0));
  };
  double low = std::max(std::floor(corr(32)), 0.0), high = std::min(std::ceil(corr(1)), dim - 1.0);
  if (low == high) high += 0.001;
  ASSERT_EQ(hp.rope.inv_freq.size(), size_t(dim / 2));
  for (int i = 0; i < dim / 2; ++i) {
    const double pf = std::pow(10000.0, 2.0 * i / dim);
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double want = 1 / (40 * pf) * ramp + 1 / pf * (1 - ramp);
    EXPECT_NEAR(hp.rope.inv_freq[size_t(i)], want, 1e-6 * want) << i;
  }
  // mscale == mscale_all_dim: cos/sin unscaled, the softmax scale times mscale^2.
  EXPECT_FLOAT_EQ(hp.rope.attention_factor, 1.0f);
  const double m = 0.1 * 0.707 * std::log(40.0) + 1;
  EXPECT_NEAR(hp.attn_scale, m * m / std::sqrt(24.0), 1e-7);
}

TEST(Families, GlmAndMinimaxRopeWidths) {
  const std::string glm = R"({"model_type":"glm4_moe","hidden_size":64,"num_hidden_layers":2,
    "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"vocab_size":256,
    "n_routed_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":16,
    "intermediate_size":64,"use_qk_norm":true,"attention_bias":true)";
  auto g = parse_hparams(glm + "}", "glm.json");
  ASSERT_TRUE(g.ok()) << g.error().message;
  EXPECT_EQ(g.value().rope.dim, 16);  // partial_rotary_factor 0.5 when absent
  EXPECT_EQ(g.value().rope.layout, ts::model::RopeLayout::kHalf);
  EXPECT_EQ(g.value().qk_norm, ts::model::QkNorm::kPerHead);
  auto g2 = parse_hparams(glm + R"(,"partial_rotary_factor":0.25})", "glm.json");
  ASSERT_TRUE(g2.ok()) << g2.error().message;
  EXPECT_EQ(g2.value().rope.dim, 8);
  const std::string mm = R"({"model_type":"minimax_m2","hidden_size":64,"num_hidden_layers":2,
    "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"vocab_size":256,
    "num_local_experts":8,"num_experts_per_tok":2,"intermediate_size":16,"rotary_dim":8})";
  auto m = parse_hparams(mm, "mm.json");
  ASSERT_TRUE(m.ok()) << m.error().message;
  EXPECT_EQ(m.value().rope.dim, 8);
  EXPECT_EQ(m.value().qk_norm, ts::model::QkNorm::kFullProjection);
  EXPECT_EQ(m.value().router.scoring, ts::model::ScoreFn::kSigmoid);
}

// A 3-layer qwen3_next config with `extra` keys spliced in.
std::string qwen3_next(const std::string& extra) {
  return R"({"model_type":"qwen3_next","hidden_size":64,"num_hidden_layers":3,
    "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":256,
    "num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":16,
    "shared_expert_intermediate_size":32,"linear_num_key_heads":2,"linear_num_value_heads":4,
    "linear_key_head_dim":8,"linear_value_head_dim":8,"linear_conv_kernel_dim":4,
    "partial_rotary_factor":0.25,)" +
         extra + "}";
}

TEST(Families, Qwen3NextLayerScheduleAndDeltaNetShapes) {
  auto hp = parse_hparams(qwen3_next(R"("full_attention_interval":3)"), "c.json");
  ASSERT_TRUE(hp.ok()) << hp.error().message;
  using ts::model::MixerKind;
  EXPECT_EQ(hp->layer_mixer, (std::vector<MixerKind>{MixerKind::kGatedDeltaNet,
                                                      MixerKind::kGatedDeltaNet,
                                                      MixerKind::kAttention}));
  EXPECT_TRUE(hp->attn_output_gate);
  EXPECT_TRUE(hp->norm_plus_one);
  EXPECT_TRUE(hp->deltanet.grouped_projection);
  EXPECT_EQ(hp->deltanet.conv_dim(), 2 * 16 + 32);
  EXPECT_EQ(hp->q_proj_rows(), 2 * 4 * 16);
  EXPECT_EQ(hp->rope.dim, 4);  // a quarter of head_dim turns
}

TEST(Families, BadConfigsNameTheKey) {
  struct BadCase {
    std::string json, key;
  };
  const std::vector<BadCase> cases = {
      {deepseek_v3(R"(,"attention_bias":true)"), "attention_bias"},
      {deepseek_v3("").replace(deepseek_v3("").find("\"n_group\":4"), 11, "\"n_group\":5"),
       "n_group"},
      {deepseek_v3("").replace(deepseek_v3("").find("\"topk_group\":2"), 14, "\"topk_group\":9"),
       "topk_group"},
      {deepseek_v3(R"(,"qk_rope_head_dim":7)")
           .replace(deepseek_v3("").find("\"qk_rope_head_dim\":8,"), 21, ""),
       "qk_rope_head_dim"},
      {deepseek_v3(R"(,"routed_scaling_factor":-1)")
           .replace(deepseek_v3("").find("\"routed_scaling_factor\":2.5"), 27, "\"x\":0"),
       "routed_scaling_factor"},
      {R"({"model_type":"deepseek_v2","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,
          "vocab_size":256,"n_routed_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":16,
          "kv_lora_rank":16,"qk_nope_head_dim":8,"qk_rope_head_dim":8,"v_head_dim":8,
          "topk_method":"noaux"})",
       "topk_method"},
      {R"({"model_type":"gpt_oss","hidden_size":64})", "deepseek_v3"},  // names the supported list
      {qwen3_next(R"("layer_types":["linear_attention","full_attention"])"), "layer_types"},
      {qwen3_next(R"("layer_types":["linear_attention","full_attention","sliding_attention"])"),
       "sliding_attention"},
      {qwen3_next(R"("layer_types":["full_attention","full_attention","full_attention"],
                     "linear_num_value_heads":5)"),
       "linear_num_value_heads"},
  };
  for (const BadCase& c : cases) {
    auto r = parse_hparams(c.json, "dir/config.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_NE(r.error().message.find(c.key), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find("dir/config.json"), std::string::npos) << r.error().message;
  }
}

// The reference rule written out plainly, in double: scores, biased choice, group mask,
// ranking (ties to the lower id), weights.
struct Ref {
  std::vector<int> ids;
  std::vector<double> w;
};
Ref reference_route(const std::vector<float>& logits, const std::vector<float>& bias,
                    const ts::model::RouterSpec& s, int k) {
  const int n = int(logits.size());
  std::vector<double> p(static_cast<size_t>(n)), choice(static_cast<size_t>(n));
  if (s.scoring == ts::model::ScoreFn::kSoftmax) {
    double mx = *std::max_element(logits.begin(), logits.end()), sum = 0;
    for (int i = 0; i < n; ++i) sum += p[size_t(i)] = std::exp(double(logits[size_t(i)]) - mx);
    for (double& v : p) v /= sum;
  } else {
    for (int i = 0; i < n; ++i) p[size_t(i)] = 1 / (1 + std::exp(-double(logits[size_t(i)])));
  }
  for (int i = 0; i < n; ++i)
    choice[size_t(i)] = p[size_t(i)] + (s.correction_bias ? bias[size_t(i)] : 0);
  std::vector<bool> eligible(size_t(n), true);
  if (s.n_group > 1) {
    const int gs = n / s.n_group;
    std::vector<std::pair<double, int>> groups;
    for (int g = 0; g < s.n_group; ++g) {
      std::vector<double> v(choice.begin() + g * gs, choice.begin() + (g + 1) * gs);
      std::sort(v.rbegin(), v.rend());
      groups.push_back({s.group_score == ts::model::GroupScore::kMax ? v[0] : v[0] + v[1], g});
    }
    std::sort(groups.begin(), groups.end(), [](auto a, auto b) { return a.first > b.first; });
    std::fill(eligible.begin(), eligible.end(), false);
    for (int r = 0; r < s.topk_group; ++r)
      for (int i = 0; i < gs; ++i) eligible[size_t(groups[size_t(r)].second * gs + i)] = true;
  }
  std::vector<int> order;
  for (int i = 0; i < n; ++i)
    if (eligible[size_t(i)]) order.push_back(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return choice[size_t(a)] > choice[size_t(b)]; });
  Ref out;
  double sum = 0;
  for (int r = 0; r < k; ++r) {
    out.ids.push_back(order[size_t(r)]);
    out.w.push_back(p[size_t(order[size_t(r)])]);
    sum += out.w.back();
  }
  for (double& v : out.w) v = (s.renormalize ? v / sum : v) * s.scale;
  return out;
}

TEST(Router, EverySpecMatchesTheReferenceRule) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.0f, 1.5f);
  using ts::model::GroupScore;
  using ts::model::ScoreFn;
  const std::vector<ts::model::RouterSpec> specs = {
      {.scoring = ScoreFn::kSigmoid,
       .correction_bias = true,
       .n_group = 8,
       .topk_group = 3,
       .renormalize = true,
       .scale = 2.5f},                                                               // DeepSeek-V3
      {.scoring = ScoreFn::kSigmoid, .correction_bias = true, .renormalize = true},  // MiniMax-M2
      {.scoring = ScoreFn::kSoftmax,
       .n_group = 4,
       .topk_group = 2,
       .group_score = GroupScore::kMax,
       .scale = 1.5f},  // DeepSeek-V2 group_limited_greedy
      {.scoring = ScoreFn::kSigmoid,
       .correction_bias = true,
       .n_group = 4,
       .topk_group = 1,
       .renormalize = false},
  };
  int group_changed = 0;
  for (const auto& s : specs)
    for (int trial = 0; trial < 200; ++trial) {
      const int n = 32, k = 6;
      std::vector<float> logits(n), bias(n);
      for (float& v : logits) v = nd(rng);
      for (float& v : bias) v = 0.3f * nd(rng);
      std::vector<int> ids(k);
      std::vector<float> w(k);
      ts::model::select_experts(logits, bias, s, {.ids = ids, .weights = w});
      const Ref want = reference_route(logits, bias, s, k);
      ASSERT_EQ(ids, want.ids) << "spec " << (&s - specs.data()) << " trial " << trial;
      for (int r = 0; r < k; ++r) EXPECT_NEAR(w[size_t(r)], want.w[size_t(r)], 1e-6 * s.scale);
      if (s.n_group > 1) {
        auto flat = s;
        flat.n_group = flat.topk_group = 1;
        if (reference_route(logits, bias, flat, k).ids != want.ids) ++group_changed;
      }
    }
  EXPECT_GT(group_changed, 100);  // the groups decided the selection in many trials
}

// The correction bias chooses, but never weighs: a large bias on one expert makes it rank
// first while its weight stays its unbiased sigmoid (renormalised).
TEST(Router, CorrectionBiasSelectsButDoesNotWeigh) {
  std::vector<float> logits = {2.0f, 1.0f, -3.0f, 0.5f};
  std::vector<float> bias = {0.0f, 0.0f, 5.0f, 0.0f};
  std::vector<int> ids(2);
  std::vector<float> w(2);
  ts::model::select_experts(
      logits, bias,
      {.scoring = ts::model::ScoreFn::kSigmoid, .correction_bias = true, .renormalize = true},
      {.ids = ids, .weights = w});
  EXPECT_EQ(ids, (std::vector<int>{2, 0}));
  const float s2 = 1 / (1 + std::exp(3.0f)), s0 = 1 / (1 + std::exp(-2.0f));
  EXPECT_NEAR(w[0], s2 / (s2 + s0), 1e-6);
  EXPECT_NEAR(w[1], s0 / (s2 + s0), 1e-6);
}

TEST(Ops, RopePartialAndInterleavedTurnTheirPairs) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int stride = 12, offset = 2, dim = 6, heads = 2, pos = 17;
  std::vector<float> inv = {1.0f, 0.1f, 0.01f};
  for (bool interleaved : {false, true}) {
    std::vector<float> x(size_t(heads * stride));
    for (float& v : x) v = nd(rng);
    std::vector<float> y = x;
    ts::cpu::rope_apply(y.data(), heads,
                        {.head_stride = stride,
                         .offset = offset,
                         .dim = dim,
                         .interleaved = interleaved,
                         .attention_factor = 0.5f,
                         .inv_freq = inv},
                        pos);
    for (int h = 0; h < heads; ++h) {
      const float* xh = x.data() + h * stride;
      const float* yh = y.data() + h * stride;
      std::vector<bool> turned(size_t(stride), false);
      for (int i = 0; i < dim / 2; ++i) {
        const int a = offset + (interleaved ? 2 * i : i),
                  b = offset + (interleaved ? 2 * i + 1 : i + dim / 2);
        const double ang = pos * double(inv[size_t(i)]), c = 0.5 * std::cos(ang),
                     s = 0.5 * std::sin(ang);
        EXPECT_NEAR(yh[a], xh[a] * c - xh[b] * s, 1e-5);
        EXPECT_NEAR(yh[b], xh[b] * c + xh[a] * s, 1e-5);
        turned[size_t(a)] = turned[size_t(b)] = true;
      }
      for (int i = 0; i < stride; ++i)
        if (!turned[size_t(i)]) {
          EXPECT_EQ(yh[i], xh[i]) << "dim " << i << " must not turn";
        }
    }
  }
}

// MLA's absorbed attention against the expanded form transformers computes: K_nope and V from
// W_UK / W_UV times each cached latent, then plain causal softmax attention per head.
TEST(Ops, MlaAbsorbedAttentionEqualsTheExpandedForm) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int H = 3, nope = 8, rope = 4, v = 6, r = 10, T = 5, pos0 = 2;
  const int qk = nope + rope, row = r + rope, n_keys = pos0 + T;
  std::vector<float> kv_b(size_t(H * (nope + v) * r)), q(size_t(T * H * qk)),
      cache(size_t(n_keys * row));
  for (auto* vec : {&kv_b, &q, &cache})
    for (float& x : *vec) x = nd(rng);
  std::vector<float> out(size_t(T * H * v), NAN);
  ts::ThreadPool pool(2);
  const float scale = 0.3f;
  ts::cpu::mla_attention(pool, {.q = q.data(),
                                .cache = cache.data(),
                                .kv_b = kv_b.data(),
                                .kv_b_dtype = ts::DType::kF32,
                                .out = out.data(),
                                .n_tokens = T,
                                .pos0 = pos0,
                                .n_heads = H,
                                .nope_dim = nope,
                                .rope_dim = rope,
                                .v_dim = v,
                                .kv_lora_rank = r,
                                .scale = scale});
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      const int keys = pos0 + t + 1;
      std::vector<double> s(static_cast<size_t>(keys));
      double mx = -1e300;
      for (int j = 0; j < keys; ++j) {
        double dot = 0;
        for (int i = 0; i < nope; ++i) {  // k_nope[i] = W_UK_h[i] . c_j
          double k = 0;
          for (int d = 0; d < r; ++d)
            k += kv_b[size_t((h * (nope + v) + i) * r + d)] * cache[size_t(j * row + d)];
          dot += q[size_t((t * H + h) * qk + i)] * k;
        }
        for (int i = 0; i < rope; ++i)
          dot += q[size_t((t * H + h) * qk + nope + i)] * cache[size_t(j * row + r + i)];
        s[size_t(j)] = dot * scale;
        mx = std::max(mx, s[size_t(j)]);
      }
      double sum = 0;
      for (double& x : s) sum += x = std::exp(x - mx);
      for (int i = 0; i < v; ++i) {
        double o = 0;
        for (int j = 0; j < keys; ++j) {
          double vj = 0;
          for (int d = 0; d < r; ++d)
            vj += kv_b[size_t((h * (nope + v) + nope + i) * r + d)] * cache[size_t(j * row + d)];
          o += s[size_t(j)] / sum * vj;
        }
        EXPECT_NEAR(out[size_t((t * H + h) * v + i)], o, 1e-4 * (1 + std::fabs(o)));
      }
    }
}

// The MLA table names every tensor; a missing correction bias names itself.
TEST(Families, MissingTensorsNameThemselves) {
  const auto dir = ts_test::data_dir() / "models" / "deepseek_v3";
  auto hp = ts::model::load_hparams(dir.string());
  ASSERT_TRUE(hp.ok()) << hp.error().message;
  int mla = 0, bias = 0;
  for (const auto& t : ts::model::checkpoint_tensors(hp.value())) {
    mla += t.name.find("kv_b_proj") != std::string::npos;
    bias += t.name.find("e_score_correction_bias") != std::string::npos;
  }
  EXPECT_EQ(mla, hp.value().n_layers);
  EXPECT_EQ(bias, 2);  // the MoE layers (first_k_dense_replace 2 of 4)
  auto set = ts::io::TensorSet::open_dir(dir.string());
  ASSERT_TRUE(set.ok()) << set.error().message;
  // Drop one tensor by reading the checkpoint into a copy without it.
  ts_test::TempDir tmp("ts_families");
  std::vector<ts::io::TensorToWrite> keep;
  for (const auto& [name, v] : set.value()->tensors())
    if (name != "model.layers.3.mlp.gate.e_score_correction_bias")
      keep.push_back({name, v.dtype, v.shape, v.data, v.n_bytes});
  ASSERT_TRUE(ts::io::write_safetensors(tmp.file("model.safetensors"), keep).ok());
  std::filesystem::copy_file(dir / "config.json", tmp.file("config.json"));
  auto cut = ts::io::TensorSet::open_dir(tmp.path().string());
  ASSERT_TRUE(cut.ok()) << cut.error().message;
  auto b = ts::model::bind_weights(hp.value(), *cut.value());
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.error().message.find("model.layers.3.mlp.gate.e_score_correction_bias"),
            std::string::npos)
      << b.error().message;
}

}  // namespace
