// AVX-512 matvec and matmul for Q8_0 / Q4_K weights (quant.h has the layouts and the
// numerics). Compiled with AVX-512 (+ VNNI) flags for this file only; reached through
// kernels_avx512.cpp's entry points, which dispatch.cpp calls only when the CPU and OS
// support them.
//
// Q8_0 (decode and prefill): X quantized to int8 blocks, vpdpbusd integer dot products in
// quant.h's accumulation order, bit-identical to the portable reference. matvec runs
// kMatvecTileRows rows per step sharing the X loads; matmul register tiles of 4 rows x 4
// tokens load each W pair once per 4 tokens.
// Q4_K, X stays F32:
//   matvec: each sub-block's 16 possible weights form a table in one zmm; vpermps looks the
//         weights up by quant (q4_k_tile has the details); even / odd sub-blocks
//         accumulate apart.
//   matmul: dequantizes a block of rows into a per-thread F32 buffer (bit-identical to
//         dequantize_row; see quant.cpp on exactness) and runs this ISA's F32 matmul on it.
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
// Software prefetch distance, as in kernels_avx512.cpp (2 KiB ahead of each row): Q4_K
// matvec and the Q8_0 tails. The Q8_0 8-row matvec tile instead prefetches the next tile
// (same offset, 8 rows on): 4096 x 4096 from DRAM 22 -> 24.5 GB/s (1 thread) and 768 x 2048
// expert matrices 31 -> 35 GB/s (2 threads) on the dev box (its rows are contiguous, so
// 2 KiB ahead mostly fell inside the tile already in flight). Q8_0 matmul prefetches one
// row tile ahead while its first token tile runs.
constexpr int64_t kPrefetchBytes = 2048;
// Q8_0 matmul register tile: 4 rows x 4 tokens = 16 accumulators + 4 W pairs + 4 W scales
// + X, its lane bias and scales, of 32 zmm.
constexpr int kMatmulTileRows = 4;
constexpr int kMatmulTileTokens = 4;
constexpr float kF32MinNormal = 1.17549435e-38f;  // FLT_MIN (no <cfloat> templates needed)
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

// Per-thread F32 scratch (dequantized rows for matmul, quantized X), reused across calls. Raw
// operator new: no std:: templates in this file.
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
// quant.h's integer order on VNNI: a zmm holds two consecutive blocks (lanes 0-7 block b,
// 8-15 block b + 1), vpdpbusd sums 4 byte products per int32 lane, and one F32 accumulator
// per (row, token) takes fma(float(p), d_w * d_x, acc): lane 8 (b mod 2) + l, as the
// contract says. vpdpbusd multiplies unsigned by signed bytes, so W is biased to
// w + 128 (xor 0x80) and each lane starts from -128 * (sum of its 4 activation bytes):
// p = -128 sum x + sum (w + 128) x = sum w x, exactly (int32 never overflows: |p| < 2^17).

// The 64 quants of blocks b, b + 1 at blk (68 bytes), biased to unsigned.
__m512i pair_qs_biased(const uint8_t* blk) {
  const __m512i v = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2 + kQ8_0BlockBytes)), 1);
  return _mm512_xor_si512(v, _mm512_set1_epi8(char(0x80)));
}

// The f16 scales of blocks b, b + 1 at blk as F32: lanes 0-7 d[b], 8-15 d[b + 1]. One
// 64-byte load covers both (bytes 0-1 and 34-35); vpermw picks and repeats them.
__m512 pair_scales(const uint8_t* blk) {
  const __m512i idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  //
                                       17, 17, 17, 17, 17, 17, 17, 17, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i h = _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(blk));
  return _mm512_cvtph_ps(_mm512_castsi512_si256(h));
}

// Lanes 0-7 d[0], 8-15 d[1].
__m512 pair_act_scales(const float* d) {
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(
      idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d)))));
}

// -128 * (sum of each lane's 4 activation bytes).
__m512i lane_bias(__m512i xq) {
  const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(char(0x80)), xq);
  return _mm512_sub_epi32(_mm512_setzero_si512(), s);
}

// The last block of an odd count: lanes 0-7 only (it is an even block); the upper lanes of
// the accumulator are kept by the mask. Loads stay inside the block.
__m512i tail_qs_biased(const uint8_t* blk) {
  return _mm512_xor_si512(
      _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))),
      _mm512_set1_epi8(char(0x80)));
}
constexpr __mmask16 kEvenLanes = 0x00ff;

