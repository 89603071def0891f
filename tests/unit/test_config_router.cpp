// config.json parsing (both rope spellings, family rules, bad keys), the router's top-k /
// renormalisation / rank order, RoPE and RMSNorm against direct formulas.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "backend/cpu/ops.h"
#include "core/dtype.h"
#include "model/hparams.h"
#include "model/router.h"

namespace {

using ts::model::parse_hparams;

std::string qwen2(const std::string& extra) {
  return R"({"model_type":"qwen2_moe","hidden_size":64,"num_hidden_layers":4,
    "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":512,"num_experts":8,
    "num_experts_per_tok":2,"moe_intermediate_size":32,"intermediate_size":160,
    "shared_expert_intermediate_size":96)" + extra + "}";
}

TEST(Config, RopeSpellingsAgree) {
  auto a = parse_hparams(qwen2(R"(,"rope_theta":12345.0)"), "a.json");
  auto b = parse_hparams(qwen2(R"(,"rope_parameters":{"rope_theta":12345.0,"rope_type":"default"})"),
                         "b.json");
  ASSERT_TRUE(a.ok()) << a.error().message;
  ASSERT_TRUE(b.ok()) << b.error().message;
  EXPECT_EQ(a->rope.theta, 12345.0f);
  EXPECT_EQ(b->rope.theta, 12345.0f);
}

TEST(Config, ContradictoryRopeThetaIsAnError) {
  auto r = parse_hparams(qwen2(R"(,"rope_theta":1.0e6,"rope_parameters":{"rope_theta":1.0e4})"),
                         "c.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("rope_theta"), std::string::npos);
  EXPECT_NE(r.error().message.find("c.json"), std::string::npos);
}

TEST(Config, Qwen2SparseStepAndMlpOnlyLayers) {
  auto r = parse_hparams(qwen2(R"(,"decoder_sparse_step":2,"mlp_only_layers":[3])"), "x.json");
  ASSERT_TRUE(r.ok()) << r.error().message;
  // sparse iff not in mlp_only_layers and (l + 1) % step == 0
  EXPECT_EQ(r->layer_is_moe, (std::vector<bool>{false, true, false, false}));
  EXPECT_EQ(r->d_ff, 160);
  EXPECT_EQ(r->d_shared, 96);
  EXPECT_TRUE(r->shared_expert_gate);
  EXPECT_TRUE(r->qkv_bias);
  EXPECT_FALSE(r->router.renormalize);
  EXPECT_EQ(r->head_dim, 16);
}

TEST(Config, FamilyRules) {
  auto mx = parse_hparams(R"({"model_type":"mixtral","hidden_size":64,"num_hidden_layers":2,
      "num_attention_heads":4,"vocab_size":100,"num_local_experts":8,"num_experts_per_tok":2,
      "intermediate_size":128})", "m.json");
  ASSERT_TRUE(mx.ok()) << mx.error().message;
  EXPECT_TRUE(mx->router.renormalize);
  EXPECT_EQ(mx->n_kv_heads, 4);
  EXPECT_EQ(mx->qk_norm, ts::model::QkNorm::kNone);
  auto q3 = parse_hparams(R"({"model_type":"qwen3_moe","hidden_size":96,"num_hidden_layers":2,
      "num_attention_heads":6,"num_key_value_heads":2,"head_dim":32,"vocab_size":100,
      "num_experts":16,"num_experts_per_tok":4,"moe_intermediate_size":48,
      "norm_topk_prob":true})", "q.json");
  ASSERT_TRUE(q3.ok()) << q3.error().message;
  EXPECT_EQ(q3->head_dim, 32);
  EXPECT_EQ(q3->q_dim(), 192);
  EXPECT_EQ(q3->qk_norm, ts::model::QkNorm::kPerHead);
  EXPECT_TRUE(q3->router.renormalize);
  auto ol = parse_hparams(R"({"model_type":"olmoe","hidden_size":64,"num_hidden_layers":2,
      "num_attention_heads":4,"vocab_size":100,"num_experts":8,"num_experts_per_tok":2,
      "intermediate_size":64})", "o.json");
  ASSERT_TRUE(ol.ok()) << ol.error().message;
  EXPECT_EQ(ol->qk_norm, ts::model::QkNorm::kFullProjection);
  EXPECT_FALSE(ol->router.renormalize);
}

