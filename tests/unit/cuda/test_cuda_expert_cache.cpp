// The GPU expert cache (--residency host|streamed on CUDA) on every fixture: logits
// byte-identical to resident mode for the expert-grouped prefill (whole-layer prefetch and
// per-expert staging), the GEMV-sized chunks and token-by-token decode (graph segments), for caches from 1 slot (fewer than top_k: the step's other experts
// go through staging) to every expert, LRU and LFU, cold and warm, from pinned host memory
// and from the files (the streamed ExpertStore); hit counters that add up; --cache-warm.
// Skipped where no CUDA device is present (CI); run on the GPU machine by tests/gpu/run.sh.
#include <gtest/gtest.h>
#include <cuda_runtime.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_session.h"
#include "backend/cuda/kernels.cuh"
#include "core/thread_pool.h"
#include "model/hparams.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "cuda_test_util.h"

namespace {

using ts_test::have_gpu;
using ts_test::data_dir;
using ts_test::fixture_names;

namespace fs = std::filesystem;
using ts::runtime::GpuResidency;

// What one engine produced: every prefill row (one chunk: the grouped MoE when the prompt
// is longer than the GEMV limit), every row of a prefill in chunks of 3 (the per-slot
// kernels), and the last logits of each decode step after the prompt.
struct Outputs {
  std::vector<float> prefill, chunked, decode;
};

class CudaExpertCache : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
    dir_ = (data_dir() / "models" / GetParam()).string();
    auto m = ts::runtime::LoadedModel::load(dir_);
    ASSERT_TRUE(m.ok()) << m.error().message;
    model_ = std::move(m.value());
    std::ifstream f(dir_ + "/ref.json");
    prompt_ = nlohmann::json::parse(f).at("prompt_ids").get<std::vector<int>>();
    if (model_->hp().n_experts == 0) GTEST_SKIP() << "no routed experts";
  }

  std::unique_ptr<ts::runtime::Engine> engine(const ts::runtime::LoadedModel& m,
                                              ts::runtime::GpuExpertOptions g, int chunk) {
    ts::runtime::SessionOptions o{.n_ctx = int(prompt_.size()) + kDecode, .prefill_chunk = chunk};
    o.gpu_experts = std::move(g);
    auto e = ts::runtime::make_engine(m, pool_, std::move(o), {ts::runtime::DeviceKind::kCuda, 0});
    EXPECT_TRUE(e.ok()) << e.error().message;
    return e.ok() ? std::move(e.value()) : nullptr;
  }

  // Prefill + decode on one engine, then the prefill again (warm cache), then a chunked
  // prefill on a second engine; the warm repeat must equal the cold run.
  Outputs run(const ts::runtime::LoadedModel& m, const ts::runtime::GpuExpertOptions& g) {
    Outputs o;
    auto s = engine(m, g, 0);
    if (!s) return o;
    EXPECT_TRUE(s->forward(prompt_, &o.prefill).ok());
    for (int i = 0; i < kDecode; ++i) {
      int next = ts::runtime::argmax(s->last_logits());
      EXPECT_TRUE(s->forward(std::span<const int>(&next, 1), nullptr).ok());
      o.decode.insert(o.decode.end(), s->last_logits().begin(), s->last_logits().end());
    }
    std::vector<float> again;
    s->reset();
    EXPECT_TRUE(s->forward(prompt_, &again).ok());
    EXPECT_EQ(0, std::memcmp(again.data(), o.prefill.data(), again.size() * 4))
        << "warm repeat differs";
    auto c = engine(m, g, 3);
    if (c) {
      EXPECT_TRUE(c->forward(prompt_, &o.chunked).ok());
    }
    return o;
  }

  static void expect_same(const Outputs& a, const Outputs& b, const std::string& what) {
    ASSERT_EQ(a.prefill.size(), b.prefill.size()) << what;
    ASSERT_EQ(a.decode.size(), b.decode.size()) << what;
    ASSERT_EQ(a.chunked.size(), b.chunked.size()) << what;
    EXPECT_EQ(0, std::memcmp(a.prefill.data(), b.prefill.data(), a.prefill.size() * 4))
        << what << ": prefill";
    EXPECT_EQ(0, std::memcmp(a.decode.data(), b.decode.data(), a.decode.size() * 4))
        << what << ": decode";
    EXPECT_EQ(0, std::memcmp(a.chunked.data(), b.chunked.data(), a.chunked.size() * 4))
        << what << ": chunks of 3";
  }

  static constexpr int kDecode = 6;
  ts::ThreadPool pool_{2};
  std::string dir_;
  std::unique_ptr<ts::runtime::LoadedModel> model_;
  std::vector<int> prompt_;
};

