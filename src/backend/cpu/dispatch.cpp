// The one dispatch point for the CPU kernels: which instruction set this CPU (and its OS)
// supports, which one is in use, and the parallel wrappers that split rows across a pool.
// Compiled with baseline flags: nothing here may execute an AVX instruction.
#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cpu/quant.h"
#include "core/status.h"
#include "core/thread_pool.h"

namespace ts::cpu {
namespace {

struct Cpuid {
  uint32_t eax = 0, ebx = 0, ecx = 0, edx = 0;
};

Cpuid cpuid(uint32_t leaf, uint32_t subleaf) {
  Cpuid r;
  if (!__get_cpuid_count(leaf, subleaf, &r.eax, &r.ebx, &r.ecx, &r.edx)) return Cpuid{};
  return r;
}

bool bit(uint32_t reg, int b) { return (reg >> b) & 1u; }

// XCR0: which register states the OS saves on context switch. An instruction set whose
// registers the OS does not save is unusable even if cpuid lists it. Executed only when
// cpuid reports OSXSAVE (xgetbv faults otherwise).
uint64_t xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return uint64_t(edx) << 32 | eax;
}

// Bit i set: Isa(i) is usable on this CPU and OS.
uint32_t supported_isas_uncached() {
  auto with = [](uint32_t set, Isa isa) { return set | 1u << int(isa); };
  uint32_t set = with(0, Isa::kPortable);
  Cpuid l1 = cpuid(1, 0);
  bool osxsave = bit(l1.ecx, 27);
  bool avx = bit(l1.ecx, 28), fma = bit(l1.ecx, 12), f16c = bit(l1.ecx, 29);
  if (!osxsave || !avx || !fma || !f16c) return set;
  uint64_t xcr = xcr0();
  constexpr uint64_t kYmmState = 0x6;   // SSE + AVX upper halves
  constexpr uint64_t kZmmState = 0xe6;  // + opmask, ZMM0-15 upper halves, ZMM16-31
  if ((xcr & kYmmState) != kYmmState) return set;
  Cpuid l7 = cpuid(7, 0);
  if (!bit(l7.ebx, 5)) return set;  // AVX2
  set = with(set, Isa::kAvx2);
  // Leaf 7 subleaf 1 exists only if l7.eax >= 1: EAX bit 4 AVX-VNNI, bit 5 AVX512_BF16.
  Cpuid l7s1 = l7.eax >= 1 ? cpuid(7, 1) : Cpuid{};
  if (bit(l7s1.eax, 4)) set = with(set, Isa::kAvx2Vnni);
  bool avx512 =
      bit(l7.ebx, 16) && bit(l7.ebx, 17) && bit(l7.ebx, 30) && bit(l7.ebx, 31);  // F, DQ, BW, VL
  // VNNI (vpdpbusd, the Q8_0 dot products) comes with every CPU that has AVX512_BF16.
  avx512 = avx512 && bit(l7.ecx, 11);
  bool bf16 = bit(l7s1.eax, 5);
  if (avx512 && bf16 && (xcr & kZmmState) == kZmmState) set = with(set, Isa::kAvx512);
  return set;
}

uint32_t supported_isas() {
  static const uint32_t set = supported_isas_uncached();
  return set;
}

// The best supported ISA not above want (kPortable always is).
Isa best_up_to(Isa want) {
  for (int i = int(want); i > 0; --i)
    if (isa_supported(Isa(i))) return Isa(i);
  return Isa::kPortable;
}

Isa isa_from_env() {
  const char* env = std::getenv("TURBOSPARK_ISA");
  if (env == nullptr || *env == '\0') return detect_isa();
  std::string_view v(env);
  Isa want;
  if (v == "portable") {
    want = Isa::kPortable;
  } else if (v == "avx2") {
    want = Isa::kAvx2;
  } else if (v == "avx2vnni") {
    want = Isa::kAvx2Vnni;
  } else if (v == "avx512") {
    want = Isa::kAvx512;
  } else {
    std::fprintf(stderr,
                 "turbospark: ignoring TURBOSPARK_ISA=%s (want portable|avx2|avx2vnni|avx512)\n",
                 env);
    return detect_isa();
  }
  // The variable only lowers the ISA; asking for more than the CPU has would crash later.
  return best_up_to(want);
}

std::atomic<Isa>& active_slot() {
  static std::atomic<Isa> slot{isa_from_env()};
  return slot;
}

void check_dtype(DType wt, int64_t cols) {
  TS_CHECK(wt == DType::kF32 || wt == DType::kF16 || wt == DType::kBF16 || wt == DType::kQ8_0 ||
               wt == DType::kQ4_K,
           "CPU kernels take F32, F16 or BF16 weights, or Q8_0 / Q4_K blocks");
  TS_CHECK(dtype_row_ok(wt, cols), "quantized rows must be whole blocks (32 / 256 weights)");
}

// A parallel_for chunk must carry enough work to pay for waking a thread (~10 us). Row
// grains are multiples of 12 so chunks hold whole register tiles of both SIMD paths
// (4 and 3 rows).
constexpr int64_t kRowGrain = 12;
constexpr int64_t kMinChunkBytes = 128 << 10;         // matvec: ~5 us of memory traffic
constexpr int64_t kMinChunkFlops = int64_t(4) << 20;  // matmul

int64_t round_up_grain(int64_t rows) {
  rows = std::max<int64_t>(rows, 1);
  return (rows + kRowGrain - 1) / kRowGrain * kRowGrain;
}

// ---- quantized weights: X quantized once per parallel call ------------------------------

// The calling thread's quantized X; the pool's threads read it while the call waits.
struct ActsBuffer {
  std::vector<int8_t> qs;
  std::vector<float> d, sum;
};

Q8Acts quantize_acts(Isa isa, const float* x, int64_t n_tokens, int64_t cols) {
  thread_local ActsBuffer buf;
  buf.qs.resize(size_t(n_tokens * cols));
  buf.d.resize(size_t(n_tokens * cols / 32));
  buf.sum.resize(buf.d.size());
  const Q8ActsOut out{buf.qs.data(), buf.d.data(), buf.sum.data()};
  switch (isa) {
    case Isa::kPortable:
      quantize_acts_q8(x, n_tokens, cols, out);
      break;
    case Isa::kAvx2:
      avx2::quantize_acts_q8(x, n_tokens, cols, out);
      break;
    case Isa::kAvx2Vnni:
      avx2vnni::quantize_acts_q8(x, n_tokens, cols, out);
      break;
    case Isa::kAvx512:
      avx512::quantize_acts_q8(x, n_tokens, cols, out);
      break;
  }
  return {out.qs, out.d, out.sum};
}

void matvec_rows_q8(Isa isa, const void* w, DType wt, Q8Acts x, float* y, int64_t cols, int64_t r0,
                    int64_t r1) {
  switch (isa) {
    case Isa::kPortable:
      return portable::matvec_rows_q8(w, wt, x, y, cols, r0, r1);
    case Isa::kAvx2:
      return avx2::matvec_rows_q8(w, wt, x, y, cols, r0, r1);
    case Isa::kAvx2Vnni:
      return avx2vnni::matvec_rows_q8(w, wt, x, y, cols, r0, r1);
    case Isa::kAvx512:
      return avx512::matvec_rows_q8(w, wt, x, y, cols, r0, r1);
  }
}

void matmul_rows_q8(Isa isa, const void* w, DType wt, Q8Acts x, int64_t n_tokens, float* y,
                    int64_t ldy, int64_t cols, int64_t r0, int64_t r1) {
  switch (isa) {
    case Isa::kPortable:
      return portable::matmul_rows_q8(w, wt, x, n_tokens, y, ldy, cols, r0, r1);
    case Isa::kAvx2:
      return avx2::matmul_rows_q8(w, wt, x, n_tokens, y, ldy, cols, r0, r1);
    case Isa::kAvx2Vnni:
      return avx2vnni::matmul_rows_q8(w, wt, x, n_tokens, y, ldy, cols, r0, r1);
    case Isa::kAvx512:
      return avx512::matmul_rows_q8(w, wt, x, n_tokens, y, ldy, cols, r0, r1);
  }
}

}  // namespace

