// Micro-benchmark of the CPU matvec / matmul kernels against the machine's roofline: matvec
// in GB/s of weights read (compared with a plain AVX-512 / AVX2 read of the same bytes),
// matmul in GFLOP/s. Weights cycle through a 1 GiB arena so matvec reads come from DRAM, not
// from the (large, shared) L3 of a cloud host.
//
// Build by hand (no CMake target on purpose; it is a lab tool):
//   g++ -std=c++20 -O3 -DNDEBUG -Isrc bench/bench_kernels.cpp src/backend/cpu/dispatch.cpp
//     src/backend/cpu/kernels_portable.cpp src/core/thread_pool.cpp
//     <kernels_avx2.o built with -mavx2 -mfma -mf16c>
//     <kernels_avx512.o built with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16
//      -mfma -mf16c> -pthread -o bench_kernels
// Run: ./bench_kernels [--quick]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "backend/cpu/kernels.h"
#include "core/dtype.h"
#include "core/thread_pool.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// CPU time of the calling thread: on a shared 2-core box, wall time of a single-threaded
// run includes time other processes held the core; thread CPU time does not. (Memory
// bandwidth taken by other processes still shows in both.)
double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Best rate over repetitions, by wall time and (single thread) by thread CPU time.
struct Rate {
  double wall = 0.0;
  double cpu = 0.0;
};

template <class Fn>
Rate best_rate(double work, int reps, const Fn& fn) {
  Rate best;
  for (int rep = 0; rep < reps; ++rep) {
    double c0 = thread_cpu_seconds();
    auto t0 = Clock::now();
    fn();
    double wall = seconds_since(t0), cpu = thread_cpu_seconds() - c0;
    best.wall = std::max(best.wall, work / wall);
    best.cpu = std::max(best.cpu, work / cpu);
  }
  return best;
}

std::string load_average() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return "?";
  char buf[64] = {};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::string s(buf, n);
  return s.substr(0, s.find(' '));
}

constexpr size_t kArenaBytes = size_t(1) << 30;

// Fills the arena with weights of type wt drawn from [-1, 1]: real values, no denormals,
// so conversions and FMAs run at their normal speed.
void fill_weights(std::vector<uint8_t>& arena, ts::DType wt, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  size_t n = arena.size() / ts::dtype_size(wt);
  // A 64 Ki-element random pattern repeated: the kernels' speed does not depend on values,
  // and generating 512 Mi random numbers would dominate the run.
  std::vector<uint8_t> pattern((size_t(1) << 16) * ts::dtype_size(wt));
  for (size_t i = 0; i < (size_t(1) << 16); ++i) {
    float v = dist(rng);
    if (wt == ts::DType::kF32) {
      std::memcpy(&pattern[i * 4], &v, 4);
    } else {
      uint16_t h = wt == ts::DType::kF16 ? ts::f32_to_f16(v) : ts::f32_to_bf16(v);
      std::memcpy(&pattern[i * 2], &h, 2);
    }
  }
  for (size_t off = 0; off < n * ts::dtype_size(wt); off += pattern.size())
    std::memcpy(&arena[off], pattern.data(), std::min(pattern.size(), arena.size() - off));
}

// The roofline: read the whole arena with wide loads and several accumulators.
__attribute__((target("avx512f"))) float read_avx512(const uint8_t* p, size_t bytes) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 256 <= bytes; i += 256) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(reinterpret_cast<const float*>(p + i)));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(reinterpret_cast<const float*>(p + i + 64)));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(reinterpret_cast<const float*>(p + i + 128)));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(reinterpret_cast<const float*>(p + i + 192)));
  }
  // Not _mm512_reduce_add_ps: g++ 12's header trips -Wuninitialized (GCC PR 105593).
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  float sum = 0.0f;
  for (float v : lanes) sum += v;
  return sum;
}

double measure_read_gbs(const std::vector<uint8_t>& arena) {
  if (!__builtin_cpu_supports("avx512f")) return 0.0;
  double best = 0.0;
  volatile float sink = 0.0f;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = Clock::now();
    sink = sink + read_avx512(arena.data(), arena.size());
    best = std::max(best, double(arena.size()) / seconds_since(t0) / 1e9);
  }
  return best;
}

// matvec over consecutive [rows, cols] windows of the arena, in GB/s of weights read.
Rate bench_matvec(ts::ThreadPool* pool, const std::vector<uint8_t>& arena, ts::DType wt,
                  int64_t rows, int64_t cols, int reps) {
  size_t mat_bytes = size_t(rows * cols) * ts::dtype_size(wt);
  size_t n_mats = std::max<size_t>(1, arena.size() / mat_bytes);
  std::vector<float> x(static_cast<size_t>(cols)), y(static_cast<size_t>(rows));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (auto& v : x) v = dist(rng);
  return best_rate(double(mat_bytes * n_mats) / 1e9, reps, [&] {
    for (size_t m = 0; m < n_mats; ++m) {
      const void* w = arena.data() + m * mat_bytes;
      if (pool != nullptr) {
        ts::cpu::matvec(*pool, w, wt, x.data(), y.data(), rows, cols);
      } else {
        ts::cpu::matvec_rows(w, wt, x.data(), y.data(), cols, 0, rows);
      }
    }
  });
}

