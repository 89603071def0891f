// Micro-benchmark of the Q8_0 / Q4_K kernels (backend/cpu/quant.h) against the machine's
// roofline: matvec 4096 x 4096 in GB/s of weights read (weights cycle through a 1 GiB arena
// so reads come from DRAM, not L3), matmul T=64 in GFLOP/s, per ISA, 1 and 2 threads.
// BF16 matvec of the same shape is printed alongside for comparison.
//
// Build by hand against the library of a CMake build (a lab tool, no target on purpose):
//   g++ -std=c++20 -O3 -DNDEBUG -Isrc bench/bench_quant.cpp build-quant/libturbospark_lib.a
//     -pthread -o bench_quant
// Run: ./bench_quant [--quick]
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
#include "backend/cpu/quant.h"
#include "core/dtype.h"
#include "core/thread_pool.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// CPU time of the calling thread: on a shared 2-core box, wall time of a single-threaded
// run includes time other processes held the core; thread CPU time does not.
double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Best rate over repetitions, by wall time and by the calling thread's CPU time.
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
    best.wall = std::max(best.wall, work / seconds_since(t0));
    best.cpu = std::max(best.cpu, work / (thread_cpu_seconds() - c0));
  }
  return best;
}

constexpr size_t kArenaBytes = size_t(1) << 30;
constexpr int64_t kRows = 4096, kCols = 4096;

// Fills the arena with whole [kRows, kCols] matrices of type wt: 64 random rows quantized
// (or converted) once, repeated.
size_t fill(std::vector<uint8_t>& arena, ts::DType wt, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const uint64_t row_bytes = ts::dtype_row_bytes(wt, kCols);
  std::vector<uint8_t> pattern(64 * row_bytes);
  std::vector<float> row(kCols);
  for (int r = 0; r < 64; ++r) {
    for (float& v : row) v = dist(rng);
    uint8_t* dst = &pattern[size_t(r) * row_bytes];
    if (ts::dtype_is_quantized(wt)) {
      ts::cpu::quantize_row(wt, row.data(), dst, kCols);
    } else {
      for (int64_t c = 0; c < kCols; ++c) {
        uint16_t h = ts::f32_to_bf16(row[size_t(c)]);
        std::memcpy(dst + 2 * c, &h, 2);
      }
    }
  }
  const size_t mat_bytes = size_t(kRows) * row_bytes;
  const size_t n_mats = arena.size() / mat_bytes;
  for (size_t off = 0; off + pattern.size() <= n_mats * mat_bytes; off += pattern.size())
    std::memcpy(&arena[off], pattern.data(), pattern.size());
  return n_mats;
}

__attribute__((target("avx512f"))) float read_avx512(const uint8_t* p, size_t bytes) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 256 <= bytes; i += 256) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(reinterpret_cast<const float*>(p + i)));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(reinterpret_cast<const float*>(p + i + 64)));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(reinterpret_cast<const float*>(p + i + 128)));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(reinterpret_cast<const float*>(p + i + 192)));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  float sum = 0.0f;
  for (float v : lanes) sum += v;
  return sum;
}

double roofline_gbs(const std::vector<uint8_t>& arena) {
  if (!__builtin_cpu_supports("avx512f")) return 0.0;
  volatile float sink = 0.0f;
  return best_rate(double(arena.size()) / 1e9, 3,
                   [&] { sink = sink + read_avx512(arena.data(), arena.size()); })
      .cpu;
}

// n_mats consecutive matrices of `rows` rows (rows < kRows: the same small matrix n_mats
// times, from cache).
Rate matvec_gbs(ts::ThreadPool* pool, const std::vector<uint8_t>& arena, size_t n_mats,
                ts::DType wt, int reps, int64_t rows = kRows) {
  const size_t mat_bytes = size_t(rows) * ts::dtype_row_bytes(wt, kCols);
  const size_t stride = rows == kRows ? mat_bytes : 0;
  std::vector<float> x(kCols), y(kRows);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& v : x) v = dist(rng);
  return best_rate(double(mat_bytes * n_mats) / 1e9, reps, [&] {
    for (size_t m = 0; m < n_mats; ++m) {
      const void* w = arena.data() + m * stride;
      if (pool != nullptr) {
        ts::cpu::matvec(*pool, w, wt, x.data(), y.data(), rows, kCols);
      } else {
        ts::cpu::matvec_rows(w, wt, x.data(), y.data(), kCols, 0, rows);
      }
    }
  });
}

