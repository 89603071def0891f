// AVX2 + FMA + F16C matvec and matmul for Q8_0 / Q4_K weights (quant.h has the layouts).
// Compiled with those flags for this file only; reached through kernels_avx2.cpp's entry
// points, which dispatch.cpp calls only when the CPU and OS support them.
//
// Each block is read once and widened to F32 in 8-lane ymm registers; X stays F32.
//   Q8_0: per block, p = sum_i qs[i] * x[i] (four widened vectors of 8), acc += d * p;
//         even and odd blocks go to two accumulators.
//   Q4_K: w . x = sum_j d*sc[j] * (q_j . x_j) - sum_j dmin*m[j] * sum(x_j), the X sums per
//         32-weight sub-block computed once per call (AVX2 has no 16-entry vpermps, so the
//         table lookup of quant_avx512.cpp does not apply); even / odd sub-blocks
//         accumulate apart.
//   matmul dequantizes a block of rows into a per-thread F32 buffer (bit-identical to
//   dequantize_row) and runs this ISA's F32 matmul on it.
//
// Determinism: a row's operations depend only on cols, never on its tile or the [r0, r1)
// range. ODR hazard as in kernels_avx2.cpp: anonymous namespace, intrinsics and library
// calls only.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <new>

#include "backend/cpu/kernels.h"
#include "backend/cpu/quant.h"

namespace ts::cpu::avx2 {
namespace {

// matvec rows per step. Four rows read 4,096 x 4,096 Q8_0 from DRAM at ~14 GB/s (1 thread)
// where two managed ~10 (a few X vectors spill; one accumulator per row with X loaded per
// block was ~11, eight rows ~13). Q4_K: the same for two or four. Lab runs on the shared dev
// box, best of 6.
constexpr int kMatvecTileRows = 4;
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kDequantBlockBytes = 64 << 10;

int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

void prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kPrefetchBytes),
               _MM_HINT_T0);
}

float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__m128i load8(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm_cvtsi64_si128(v);
}

// 8 int8 at p -> 8 F32 lanes.
__m256 widen_i8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p))); }

struct Scratch {
  float* data = nullptr;
  size_t size = 0;
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { ::operator delete (data, std::align_val_t{64}); }
  float* get(size_t n) {
    if (n > size) {
      ::operator delete (data, std::align_val_t{64});
      data = static_cast<float*>(::operator new (n * sizeof(float), std::align_val_t{64}));
      size = n;
    }
    return data;
  }
};

// ---- Q8_0 ------------------------------------------------------------------------------

__m256 q8_0_block(const uint8_t* blk, const __m256* xv, __m256 acc) {
  __m256 p = _mm256_mul_ps(widen_i8(blk + 2), xv[0]);
  p = _mm256_fmadd_ps(widen_i8(blk + 10), xv[1], p);
  p = _mm256_fmadd_ps(widen_i8(blk + 18), xv[2], p);
  p = _mm256_fmadd_ps(widen_i8(blk + 26), xv[3], p);
  return _mm256_fmadd_ps(p, _mm256_set1_ps(load_f16(blk)), acc);
}

template <int NR>
void q8_0_tile(const uint8_t* w, int64_t row_bytes, int64_t n_blocks, const float* x, float* y) {
  __m256 acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= n_blocks; b += 2) {
    __m256 xv[8];
    for (int j = 0; j < 8; ++j) xv[j] = _mm256_loadu_ps(x + b * 32 + 8 * j);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * int64_t(kQ8_0BlockBytes);
      prefetch(blk);
      acc[r][0] = q8_0_block(blk, xv, acc[r][0]);
      acc[r][1] = q8_0_block(blk + kQ8_0BlockBytes, xv + 4, acc[r][1]);
    }
  }
  if (b < n_blocks) {
    __m256 xv[4];
    for (int j = 0; j < 4; ++j) xv[j] = _mm256_loadu_ps(x + b * 32 + 8 * j);
    for (int r = 0; r < NR; ++r)
      acc[r][0] = q8_0_block(w + r * row_bytes + b * int64_t(kQ8_0BlockBytes), xv, acc[r][0]);
  }
  for (int r = 0; r < NR; ++r) y[r] = reduce_add(_mm256_add_ps(acc[r][0], acc[r][1]));
}