Isa detect_isa() { return best_up_to(Isa::kAvx512); }

bool isa_supported(Isa isa) { return (supported_isas() >> int(isa)) & 1u; }

Isa active_isa() { return active_slot().load(std::memory_order_relaxed); }

void set_active_isa(Isa isa) { active_slot().store(best_up_to(isa), std::memory_order_relaxed); }

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return "portable";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx2Vnni:
      return "avx2vnni";
    case Isa::kAvx512:
      return "avx512";
  }
  return "?";
}

bool matmul_rounds_x_to_bf16(Isa isa, DType wt) {
  return isa == Isa::kAvx512 && wt == DType::kBF16;
}

void matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                 int64_t r1) {
  check_dtype(wt, cols);
  switch (active_isa()) {
    case Isa::kPortable:
      return portable::matvec_rows(w, wt, x, y, cols, r0, r1);
    case Isa::kAvx2:
      return avx2::matvec_rows(w, wt, x, y, cols, r0, r1);
    case Isa::kAvx2Vnni:  // avx2's kernels but for the int8 dots
      if (dtype_is_quantized(wt)) return avx2vnni::quant_matvec_rows(w, wt, x, y, cols, r0, r1);
      return avx2::matvec_rows(w, wt, x, y, cols, r0, r1);
    case Isa::kAvx512:
      return avx512::matvec_rows(w, wt, x, y, cols, r0, r1);
  }
}

void matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y, int64_t ldy,
                 int64_t cols, int64_t r0, int64_t r1) {
  check_dtype(wt, cols);
  switch (active_isa()) {
    case Isa::kPortable:
      return portable::matmul_rows(w, wt, x, n_tokens, y, ldy, cols, r0, r1);
    case Isa::kAvx2:
      return avx2::matmul_rows(w, wt, x, n_tokens, y, ldy, cols, r0, r1);
    case Isa::kAvx2Vnni:
      if (dtype_is_quantized(wt))
        return avx2vnni::quant_matmul_rows(w, wt, x, n_tokens, y, ldy, cols, r0, r1);
      return avx2::matmul_rows(w, wt, x, n_tokens, y, ldy, cols, r0, r1);
    case Isa::kAvx512:
      return avx512::matmul_rows(w, wt, x, n_tokens, y, ldy, cols, r0, r1);
  }
}

void matvec(ThreadPool& pool, const void* w, DType wt, const float* x, float* y, int64_t rows,
            int64_t cols) {
  check_dtype(wt, cols);
  int64_t row_bytes = std::max<int64_t>(1, int64_t(dtype_row_bytes(wt, cols)));
  int64_t grain = round_up_grain(kMinChunkBytes / row_bytes);
  if (dtype_is_quantized(wt)) {
    const Isa isa = active_isa();
    const Q8Acts xq = quantize_acts(isa, x, 1, cols);
    pool.parallel_for(rows, grain, [&](int64_t r0, int64_t r1) {
      matvec_rows_q8(isa, w, wt, xq, y, cols, r0, r1);
    });
    return;
  }
  pool.parallel_for(rows, grain,
                    [&](int64_t r0, int64_t r1) { matvec_rows(w, wt, x, y, cols, r0, r1); });
}

void matmul(ThreadPool& pool, const void* w, DType wt, const float* x, int64_t n_tokens, float* y,
            int64_t rows, int64_t cols) {
  int64_t row_flops = std::max<int64_t>(1, 2 * cols * n_tokens);
  int64_t grain = round_up_grain(kMinChunkFlops / row_flops);
  if (dtype_is_quantized(wt)) {
    check_dtype(wt, cols);
    const Isa isa = active_isa();
    const Q8Acts xq = quantize_acts(isa, x, n_tokens, cols);
    pool.parallel_for(rows, grain, [&](int64_t r0, int64_t r1) {
      matmul_rows_q8(isa, w, wt, xq, n_tokens, y, rows, cols, r0, r1);
    });
    return;
  }
  pool.parallel_for(rows, grain, [&](int64_t r0, int64_t r1) {
    matmul_rows(w, wt, x, n_tokens, y, rows, cols, r0, r1);
  });
}

}  // namespace ts::cpu
