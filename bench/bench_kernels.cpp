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
#include <random>
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

// matvec over consecutive [rows, cols] windows of the arena; returns GB/s of weights read.
double bench_matvec(ts::ThreadPool* pool, const std::vector<uint8_t>& arena, ts::DType wt,
                    int64_t rows, int64_t cols, int reps) {
  size_t mat_bytes = size_t(rows * cols) * ts::dtype_size(wt);
  size_t n_mats = std::max<size_t>(1, arena.size() / mat_bytes);
  std::vector<float> x(static_cast<size_t>(cols)), y(static_cast<size_t>(rows));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (auto& v : x) v = dist(rng);
  double best = 0.0;
  for (int rep = 0; rep < reps; ++rep) {
    auto t0 = Clock::now();
    for (size_t m = 0; m < n_mats; ++m) {
      const void* w = arena.data() + m * mat_bytes;
      if (pool != nullptr) {
        ts::cpu::matvec(*pool, w, wt, x.data(), y.data(), rows, cols);
      } else {
        ts::cpu::matvec_rows(w, wt, x.data(), y.data(), cols, 0, rows);
      }
    }
    best = std::max(best, double(mat_bytes * n_mats) / seconds_since(t0) / 1e9);
  }
  return best;
}

// matmul of n_tokens x [rows, cols]; weights reused across reps (it is compute-bound).
double bench_matmul(ts::ThreadPool* pool, const std::vector<uint8_t>& arena, ts::DType wt,
                    int64_t n_tokens, int64_t rows, int64_t cols, int reps) {
  std::vector<float> x(static_cast<size_t>(n_tokens * cols));
  std::vector<float> y(static_cast<size_t>(n_tokens * rows));
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (auto& v : x) v = dist(rng);
  double flops = 2.0 * double(n_tokens) * double(rows) * double(cols);
  double best = 0.0;
  for (int rep = 0; rep < reps; ++rep) {
    auto t0 = Clock::now();
    if (pool != nullptr) {
      ts::cpu::matmul(*pool, arena.data(), wt, x.data(), n_tokens, y.data(), rows, cols);
    } else {
      ts::cpu::matmul_rows(arena.data(), wt, x.data(), n_tokens, y.data(), rows, cols, 0, rows);
    }
    best = std::max(best, flops / seconds_since(t0) / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = argc > 1 && std::string_view(argv[1]) == "--quick";
  int reps = quick ? 2 : 4;
  std::vector<uint8_t> arena(kArenaBytes);
  std::mt19937 rng(42);
  ts::ThreadPool pool2(2);
  std::printf("detected ISA: %s\n", std::string(ts::cpu::isa_name(ts::cpu::detect_isa())).c_str());

  fill_weights(arena, ts::DType::kF32, rng);
  double read_gbs = measure_read_gbs(arena);
  std::printf("roofline: AVX-512 read of 1 GiB, 1 thread: %.1f GB/s\n\n", read_gbs);

  const ts::DType dtypes[] = {ts::DType::kF32, ts::DType::kF16, ts::DType::kBF16};
  const ts::cpu::Isa isas[] = {ts::cpu::Isa::kPortable, ts::cpu::Isa::kAvx2, ts::cpu::Isa::kAvx512};
  std::printf("%-9s %-5s %12s %12s %12s %14s %14s\n", "isa", "dtype", "mv4096 1t", "mv4096 2t",
              "lmhead 2t", "mm256 1t", "mm256 2t");
  std::printf("%-9s %-5s %12s %12s %12s %14s %14s\n", "", "", "GB/s", "GB/s", "GB/s", "GFLOP/s",
              "GFLOP/s");
  for (ts::DType wt : dtypes) {
    fill_weights(arena, wt, rng);
    for (ts::cpu::Isa isa : isas) {
      if (isa > ts::cpu::detect_isa()) continue;
      ts::cpu::set_active_isa(isa);
      bool slow = isa == ts::cpu::Isa::kPortable;
      int r = slow ? 1 : reps;
      double mv1 = bench_matvec(nullptr, arena, wt, 4096, 4096, r);
      double mv2 = bench_matvec(&pool2, arena, wt, 4096, 4096, r);
      // lm head of a 152k vocabulary, d_model 2048 (BF16: 622 MB); F32 is cut to the arena.
      int64_t lm_rows =
          std::min<int64_t>(151936, int64_t(kArenaBytes / (2048 * ts::dtype_size(wt))));
      double lm = slow ? 0.0 : bench_matvec(&pool2, arena, wt, lm_rows, 2048, r);
      double mm1 = bench_matmul(nullptr, arena, wt, slow ? 16 : 256, 2048, 2048, r);
      double mm2 = bench_matmul(&pool2, arena, wt, slow ? 16 : 256, 2048, 2048, r);
      std::printf("%-9s %-5s %12.1f %12.1f %12.1f %14.1f %14.1f%s\n",
                  std::string(ts::cpu::isa_name(isa)).c_str(),
                  std::string(ts::dtype_name(wt)).c_str(), mv1, mv2, lm, mm1, mm2,
                  slow ? "  (matmul with 16 tokens)" : "");
    }
  }
  std::printf(
      "\nmv4096: 4096x4096 matvec cycling through 1 GiB of weights; lmhead: 151936 rows "
      "x 2048 cols; mm256: 256 tokens x [2048, 2048].\n");
  return 0;
}