// matmul of n_tokens x [rows, cols] in GFLOP/s; the same weights every rep (2048 x 2048 is
// 8 MiB in BF16: compute-bound, mostly from L2/L3).
Rate bench_matmul(ts::ThreadPool* pool, const std::vector<uint8_t>& arena, ts::DType wt,
                  int64_t n_tokens, int64_t rows, int64_t cols, int reps) {
  std::vector<float> x(static_cast<size_t>(n_tokens * cols));
  std::vector<float> y(static_cast<size_t>(n_tokens * rows));
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (auto& v : x) v = dist(rng);
  double gflop = 2.0 * double(n_tokens) * double(rows) * double(cols) / 1e9;
  return best_rate(gflop, reps, [&] {
    if (pool != nullptr) {
      ts::cpu::matmul(*pool, arena.data(), wt, x.data(), n_tokens, y.data(), rows, cols);
    } else {
      ts::cpu::matmul_rows(arena.data(), wt, x.data(), n_tokens, y.data(), rows, cols, 0, rows);
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = argc > 1 && std::string_view(argv[1]) == "--quick";
  int reps = quick ? 2 : 5;
  std::vector<uint8_t> arena(kArenaBytes);
  std::mt19937 rng(42);
  ts::ThreadPool pool2(2);
  std::printf("detected ISA: %s; load average at start: %s\n",
              std::string(ts::cpu::isa_name(ts::cpu::detect_isa())).c_str(),
              load_average().c_str());

  fill_weights(arena, ts::DType::kF32, rng);
  std::printf("roofline: AVX-512 read of 1 GiB, 1 thread: %.1f GB/s\n\n", measure_read_gbs(arena));

  const ts::DType dtypes[] = {ts::DType::kF32, ts::DType::kF16, ts::DType::kBF16};
  const ts::cpu::Isa isas[] = {ts::cpu::Isa::kPortable, ts::cpu::Isa::kAvx2,
                               ts::cpu::Isa::kAvx2Vnni, ts::cpu::Isa::kAvx512};
  std::printf("%-9s %-5s | %-24s | %-9s | %-27s\n", "", "", "matvec 4096x4096, GB/s", "lm head",
              "matmul T=256 2048x2048 GFLOP/s");
  std::printf("%-9s %-5s | %7s %7s %8s | %9s | %8s %8s %9s\n", "isa", "dtype", "1t", "1t-cpu", "2t",
              "2t GB/s", "1t", "1t-cpu", "2t");
  for (ts::DType wt : dtypes) {
    fill_weights(arena, wt, rng);
    for (ts::cpu::Isa isa : isas) {
      if (!ts::cpu::isa_supported(isa)) continue;
      ts::cpu::set_active_isa(isa);
      bool slow = isa == ts::cpu::Isa::kPortable;
      int r = slow ? 1 : reps;
      Rate mv1 = bench_matvec(nullptr, arena, wt, 4096, 4096, r);
      Rate mv2 = bench_matvec(&pool2, arena, wt, 4096, 4096, r);
      // lm head of a 152k vocabulary, d_model 2048 (BF16: 622 MB); F32 is cut to the arena.
      int64_t lm_rows =
          std::min<int64_t>(151936, int64_t(kArenaBytes / (2048 * ts::dtype_size(wt))));
      Rate lm = slow ? Rate{} : bench_matvec(&pool2, arena, wt, lm_rows, 2048, r);
      int64_t n_tokens = slow ? 16 : 256;
      Rate mm1 = bench_matmul(nullptr, arena, wt, n_tokens, 2048, 2048, r);
      Rate mm2 = bench_matmul(&pool2, arena, wt, n_tokens, 2048, 2048, r);
      std::printf("%-9s %-5s | %7.1f %7.1f %8.1f | %9.1f | %8.1f %8.1f %9.1f%s\n",
                  std::string(ts::cpu::isa_name(isa)).c_str(),
                  std::string(ts::dtype_name(wt)).c_str(), mv1.wall, mv1.cpu, mv2.wall, lm.wall,
                  mm1.wall, mm1.cpu, mm2.wall, slow ? "  (T=16)" : "");
    }
  }
  std::printf(
      "\nmatvec cycles through 1 GiB of weights (DRAM, not L3); lm head: 151936 x 2048 (F32: "
      "cut to 1 GiB), 2 threads. 1t-cpu: work / thread CPU time (excludes time other "
      "processes held the core). Best of %d. Load average at end: %s\n",
      reps, load_average().c_str());
  return 0;
}
