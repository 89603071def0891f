// AVX-512 matvec and matmul for Q8_0 / Q4_K weights (quant.h has the layouts). Compiled
// with AVX-512 flags for this file only; reached through kernels_avx512.cpp's entry points,
// which dispatch.cpp calls only when the CPU and OS support them.
//
// matvec (decode) is meant to run at memory bandwidth: each block is read once, widened to
// F32 in registers and multiplied with X (which stays F32), several rows per step sharing
// the X loads.
//   Q8_0: per block, p = sum_i qs[i] * x[i] in one zmm (two FMA lanes of 16), then
//         acc += d * p; even and odd blocks go to two accumulators.
//   Q4_K: each sub-block's 16 possible weights form a table in one zmm; vpermps looks the
//         weights up by quant (q4_k_tile has the details); even / odd sub-blocks
//         accumulate apart.
// matmul (prefill) dequantizes a block of rows into a per-thread F32 buffer (bit-identical
// to dequantize_row; see quant.cpp on exactness) and runs this ISA's F32 matmul on it.
//
// Determinism: a row's operations depend only on cols (never on the tile it is in or the
// [r0, r1) range), so splitting rows across threads cannot change a result.
//
// ODR hazard (as kernels_avx512.cpp): everything lives in an anonymous namespace and uses
// only intrinsics and library calls, never inline functions or templates from shared
// headers (quant.h's q4_k_scale_min and dtype.h's helpers are re-done here).

// g++ 12.2's AVX-512 intrinsics trip -W(maybe-)uninitialized inside the header (GCC PR
// 105593); see kernels_avx512.cpp.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>
#include <cstring>
#include <new>

#include "backend/cpu/kernels.h"
#include "backend/cpu/quant.h"

namespace ts::cpu::avx512 {
namespace {

// matvec rows per step, then 4, then 1 for the rest. Eight rows in flight read 4,096 x 4,096
// Q8_0 from DRAM at ~18 GB/s (1 thread) where four managed ~14 and two ~11; 12 or 16 were
// no better (Q4_K: 8.1 vs 7.0 GB/s for 8 vs 4). Lab runs on the shared dev box, best of 6.
constexpr int kMatvecTileRows = 8;
// Software prefetch distance, as in kernels_avx512.cpp (2 KiB ahead of each row).
constexpr int64_t kPrefetchBytes = 2048;
// matmul: F32 rows dequantized per step; 64 KiB stays in L2 next to the X tile.
constexpr int64_t kDequantBlockBytes = 64 << 10;

int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

void prefetch(const uint8_t* p) {
  // Integer arithmetic: the address may lie past the end of W (prefetch never faults).
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kPrefetchBytes),
               _MM_HINT_T0);
}

// Fixed-order horizontal sums.
float reduce_add(__m512 v) {
  __m512 s = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(s);
}

// 16 int8 / uint8 at p -> 16 F32 lanes.
__m512 widen_i8(const uint8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Per-thread F32 scratch (dequantized rows for matmul), reused
// across calls. Raw operator new: no std:: templates in this file.
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

// acc += d * (qs . x) for one block at blk and the 32 floats x0 | x1.
__m512 q8_0_block(const uint8_t* blk, __m512 x0, __m512 x1, __m512 acc) {
  __m512 p = _mm512_mul_ps(widen_i8(blk + 2), x0);
  p = _mm512_fmadd_ps(widen_i8(blk + 18), x1, p);
  return _mm512_fmadd_ps(p, _mm512_set1_ps(load_f16(blk)), acc);
}

// y[i] = W[i, :] . x for the NR rows starting at w.
template <int NR>
void q8_0_tile(const uint8_t* w, int64_t row_bytes, int64_t n_blocks, const float* x, float* y) {
  __m512 acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= n_blocks; b += 2) {
    const float* xb = x + b * 32;
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 x2 = _mm512_loadu_ps(xb + 32), x3 = _mm512_loadu_ps(xb + 48);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * int64_t(kQ8_0BlockBytes);
      prefetch(blk);
      acc[r][0] = q8_0_block(blk, x0, x1, acc[r][0]);
      acc[r][1] = q8_0_block(blk + kQ8_0BlockBytes, x2, x3, acc[r][1]);
    }
  }
  if (b < n_blocks) {
    const float* xb = x + b * 32;
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    for (int r = 0; r < NR; ++r)
      acc[r][0] = q8_0_block(w + r * row_bytes + b * int64_t(kQ8_0BlockBytes), x0, x1, acc[r][0]);
  }
  for (int r = 0; r < NR; ++r) y[r] = reduce_add(_mm512_add_ps(acc[r][0], acc[r][1]));
}

void q8_0_matvec(const uint8_t* w, const float* x, float* y, int64_t cols, int64_t r0, int64_t r1) {
  const int64_t n_blocks = cols / kQ8_0BlockElems;
  const int64_t row_bytes = n_blocks * int64_t(kQ8_0BlockBytes);
  int64_t r = r0;
  for (; r + kMatvecTileRows <= r1; r += kMatvecTileRows)
    q8_0_tile<kMatvecTileRows>(w + r * row_bytes, row_bytes, n_blocks, x, y + r);
  for (; r + 4 <= r1; r += 4) q8_0_tile<4>(w + r * row_bytes, row_bytes, n_blocks, x, y + r);
  for (; r < r1; ++r) q8_0_tile<1>(w + r * row_bytes, row_bytes, n_blocks, x, y + r);
}

