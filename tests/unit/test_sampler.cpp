// Sampler: presence / frequency penalties against a direct reference, logit biases, min-p's
// cut, seeds; the draw against the whole-vocabulary sort it replaced (the same token from the
// same seed).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "core/thread_pool.h"
#include "runtime/sampler.h"

namespace {

using ts::runtime::Sampler;
using ts::runtime::SamplerOptions;

std::vector<float> random_logits(std::mt19937& rng, int n) {
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

TEST(Sampler, GreedyPenaltiesMatchReference) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<float> logits = random_logits(rng, 50);
    // Large enough that 40 steps always move greedy off the best token (the gap between the
    // two best of 50 normal(0, 2) logits is far below presence + 40 * 0.2).
    std::uniform_real_distribution<float> pen(0.2f, 2.0f);
    const float presence = pen(rng), frequency = pen(rng);
    Sampler s({.presence_penalty = presence, .frequency_penalty = frequency});
    std::map<int, int> counts;
    for (int step = 0; step < 40; ++step) {
      std::vector<float> ref = logits;
      for (auto [id, n] : counts) ref[size_t(id)] -= presence + frequency * float(n);
      const int want = ts::runtime::argmax(ref);
      ASSERT_EQ(s.sample(logits), want) << "trial " << trial << " step " << step;
      ++counts[want];
    }
    // The penalties must have moved greedy off the single best token.
    EXPECT_GT(counts.size(), 1u);
  }
}

// logit_bias: added to the logits before the penalties and any sampling; -100 keeps a token
// out of every draw, a bias that lifts a token above the rest makes greedy take it, ids past
// the logits are ignored.
TEST(Sampler, LogitBiasShiftsTheLogitsFirst) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<float> logits = random_logits(rng, 40);
    const int best = ts::runtime::argmax(logits);
    const int other = (best + 1 + int(rng() % 39)) % 40;
    std::vector<float> lifted = logits;
    lifted[size_t(other)] += 30.0f;
    Sampler lift({.logit_bias = {{other, 30.0f}, {999, 50.0f}}});
    EXPECT_EQ(lift.sample(logits), ts::runtime::argmax(lifted));
    EXPECT_EQ(lift.sample(logits), other);
    Sampler ban({.temperature = 1.0f, .seed = rng(), .logit_bias = {{best, -100.0f}}});
    for (int i = 0; i < 500; ++i) ASSERT_NE(ban.sample(logits), best) << "trial " << trial;
    // Greedy with the best banned and a penalty on what it said: the reference applies both.
    Sampler both({.frequency_penalty = 1.0f, .logit_bias = {{best, -100.0f}}});
    std::map<int, int> counts;
    for (int step = 0; step < 10; ++step) {
      std::vector<float> ref = logits;
      ref[size_t(best)] -= 100.0f;
      for (auto [id, n] : counts) ref[size_t(id)] -= float(n);
      const int want = ts::runtime::argmax(ref);
      ASSERT_EQ(both.sample(logits), want) << "trial " << trial << " step " << step;
      ++counts[want];
    }
  }
}

TEST(Sampler, NegativePenaltyRepeats) {
  // A negative frequency penalty favours what was already said: greedy never leaves it.
  std::vector<float> logits = {1.0f, 0.9f, 0.8f};
  Sampler s({.frequency_penalty = -1.0f});
  for (int i = 0; i < 10; ++i) EXPECT_EQ(s.sample(logits), 0);
}

TEST(Sampler, MinPCutsRelativeToTheBest) {
  // Three near-equal tokens and the rest far below: with min_p = 0.2 the far ones
  // (probability ratio e^-6 to the best) never come, and all near ones do.
  std::mt19937 rng(std::random_device{}());
  std::vector<float> logits(20, -6.0f);
  logits[3] = 0.0f, logits[7] = -0.3f, logits[11] = -0.6f;
  Sampler s({.temperature = 1.0f, .min_p = 0.2f, .seed = rng()});
  std::set<int> seen;
  for (int i = 0; i < 2000; ++i) seen.insert(s.sample(logits));
  EXPECT_EQ(seen, (std::set<int>{3, 7, 11}));
  // Without min-p the tail shows up.
  Sampler plain({.temperature = 1.0f, .seed = rng()});
  std::set<int> all;
  for (int i = 0; i < 2000; ++i) all.insert(plain.sample(logits));
  EXPECT_GT(all.size(), 3u);
}

TEST(Sampler, MinPOneIsGreedy) {
  std::mt19937 rng(std::random_device{}());
  const std::vector<float> logits = random_logits(rng, 100);
  Sampler s({.temperature = 1.5f, .min_p = 1.0f, .seed = rng()});
  for (int i = 0; i < 50; ++i) EXPECT_EQ(s.sample(logits), ts::runtime::argmax(logits));
}

TEST(Sampler, SeedReproducesWithPenalties) {
  std::mt19937 rng(std::random_device{}());
  const std::vector<float> logits = random_logits(rng, 64);
  const SamplerOptions opt{.temperature = 0.8f,
                           .top_k = 20,
                           .top_p = 0.9f,
                           .min_p = 0.05f,
                           .presence_penalty = 0.5f,
                           .frequency_penalty = 0.3f,
                           .seed = rng()};
  Sampler a(opt), b(opt);
  std::vector<int> sa, sb;
  for (int i = 0; i < 100; ++i) sa.push_back(a.sample(logits)), sb.push_back(b.sample(logits));
  EXPECT_EQ(sa, sb);
  EXPECT_GT(std::set<int>(sa.begin(), sa.end()).size(), 1u);
}

