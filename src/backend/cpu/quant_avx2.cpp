// AVX2 + FMA + F16C matvec and matmul for Q8_0 / Q4_K weights (quant.h has the layouts and
// the numerics). Compiled with those flags for this file only; reached through
// kernels_avx2.cpp's entry points, which dispatch.cpp calls only when the CPU and OS
// support them.
//
//   Q8_0: X quantized to int8 blocks; per block an integer dot (vpmaddubsw / vpmaddwd) in
//         quant.h's accumulation order, bit-identical to the portable reference. matvec
//         runs kMatvecTileRows rows per step; matmul 2 x 2 (row, token) tiles.
//   Q4_K: X stays F32. w . x = sum_j d*sc[j] * (q_j . x_j) - sum_j dmin*m[j] * sum(x_j),
//         the X sums per 32-weight sub-block computed once per call (AVX2 has no 16-entry
//         vpermps, so the table lookup of quant_avx512.cpp does not apply); even / odd
//         sub-blocks accumulate apart. matmul dequantizes a block of rows into a per-thread
//         F32 buffer (bit-identical to dequantize_row) and runs this ISA's F32 matmul on it.
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
constexpr float kF32MinNormal = 1.17549435e-38f;  // FLT_MIN

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
//
// quant.h's integer order in 256-bit registers: one block per ymm, vpmaddubsw + vpmaddwd
// sum 4 byte products per int32 lane (the sign trick: |w| unsigned times x with w's sign;
// pair sums stay below 2 * 128 * 127 < 2^15, so vpmaddubsw never saturates), even blocks
// into one accumulator (the contract's lanes 0-7) and odd blocks into another (8-15).

// The 8 lane sums of one block's quants at wq (32 bytes) with the activation quants x.
__m256i block_dot(const uint8_t* wq, __m256i x) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq));
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

// acc[t][r][parity] for NR rows at w and NT tokens (x rows at xq + t * cols).
template <int NR, int NT>
void q8_0_tile(const uint8_t* w, int64_t row_bytes, int64_t n_blocks, const int8_t* xq,
               const float* xd, int64_t cols, float* y, int64_t ldy, bool prefetch_w) {
  __m256 acc[NT][NR][2];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r][0] = acc[t][r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int parity = int(b & 1);
    __m256 wd[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * int64_t(kQ8_0BlockBytes);
      if (prefetch_w && parity == 0) prefetch(blk);
      wd[r] = _mm256_set1_ps(load_f16(blk));
    }
    for (int t = 0; t < NT; ++t) {
      const __m256i x =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * cols + b * 32));
      const __m256 dx = _mm256_broadcast_ss(xd + t * n_blocks + b);
      for (int r = 0; r < NR; ++r) {
        const __m256i p = block_dot(w + r * row_bytes + b * int64_t(kQ8_0BlockBytes) + 2, x);
        // d_w * d_x: one F32 multiplication, as the reference.
        acc[t][r][parity] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(wd[r], dx), acc[t][r][parity]);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r)
      y[t * ldy + r] = reduce_add(_mm256_add_ps(acc[t][r][0], acc[t][r][1]));
}

void q8_0_matvec(const uint8_t* w, Q8Acts x, float* y, int64_t cols, int64_t r0, int64_t r1) {
  const int64_t n_blocks = cols / kQ8_0BlockElems;
  const int64_t row_bytes = n_blocks * int64_t(kQ8_0BlockBytes);
  int64_t r = r0;
  for (; r + kMatvecTileRows <= r1; r += kMatvecTileRows)
    q8_0_tile<kMatvecTileRows, 1>(w + r * row_bytes, row_bytes, n_blocks, x.qs, x.d, cols, y + r, 0,
                                  true);
  for (; r < r1; ++r)
    q8_0_tile<1, 1>(w + r * row_bytes, row_bytes, n_blocks, x.qs, x.d, cols, y + r, 0, true);
}