TEST_P(CudaExpertCache, HostModeByteIdenticalToResidentForEveryCacheSize) {
  const auto& hp = model_->hp();
  const Outputs base = run(*model_, {});
  ASSERT_FALSE(base.prefill.empty());
  for (int slots : {1, std::max(1, hp.top_k - 1), hp.top_k, hp.n_experts})
    for (auto policy : {ts::experts::CachePolicy::kLru, ts::experts::CachePolicy::kLfu}) {
      ts::runtime::GpuExpertOptions g{.residency = GpuResidency::kHost, .slots_per_layer = slots,
                                      .policy = policy};
      expect_same(base, run(*model_, g),
                  "host, " + std::to_string(slots) + " slots, " +
                      (policy == ts::experts::CachePolicy::kLru ? "lru" : "lfu"));
    }
  // Prefill without the whole-layer prefetch: each miss streams through the staging ring
  // (or a free slot) as the grouped GEMMs reach its expert.
  for (int slots : {1, hp.top_k}) {
    ts::runtime::GpuExpertOptions g{.residency = GpuResidency::kHost, .slots_per_layer = slots,
                                    .layer_prefetch = false};
    expect_same(base, run(*model_, g), "host, no prefetch, " + std::to_string(slots) + " slots");
  }
}

// Decode past kClusterAttentionKeys keys replays one set of graph segments up to it (attention
// in clusters) and another after: every step's logits byte-identical to resident mode's graphs.
// (Added in the ninth session after its last device run: first run by the next tests/gpu/run.sh.)
TEST_P(CudaExpertCache, DecodeAcrossTheClusterAttentionBoundMatchesResident) {
  const int T = ts::cuda::kClusterAttentionKeys + 12;
  std::vector<int> tokens;
  for (int t = 0; t < T; ++t) tokens.push_back(prompt_[size_t(t) % prompt_.size()]);
  const auto decode = [&](const ts::runtime::GpuExpertOptions& g) {
    ts::runtime::SessionOptions o{.n_ctx = T};
    o.gpu_experts = g;
    auto e = ts::runtime::make_engine(*model_, pool_, std::move(o),
                                      {ts::runtime::DeviceKind::kCuda, 0});
    EXPECT_TRUE(e.ok()) << e.error().message;
    std::vector<float> rows;
    if (!e.ok()) return rows;
    for (int t = 0; t < T; ++t) {
      EXPECT_TRUE((*e)->forward(std::span<const int>(&tokens[size_t(t)], 1), nullptr).ok());
      rows.insert(rows.end(), (*e)->last_logits().begin(), (*e)->last_logits().end());
    }
    return rows;
  };
  const std::vector<float> resident = decode({});
  const std::vector<float> host = decode({.residency = GpuResidency::kHost,
                                          .slots_per_layer = model_->hp().top_k});
  ASSERT_EQ(resident.size(), host.size());
  ASSERT_FALSE(resident.empty());
  const size_t V = size_t(model_->hp().vocab);
  for (int t = 0; t < T; ++t)
    EXPECT_EQ(0, std::memcmp(&resident[size_t(t) * V], &host[size_t(t) * V], V * 4))
        << "position " << t;
}

// Misses read from the checkpoint files by the streamed ExpertStore (1 or 2 host slots, so
// several reads per step), into GPU caches of 1 slot and of half the experts.
TEST_P(CudaExpertCache, StreamedModeByteIdenticalToResident) {
  const auto& hp = model_->hp();
  const Outputs base = run(*model_, {});
  for (int store_slots : {1, 2}) {
    ts::runtime::LoadOptions lo;
    lo.residency = ts::experts::Residency::kStreamed;
    lo.streamed.slots_per_layer = store_slots;
    auto m = ts::runtime::LoadedModel::load(dir_, lo);
    ASSERT_TRUE(m.ok()) << m.error().message;
    for (int slots : {1, std::max(1, hp.n_experts / 2)}) {
      ts::runtime::GpuExpertOptions g{.residency = GpuResidency::kStreamed, .slots_per_layer = slots};
      expect_same(base, run(*m.value(), g),
                  "streamed (" + std::to_string(store_slots) + " host slots), " +
                      std::to_string(slots) + " GPU slots");
    }
  }
}