struct BadCase {
  std::string json;
  std::string key;
};

TEST(Config, BadConfigsNameTheKey) {
  const BadCase cases[] = {
      {R"({"model_type":"llama","hidden_size":64})", "model_type"},
      {R"({"hidden_size":64})", "model_type"},
      {qwen2(R"(,"num_experts_per_tok":9)").replace(qwen2("").find("\"num_experts_per_tok\":2,"),
                                                   24, ""),
       "num_experts_per_tok"},
      {qwen2(",\"num_key_value_heads\":3").replace(qwen2("").find("\"num_key_value_heads\":2,"),
                                                  24, ""),
       "num_key_value_heads"},
      {R"({"model_type":"mixtral","hidden_size":65,"num_hidden_layers":2,
          "num_attention_heads":4,"vocab_size":100,"num_local_experts":8,
          "num_experts_per_tok":2,"intermediate_size":128})", "num_attention_heads"},
      {R"({"model_type":"mixtral","hidden_size":64,"num_hidden_layers":"two"})", "num_hidden_layers"},
      {qwen2(R"(,"rope_parameters":{"rope_type":"longrope","rope_theta":1e6})"), "rope_type"},
      {qwen2(R"(,"rope_parameters":{"rope_type":"yarn","rope_theta":1e6})"),
       "original_max_position_embeddings"},
      {qwen2(R"(,"mlp_only_layers":[7])"), "mlp_only_layers"},
      {"{not json", "not valid JSON"},
  };
  for (const BadCase& c : cases) {
    auto r = parse_hparams(c.json, "dir/config.json");
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_NE(r.error().message.find(c.key), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find("dir/config.json"), std::string::npos) << r.error().message;
  }
}

TEST(Router, TopKInRankOrderWithRenormalisation) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> logits(16);
    for (float& v : logits) v = nd(rng);
    for (bool renorm : {false, true}) {
      std::vector<int> ids(4);
      std::vector<float> w(4);
      ts::model::select_experts(logits, {}, {.renormalize = renorm}, {.ids = ids, .weights = w});
      // Reference: softmax, then sort indices by probability descending.
      double mx = *std::max_element(logits.begin(), logits.end()), sum = 0;
      std::vector<double> p(16);
      for (int i = 0; i < 16; ++i) sum += p[size_t(i)] = std::exp(double(logits[size_t(i)]) - mx);
      std::vector<int> order(16);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int b) { return p[size_t(a)] > p[size_t(b)]; });
      double top_sum = 0;
      for (int r = 0; r < 4; ++r) top_sum += p[size_t(order[size_t(r)])] / sum;
      for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(ids[size_t(r)], order[size_t(r)]) << "rank " << r;
        double want = p[size_t(order[size_t(r)])] / sum / (renorm ? top_sum : 1.0);
        EXPECT_NEAR(w[size_t(r)], want, 1e-6);
      }
    }
  }
}

TEST(Router, TiesGoToTheLowerExpertId) {
  std::vector<float> logits = {0.5f, 2.0f, 1.0f, 2.0f, 1.0f};
  std::vector<int> ids(3);
  std::vector<float> w(3);
  ts::model::select_experts(logits, {}, {}, {.ids = ids, .weights = w});
  EXPECT_EQ(ids, (std::vector<int>{1, 3, 2}));
}

TEST(Ops, RmsNormMatchesFormula) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.0f, 3.0f);
  const int n = 37;
  std::vector<float> x(2 * n), w(n), y(2 * n, NAN);
  for (float& v : x) v = nd(rng);
  for (float& v : w) v = 1.0f + 0.2f * nd(rng);
  ts::cpu::rmsnorm_rows(x.data(), w.data(), y.data(), 2, n, 1e-5f);
  for (int r = 0; r < 2; ++r) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += double(x[size_t(r * n + i)]) * x[size_t(r * n + i)];
    double inv = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int i = 0; i < n; ++i)
      EXPECT_NEAR(y[size_t(r * n + i)], w[size_t(i)] * x[size_t(r * n + i)] * inv, 1e-5);
  }
}