// Y[t, r] for NR rows at w and NT tokens (x rows at xq + t * cols, scales xd + t * n_blocks).
// Each W pair is loaded once and used for NT tokens; each X pair once for NR rows.
// prefetch_ahead: bytes ahead of each W pair to prefetch (0: none).
template <int NR, int NT>
void q8_0_tile(const uint8_t* w, int64_t row_bytes, int64_t n_blocks, const int8_t* xq,
               const float* xd, int64_t cols, float* y, int64_t ldy, int64_t prefetch_ahead) {
  __m512 acc[NT][NR];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= n_blocks; b += 2) {
    __m512i wq[NR];
    __m512 wd[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * int64_t(kQ8_0BlockBytes);
      if (prefetch_ahead != 0)
        _mm_prefetch(
            reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(blk) + prefetch_ahead),
            _MM_HINT_T0);
      wq[r] = pair_qs_biased(blk);
      wd[r] = pair_scales(blk);
    }
    for (int t = 0; t < NT; ++t) {
      const __m512i x = _mm512_loadu_si512(xq + t * cols + b * 32);
      const __m512i bias = lane_bias(x);
      const __m512 dx = pair_act_scales(xd + t * n_blocks + b);
      for (int r = 0; r < NR; ++r) {
        const __m512i p = _mm512_dpbusd_epi32(bias, wq[r], x);
        acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(wd[r], dx), acc[t][r]);
      }
    }
  }
  if (b < n_blocks) {
    __m512i wq[NR];
    __m512 wd[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + r * row_bytes + b * int64_t(kQ8_0BlockBytes);
      wq[r] = tail_qs_biased(blk);
      wd[r] = _mm512_set1_ps(load_f16(blk));
    }
    for (int t = 0; t < NT; ++t) {
      const __m512i x = _mm512_zextsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * cols + b * 32)));
      const __m512i bias = lane_bias(x);
      const __m512 dx = _mm512_set1_ps(xd[t * n_blocks + b]);
      for (int r = 0; r < NR; ++r) {
        const __m512i p = _mm512_dpbusd_epi32(bias, wq[r], x);
        acc[t][r] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(wd[r], dx),
                                          acc[t][r], kEvenLanes);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) y[t * ldy + r] = reduce_add(acc[t][r]);
}

void q8_0_matvec(const uint8_t* w, Q8Acts x, float* y, int64_t cols, int64_t r0, int64_t r1) {
  const int64_t n_blocks = cols / kQ8_0BlockElems;
  const int64_t row_bytes = n_blocks * int64_t(kQ8_0BlockBytes);
  int64_t r = r0;
  for (; r + kMatvecTileRows <= r1; r += kMatvecTileRows)
    q8_0_tile<kMatvecTileRows, 1>(w + r * row_bytes, row_bytes, n_blocks, x.qs, x.d, cols, y + r, 0,
                                  kMatvecTileRows * row_bytes);
  for (; r + 4 <= r1; r += 4)
    q8_0_tile<4, 1>(w + r * row_bytes, row_bytes, n_blocks, x.qs, x.d, cols, y + r, 0,
                    kPrefetchBytes);
  for (; r < r1; ++r)
    q8_0_tile<1, 1>(w + r * row_bytes, row_bytes, n_blocks, x.qs, x.d, cols, y + r, 0,
                    kPrefetchBytes);
}

// One row tile (NR rows) against every token, kMatmulTileTokens at a time. The first token
// tile prefetches the next row tile (W of an expert comes from DRAM once per call); the
// others find this tile in L1.
template <int NR>
void q8_0_row_tile(const uint8_t* w, int64_t row_bytes, int64_t n_blocks, Q8Acts x,
                   int64_t n_tokens, int64_t cols, float* y, int64_t ldy) {
  int64_t ahead = NR * row_bytes;
  int64_t t = 0;
  for (; t + kMatmulTileTokens <= n_tokens; t += kMatmulTileTokens, ahead = 0)
    q8_0_tile<NR, kMatmulTileTokens>(w, row_bytes, n_blocks, x.qs + t * cols, x.d + t * n_blocks,
                                     cols, y + t * ldy, ldy, ahead);
  const int64_t left = n_tokens - t;
  const int8_t* xq = x.qs + t * cols;
  const float* xd = x.d + t * n_blocks;
  y += t * ldy;
  if (left == 3) q8_0_tile<NR, 3>(w, row_bytes, n_blocks, xq, xd, cols, y, ldy, ahead);
  if (left == 2) q8_0_tile<NR, 2>(w, row_bytes, n_blocks, xq, xd, cols, y, ldy, ahead);
  if (left == 1) q8_0_tile<NR, 1>(w, row_bytes, n_blocks, xq, xd, cols, y, ldy, ahead);
}

void q8_0_matmul(const uint8_t* w, Q8Acts x, int64_t n_tokens, float* y, int64_t ldy, int64_t cols,
                 int64_t r0, int64_t r1) {
  const int64_t n_blocks = cols / kQ8_0BlockElems;
  const int64_t row_bytes = n_blocks * int64_t(kQ8_0BlockBytes);
  int64_t r = r0;
  for (; r + kMatmulTileRows <= r1; r += kMatmulTileRows)
    q8_0_row_tile<kMatmulTileRows>(w + r * row_bytes, row_bytes, n_blocks, x, n_tokens, cols, y + r,
                                   ldy);
  for (; r < r1; ++r)
    q8_0_row_tile<1>(w + r * row_bytes, row_bytes, n_blocks, x, n_tokens, cols, y + r, ldy);
}

// quant.h's activation rule: amax / 127 and its inverse in scalar F32 (as the reference),
// x * id and vcvtps2dq with round-to-nearest-even; |q| <= 127, so the saturating narrow
// never saturates.
void quantize_acts(const float* x, int64_t n_blocks, int8_t* qs, float* d) {
  for (int64_t b = 0; b < n_blocks; ++b, x += 32, qs += 32) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float db = amax / 127.0f;
    const float id = db >= kF32MinNormal ? 1.0f / db : 0.0f;
    d[b] = db;
    const __m512 vid = _mm512_set1_ps(id);
    constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, vid), kRne);
    const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, vid), kRne);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 16), _mm512_cvtsepi32_epi8(q1));
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

}  // namespace ts::cpu::avx512