Rate matmul_gflops(ts::ThreadPool* pool, const std::vector<uint8_t>& arena, ts::DType wt,
                   int64_t n_tokens, int reps) {
  std::vector<float> x(size_t(n_tokens * kCols)), y(size_t(n_tokens * kRows));
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& v : x) v = dist(rng);
  const double gflop = 2.0 * double(n_tokens) * double(kRows) * double(kCols) / 1e9;
  return best_rate(gflop, reps, [&] {
    if (pool != nullptr) {
      ts::cpu::matmul(*pool, arena.data(), wt, x.data(), n_tokens, y.data(), kRows, kCols);
    } else {
      ts::cpu::matmul_rows(arena.data(), wt, x.data(), n_tokens, y.data(), kRows, kCols, 0, kRows);
    }
  });
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

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string_view(argv[1]) == "--quick";
  const int reps = quick ? 2 : 5;
  const std::string load_at_start = load_average();
  std::vector<uint8_t> arena(kArenaBytes);
  std::mt19937 rng(42);
  ts::ThreadPool pool2(2);
  std::printf("detected ISA: %s\n", std::string(ts::cpu::isa_name(ts::cpu::detect_isa())).c_str());
  std::printf("roofline: AVX-512 read of 1 GiB, 1 thread: %.1f GB/s\n\n", roofline_gbs(arena));
  std::printf("%-9s %-5s | %-44s | %-26s\n", "", "", "matvec 4096 cols, GB/s of weights",
              "matmul T=64 GFLOP/s");
  std::printf("%-9s %-5s | %7s %7s %7s %7s %11s | %8s %8s %8s\n", "isa", "dtype", "1t", "1t-cpu",
              "2t", "Gw/s", "L2 1t-cpu", "1t", "1t-cpu", "2t");
  const ts::cpu::Isa isas[] = {ts::cpu::Isa::kPortable, ts::cpu::Isa::kAvx2,
                               ts::cpu::Isa::kAvx2Vnni, ts::cpu::Isa::kAvx512};
  for (ts::DType wt : {ts::DType::kQ8_0, ts::DType::kQ4_K, ts::DType::kBF16}) {
    const size_t n_mats = fill(arena, wt, rng);
    const double bytes_per_weight = double(ts::dtype_row_bytes(wt, kCols)) / double(kCols);
    for (ts::cpu::Isa isa : isas) {
      if (!ts::cpu::isa_supported(isa)) continue;
      ts::cpu::set_active_isa(isa);
      const bool slow = isa == ts::cpu::Isa::kPortable;
      const int r = slow ? 1 : reps;
      const Rate mv1 = matvec_gbs(nullptr, arena, slow ? 4 : n_mats, wt, r);
      const Rate mv2 = matvec_gbs(&pool2, arena, slow ? 4 : n_mats, wt, r);
      // 128 rows (~0.3-0.6 MiB quantized) read 256 times: from L2, the kernel's compute limit.
      const Rate l2 = matvec_gbs(nullptr, arena, slow ? 8 : 256, wt, r, 128);
      const Rate mm1 = matmul_gflops(nullptr, arena, wt, slow ? 8 : 64, r);
      const Rate mm2 = matmul_gflops(&pool2, arena, wt, slow ? 8 : 64, r);
      std::printf("%-9s %-5s | %7.1f %7.1f %7.1f %7.2f %11.1f | %8.1f %8.1f %8.1f%s\n",
                  std::string(ts::cpu::isa_name(isa)).c_str(),
                  std::string(ts::dtype_name(wt)).c_str(), mv1.wall, mv1.cpu, mv2.wall,
                  mv1.cpu / bytes_per_weight, l2.cpu, mm1.wall, mm1.cpu, mm2.wall,
                  slow ? "  (T=8)" : "");
    }
  }
  std::printf(
      "\nmatvec cycles through 1 GiB of weights (DRAM, not L3); Gw/s: billions of "
      "weights per second (1t-cpu); L2: 128 x 4096 re-read from cache. 1t-cpu: work / "
      "thread CPU time. Best of %d. Load average at start %s, end %s.\n",
      reps, load_at_start.c_str(), load_average().c_str());
  return 0;
}