// Counters: a cache that holds every expert misses only on first use, so a second identical
// prefill hits everything and copies nothing; a 1-slot cache misses and copies on every run.
// (Per-expert loading: the whole-layer prefetch also copies experts the chunk does not use.)
TEST_P(CudaExpertCache, HitCountersAddUp) {
  const auto& hp = model_->hp();
  auto full = engine(*model_, {.residency = GpuResidency::kHost, .slots_per_layer = hp.n_experts,
                               .layer_prefetch = false}, 0);
  ASSERT_TRUE(full);
  ASSERT_TRUE(full->forward(prompt_, nullptr).ok());
  const ts::runtime::ExpertCacheReport first = full->expert_cache().value();
  EXPECT_EQ(first.hits, 0u);
  EXPECT_GT(first.requests, 0u);
  EXPECT_GT(first.copied_bytes, 0u);
  full->reset();
  ASSERT_TRUE(full->forward(prompt_, nullptr).ok());
  const ts::runtime::ExpertCacheReport second = full->expert_cache().value();
  EXPECT_EQ(second.requests - first.requests, first.requests);
  EXPECT_EQ(second.hits - first.hits, first.requests);
  EXPECT_EQ(second.copied_bytes, first.copied_bytes);
  EXPECT_EQ(second.slots_per_layer, hp.n_experts);
  EXPECT_EQ(second.residency, "host");

  auto one = engine(*model_, {.residency = GpuResidency::kHost, .slots_per_layer = 1}, 0);
  ASSERT_TRUE(one);
  ASSERT_TRUE(one->forward(prompt_, nullptr).ok());
  one->reset();
  ASSERT_TRUE(one->forward(prompt_, nullptr).ok());
  const ts::runtime::ExpertCacheReport r = one->expert_cache().value();
  EXPECT_EQ(r.requests, second.requests);
  EXPECT_LT(r.hits, r.requests);
  EXPECT_GT(r.copied_bytes, first.copied_bytes);

  // With the prefetch, what a chunk used still enters the cache: the repeat hits everything.
  auto pf = engine(*model_, {.residency = GpuResidency::kHost, .slots_per_layer = hp.n_experts}, 0);
  ASSERT_TRUE(pf);
  ASSERT_TRUE(pf->forward(prompt_, nullptr).ok());
  const ts::runtime::ExpertCacheReport p1 = pf->expert_cache().value();
  pf->reset();
  ASSERT_TRUE(pf->forward(prompt_, nullptr).ok());
  const ts::runtime::ExpertCacheReport p2 = pf->expert_cache().value();
  EXPECT_EQ(p1.requests, first.requests);
  EXPECT_EQ(p2.hits - p1.hits, p1.requests);
}

// --cache-warm: the histogram of a resident run fills a full-size cache with every expert
// the prompt uses, so the same prompt then hits on every request and copies nothing.
TEST_P(CudaExpertCache, WarmStartFromARouterHistogram) {
  const auto& hp = model_->hp();
  auto res = engine(*model_, {}, 0);
  ASSERT_TRUE(res);
  ASSERT_TRUE(res->forward(prompt_, nullptr).ok());
  const std::vector<uint64_t> hist = res->router_hist();
  ts::runtime::GpuExpertOptions g{.residency = GpuResidency::kHost, .slots_per_layer = hp.n_experts,
                                  .layer_prefetch = false};
  for (int l = 0; l < hp.n_layers; ++l)
    g.warm.emplace_back(hist.begin() + l * hp.n_experts, hist.begin() + (l + 1) * hp.n_experts);
  auto warm = engine(*model_, g, 0);
  ASSERT_TRUE(warm);
  std::vector<float> a, b;
  ASSERT_TRUE(warm->forward(prompt_, &a).ok());
  const ts::runtime::ExpertCacheReport r = warm->expert_cache().value();
  EXPECT_GT(r.requests, 0u);
  EXPECT_EQ(r.hits, r.requests);
  EXPECT_EQ(r.copied_bytes, 0u);
  res->reset();
  ASSERT_TRUE(res->forward(prompt_, &b).ok());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
}

INSTANTIATE_TEST_SUITE_P(Models, CudaExpertCache, ::testing::ValuesIn(ts_test::cuda_fixture_names()),
                         [](const auto& info) { return info.param; });

