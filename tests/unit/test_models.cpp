// Every fixture under tests/models (made by scripts/make_fixtures.py with transformers) is
// checked logit-for-logit: prefill logits at every prompt position, the greedy continuation,
// decode through the KV cache against prefill, and thread-count invariance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "backend/cpu/ops.h"
#include "core/thread_pool.h"
#include "io/npy.h"
#include "runtime/model.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "test_data.h"

namespace {

namespace fs = std::filesystem;

using ts_test::fixture_names;

fs::path models_dir() { return ts_test::data_dir() / "models"; }

struct Ref {
  std::vector<int> prompt, greedy;
  ts::io::NpyArray logits;
};

Ref load_ref(const std::string& dir) {
  std::ifstream f(dir + "/ref.json");
  nlohmann::json j = nlohmann::json::parse(f);
  Ref r;
  r.prompt = j.at("prompt_ids").get<std::vector<int>>();
  r.greedy = j.at("greedy_ids").get<std::vector<int>>();
  auto a = ts::io::read_npy_f32(dir + "/logits.npy");
  EXPECT_TRUE(a.ok()) << (a.ok() ? "" : a.error().message);
  if (a.ok()) r.logits = std::move(a.value());
  return r;
}

// max |a - b| / max |b| over one row.
double rel_err(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num = std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return num / den;
}

class Fixture : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = (models_dir() / GetParam()).string();
    auto m = ts::runtime::LoadedModel::load(dir_);
    ASSERT_TRUE(m.ok()) << m.error().message;
    model_ = std::move(m.value());
    ref_ = load_ref(dir_);
    ASSERT_EQ(ref_.logits.shape.size(), 2u);
    ASSERT_EQ(ref_.logits.shape[0], int64_t(ref_.prompt.size()));
    ASSERT_EQ(ref_.logits.shape[1], int64_t(model_->hp().vocab));
  }
  std::string dir_;
  std::unique_ptr<ts::runtime::LoadedModel> model_;
  Ref ref_;
};

constexpr double kTol = 1e-4;

TEST_P(Fixture, PrefillLogitsMatchTransformers) {
  ts::ThreadPool pool(2);
  ts::runtime::Session s(*model_, pool, {.n_ctx = int(ref_.prompt.size())});
  std::vector<float> logits;
  ASSERT_TRUE(s.forward(ref_.prompt, &logits).ok());
  const size_t V = size_t(model_->hp().vocab);
  double worst = 0;
  for (size_t t = 0; t < ref_.prompt.size(); ++t) {
    double e = rel_err(&logits[t * V], &ref_.logits.data[t * V], V);
    worst = std::max(worst, e);
    EXPECT_LE(e, kTol) << "position " << t;
  }
  std::printf("[ %s ] prefill max rel err %.3g\n", GetParam().c_str(), worst);
}

TEST_P(Fixture, GreedyContinuationMatchesTransformers) {
  ts::ThreadPool pool(2);
  ts::runtime::Session s(*model_, pool,
                         {.n_ctx = int(ref_.prompt.size() + ref_.greedy.size())});
  ASSERT_TRUE(s.forward(ref_.prompt, nullptr).ok());
  std::vector<int> got;
  for (size_t i = 0; i < ref_.greedy.size(); ++i) {
    int next = ts::runtime::argmax(s.last_logits());
    got.push_back(next);
    ASSERT_TRUE(s.forward(std::span<const int>(&next, 1), nullptr).ok());
  }
  EXPECT_EQ(got, ref_.greedy);
}

TEST_P(Fixture, DecodeMatchesPrefill) {
  ts::ThreadPool pool(2);
  ts::runtime::Session s(*model_, pool, {.n_ctx = int(ref_.prompt.size())});
  const size_t V = size_t(model_->hp().vocab);
  for (size_t t = 0; t < ref_.prompt.size(); ++t) {
    ASSERT_TRUE(s.forward(std::span<const int>(&ref_.prompt[t], 1), nullptr).ok());
    EXPECT_LE(rel_err(s.last_logits().data(), &ref_.logits.data[t * V], V), kTol)
        << "position " << t;
  }
}