// 2 rows x 2 tokens x 2 parities = 8 accumulators of 16 ymm.
void q8_0_matmul(const uint8_t* w, Q8Acts x, int64_t n_tokens, float* y, int64_t ldy, int64_t cols,
                 int64_t r0, int64_t r1) {
  const int64_t n_blocks = cols / kQ8_0BlockElems;
  const int64_t row_bytes = n_blocks * int64_t(kQ8_0BlockBytes);
  for (int64_t r = r0; r < r1; r += 2) {
    const uint8_t* wr = w + r * row_bytes;
    const bool two_rows = r + 1 < r1;
    int64_t t = 0;
    for (; t + 2 <= n_tokens; t += 2) {
      const int8_t* xq = x.qs + t * cols;
      const float* xd = x.d + t * n_blocks;
      if (two_rows) {
        q8_0_tile<2, 2>(wr, row_bytes, n_blocks, xq, xd, cols, y + t * ldy + r, ldy, false);
      } else {
        q8_0_tile<1, 2>(wr, row_bytes, n_blocks, xq, xd, cols, y + t * ldy + r, ldy, false);
      }
    }
    if (t < n_tokens) {
      const int8_t* xq = x.qs + t * cols;
      const float* xd = x.d + t * n_blocks;
      if (two_rows) {
        q8_0_tile<2, 1>(wr, row_bytes, n_blocks, xq, xd, cols, y + t * ldy + r, ldy, false);
      } else {
        q8_0_tile<1, 1>(wr, row_bytes, n_blocks, xq, xd, cols, y + t * ldy + r, ldy, false);
      }
    }
  }
}

// quant.h's activation rule; vcvtps2dq rounds to nearest even (the default MXCSR mode), and
// |q| <= 127 so the saturating packs never saturate. The packs interleave 128-bit lanes;
// vpermd puts the 8 groups of 4 back in order.
void quantize_acts(const float* x, int64_t n_blocks, int8_t* qs, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < n_blocks; ++b, x += 32, qs += 32) {
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 8 * j);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float db = amax / 127.0f;
    const float id = db >= kF32MinNormal ? 1.0f / db : 0.0f;
    d[b] = db;
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vid));
    const __m256i q16a = _mm256_packs_epi32(q[0], q[1]), q16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs), q8);
  }
}

// Per-thread quantized X for calls that bring F32 activations.
struct ActsScratch {
  Scratch qs, d;
  Q8Acts quantize(const float* x, int64_t n_tokens, int64_t cols) {
    const int64_t n_blocks = n_tokens * cols / 32;
    int8_t* q = reinterpret_cast<int8_t*>(qs.get(size_t(n_tokens * cols / 4)));
    float* s = d.get(size_t(n_blocks));
    quantize_acts(x, n_blocks, q, s);
    return {q, s};
  }
};

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

void quantize_acts_q8(const float* x, int64_t n_tokens, int64_t cols, int8_t* qs, float* d) {
  quantize_acts(x, n_tokens * cols / 32, qs, d);
}

void q8_0_matvec_rows(const void* w, Q8Acts x, float* y, int64_t cols, int64_t r0, int64_t r1) {
  q8_0_matvec(static_cast<const uint8_t*>(w), x, y, cols, r0, r1);
}

void q8_0_matmul_rows(const void* w, Q8Acts x, int64_t n_tokens, float* y, int64_t ldy,
                      int64_t cols, int64_t r0, int64_t r1) {
  if (r0 >= r1 || n_tokens <= 0) return;
  q8_0_matmul(static_cast<const uint8_t*>(w), x, n_tokens, y, ldy, cols, r0, r1);
}

void quant_matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                       int64_t r1) {
  const auto* wb = static_cast<const uint8_t*>(w);
  if (wt == DType::kQ8_0) {
    thread_local ActsScratch scratch;
    return q8_0_matvec(wb, scratch.quantize(x, 1, cols), y, cols, r0, r1);
  }
  return q4_k_matvec(wb, x, y, cols, r0, r1);
}

void quant_matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y,
                       int64_t ldy, int64_t cols, int64_t r0, int64_t r1) {
  if (r0 >= r1 || n_tokens <= 0 || cols <= 0) return;
  if (wt == DType::kQ8_0) {
    thread_local ActsScratch scratch;
    return q8_0_matmul(static_cast<const uint8_t*>(w), scratch.quantize(x, n_tokens, cols),
                       n_tokens, y, ldy, cols, r0, r1);
  }
  thread_local Scratch scratch;
  const int64_t n_blocks = cols / kQ4_KBlockElems;
  const int64_t row_bytes = n_blocks * int64_t(kQ4_KBlockBytes);
  int64_t block_rows = kDequantBlockBytes / int64_t(sizeof(float)) / cols;
  block_rows = block_rows < 12 ? 12 : block_rows / 12 * 12;  // whole F32 register tiles
  float* f32 = scratch.get(size_t(min64(block_rows, r1 - r0) * cols));
  for (int64_t rb = r0; rb < r1; rb += block_rows) {
    const int64_t n = min64(block_rows, r1 - rb);
    for (int64_t i = 0; i < n; ++i)
      q4_k_dequantize(static_cast<const uint8_t*>(w) + (rb + i) * row_bytes, n_blocks,
                      f32 + i * cols);
    matmul_rows(f32, DType::kF32, x, n_tokens, y + rb, ldy, cols, 0, n);
  }
}

}  // namespace ts::cpu::avx2