void q8_0_matvec(const uint8_t* w, const float* x, float* y, int64_t cols, int64_t r0, int64_t r1) {
  const int64_t n_blocks = cols / kQ8_0BlockElems;
  const int64_t row_bytes = n_blocks * int64_t(kQ8_0BlockBytes);
  int64_t r = r0;
  for (; r + kMatvecTileRows <= r1; r += kMatvecTileRows)
    q8_0_tile<kMatvecTileRows>(w + r * row_bytes, row_bytes, n_blocks, x, y + r);
  for (; r < r1; ++r) q8_0_tile<1>(w + r * row_bytes, row_bytes, n_blocks, x, y + r);
}

void q8_0_dequantize(const uint8_t* blk, int64_t n_blocks, float* out) {
  for (int64_t b = 0; b < n_blocks; ++b, blk += kQ8_0BlockBytes, out += 32) {
    const __m256 d = _mm256_set1_ps(load_f16(blk));
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(widen_i8(blk + 2 + 8 * j), d));
  }
}

// ---- Q4_K ------------------------------------------------------------------------------

struct Q4KScales {
  __m256 dsc;  // d * sc[j], exact
  __m256 dm;   // dmin * m[j], exact
};

Q4KScales q4_k_scales(const uint8_t* blk) {
  uint32_t u[3];
  std::memcpy(u, blk + 4, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  const uint64_t sc = uint64_t(u[0] & kLow6) | uint64_t((u[2] & kLow4) | ((u[0] >> 6) & kLow2) << 4)
                                                   << 32;
  const uint64_t m =
      uint64_t(u[1] & kLow6) | uint64_t(((u[2] >> 4) & kLow4) | ((u[1] >> 6) & kLow2) << 4) << 32;
  auto widen8 = [](uint64_t v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(v))));
  };
  return {_mm256_mul_ps(widen8(sc), _mm256_set1_ps(load_f16(blk))),
          _mm256_mul_ps(widen8(m), _mm256_set1_ps(load_f16(blk + 2)))};
}

void sub_block_sums(const float* x, int64_t n_sub, float* xsum) {
  for (int64_t j = 0; j < n_sub; ++j) {
    const float* p = x + 32 * j;
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                             _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
    xsum[j] = reduce_add(s);
  }
}

