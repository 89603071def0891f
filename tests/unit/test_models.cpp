// Every fixture under tests/models (made by scripts/make_fixtures.py with transformers) is
// checked logit-for-logit: prefill logits at every prompt position, the greedy continuation,
// decode through the KV cache against prefill, and thread-count invariance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/thread_pool.h"
#include "io/npy.h"
#include "runtime/model.h"
#include "runtime/sampler.h"
#include "runtime/session.h"

namespace {

namespace fs = std::filesystem;

std::vector<std::string> fixture_names() {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(fs::path(TS_TEST_DATA_DIR) / "models"))
    if (fs::exists(e.path() / "ref.json") && fs::exists(e.path() / "logits.npy"))
      out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

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
    dir_ = (fs::path(TS_TEST_DATA_DIR) / "models" / GetParam()).string();
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

INSTANTIATE_TEST_SUITE_P(Models, Fixture, ::testing::ValuesIn(fixture_names()),
                         [](const auto& info) { return info.param; });

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
