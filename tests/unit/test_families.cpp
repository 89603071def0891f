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
#include "model/stacked_experts.h"
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
      {R"({"model_type":"llama4","hidden_size":64})", "gpt_oss"},  // names the supported list
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
  } else if (s.scoring == ts::model::ScoreFn::kTopkSoftmax) {
    for (int i = 0; i < n; ++i) p[size_t(i)] = logits[size_t(i)];  // weighed after the choice
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
  }
  if (s.scoring == ts::model::ScoreFn::kTopkSoftmax) {  // softmax over the k winners' logits
    double z = 0;
    for (double v : out.w) z += std::exp(v);
    for (double& v : out.w) v = std::exp(v) / z;
  }
  for (double v : out.w) sum += v;
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
       .scale = 1.5f},                                         // DeepSeek-V2 group_limited_greedy
      {.scoring = ScoreFn::kTopkSoftmax, .logit_bias = true},  // gpt-oss
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

// gpt-oss: the fixture's config gives sinks, windows by layer_types, the biases, the router
// rule, the clamped SwiGLU and transformers' YaRN (truncate absent: true).
TEST(Families, GptOssConfigGivesSinksWindowsBiasesAndItsRouter) {
  auto r = ts::model::load_hparams((ts_test::data_dir() / "models" / "gpt_oss").string());
  ASSERT_TRUE(r.ok()) << r.error().message;
  const auto& hp = r.value();
  EXPECT_EQ(hp.family, ts::model::Family::kGptOss);
  EXPECT_EQ(hp.layer_window, (std::vector<int>{6, 0, 6}));
  EXPECT_TRUE(hp.attention_sinks);
  EXPECT_TRUE(hp.qkv_bias);
  EXPECT_TRUE(hp.o_bias);
  EXPECT_EQ(hp.router.scoring, ts::model::ScoreFn::kTopkSoftmax);
  EXPECT_TRUE(hp.router.logit_bias);
  EXPECT_FALSE(hp.router.renormalize);
  EXPECT_TRUE(hp.expert_bias);
  EXPECT_EQ(hp.expert_act.kind, ts::model::ExpertAct::kClampedSwiglu);
  EXPECT_EQ(hp.expert_act.limit, 7.0f);
  EXPECT_EQ(hp.expert_act.alpha, 1.702f);
  EXPECT_EQ(hp.d_expert, 64);
  EXPECT_EQ(hp.n_experts, 16);
  EXPECT_TRUE(hp.rope.yarn);
  EXPECT_EQ(hp.rope.layout, ts::model::RopeLayout::kHalf);
  EXPECT_EQ(hp.rope.theta, 150000.0f);
  EXPECT_FLOAT_EQ(hp.rope.attention_factor, float(0.1 * std::log(32.0) + 1.0));
  // Without layer_types, transformers' default: even layers slide (sliding_window 128 when absent).
  auto d = parse_hparams(R"({"model_type":"gpt_oss","hidden_size":64,"num_hidden_layers":4,
      "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":64,
      "num_local_experts":4,"num_experts_per_tok":2,"intermediate_size":32})",
                         "d.json");
  ASSERT_TRUE(d.ok()) << d.error().message;
  EXPECT_EQ(d.value().layer_window, (std::vector<int>{128, 0, 128, 0}));
}

std::string gpt_oss(const std::string& extra) {
  return R"({"model_type":"gpt_oss","hidden_size":64,"num_hidden_layers":3,
    "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":64,
    "num_local_experts":4,"num_experts_per_tok":2,"intermediate_size":32,"sliding_window":8)" +
         extra + "}";
}

