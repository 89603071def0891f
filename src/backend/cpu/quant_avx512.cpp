// AVX-512 matvec and matmul for Q8_0 / Q4_K weights (quant.h has the layouts and the
// numerics). Compiled with AVX-512 (+ VNNI) flags for this file only; reached through
// kernels_avx512.cpp's entry points, which dispatch.cpp calls only when the CPU and OS
// support them.
//
// Both types (decode and prefill): X quantized to int8 blocks, vpdpbusd integer dot
// products in quant.h's accumulation order, bit-identical to the portable reference. matvec
// runs kMatvecTileRows rows per step sharing the X loads; matmul register tiles of 4 rows x
// 4 tokens load each W group once per 4 tokens. Q8_0Tile and Q4_KTile hold the per-type
// inner loops; the drivers below them are shared.
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

#include "backend/cpu/quant.h"

namespace ts::cpu::avx512 {
namespace {

// matvec rows per step, then 4, then 1 for the rest. Eight rows in flight read 4,096 x 4,096
// Q8_0 from DRAM at ~18 GB/s (1 thread) where four managed ~14 and two ~11; 12 or 16 were
// no better (Q4_K: 8.1 vs 7.0 GB/s for 8 vs 4). Lab runs on the shared dev box, best of 6.
constexpr int kMatvecTileRows = 8;
// Software prefetch: the matvec tile prefetches the next tile (same offset, kMatvecTileRows
// rows on; its rows are contiguous). Against 2 KiB ahead in each row (kernels_avx512.cpp's
// choice, which here mostly fell inside the tile already in flight): Q8_0 4096 x 4096 from
// DRAM 22 -> 24.5 GB/s (1 thread), 768 x 2048 expert matrices 31 -> 35 GB/s (2 threads), on
// the dev box. The matmul prefetches one row tile ahead while its first token tile runs.
//
// matmul register tile: 4 rows x 4 tokens = 16 accumulators + 4 W groups + 4 W scales + X,
// its lane bias and scales, of 32 zmm (Q4_K's min accumulators are ymm and spill).
constexpr int kMatmulTileRows = 4;
constexpr int kMatmulTileTokens = 4;
constexpr float kF32MinNormal = 1.17549435e-38f;  // FLT_MIN (no <cfloat> templates needed)

float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

void prefetch_at(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// Fixed-order horizontal sums: halving (lanes i and i + 8, then i + 4, ...), quant.h's order.
float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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

// Lanes 0-7 d[0], 8-15 d[1]. The two floats are one 8-byte load, but d is only 4-byte
// aligned (t * n_blocks + b is odd when n_blocks is): memcpy, not a load through a double* (UBSan
// reported that misaligned load; the compiler emits the same vmovq).
__m512 pair_act_scales(const float* d) {
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  double pair;
  std::memcpy(&pair, d, sizeof pair);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_set_sd(pair))));
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

// Y[t, r] for NR rows at w and NT tokens (token t of x at x.qs + t * cols, x.d + t * cols /
// 32). Each W pair is loaded once and used for NT tokens; each X pair once for NR rows.
// prefetch_ahead: bytes ahead of each W pair to prefetch (0: none).
struct Q8_0Tile {
  static constexpr int64_t kBlockElems = kQ8_0BlockElems, kBlockBytes = kQ8_0BlockBytes;
  template <int NR, int NT>
  static void run(const uint8_t* w, int64_t row_bytes, Q8Acts x, int64_t cols, float* y,
                  int64_t ldy, int64_t prefetch_ahead) {
    const int64_t n_blocks = cols / kBlockElems;
    __m512 acc[NT][NR];
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < NR; ++r) acc[t][r] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= n_blocks; b += 2) {
      __m512i wq[NR];
      __m512 wd[NR];
      for (int r = 0; r < NR; ++r) {
        const uint8_t* blk = w + r * row_bytes + b * kBlockBytes;
        if (prefetch_ahead != 0) prefetch_at(blk + prefetch_ahead);
        wq[r] = pair_qs_biased(blk);
        wd[r] = pair_scales(blk);
      }
      for (int t = 0; t < NT; ++t) {
        const __m512i xq = _mm512_loadu_si512(x.qs + t * cols + b * 32);
        const __m512i bias = lane_bias(xq);
        const __m512 dx = pair_act_scales(x.d + t * n_blocks + b);
        for (int r = 0; r < NR; ++r) {
          const __m512i p = _mm512_dpbusd_epi32(bias, wq[r], xq);
          acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(wd[r], dx), acc[t][r]);
        }
      }
    }
    if (b < n_blocks) {
      __m512i wq[NR];
      __m512 wd[NR];
      for (int r = 0; r < NR; ++r) {
        const uint8_t* blk = w + r * row_bytes + b * kBlockBytes;
        wq[r] = tail_qs_biased(blk);
        wd[r] = _mm512_set1_ps(load_f16(blk));
      }
      for (int t = 0; t < NT; ++t) {
        const __m512i xq = _mm512_zextsi256_si512(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs + t * cols + b * 32)));
        const __m512i bias = lane_bias(xq);
        const __m512 dx = _mm512_set1_ps(x.d[t * n_blocks + b]);
        for (int r = 0; r < NR; ++r) {
          const __m512i p = _mm512_dpbusd_epi32(bias, wq[r], xq);
          acc[t][r] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(wd[r], dx),
                                            acc[t][r], kEvenLanes);
        }
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < NR; ++r) y[t * ldy + r] = reduce_add(acc[t][r]);
  }
};