// BF16 and Q8_0 experts take the grouped tensor-core kernels in prefill (Q4_K experts the
// same on BF16 copies; the fixtures' F32 experts take cuBLAS): a small synthetic model with
// every token's experts drawn afresh, so every expert is used and most are misses. Host mode
// with 1 / 4 / 16 slots, with and without the whole-layer prefetch, must equal resident byte
// for byte; and the grouped prefill must agree with the per-token GEMV kernels (chunks of 8)
// to BF16 precision.
void check_grouped_prefill(const std::string& cfg, ts::DType t, int n_prompt,
                           std::optional<ts::DType> down_t = std::nullopt) {
  auto hp = ts::model::parse_hparams(cfg, "test config");
  ASSERT_TRUE(hp.ok()) << hp.error().message;
  const int vocab = hp.value().vocab;
  std::vector<int> prompt;
  for (int i = 0; i < n_prompt; ++i) prompt.push_back((i * 37 + 11) % vocab);
  const auto run = [&](ts::runtime::GpuExpertOptions g, int chunk) {
    ts::runtime::SessionOptions o{.n_ctx = std::max(512, n_prompt), .prefill_chunk = chunk};
    o.gpu_experts = g;
    auto e = ts::cuda::make_synthetic_cuda_session(
        hp.value(), std::move(o), 0,
        {.dtype = t, .seed = 5, .sampled_routing = true, .expert_down_dtype = down_t});
    EXPECT_TRUE(e.ok()) << e.error().message;
    std::vector<float> logits;
    if (e.ok()) {
      EXPECT_TRUE(e.value()->forward(prompt, &logits).ok());
    }
    return logits;
  };
  const std::vector<float> resident = run({}, n_prompt);
  ASSERT_EQ(resident.size(), prompt.size() * size_t(vocab));
  for (int slots : {1, 4, 16})
    for (bool prefetch : {true, false}) {
      const std::vector<float> host = run(
          {.residency = GpuResidency::kHost, .slots_per_layer = slots, .layer_prefetch = prefetch},
          n_prompt);
      ASSERT_EQ(host.size(), resident.size());
      EXPECT_EQ(0, std::memcmp(host.data(), resident.data(), host.size() * 4))
          << ts::dtype_name(t) << " host, " << slots << " slots, prefetch " << prefetch;
    }
  const std::vector<float> gemv = run({}, 8);
  ASSERT_EQ(gemv.size(), resident.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < gemv.size(); ++i) {
    num = std::max(num, double(std::fabs(gemv[i] - resident[i])));
    den = std::max(den, double(std::fabs(gemv[i])));
  }
  EXPECT_LE(num / den, 3e-2) << ts::dtype_name(t) << ": grouped vs GEMV prefill";
  EXPECT_GT(num, 0.0) << "the two paths should round differently";
}

// The two tests' model: a 2-layer qwen3_moe of 16 experts (top 4) of width d_expert.
std::string grouped_config(int d_expert) {
  return R"({"model_type": "qwen3_moe", "hidden_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 512, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": )" +
         std::to_string(d_expert) + R"(, "intermediate_size": 512, "norm_topk_prob": true,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 2048})";
}

TEST(CudaExpertCacheGrouped, TensorCorePrefillMatchesResidentAndGemvPath) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::string cfg = grouped_config(96);
  // 20, 40, 100 and 400 tokens: 5, 10, 25 and 100 rows per expert (Q8_0 experts read as blocks
  // by the grouped kernels: d_model 256 on grouped_quant_mma_kernel, d_expert 96 on the WMMA
  // one; at 20 and 40 tokens no expert has more than kQuantSmallTile rows: tiles of that
  // height); 1,100: 275 rows per expert (Q8_0 experts dequantized to BF16 for the chunk first,
  // kDequantQ8MinRows). Resident, BF16 experts and Q8_0 ones of 40 and 100 tokens run on the
  // plan unread (launches for both heights, the plan's taking the tiles; Q8_0 at 20 tokens
  // reads it); the host cache reads it: byte-identical.
  for (const int n_prompt : {20, 40, 100, 400, 1100})
    for (ts::DType t : {ts::DType::kBF16, ts::DType::kQ8_0}) {
      SCOPED_TRACE(std::string(ts::dtype_name(t)) + ", " + std::to_string(n_prompt) + " tokens");
      check_grouped_prefill(cfg, t, n_prompt);
    }
}

// Q4_K experts (rows of 256-multiples) read in place by the grouped kernel at 10 and 25 rows
// per expert and on BF16 copies at 100 (kDequantQ4KMinRows), alone and with Q8_0 down matrices
// (a Q4_K_M file's Q6_K ones requantized at load: phase 2 on the Q8_0 kernel); the dense Q4_K
// matrices through the dequantization for cuBLAS.
TEST(CudaExpertCacheGrouped, Q4KExpertsPrefillMatchesResidentAndGemvPath) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::string cfg = grouped_config(256);
  for (const int n_prompt : {40, 100, 400})
    for (const bool q8_down : {false, true}) {
      SCOPED_TRACE(std::to_string(n_prompt) + " tokens, down " + (q8_down ? "Q8_0" : "Q4_K"));
      check_grouped_prefill(cfg, ts::DType::kQ4_K, n_prompt,
                            q8_down ? std::optional(ts::DType::kQ8_0) : std::nullopt);
    }
}