// The draw as the sampler made it before its sort became lazy: every token sorted by logit
// (ties: lower id), weights exp((logit - max) / T) summed in that order, top-k, top-p, min-p
// as prefixes, then the seeded walk.
std::vector<int> full_order(std::span<const float> logits) {
  std::vector<int> idx(logits.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](int a, int b) {
    return logits[size_t(a)] > logits[size_t(b)] ||
           (logits[size_t(a)] == logits[size_t(b)] && a < b);
  });
  return idx;
}

// idx: full_order(logits).
int reference_pick(std::span<const float> logits, const std::vector<int>& idx,
                   const SamplerOptions& o, std::mt19937_64& rng) {
  size_t keep = idx.size();
  if (o.top_k > 0 && size_t(o.top_k) < keep) keep = size_t(o.top_k);
  std::vector<double> p(keep);
  const double mx = logits[size_t(idx[0])];
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) {
    p[i] = std::exp((double(logits[size_t(idx[i])]) - mx) / double(o.temperature));
    sum += p[i];
  }
  if (o.top_p < 1.0f) {
    double cum = 0;
    size_t n = 0;
    while (n < keep) {
      cum += p[n] / sum;
      ++n;
      if (cum >= double(o.top_p)) break;
    }
    keep = n;
    sum = std::accumulate(p.begin(), p.begin() + long(keep), 0.0);
  }
  if (o.min_p > 0.0f) {
    size_t n = 1;
    while (n < keep && p[n] >= double(o.min_p)) ++n;
    keep = n;
    sum = std::accumulate(p.begin(), p.begin() + long(keep), 0.0);
  }
  double u = double(rng() >> 11) * (1.0 / 9007199254740992.0) * sum;
  for (size_t i = 0; i < keep; ++i) {
    if (u < p[i]) return idx[i];
    u -= p[i];
  }
  return idx[keep - 1];
}

// Flat and peaked logits, ties, tokens masked to -inf (JSON mode), vocabularies from 3 to
// 152k, and every combination of the cuts: the same token as the reference, draw for draw
// (a draw could only differ where the two sums' last bits put it exactly on a boundary), with
// and without a thread pool.
TEST(Sampler, LazySortDrawsWhatTheFullSortDrew) {
  std::mt19937 rng(std::random_device{}());
  const SamplerOptions cuts[] = {
      {.temperature = 0.7f},
      {.temperature = 1.0f, .top_p = 0.95f},
      {.temperature = 0.6f, .top_k = 20, .top_p = 0.95f},
      {.temperature = 1.3f, .min_p = 0.05f},
      {.temperature = 0.8f, .top_k = 300, .top_p = 0.5f, .min_p = 0.01f},
      {.temperature = 50.0f},
      {.temperature = 0.05f, .top_p = 0.99f},
  };
  int draws = 0;
  ts::ThreadPool pool(3);  // the passes over the vocabulary in chunks on 3 threads: the same draws
  for (int vocab : {3, 100, 5000, 151936}) {
    for (int shape = 0; shape < 4; ++shape) {
      std::vector<float> logits = random_logits(rng, vocab);
      if (shape == 1)  // peaked: a few tokens far above the rest
        for (int i = 0; i < std::min(vocab, 5); ++i) logits[size_t(rng() % vocab)] += 15.0f;
      if (shape == 2)  // ties: logits on a coarse grid
        for (float& l : logits) l = std::round(l);
      if (shape == 3)  // most tokens masked
        for (float& l : logits)
          if (rng() % 10 != 0) l = -INFINITY;
      if (shape == 3) logits[0] = 1.0f;  // at least one token left
      const std::vector<int> order = full_order(logits);
      for (SamplerOptions o : cuts) {
        o.seed = rng();
        Sampler s(o), threaded(o);
        threaded.set_pool(&pool);
        std::mt19937_64 ref_rng(o.seed);
        const int n = vocab > 10000 ? 8 : 40;
        for (int i = 0; i < n; ++i, ++draws) {
          const int want = reference_pick(logits, order, o, ref_rng);
          ASSERT_EQ(threaded.sample(logits), want) << "on 3 threads";
          ASSERT_EQ(s.sample(logits), want)
              << "vocab " << vocab << " shape " << shape << " T " << o.temperature << " top_k "
              << o.top_k << " top_p " << o.top_p << " min_p " << o.min_p << " draw " << i;
        }
      }
    }
  }
  EXPECT_GT(draws, 1000);
}

// Greedy over a large vocabulary goes by ranges on the pool: argmax's answer (the first of
// the largest) also with ties across ranges, NaN inside, NaN first (argmax: 0) and -inf.
TEST(Sampler, GreedyOnAPoolIsArgmax) {
  std::mt19937 rng(std::random_device{}());
  ts::ThreadPool pool(3);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<float> logits = random_logits(rng, 40000 + int(rng() % 20000));
    const size_t n = logits.size();
    if (trial % 4 == 1) {  // the largest value twice, far apart
      const float top = *std::max_element(logits.begin(), logits.end()) + 1.0f;
      logits[rng() % n] = top;
      logits[rng() % n] = top;
    }
    if (trial % 4 == 2) logits[rng() % n] = NAN;
    if (trial % 8 == 3) logits[0] = NAN;
    if (trial % 4 == 3)
      for (float& l : logits)
        if (rng() % 3 == 0) l = -INFINITY;
    Sampler s(SamplerOptions{});
    s.set_pool(&pool);
    ASSERT_EQ(s.sample(logits), ts::runtime::argmax(logits)) << "trial " << trial;
  }
}

}  // namespace
