// ThreadPool: parallel_for covers its range once; fixed_chunks gives every thread count (and
// no pool) the same ranges, so results kept per chunk and combined in order are the same bits.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "core/thread_pool.h"

namespace {

TEST(ThreadPool, ParallelForCoversTheRangeOnce) {
  for (int threads : {1, 2, 3, 5}) {
    ts::ThreadPool pool(threads);
    for (int64_t n : {0, 1, 7, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      pool.parallel_for(n, 3, [&](int64_t a, int64_t b) {
        for (int64_t i = a; i < b; ++i) hits[size_t(i)]++;
      });
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[size_t(i)].load(), 1) << threads << " " << n;
    }
  }
}

TEST(ThreadPool, FixedChunksAreTheSameRangesOnAnyPool) {
  std::mt19937 rng(3);
  std::vector<float> v(100003);
  for (float& x : v) x = std::ldexp(float(rng() % 1000), int(rng() % 40) - 20);
  // The ranges seen, and a sum made of per-chunk float sums (order-sensitive in float).
  const auto run = [&](ts::ThreadPool* pool, size_t n) {
    std::vector<std::tuple<size_t, size_t>> ranges(16);
    std::vector<float> part(16, 0.0f);
    ts::ThreadPool::fixed_chunks(pool, n, 16, [&](size_t a, size_t b, int c) {
      ranges[size_t(c)] = {a, b};
      for (size_t i = a; i < b; ++i) part[size_t(c)] += v[i];
    });
    float sum = 0;
    for (float p : part) sum += p;
    return std::pair{ranges, sum};
  };
  for (size_t n : {size_t(0), size_t(5), size_t(16), v.size()}) {
    const auto [want_ranges, want_sum] = run(nullptr, n);
    size_t covered = 0;
    for (const auto& [a, b] : want_ranges) {
      EXPECT_EQ(a, covered) << "contiguous, in chunk order";
      EXPECT_LE(a, b);
      covered = b;
    }
    EXPECT_EQ(covered, n);
    for (int threads : {1, 2, 3, 7}) {
      ts::ThreadPool pool(threads);
      const auto [ranges, sum] = run(&pool, n);
      EXPECT_EQ(ranges, want_ranges) << threads;
      EXPECT_EQ(sum, want_sum) << threads;  // bitwise
    }
  }
}

}  // namespace