TEST(Families, GptOssBadConfigsNameTheKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {gpt_oss(R"(,"layer_types":["sliding_attention","full_attention"])"), "layer_types"},
      {gpt_oss(R"(,"layer_types":["sliding_attention","full_attention","chunked_attention"])"),
       "chunked_attention"},
      {gpt_oss(R"(,"layer_types":"sliding_attention")"), "layer_types"},
      {gpt_oss(R"(,"layer_types":["sliding_attention",1,"full_attention"])"), "layer_types"},
      {gpt_oss(R"(,"swiglu_limit":8.0)"), "swiglu_limit"},
      {gpt_oss(R"(,"quantization_config":{"quant_method":"mxfp4"})"), "quantization_config"},
      {gpt_oss("").replace(gpt_oss("").find("\"sliding_window\":8"), 18, "\"sliding_window\":null"),
       "sliding_window"},
      {gpt_oss("").replace(gpt_oss("").find("\"sliding_window\":8"), 18, "\"sliding_window\":0"),
       "sliding_window"},
  };
  for (const auto& [json, key] : cases) {
    auto r = parse_hparams(json, "dir/config.json");
    ASSERT_FALSE(r.ok()) << json;
    EXPECT_NE(r.error().message.find(key), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find("dir/config.json"), std::string::npos) << r.error().message;
  }
  // Full attention everywhere needs no window.
  auto full = parse_hparams(
      gpt_oss(R"(,"layer_types":["full_attention","full_attention","full_attention"])")
          .replace(gpt_oss("").find("\"sliding_window\":8"), 18, "\"sliding_window\":null"),
      "full.json");
  ASSERT_TRUE(full.ok()) << full.error().message;
  EXPECT_EQ(full.value().layer_window, (std::vector<int>{0, 0, 0}));
}

// gpt-oss's router: the top_k logits win and their weights are a softmax over those k alone,
// not the full softmax's probabilities (which here sum to less than 1).
TEST(Router, TopkSoftmaxWeighsOnlyTheChosenLogits) {
  std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.0f, 2.5f};
  std::vector<int> ids(2);
  std::vector<float> w(2);
  ts::model::select_experts(logits, {}, {.scoring = ts::model::ScoreFn::kTopkSoftmax},
                            {.ids = ids, .weights = w});
  EXPECT_EQ(ids, (std::vector<int>{1, 4}));
  const double e = std::exp(-0.5);
  EXPECT_NEAR(w[0], 1 / (1 + e), 1e-7);
  EXPECT_NEAR(w[1], e / (1 + e), 1e-7);
}

// Attention with sinks and a sliding window against the rule written out in double: the
// query at p sees keys j <= p with p - j < window, and each head's sink joins the softmax
// denominator only. Random inputs, several windows (one wider than the context).
TEST(Ops, AttentionSinksAndSlidingWindowMatchTheRule) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int H = 4, KV = 2, D = 8, T = 11, pos0 = 3, keys = pos0 + T;
  std::vector<float> q(size_t(T * H * D)), k(size_t(keys * KV * D)), v(k.size()), sinks(H);
  for (auto* x : {&q, &k, &v, &sinks})
    for (float& f : *x) f = 1.5f * nd(rng);
  ts::ThreadPool pool(2);
  for (int window : {0, 1, 4, 5, 40}) {
    for (bool with_sinks : {false, true}) {
      std::vector<float> out(q.size(), NAN);
      ts::cpu::attention(
          pool, {.q = q.data(),
                 .k_cache = k.data(),
                 .v_cache = v.data(),
                 .rows = {},
                 .out = out.data(),
                 .n_tokens = T,
                 .pos0 = pos0,
                 .n_heads = H,
                 .n_kv_heads = KV,
                 .head_dim = D,
                 .scale = 0.35f,
                 .window = window,
                 .sinks = with_sinks ? std::span<const float>(sinks) : std::span<const float>()});
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) {
          const int p = pos0 + t, g = h / (H / KV);
          std::vector<double> s;
          std::vector<int> seen;
          for (int j = 0; j <= p; ++j) {
            if (window > 0 && !(p - j < window)) continue;
            double dot = 0;
            for (int i = 0; i < D; ++i)
              dot += double(q[size_t((t * H + h) * D + i)]) * k[size_t((j * KV + g) * D + i)];
            s.push_back(dot * 0.35);
            seen.push_back(j);
          }
          double mx = with_sinks ? sinks[size_t(h)] : -INFINITY;
          for (double x : s) mx = std::max(mx, x);
          double z = with_sinks ? std::exp(sinks[size_t(h)] - mx) : 0;
          for (double x : s) z += std::exp(x - mx);
          for (int i = 0; i < D; ++i) {
            double o = 0;
            for (size_t m = 0; m < s.size(); ++m)
              o += std::exp(s[m] - mx) / z * v[size_t((seen[m] * KV + g) * D + i)];
            EXPECT_NEAR(out[size_t((t * H + h) * D + i)], o, 2e-5 * (1 + std::fabs(o)))
                << "window " << window << (with_sinks ? " sinks" : "") << " t " << t << " h " << h;
          }
        }
    }
  }
}