TEST_P(Fixture, ChunkedPrefillMatchesWholePrefill) {
  ts::ThreadPool pool(2);
  ts::runtime::Session whole(*model_, pool, {.n_ctx = int(ref_.prompt.size())});
  ts::runtime::Session chunked(*model_, pool,
                               {.n_ctx = int(ref_.prompt.size()), .prefill_chunk = 7});
  std::vector<float> a, b;
  ASSERT_TRUE(whole.forward(ref_.prompt, &a).ok());
  ASSERT_TRUE(chunked.forward(ref_.prompt, &b).ok());
  const size_t V = size_t(model_->hp().vocab);
  for (size_t t = 0; t < ref_.prompt.size(); ++t)
    EXPECT_LE(rel_err(&b[t * V], &a[t * V], V), kTol) << "position " << t;
}

TEST_P(Fixture, ThreadCountDoesNotChangeLogits) {
  std::vector<float> a, b;
  for (int threads : {1, 2}) {
    ts::ThreadPool pool(threads);
    ts::runtime::Session s(*model_, pool, {.n_ctx = int(ref_.prompt.size())});
    ASSERT_TRUE(s.forward(ref_.prompt, threads == 1 ? &a : &b).ok());
  }
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

// bench --synthetic's size check (synthetic_weight_bytes, from the tensor table) against the
// loader's count of a real checkpoint of the same shape and type (the F32 fixtures): the same
// bytes, dense and routed.
TEST_P(Fixture, SyntheticWeightBytesMatchTheLoadersCount) {
  const ts::model::HParams& hp = model_->hp();
  const ts::model::WeightCounts& c = model_->counts();
  auto r = ts::model::synthetic_weight_bytes(hp, ts::DType::kF32, ts::DType::kF32);
  ASSERT_TRUE(r.ok()) << r.error().message;
  const ts::model::WeightBytes b = r.value();
  EXPECT_EQ(b.routed, c.routed_bytes);
  EXPECT_EQ(b.dense, c.dense_bytes);
}

INSTANTIATE_TEST_SUITE_P(Models, Fixture, ::testing::ValuesIn(fixture_names()),
                         [](const auto& info) { return info.param; });

// The benchmark shape (bench/qwen3-30b-a3b.json) in Q8_0 and BF16, sizes worked out by hand:
// Q8_0 rows of 2,048 are 2,176 bytes (64 blocks of 34), of 768 816, of 4,096 4,352; the
// embedding and router stay BF16; the lm head is not tied.
TEST(SyntheticWeights, BytesOfTheQwen3BenchShape) {
  auto hp = ts::model::parse_hparams(R"({"model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "intermediate_size": 6144, "norm_topk_prob": true,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "tie_word_embeddings": false})",
                                     "test config");
  ASSERT_TRUE(hp.ok()) << hp.error().message;
  // Experts: 48 x 128 x (2 x 768 x 2,176 + 2,048 x 816). Dense: embedding 151,936 x 2,048 x 2,
  // lm head 151,936 x 2,176, final norm 8,192, and per layer two norms (16,384), q (4,096 x
  // 2,176), k and v (2 x 512 x 2,176), o (2,048 x 4,352), q/k norms (1,024), router (128 x
  // 4,096).
  auto rq = ts::model::synthetic_weight_bytes(hp.value(), ts::DType::kQ8_0, ts::DType::kQ8_0);
  ASSERT_TRUE(rq.ok()) << rq.error().message;
  const ts::model::WeightBytes q = rq.value();
  EXPECT_EQ(q.routed, 30802968576u);
  EXPECT_EQ(q.dense, 1941544960u);
  // BF16: 2 bytes a weight everywhere (the lm head too).
  auto rb = ts::model::synthetic_weight_bytes(hp.value(), ts::DType::kBF16, ts::DType::kBF16);
  ASSERT_TRUE(rb.ok()) << rb.error().message;
  EXPECT_EQ(rb.value().routed, 57982058496u);
  EXPECT_EQ(rb.value().dense, 3082608640u);
  // Q4_K blocks are 256 wide: moe_intermediate_size 768 is 3 of them, but the Q4_K experts' down
  // matrices asked in Q8_0 are fine too; hidden_size 2,048 is 8.
  EXPECT_TRUE(
      ts::model::synthetic_weight_bytes(hp.value(), ts::DType::kQ4_K, ts::DType::kQ8_0).ok());
  // A width that is not a whole number of blocks is an error naming the field, not an abort.
  auto odd = hp.value();
  odd.d_expert = 760;
  auto e = ts::model::synthetic_weight_bytes(odd, ts::DType::kQ8_0, ts::DType::kQ8_0);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.error().message, "moe_intermediate_size 760 is not a multiple of 32, the Q8_0 block");
  EXPECT_TRUE(ts::model::synthetic_weight_bytes(odd, ts::DType::kBF16, ts::DType::kBF16).ok());
  odd = hp.value();
  odd.d_model = 2000;
  e = ts::model::synthetic_weight_bytes(odd, ts::DType::kQ4_K, ts::DType::kQ4_K);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.error().message, "hidden_size 2000 is not a multiple of 256, the Q4_K block");
}

