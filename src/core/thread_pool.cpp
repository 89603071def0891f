#include "core/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TS_CPU_RELAX() _mm_pause()
#else
#define TS_CPU_RELAX() std::this_thread::yield()
#endif

namespace ts {
namespace {
// How long an idle worker spins before it sleeps. Long enough to cover the gaps between the
// parallel-fors of one decode step, short enough not to burn a core between requests.
constexpr auto kSpin = std::chrono::microseconds(2000);
}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  cv_start_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  for (;;) {
    // Spin, then sleep, until a new generation (or stop).
    auto t0 = std::chrono::steady_clock::now();
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && !stop_.load()) {
      TS_CPU_RELAX();
      // Yield now and then: when other processes compete for the cores, a pure spin would
      // hold a core the thread we wait for needs.
      if (++spins % 256 == 0) std::this_thread::yield();
      if (spins % 1024 == 0 && std::chrono::steady_clock::now() - t0 > kSpin) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1);
        cv_start_.wait(lock, [&] {
          return stop_.load() || generation_.load(std::memory_order_acquire) != seen;
        });
        sleepers_.fetch_sub(1);
        break;
      }
    }
    if (stop_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    (*job_)(index);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run_on_all(const std::function<void(int)>& fn) {
  if (n_threads_ == 1) {
    fn(0);
    return;
  }
  job_ = &fn;
  pending_.store(n_threads_ - 1, std::memory_order_release);
  {
    // Publishing under the mutex pairs with a worker's check-then-sleep.
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  if (sleepers_.load() > 0) cv_start_.notify_all();
  fn(0);
  for (int spins = 1; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    TS_CPU_RELAX();
    if (spins % 256 == 0) std::this_thread::yield();
  }
  job_ = nullptr;
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  int64_t chunks = (n + grain - 1) / grain;
  int used = int(std::min<int64_t>(n_threads_, chunks));
  if (used <= 1) {
    fn(0, n);
    return;
  }
  run_on_all([&](int t) {
    if (t >= used) return;
    int64_t c0 = chunks * t / used, c1 = chunks * (t + 1) / used;
    int64_t b = c0 * grain, e = std::min(n, c1 * grain);
    if (b < e) fn(b, e);
  });
}

void ThreadPool::fixed_chunks(ThreadPool* pool, size_t n, int chunks,
                              const std::function<void(size_t, size_t, int)>& fn) {
  const size_t per = (n + size_t(chunks) - 1) / size_t(chunks);
  const auto run = [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      fn(std::min(n, size_t(c) * per), std::min(n, size_t(c + 1) * per), int(c));
  };
  if (pool)
    pool->parallel_for(chunks, 1, run);  // one thread: inline
  else
    run(0, chunks);
}

}  // namespace ts