// quant.h's activation rule: amax / 127 and its inverse in scalar F32 (as the reference),
// x * id and vcvtps2dq with round-to-nearest-even; |q| <= 127, so the saturating narrow
// never saturates. The quant sum is exact in int32.
void quantize_acts(const float* x, int64_t n_blocks, Q8ActsOut out) {
  int8_t* qs = out.qs;
  for (int64_t b = 0; b < n_blocks; ++b, x += 32, qs += 32) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float db = amax / 127.0f;
    const float id = db >= kF32MinNormal ? 1.0f / db : 0.0f;
    const __m512 vid = _mm512_set1_ps(id);
    constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, vid), kRne);
    const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, vid), kRne);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 16), _mm512_cvtsepi32_epi8(q1));
    out.d[b] = db;
    out.sum[b] = db * float(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

// Per-thread quantized X for calls that bring F32 activations (Scratch holds floats; the
// quants take n / 4 of them).
struct ActsScratch {
  Scratch qs, d, sum;
  Q8Acts quantize(const float* x, int64_t n_tokens, int64_t cols) {
    const int64_t n_blocks = n_tokens * cols / 32;
    const Q8ActsOut out{reinterpret_cast<int8_t*>(qs.get(size_t(n_tokens * cols / 4))),
                        d.get(size_t(n_blocks)), sum.get(size_t(n_blocks))};
    quantize_acts(x, n_blocks, out);
    return {out.qs, out.d, out.sum};
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

// quant.h's order for Q4_K: a 64-weight group's 32 quant bytes hold sub-blocks 2g (low
// nibbles) and 2g + 1 (high nibbles), so [low | high] in one zmm is the contract's even /
// odd lane layout, against the 64 activation bytes of those two sub-blocks. The quants are
// unsigned, as vpdpbusd wants: no bias. Mins: one FMA of 8 lanes per super-block, against
// the activation block sums.
struct Q4_KTile {
  static constexpr int64_t kBlockElems = kQ4_KBlockElems, kBlockBytes = kQ4_KBlockBytes;
  template <int NR, int NT>
  static void run(const uint8_t* w, int64_t row_bytes, Q8Acts x, int64_t cols, float* y,
                  int64_t ldy, int64_t prefetch_ahead) {
    const int64_t n_blocks = cols / kBlockElems, n_x_blocks = cols / 32;
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 acc[NT][NR];
    __m256 macc[NT][NR];
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < NR; ++r)
        acc[t][r] = _mm512_setzero_ps(), macc[t][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n_blocks; ++b) {
      __m512 dsc[NR];  // d * sc[j] in lanes 0-7 (permuted per group below)
      for (int r = 0; r < NR; ++r) {
        const uint8_t* blk = w + r * row_bytes + b * kBlockBytes;
        if (prefetch_ahead != 0)
          for (int64_t line = 0; line < kBlockBytes; line += 64)
            prefetch_at(blk + prefetch_ahead + line);
        const Q4KScales s = q4_k_scales(blk);
        dsc[r] = _mm512_castps256_ps512(s.dsc);
        for (int t = 0; t < NT; ++t)
          macc[t][r] =
              _mm256_fmadd_ps(s.dm, _mm256_loadu_ps(x.sum + t * n_x_blocks + 8 * b), macc[t][r]);
      }
      for (int g = 0; g < 4; ++g) {
        const __m512i pick = _mm512_set_epi32(2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1,
                                              2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g, 2 * g, 2 * g,
                                              2 * g, 2 * g, 2 * g, 2 * g, 2 * g);
        __m512i wq[NR];
        __m512 wd[NR];
        for (int r = 0; r < NR; ++r) {
          const __m256i v = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(w + r * row_bytes + b * kBlockBytes + 16 + 32 * g));
          const __m512i both =
              _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
          wq[r] = _mm512_and_si512(both, low4);
          wd[r] = _mm512_permutexvar_ps(pick, dsc[r]);
        }
        for (int t = 0; t < NT; ++t) {
          const __m512i xq = _mm512_loadu_si512(x.qs + t * cols + b * 256 + 64 * g);
          const __m512 dx = pair_act_scales(x.d + t * n_x_blocks + 8 * b + 2 * g);
          for (int r = 0; r < NR; ++r) {
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[r], xq);
            acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(wd[r], dx), acc[t][r]);
          }
        }
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < NR; ++r) y[t * ldy + r] = reduce_add(acc[t][r]) - reduce_add8(macc[t][r]);
  }
};