// tests/gpu/real_widths.sh runs on a GPU machine only: here, every shape it reads parses, has
// its two layers, takes whole Q8_0 blocks in every matrix (the Q8_0 pack quantizes them all),
// and is its bench/ namesake's shape but for the layer count, so the two cannot drift apart.
TEST(SyntheticWeights, RealWidthShapesParseAndMatchTheBenchShapes) {
  const fs::path dir = ts_test::data_dir() / "gpu" / "shapes";
  const fs::path bench = ts_test::data_dir().parent_path() / "bench";
  int shapes = 0, matched = 0;
  for (const auto& f : fs::directory_iterator(dir)) {
    if (f.path().extension() != ".json") continue;
    ++shapes;
    SCOPED_TRACE(f.path().string());
    std::ifstream in(f.path());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto hp = ts::model::parse_hparams(text, f.path().string());
    ASSERT_TRUE(hp.ok()) << hp.error().message;
    EXPECT_EQ(hp.value().n_layers, 2);
    auto q = ts::model::synthetic_weight_bytes(hp.value(), ts::DType::kQ8_0, ts::DType::kQ8_0);
    EXPECT_TRUE(q.ok()) << q.error().message;
    std::string name = f.path().stem().string();
    const std::string suffix = "-2layer";
    ASSERT_TRUE(name.size() > suffix.size() && name.ends_with(suffix)) << name;
    name.resize(name.size() - suffix.size());
    const fs::path twin = bench / (name + ".json");
    if (!fs::exists(twin)) continue;
    ++matched;
    nlohmann::json a = nlohmann::json::parse(text), b = nlohmann::json::parse(std::ifstream(twin));
    a.erase("num_hidden_layers");
    b.erase("num_hidden_layers");
    EXPECT_EQ(a, b) << "differs from " << twin.string() << " beyond num_hidden_layers";
  }
  EXPECT_GE(shapes, 7);
  EXPECT_GE(matched, 3);  // qwen3-30b-a3b, olmoe-1b-7b, mixtral-8x7b
}

}  // namespace