// The clamped SwiGLU at and past its limits, against transformers' _apply_gate in double:
// the gate is clamped from above only, up on both sides, and up + 1 multiplies.
TEST(Ops, ClampedSwigluAtAndPastItsLimits) {
  const std::vector<float> g = {-20.0f, -8.0f, -7.0f, -1.0f, 0.0f, 0.5f, 6.99f, 7.0f, 7.5f, 30.0f};
  const std::vector<float> u = {-30.0f, -7.5f, -7.0f, -1.0f, 0.0f, 2.0f, 6.99f, 7.0f, 9.0f, -9.0f};
  for (float ui : u) {
    std::vector<float> us(g.size(), ui), h(g.size());
    ts::cpu::clamped_swiglu(g.data(), us.data(), h.data(), int64_t(g.size()), 7.0f, 1.702f);
    for (size_t i = 0; i < g.size(); ++i) {
      const double gate = std::min(double(g[i]), 7.0), up = std::clamp(double(ui), -7.0, 7.0);
      const double want = (up + 1) * gate / (1 + std::exp(-1.702 * gate));
      EXPECT_NEAR(h[i], want, 1e-6 * (1e-3 + std::fabs(want))) << "g " << g[i] << " u " << ui;
    }
  }
}

// gpt-oss's Hub layout: each layer's experts in stacked tensors, gate and up interleaved by
// column, stored for x @ W. Distinct values everywhere show that every per-expert view holds
// the columns the rule says, transposed; the stacked names leave the set; and bad tensors are
// errors naming them.
TEST(Families, GptOssStackedExpertsSplitByColumnParity) {
  auto hp = parse_hparams(R"({"model_type":"gpt_oss","hidden_size":4,"num_hidden_layers":1,
      "num_attention_heads":2,"num_key_value_heads":1,"head_dim":2,"vocab_size":8,
      "num_local_experts":2,"num_experts_per_tok":1,"intermediate_size":3,
      "layer_types":["full_attention"]})",
                          "tiny.json");
  ASSERT_TRUE(hp.ok()) << hp.error().message;
  const int E = 2, d = 4, ff = 3;
  std::vector<float> gu(size_t(E * d * 2 * ff)), gub(size_t(E * 2 * ff)), dn(size_t(E * ff * d)),
      dnb(size_t(E * d));
  for (size_t i = 0; i < gu.size(); ++i) gu[i] = float(i) + 0.25f;
  for (size_t i = 0; i < gub.size(); ++i) gub[i] = -float(i) - 0.5f;
  for (size_t i = 0; i < dn.size(); ++i) dn[i] = 1000.0f + float(i);
  for (size_t i = 0; i < dnb.size(); ++i) dnb[i] = 2000.0f + float(i);
  const std::string p = "model.layers.0.mlp.experts.";
  auto write = [&](const ts_test::TempDir& dir, bool short_down, bool no_gate_up_bias) {
    std::vector<ts::io::TensorToWrite> t = {
        {p + "gate_up_proj", ts::DType::kF32, {E, d, 2 * ff}, gu.data(), gu.size() * 4},
        {p + "down_proj",
         ts::DType::kF32,
         {E, short_down ? ff - 1 : ff, d},
         dn.data(),
         size_t(E * (short_down ? ff - 1 : ff) * d) * 4},
        {p + "down_proj_bias", ts::DType::kF32, {E, d}, dnb.data(), dnb.size() * 4}};
    if (!no_gate_up_bias)
      t.push_back(
          {p + "gate_up_proj_bias", ts::DType::kF32, {E, 2 * ff}, gub.data(), gub.size() * 4});
    EXPECT_TRUE(ts::io::write_safetensors(dir.file("model.safetensors"), t).ok());
    auto set = ts::io::TensorSet::open_dir(dir.path().string());
    EXPECT_TRUE(set.ok()) << set.error().message;
    return std::move(set.value());
  };
  ts_test::TempDir tmp("ts_gptoss");
  auto set = write(tmp, false, false);
  auto note = ts::model::unstack_experts(hp.value(), *set);
  ASSERT_TRUE(note.ok()) << note.error().message;
  EXPECT_NE(note.value().find("gate_up_proj"), std::string::npos) << note.value();
  auto at = [&](const std::string& name) {
    const ts::io::TensorView* v = set->find(name);
    EXPECT_NE(v, nullptr) << name;
    return v ? reinterpret_cast<const float*>(v->data) : nullptr;
  };
  for (int e = 0; e < E; ++e) {
    const std::string pe = p + std::to_string(e) + ".";
    const float *gate = at(pe + "gate_proj.weight"), *up = at(pe + "up_proj.weight"),
                *down = at(pe + "down_proj.weight"), *gate_b = at(pe + "gate_proj.bias"),
                *up_b = at(pe + "up_proj.bias"), *down_b = at(pe + "down_proj.bias");
    ASSERT_TRUE(gate && up && down && gate_b && up_b && down_b);
    EXPECT_EQ(set->find(pe + "gate_proj.weight")->shape, (std::vector<int64_t>{ff, d}));
    EXPECT_EQ(set->find(pe + "down_proj.weight")->shape, (std::vector<int64_t>{d, ff}));
    for (int r = 0; r < ff; ++r) {
      for (int i = 0; i < d; ++i) {
        EXPECT_EQ(gate[r * d + i], gu[size_t((e * d + i) * 2 * ff + 2 * r)]) << e << r << i;
        EXPECT_EQ(up[r * d + i], gu[size_t((e * d + i) * 2 * ff + 2 * r + 1)]) << e << r << i;
        EXPECT_EQ(down[i * ff + r], dn[size_t((e * ff + r) * d + i)]) << e << r << i;
      }
      EXPECT_EQ(gate_b[r], gub[size_t(e * 2 * ff + 2 * r)]);
      EXPECT_EQ(up_b[r], gub[size_t(e * 2 * ff + 2 * r + 1)]);
    }
    for (int i = 0; i < d; ++i) EXPECT_EQ(down_b[i], dnb[size_t(e * d + i)]);
  }
  for (const char* stacked : {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"})
    EXPECT_EQ(set->find(p + stacked), nullptr) << stacked;
  // Split once, a set names each expert (as a pack does): nothing more to do.
  auto again = ts::model::unstack_experts(hp.value(), *set);
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_EQ(again.value(), "");

  ts_test::TempDir bad1("ts_gptoss"), bad2("ts_gptoss");
  auto short_down = write(bad1, true, false);
  auto e1 = ts::model::unstack_experts(hp.value(), *short_down);
  ASSERT_FALSE(e1.ok());
  EXPECT_NE(e1.error().message.find("tensor " + p + "down_proj in "), std::string::npos)
      << e1.error().message;
  EXPECT_NE(e1.error().message.find("has shape [2, 2, 4], config.json implies [2, 3, 4]"),
            std::string::npos)
      << e1.error().message;
  auto no_bias = write(bad2, false, true);
  auto e2 = ts::model::unstack_experts(hp.value(), *no_bias);
  ASSERT_FALSE(e2.ok());
  EXPECT_NE(e2.error().message.find(p + "gate_up_proj_bias is missing"), std::string::npos)
      << e2.error().message;
}

// The fixture without one of its sinks, or without a layer's stacked experts: errors naming
// the tensor.
TEST(Families, GptOssMissingTensorsNameThemselves) {
  const auto dir = ts_test::data_dir() / "models" / "gpt_oss";
  auto hp = ts::model::load_hparams(dir.string());
  ASSERT_TRUE(hp.ok()) << hp.error().message;
  for (const std::string cut :
       {"model.layers.1.self_attn.sinks", "model.layers.2.mlp.experts.gate_up_proj",
        "model.layers.0.self_attn.o_proj.bias", "model.layers.2.mlp.router.bias"}) {
    auto set = ts::io::TensorSet::open_dir(dir.string());
    ASSERT_TRUE(set.ok()) << set.error().message;
    set.value()->drop(cut);
    auto note = ts::model::unstack_experts(hp.value(), *set.value());
    std::string msg;
    if (!note.ok()) {
      msg = note.error().message;
    } else {
      auto b = ts::model::bind_weights(hp.value(), *set.value());
      ASSERT_FALSE(b.ok()) << cut;
      msg = b.error().message;
    }
    EXPECT_NE(msg.find("tensor " + cut + " is missing"), std::string::npos) << msg;
  }
}

}  // namespace
