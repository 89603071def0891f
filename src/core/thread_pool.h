// A fixed pool of worker threads running one parallel-for at a time. The calling thread
// takes part as worker 0. Work is split into contiguous ranges by index, so a row's result
// never depends on how many threads ran (each row is computed by exactly one thread with
// one fixed summation order): output is identical for any thread count.
//
// Workers spin on an atomic generation counter for a short while before sleeping on a
// condition variable: a decode step issues hundreds of small parallel-fors, and waking a
// sleeping thread costs tens of microseconds each (measured: decode of the 2 GB bench model
// went from 4.8 to 46 tok/s with 2 threads, docs/PERF.md).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ts {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Calls fn(begin, end) on disjoint ranges covering [0, n), at most one per thread;
  // ranges are multiples of `grain` (except the last). Returns when all are done.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  // Calls fn(thread_index) once on each of size() threads.
  void run_on_all(const std::function<void(int)>& fn);
  // Calls fn(begin, end, chunk) on `chunks` fixed ranges of [0, n) (the last ones may be
  // empty), on the pool's threads when there is a pool: results kept per
  // chunk and combined in chunk order are the same bits for any thread count. Not from inside
  // another parallel-for of the same pool.
  static void fixed_chunks(ThreadPool* pool, size_t n, int chunks,
                           const std::function<void(size_t, size_t, int)>& fn);

 private:
  void worker(int index);

  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_start_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace ts