namespace {

// DESIGN.md invariant: logits are byte-identical whatever the residency, cache size, policy,
// cold or warm cache, and across repeated runs in one process.
TEST_P(Fixture, LogitsByteIdenticalAcrossResidencyModes) {
  using ts::experts::CachePolicy;
  using ts::experts::Residency;
  ts::ThreadPool pool(2);
  auto run = [&](const ts::runtime::LoadedModel& m, int repeats, int chunk) {
    std::vector<float> first;
    ts::runtime::Session s(m, pool, {.n_ctx = int(ref_.prompt.size()), .prefill_chunk = chunk});
    for (int r = 0; r < repeats; ++r) {
      std::vector<float> logits;
      s.reset();
      EXPECT_TRUE(s.forward(ref_.prompt, &logits).ok());
      if (r == 0) first = logits;
      else EXPECT_EQ(0, std::memcmp(first.data(), logits.data(), first.size() * 4)) << "repeat " << r;
    }
    return first;
  };
  const std::vector<float> base = run(*model_, 5, 256);
  const int n_experts = model_->hp().n_experts, top_k = model_->hp().top_k;
  struct Mode {
    Residency residency;
    int slots;
    CachePolicy policy;
  };
  // Experts rearranged at load (gpt-oss's stacked layout) are not in the file to stream from:
  // refused, naming the pack that does (test_pack.cpp streams gpt-oss's pack).
  const bool converted = !model_->load_note().empty();
  std::vector<Mode> modes = {{Residency::kResident, 0, CachePolicy::kLru}};
  for (int slots : {1, 2, top_k, n_experts})
    for (CachePolicy p : {CachePolicy::kLru, CachePolicy::kLfu})
      modes.push_back({Residency::kStreamed, slots, p});
  for (const Mode& mode : modes) {
    ts::runtime::LoadOptions opt;
    opt.residency = mode.residency;
    opt.streamed.slots_per_layer = std::max(1, mode.slots);
    opt.streamed.policy = mode.policy;
    auto m = ts::runtime::LoadedModel::load(dir_, opt);
    if (converted && mode.residency == Residency::kStreamed) {
      ASSERT_FALSE(m.ok());
      EXPECT_NE(m.error().message.find("turbospark pack"), std::string::npos) << m.error().message;
      continue;
    }
    ASSERT_TRUE(m.ok()) << m.error().message;
    // repeats cover cold then warm caches; chunk 5 makes several acquires per layer.
    for (int chunk : {256, 5}) {
      std::vector<float> got = run(*m.value(), 3, chunk);
      if (chunk == 256) {
        EXPECT_EQ(0, std::memcmp(base.data(), got.data(), base.size() * 4))
            << ts::experts::residency_name(mode.residency) << " slots " << mode.slots;
      }
    }
    auto st = m.value()->experts().stats();
    if (mode.residency == Residency::kStreamed && mode.slots < n_experts) {
      EXPECT_LT(st.hits, st.requests) << "a small cache must miss";
      EXPECT_GT(st.bytes_read, 0u);
    }
  }
}

}  // namespace