// rmsnorm_fits_f16: weights at its bound keep every output of rows built to reach it (all the
// energy in one element, at scales from 1e-20 to 1e18, with and without eps; random rows)
// within F16's range, through the F16 conversion the CUDA prefill uses; weights 20% past it
// give an output F16 cannot hold, and are refused; non-finite or empty weights are refused.
TEST(Ops, RmsNormFitsF16BoundsEveryRow) {
  const int n = 2048;
  const auto worst = [&](const std::vector<float>& w, float eps) {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> x(static_cast<size_t>(n)), y(static_cast<size_t>(n));
    double most = 0;
    for (int trial = 0; trial < 40; ++trial) {
      std::fill(x.begin(), x.end(), 0.0f);
      if (trial < 20) {  // on the largest weights (100, 101), at 1e-20 .. 1e18
        x[size_t(100 + trial % 2)] = std::pow(10.0f, 2.0f * float(trial) - 20.0f);
      } else {
        for (float& v : x) v = nd(rng) * std::pow(10.0f, float(trial - 30));
      }
      ts::cpu::rmsnorm_rows(x.data(), w.data(), y.data(), 1, n, eps);
      for (float v : y) most = std::max(most, std::fabs(double(ts::f16_to_f32(ts::f32_to_f16(v)))));
    }
    return most;
  };
  // sqrt(2048) = 45.25...: 60,000 / 45.25 = 1,325.8.
  std::vector<float> w(size_t(n), 0.5f);
  w[100] = 1325.0f;
  w[101] = -1325.0f;
  EXPECT_TRUE(ts::cpu::rmsnorm_fits_f16(w));
  for (float eps : {0.0f, 1e-6f}) {
    const double got = worst(w, eps);
    EXPECT_LE(got, 65504.0) << "eps " << eps;
    EXPECT_GT(got, 50000.0) << "eps " << eps << ": the rows should come near the bound";
  }
  std::vector<float> past(w);
  past[100] = 1325.0f * 1.2f;
  EXPECT_FALSE(ts::cpu::rmsnorm_fits_f16(past));
  EXPECT_TRUE(std::isinf(worst(past, 0.0f))) << "an output past F16 that the bound refuses";
  std::vector<float> bad(w);
  bad[7] = NAN;
  EXPECT_FALSE(ts::cpu::rmsnorm_fits_f16(bad));
  bad[7] = INFINITY;
  EXPECT_FALSE(ts::cpu::rmsnorm_fits_f16(bad));
  EXPECT_FALSE(ts::cpu::rmsnorm_fits_f16({}));
  EXPECT_TRUE(ts::cpu::rmsnorm_fits_f16(std::vector<float>(size_t(n), 1.0f)));
}

TEST(Ops, RopeRotatesHalvesByPositionTimesFrequency) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int hd = 8, heads = 3, pos = 45;
  const double theta = 10000.0;
  std::vector<float> inv(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv[size_t(i)] = float(1.0 / std::pow(theta, 2.0 * i / hd));
  std::vector<float> x(heads * hd);
  for (float& v : x) v = nd(rng);
  std::vector<float> y = x;
  ts::cpu::rope_apply(y.data(), heads, {.head_stride = hd, .dim = hd, .inv_freq = inv}, pos);
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < hd / 2; ++i) {
      double a = x[size_t(h * hd + i)], b = x[size_t(h * hd + i + hd / 2)];
      double ang = pos * double(inv[size_t(i)]);
      EXPECT_NEAR(y[size_t(h * hd + i)], a * std::cos(ang) - b * std::sin(ang), 1e-5);
      EXPECT_NEAR(y[size_t(h * hd + i + hd / 2)], b * std::cos(ang) + a * std::sin(ang), 1e-5);
    }
}

}  // namespace