// Decode past the cluster path's kClusterAttentionKeys keys on models whose weights are not
// F32 (attention on tensor cores from the cache's BF16 copies): the resident graphs and the host
// expert cache's segments byte-identical at every step, and every step's logits within BF16
// precision of one prefill of the same tokens (tensor-core prefill attention, grouped experts):
// a wrong layer's or position's keys would miss by far more. Every position's experts are drawn
// from the position alone (sampled routing), so both paths pick the same ones.
TEST(CudaExpertCacheGrouped, LongDecodeOnTensorCoresMatchesHostCacheAndPrefill) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto hp = ts::model::parse_hparams(grouped_config(96), "test config");
  ASSERT_TRUE(hp.ok()) << hp.error().message;
  ASSERT_TRUE(ts::cuda::tc_decode_attention_applies(hp.value().n_heads, hp.value().n_kv_heads,
                                                    hp.value().head_dim));
  const int vocab = hp.value().vocab, T = ts::cuda::kClusterAttentionKeys + 40, P = 200;
  std::vector<int> tokens;
  for (int i = 0; i < T; ++i) tokens.push_back((i * 37 + 11) % vocab);
  for (const ts::DType t : {ts::DType::kBF16, ts::DType::kQ8_0}) {
    SCOPED_TRACE(ts::dtype_name(t));
    const auto session = [&](ts::runtime::GpuExpertOptions g) {
      ts::runtime::SessionOptions o{.n_ctx = 512};
      o.gpu_experts = g;
      auto e = ts::cuda::make_synthetic_cuda_session(
          hp.value(), std::move(o), 0, {.dtype = t, .seed = 9, .sampled_routing = true});
      EXPECT_TRUE(e.ok()) << e.error().message;
      return e.ok() ? std::move(e.value()) : nullptr;
    };
    // Prefill of the first P tokens, then one step per token up to T.
    const auto decode = [&](ts::runtime::GpuExpertOptions g) {
      std::vector<float> rows;
      auto e = session(g);
      if (!e) return rows;
      EXPECT_TRUE(e->forward(std::span<const int>(tokens.data(), P), nullptr).ok());
      for (int i = P; i < T; ++i) {
        EXPECT_TRUE(e->forward(std::span<const int>(&tokens[size_t(i)], 1), nullptr).ok());
        rows.insert(rows.end(), e->last_logits().begin(), e->last_logits().end());
      }
      return rows;
    };
    const std::vector<float> resident = decode({});
    const std::vector<float> host =
        decode({.residency = GpuResidency::kHost, .slots_per_layer = 4});
    ASSERT_EQ(resident.size(), size_t(T - P) * size_t(vocab));
    ASSERT_EQ(host.size(), resident.size());
    EXPECT_EQ(0, std::memcmp(host.data(), resident.data(), host.size() * 4)) << "host cache";
    std::vector<float> prefill;
    auto e = session({});
    ASSERT_TRUE(e);
    ASSERT_TRUE(e->forward(tokens, &prefill).ok());
    ASSERT_EQ(prefill.size(), size_t(T) * size_t(vocab));
    double num = 0, den = 0;
    for (int i = P; i < T; ++i)
      for (int v = 0; v < vocab; ++v) {
        const float d = resident[size_t(i - P) * size_t(vocab) + size_t(v)];
        const float p = prefill[size_t(i) * size_t(vocab) + size_t(v)];
        num = std::max(num, double(std::fabs(d - p)));
        den = std::max(den, double(std::fabs(p)));
      }
    EXPECT_LE(num / den, 3e-2) << "decode vs prefill";
  }
}

TEST(CudaExpertCacheErrors, CacheSmallerThanOneExpertIsAClearError) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto m = ts::runtime::LoadedModel::load((data_dir() / "models" / "olmoe").string());
  ASSERT_TRUE(m.ok());
  ts::ThreadPool pool(1);
  ts::runtime::SessionOptions o{.n_ctx = 16};
  o.gpu_experts = {.residency = GpuResidency::kHost, .cache_gb = 1e-9};
  auto e = ts::runtime::make_engine(*m.value(), pool, std::move(o),
                                    {ts::runtime::DeviceKind::kCuda, 0});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message.find("--gpu-expert-cache-gb"), std::string::npos)
      << e.error().message;
}

}  // namespace