// ---- drivers (both types) ----------------------------------------------------------------

template <class Tile>
void matvec_q8(const uint8_t* w, Q8Acts x, float* y, int64_t cols, int64_t r0, int64_t r1) {
  const int64_t row_bytes = cols / Tile::kBlockElems * Tile::kBlockBytes;
  int64_t r = r0;
  for (; r + kMatvecTileRows <= r1; r += kMatvecTileRows)
    Tile::template run<kMatvecTileRows, 1>(w + r * row_bytes, row_bytes, x, cols, y + r, 0,
                                           kMatvecTileRows * row_bytes);
  for (; r + 4 <= r1; r += 4)
    Tile::template run<4, 1>(w + r * row_bytes, row_bytes, x, cols, y + r, 0, 4 * row_bytes);
  for (; r < r1; ++r) Tile::template run<1, 1>(w + r * row_bytes, row_bytes, x, cols, y + r, 0, 0);
}

// One row tile (NR rows) against every token, kMatmulTileTokens at a time. The first token
// tile prefetches the next row tile (W of an expert comes from DRAM once per call); the
// others find this tile in L1.
template <class Tile, int NR>
void matmul_row_tile_q8(const uint8_t* w, int64_t row_bytes, Q8Acts x, int64_t n_tokens,
                        int64_t cols, float* y, int64_t ldy) {
  const int64_t n_x_blocks = cols / 32;
  auto at = [&](int64_t t) {
    return Q8Acts{x.qs + t * cols, x.d + t * n_x_blocks, x.sum + t * n_x_blocks};
  };
  int64_t ahead = NR * row_bytes;
  int64_t t = 0;
  for (; t + kMatmulTileTokens <= n_tokens; t += kMatmulTileTokens, ahead = 0)
    Tile::template run<NR, kMatmulTileTokens>(w, row_bytes, at(t), cols, y + t * ldy, ldy, ahead);
  const int64_t left = n_tokens - t;
  y += t * ldy;
  if (left == 3) Tile::template run<NR, 3>(w, row_bytes, at(t), cols, y, ldy, ahead);
  if (left == 2) Tile::template run<NR, 2>(w, row_bytes, at(t), cols, y, ldy, ahead);
  if (left == 1) Tile::template run<NR, 1>(w, row_bytes, at(t), cols, y, ldy, ahead);
}

template <class Tile>
void matmul_q8(const uint8_t* w, Q8Acts x, int64_t n_tokens, float* y, int64_t ldy, int64_t cols,
               int64_t r0, int64_t r1) {
  const int64_t row_bytes = cols / Tile::kBlockElems * Tile::kBlockBytes;
  int64_t r = r0;
  for (; r + kMatmulTileRows <= r1; r += kMatmulTileRows)
    matmul_row_tile_q8<Tile, kMatmulTileRows>(w + r * row_bytes, row_bytes, x, n_tokens, cols,
                                              y + r, ldy);
  for (; r < r1; ++r)
    matmul_row_tile_q8<Tile, 1>(w + r * row_bytes, row_bytes, x, n_tokens, cols, y + r, ldy);
}

}  // namespace

void quantize_acts_q8(const float* x, int64_t n_tokens, int64_t cols, Q8ActsOut out) {
  quantize_acts(x, n_tokens * cols / 32, out);
}

void matvec_rows_q8(const void* w, DType wt, Q8Acts x, float* y, int64_t cols, int64_t r0,
                    int64_t r1) {
  const auto* wb = static_cast<const uint8_t*>(w);
  if (wt == DType::kQ8_0) return matvec_q8<Q8_0Tile>(wb, x, y, cols, r0, r1);
  return matvec_q8<Q4_KTile>(wb, x, y, cols, r0, r1);
}

void matmul_rows_q8(const void* w, DType wt, Q8Acts x, int64_t n_tokens, float* y, int64_t ldy,
                    int64_t cols, int64_t r0, int64_t r1) {
  if (r0 >= r1 || n_tokens <= 0) return;
  const auto* wb = static_cast<const uint8_t*>(w);
  if (wt == DType::kQ8_0) return matmul_q8<Q8_0Tile>(wb, x, n_tokens, y, ldy, cols, r0, r1);
  return matmul_q8<Q4_KTile>(wb, x, n_tokens, y, ldy, cols, r0, r1);
}

void quant_matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                       int64_t r1) {
  thread_local ActsScratch scratch;
  matvec_rows_q8(w, wt, scratch.quantize(x, 1, cols), y, cols, r0, r1);
}

void quant_matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y,
                       int64_t ldy, int64_t cols, int64_t r0, int64_t r1) {
  if (r0 >= r1 || n_tokens <= 0 || cols <= 0) return;
  thread_local ActsScratch scratch;
  matmul_rows_q8(w, wt, scratch.quantize(x, n_tokens, cols), n_tokens, y, ldy, cols, r0, r1);
}

}  // namespace ts::cpu::avx512