void q8_0_dequantize(const uint8_t* blk, int64_t n_blocks, float* out) {
  for (int64_t b = 0; b < n_blocks; ++b, blk += kQ8_0BlockBytes, out += 32) {
    const __m512 d = _mm512_set1_ps(load_f16(blk));
    _mm512_storeu_ps(out, _mm512_mul_ps(widen_i8(blk + 2), d));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(widen_i8(blk + 18), d));
  }
}

// ---- Q4_K ------------------------------------------------------------------------------

// The 8 sub-block scales and mins of a block (quant.h), times d and dmin: exact in F32.
struct Q4KScales {
  __m256 dsc;  // d * sc[j]
  __m256 dm;   // dmin * m[j]
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

// Q4_K matvec: the 16 possible weights of a sub-block, (d * sc) * k - dmin * m for
// k = 0..15, form a table in one zmm (bit-identical to dequantize_row: quant.cpp); vpermps
// with the widened quant bytes as indices looks weights up directly (it reads only an
// index's low 4 bits, so the low nibble needs no mask). Per 16 weights: a lookup and an
// FMA with X, plus a shift for high nibbles, instead of mask, convert and a separate scale.
// Against the factored form of quant_avx2.cpp (convert, d * sc per sub-block, mins against
// X's sub-block sums) it measured the same speed (128 x 4096 from L2, 1 thread: 12-16 GB/s
// for both on the shared Zen 5 dev box; 8.0 vs ~8.1 GB/s on a Xeon); it is kept because
// its dot runs over exactly the dequantized weights, with no cancellation between a
// scale sum and a min sum, and needs no X scratch.
template <int NR>
void q4_k_tile(const uint8_t* w, int64_t row_bytes, int64_t n_blocks, const float* x, float* y) {
  __m512 acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t b = 0; b < n_blocks; ++b) {
    alignas(32) float dsc[NR][8], neg_dm[NR][8];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * int64_t(kQ4_KBlockBytes);
      for (int64_t ahead = 0; ahead < int64_t(kQ4_KBlockBytes); ahead += 64) prefetch(blk + ahead);
      Q4KScales s = q4_k_scales(blk);
      _mm256_store_ps(dsc[r], s.dsc);
      _mm256_store_ps(neg_dm[r], _mm256_sub_ps(_mm256_setzero_ps(), s.dm));
    }
    const float* xb = x + b * 256;
    for (int g = 0; g < 4; ++g) {
      const __m512 x0 = _mm512_loadu_ps(xb + 64 * g), x1 = _mm512_loadu_ps(xb + 64 * g + 16);
      const __m512 x2 = _mm512_loadu_ps(xb + 64 * g + 32), x3 = _mm512_loadu_ps(xb + 64 * g + 48);
      for (int r = 0; r < NR; ++r) {
        const uint8_t* qs = w + r * row_bytes + b * int64_t(kQ4_KBlockBytes) + 16 + 32 * g;
        const __m512i v0 =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
        const __m512i v1 =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
        const __m512 lo =
            _mm512_fmadd_ps(iota, _mm512_set1_ps(dsc[r][2 * g]), _mm512_set1_ps(neg_dm[r][2 * g]));
        const __m512 hi = _mm512_fmadd_ps(iota, _mm512_set1_ps(dsc[r][2 * g + 1]),
                                          _mm512_set1_ps(neg_dm[r][2 * g + 1]));
        acc[r][0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v0, lo), x0, acc[r][0]);
        acc[r][1] =
            _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), hi), x2, acc[r][1]);
        acc[r][0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v1, lo), x1, acc[r][0]);
        acc[r][1] =
            _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), hi), x3, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) y[r] = reduce_add(_mm512_add_ps(acc[r][0], acc[r][1]));
}

void q4_k_matvec(const uint8_t* w, const float* x, float* y, int64_t cols, int64_t r0, int64_t r1) {
  const int64_t n_blocks = cols / kQ4_KBlockElems;
  const int64_t row_bytes = n_blocks * int64_t(kQ4_KBlockBytes);
  int64_t r = r0;
  for (; r + kMatvecTileRows <= r1; r += kMatvecTileRows)
    q4_k_tile<kMatvecTileRows>(w + r * row_bytes, row_bytes, n_blocks, x, y + r);
  for (; r + 4 <= r1; r += 4) q4_k_tile<4>(w + r * row_bytes, row_bytes, n_blocks, x, y + r);
  for (; r < r1; ++r) q4_k_tile<1>(w + r * row_bytes, row_bytes, n_blocks, x, y + r);
}

// w = (d * sc) * q - dmin * m with one rounding (quant.cpp): the FMA gives the same bits.
void q4_k_dequantize(const uint8_t* blk, int64_t n_blocks, float* out) {
  const __m512i low4 = _mm512_set1_epi32(15);
  for (int64_t b = 0; b < n_blocks; ++b, blk += kQ4_KBlockBytes) {
    Q4KScales s = q4_k_scales(blk);
    alignas(32) float dsc[8], dm[8];
    _mm256_store_ps(dsc, s.dsc);
    _mm256_store_ps(dm, s.dm);
    for (int g = 0; g < 4; ++g, out += 64) {
      const uint8_t* qs = blk + 16 + 32 * g;
      for (int h = 0; h < 2; ++h) {
        const __m512i v =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * h)));
        const __m512 d0 = _mm512_set1_ps(dsc[2 * g]), m0 = _mm512_set1_ps(-dm[2 * g]);
        const __m512 d1 = _mm512_set1_ps(dsc[2 * g + 1]), m1 = _mm512_set1_ps(-dm[2 * g + 1]);
        _mm512_storeu_ps(out + 16 * h,
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low4)), d0, m0));
        _mm512_storeu_ps(out + 32 + 16 * h,
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d1, m1));
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

}  // namespace ts::cpu::avx512