template <int NR>
void q4_k_tile(const uint8_t* w, int64_t row_bytes, int64_t n_blocks, const float* x,
               const float* xsum, float* y) {
  __m256 acc[NR][2], acc_min[NR];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = acc_min[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi32(15);
  for (int64_t b = 0; b < n_blocks; ++b) {
    alignas(32) float dsc[NR][8];
    const __m256 xs = _mm256_loadu_ps(xsum + 8 * b);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * int64_t(kQ4_KBlockBytes);
      for (int64_t ahead = 0; ahead < int64_t(kQ4_KBlockBytes); ahead += 64) prefetch(blk + ahead);
      Q4KScales s = q4_k_scales(blk);
      _mm256_store_ps(dsc[r], s.dsc);
      acc_min[r] = _mm256_fmadd_ps(s.dm, xs, acc_min[r]);
    }
    const float* xb = x + b * 256;
    for (int g = 0; g < 4; ++g) {
      for (int r = 0; r < NR; ++r) {
        const uint8_t* qs = w + r * row_bytes + b * int64_t(kQ4_KBlockBytes) + 16 + 32 * g;
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) {
          const __m256i v = _mm256_cvtepu8_epi32(load8(qs + 8 * k));
          lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low4)),
                               _mm256_loadu_ps(xb + 64 * g + 8 * k), lo);
          hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)),
                               _mm256_loadu_ps(xb + 64 * g + 32 + 8 * k), hi);
        }
        acc[r][0] = _mm256_fmadd_ps(lo, _mm256_set1_ps(dsc[r][2 * g]), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(hi, _mm256_set1_ps(dsc[r][2 * g + 1]), acc[r][1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    y[r] = reduce_add(_mm256_add_ps(acc[r][0], acc[r][1])) - reduce_add(acc_min[r]);
}

void q4_k_matvec(const uint8_t* w, const float* x, float* y, int64_t cols, int64_t r0, int64_t r1) {
  thread_local Scratch scratch;
  const int64_t n_blocks = cols / kQ4_KBlockElems;
  const int64_t row_bytes = n_blocks * int64_t(kQ4_KBlockBytes);
  float* xsum = scratch.get(size_t(n_blocks * 8));
  sub_block_sums(x, n_blocks * 8, xsum);
  int64_t r = r0;
  for (; r + kMatvecTileRows <= r1; r += kMatvecTileRows)
    q4_k_tile<kMatvecTileRows>(w + r * row_bytes, row_bytes, n_blocks, x, xsum, y + r);
  for (; r < r1; ++r) q4_k_tile<1>(w + r * row_bytes, row_bytes, n_blocks, x, xsum, y + r);
}

// w = (d * sc) * q - dmin * m with one rounding (quant.cpp): the FMA gives the same bits.
void q4_k_dequantize(const uint8_t* blk, int64_t n_blocks, float* out) {
  const __m256i low4 = _mm256_set1_epi32(15);
  for (int64_t b = 0; b < n_blocks; ++b, blk += kQ4_KBlockBytes) {
    Q4KScales s = q4_k_scales(blk);
    alignas(32) float dsc[8], dm[8];
    _mm256_store_ps(dsc, s.dsc);
    _mm256_store_ps(dm, s.dm);
    for (int g = 0; g < 4; ++g, out += 64) {
      const __m256 d0 = _mm256_set1_ps(dsc[2 * g]), m0 = _mm256_set1_ps(-dm[2 * g]);
      const __m256 d1 = _mm256_set1_ps(dsc[2 * g + 1]), m1 = _mm256_set1_ps(-dm[2 * g + 1]);
      for (int k = 0; k < 4; ++k) {
        const __m256i v = _mm256_cvtepu8_epi32(load8(blk + 16 + 32 * g + 8 * k));
        _mm256_storeu_ps(out + 8 * k,
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low4)), d0, m0));
        _mm256_storeu_ps(out + 32 + 8 * k,
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d1, m1));
      }
    }
  }
}

}  // namespace

void quant_matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                       int64_t r1) {
  const auto* wb = static_cast<const uint8_t*>(w);
  if (wt == DType::kQ8_0) return q8_0_matvec(wb, x, y, cols, r0, r1);
  return q4_k_matvec(wb, x, y, cols, r0, r1);
}

void quant_matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y,
                       int64_t ldy, int64_t cols, int64_t r0, int64_t r1) {
  if (r0 >= r1 || n_tokens <= 0 || cols <= 0) return;
  thread_local Scratch scratch;
  const bool q8 = wt == DType::kQ8_0;
  const int64_t n_blocks = cols / (q8 ? kQ8_0BlockElems : kQ4_KBlockElems);
  const int64_t row_bytes = n_blocks * int64_t(q8 ? kQ8_0BlockBytes : kQ4_KBlockBytes);
  int64_t block_rows = kDequantBlockBytes / int64_t(sizeof(float)) / cols;
  block_rows = block_rows < 12 ? 12 : block_rows / 12 * 12;  // whole F32 register tiles
  float* f32 = scratch.get(size_t(min64(block_rows, r1 - r0) * cols));
  for (int64_t rb = r0; rb < r1; rb += block_rows) {
    const int64_t n = min64(block_rows, r1 - rb);
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* row = static_cast<const uint8_t*>(w) + (rb + i) * row_bytes;
      if (q8) {
        q8_0_dequantize(row, n_blocks, f32 + i * cols);
      } else {
        q4_k_dequantize(row, n_blocks, f32 + i * cols);
      }
    }
    matmul_rows(f32, DType::kF32, x, n_tokens, y + rb, ldy, cols, 0, n);
  }
}

}  // namespace ts::cpu::avx2