namespace {

ts::io::NpyArray load_npy(const std::string& path) {
  auto a = ts::io::read_npy_f32(path);
  EXPECT_TRUE(a.ok()) << path;
  return a.ok() ? std::move(a.value()) : ts::io::NpyArray{};
}

// Residual capture against transformers' output_hidden_states: entry 0 is the embedding
// output, entry l + 1 the output of layer l, and the last entry has the final norm applied.
TEST_P(Fixture, CapturedResidualsMatchTransformersHiddenStates) {
  const auto& hp = model_->hp();
  ts::io::NpyArray hs = load_npy(dir_ + "/hidden_states.npy");
  ASSERT_EQ(hs.shape, (std::vector<int64_t>{hp.n_layers + 1, int64_t(ref_.prompt.size()), hp.d_model}));
  ts::ThreadPool pool(2);
  ts::runtime::Interventions iv;
  for (int l = -1; l < hp.n_layers; ++l) iv.capture_layers.push_back(l);
  std::vector<float> with, without;
  ts::runtime::Session s(*model_, pool, {.n_ctx = int(ref_.prompt.size()), .interventions = iv});
  ASSERT_TRUE(s.forward(ref_.prompt, &with).ok());
  ts::runtime::Session plain(*model_, pool, {.n_ctx = int(ref_.prompt.size())});
  ASSERT_TRUE(plain.forward(ref_.prompt, &without).ok());
  EXPECT_EQ(0, std::memcmp(with.data(), without.data(), with.size() * 4)) << "capture changed logits";
  ASSERT_EQ(s.captured_positions(), int64_t(ref_.prompt.size()));
  const size_t d = size_t(hp.d_model), T = ref_.prompt.size();
  for (int e = 0; e <= hp.n_layers; ++e) {
    std::vector<float> got = s.captures()[size_t(std::min(e, hp.n_layers))];  // capture of layer e-1
    if (e == hp.n_layers) {
      got = s.captures()[size_t(hp.n_layers)];
      ts::cpu::rmsnorm_rows(got.data(), model_->dense().final_norm.data(), got.data(), int64_t(T),
                            int64_t(d), hp.rms_eps);
    }
    for (size_t t = 0; t < T; ++t)
      EXPECT_LE(rel_err(&got[t * d], &hs.data[(size_t(e) * T + t) * d], d), 1e-4)
          << "hidden_states[" << e << "] position " << t;
  }
}

// Steering: a zero vector leaves logits byte-identical; each mode changes the captured
// residual exactly as its formula says.
TEST_P(Fixture, SteeringModesMatchTheirFormulas) {
  const auto& hp = model_->hp();
  const int layer = hp.n_layers / 2;
  const size_t d = size_t(hp.d_model), T = ref_.prompt.size();
  ts::ThreadPool pool(2);
  auto run = [&](std::vector<ts::runtime::SteerOp> ops, std::vector<float>* logits) {
    ts::runtime::Interventions iv;
    iv.steer.resize(size_t(hp.n_layers));
    iv.steer[size_t(layer)] = std::move(ops);
    iv.capture_layers = {layer};
    ts::runtime::Session s(*model_, pool, {.n_ctx = int(T), .interventions = iv});
    EXPECT_TRUE(s.forward(ref_.prompt, logits).ok());
    return s.captures()[0];
  };
  std::vector<float> base_logits, logits;
  const std::vector<float> base = run({}, &base_logits);
  using ts::runtime::SteerMode;
  run({{.v = std::vector<float>(d, 0.0f), .scale = 3.0f, .mode = SteerMode::kAdd}}, &logits);
  EXPECT_EQ(0, std::memcmp(base_logits.data(), logits.data(), logits.size() * 4));

  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(d);
  for (float& x : v) x = nd(rng);
  for (SteerMode mode : {SteerMode::kAdd, SteerMode::kAblate, SteerMode::kClamp, SteerMode::kRenorm}) {
    const float scale = 0.7f;
    const std::vector<float> got = run({{.v = v, .scale = scale, .mode = mode}}, &logits);
    double vv = 0;
    for (float x : v) vv += double(x) * x;
    for (size_t t = 0; t < T; ++t) {
      const float* x = &base[t * d];
      std::vector<double> want(d);
      double xv = 0, xx = 0;
      for (size_t i = 0; i < d; ++i) xv += double(x[i]) * v[i], xx += double(x[i]) * x[i];
      const double along = xv / std::sqrt(vv);
      for (size_t i = 0; i < d; ++i) {
        const double u = v[i] / std::sqrt(vv);
        switch (mode) {
          case SteerMode::kAdd: want[i] = x[i] + scale * v[i]; break;
          case SteerMode::kAblate: want[i] = x[i] - scale * along * u; break;
          case SteerMode::kClamp: want[i] = x[i] + (scale - along) * u; break;
          case SteerMode::kRenorm: want[i] = x[i] + scale * v[i]; break;
        }
      }
      if (mode == SteerMode::kRenorm) {
        double yy = 0;
        for (double y : want) yy += y * y;
        for (double& y : want) y *= std::sqrt(xx / yy);
      }
      double num = 0, den = 0;
      for (size_t i = 0; i < d; ++i) {
        num = std::max(num, std::fabs(double(got[t * d + i]) - want[i]));
        den = std::max(den, std::fabs(want[i]));
      }
      EXPECT_LE(num / den, 1e-5) << "mode " << int(mode) << " position " << t;
    }
    EXPECT_NE(0, std::memcmp(base_logits.data(), logits.data(), logits.size() * 4))
        << "steering mode " << int(mode) << " had no effect on logits";
  }
}

}  // namespace
