// AVX2 + FMA + F16C matvec and matmul for Q8_0 / Q4_K weights (quant.h has the layouts and
// the numerics). Compiled with those flags for this file only; reached through
// kernels_avx2.cpp's entry points, which dispatch.cpp calls only when the CPU and OS
// support them.
//
// Both types: X quantized to int8 blocks; per 32-block an integer dot in quant.h's
// accumulation order, bit-identical to the portable reference. matvec runs kMatvecTileRows
// rows per step; matmul 2 x 2 (row, token) tiles.
//
// Two builds of this file: namespace avx2 (vpmaddubsw + vpmaddwd for the 4-byte dots) and,
// from quant_avx2_vnni.cpp with TS_QUANT_AVX2_VNNI and -mavxvnni added, namespace avx2vnni
// (AVX-VNNI's vpdpbusd on ymm: one instruction instead of two, same exact int32 sums, so
// the same bits). dispatch.cpp picks avx2vnni when cpuid reports AVX-VNNI.
//
// Determinism: a row's operations depend only on cols, never on its tile or the [r0, r1)
// range. ODR hazard as in kernels_avx2.cpp: anonymous namespace, intrinsics and library
// calls only.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <new>

#include "backend/cpu/quant.h"

#if TS_QUANT_AVX2_VNNI
namespace ts::cpu::avx2vnni {
#else
namespace ts::cpu::avx2 {
#endif
namespace {

// matvec rows per step. Four rows read 4,096 x 4,096 Q8_0 from DRAM at ~14 GB/s (1 thread)
// where two managed ~10 (a few X vectors spill; one accumulator per row with X loaded per
// block was ~11, eight rows ~13). Q4_K: the same for two or four. Lab runs on the shared dev
// box, best of 6.
constexpr int kMatvecTileRows = 4;
constexpr float kF32MinNormal = 1.17549435e-38f;  // FLT_MIN

float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The matvec tile prefetches the next tile (same offset, kMatvecTileRows rows on), as
// quant_avx512.cpp does.
void prefetch_at(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
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
// quant.h's integer order in 256-bit registers: one 32-block per ymm, dot4 sums 4 byte
// products per int32 lane, even blocks into one accumulator (the contract's lanes 0-7) and
// odd blocks into another (8-15). Q8_0 uses the sign trick (|w| unsigned times x with w's
// sign; pair sums stay below 2 * 128 * 127 < 2^15, so vpmaddubsw never saturates); Q4_K's
// quants are unsigned already (pair sums <= 2 * 15 * 127).

// Lane l of the result: sum_{i < 4} u[4l + i] * s[4l + i], u unsigned and s signed bytes,
// exact (at most 4 * 255 * 128 in magnitude).
__m256i dot4(__m256i u, __m256i s) {
#if TS_QUANT_AVX2_VNNI
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// acc[t][r][parity] for NR rows at w and NT tokens (token t of x at x.qs + t * cols,
// x.d + t * cols / 32). prefetch_ahead: bytes ahead of each W block to prefetch (0: none).
struct Q8_0Tile {
  static constexpr int64_t kBlockElems = kQ8_0BlockElems, kBlockBytes = kQ8_0BlockBytes;
  template <int NR, int NT>
  static void run(const uint8_t* w, int64_t row_bytes, Q8Acts x, int64_t cols, float* y,
                  int64_t ldy, int64_t prefetch_ahead) {
    const int64_t n_blocks = cols / kBlockElems;
    __m256 acc[NT][NR][2];
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < NR; ++r) acc[t][r][0] = acc[t][r][1] = _mm256_setzero_ps();
    // Block b into acc[...][parity]; parity a compile-time constant, so that acc stays in
    // registers (indexed by b & 1 it lived on the stack, each FMA a load and a store).
    auto block = [&]<int parity>(int64_t b) {
      __m256i wq[NR];
      __m256 wd[NR];
      for (int r = 0; r < NR; ++r) {
        const uint8_t* blk = w + r * row_bytes + b * kBlockBytes;
        if (prefetch_ahead != 0 && parity == 0) prefetch_at(blk + prefetch_ahead);
        wq[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        wd[r] = _mm256_set1_ps(load_f16(blk));
      }
      for (int t = 0; t < NT; ++t) {
        const __m256i xq =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs + t * cols + b * 32));
        const __m256 dx = _mm256_broadcast_ss(x.d + t * n_blocks + b);
        for (int r = 0; r < NR; ++r) {
          const __m256i p = dot4(_mm256_sign_epi8(wq[r], wq[r]), _mm256_sign_epi8(xq, wq[r]));
          // d_w * d_x: one F32 multiplication, as the reference.
          acc[t][r][parity] =
              _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(wd[r], dx), acc[t][r][parity]);
        }
      }
    };
    int64_t b = 0;
    for (; b + 1 < n_blocks; b += 2) {
      block.template operator()<0>(b);
      block.template operator()<1>(b + 1);
    }
    if (b < n_blocks) block.template operator()<0>(b);
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < NR; ++r)
        y[t * ldy + r] = reduce_add(_mm256_add_ps(acc[t][r][0], acc[t][r][1]));
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

// Group g of a super-block (64 weights): low nibbles are sub-block 2g (even), high nibbles
// 2g + 1 (odd). Mins: one FMA of 8 lanes per super-block, against the activation block sums.
struct Q4_KTile {
  static constexpr int64_t kBlockElems = kQ4_KBlockElems, kBlockBytes = kQ4_KBlockBytes;
  template <int NR, int NT>
  static void run(const uint8_t* w, int64_t row_bytes, Q8Acts x, int64_t cols, float* y,
                  int64_t ldy, int64_t prefetch_ahead) {
    const int64_t n_blocks = cols / kBlockElems, n_x_blocks = cols / 32;
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 acc[NT][NR][2], macc[NT][NR];
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < NR; ++r) acc[t][r][0] = acc[t][r][1] = macc[t][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n_blocks; ++b) {
      alignas(32) float dsc[NR][8];
      for (int r = 0; r < NR; ++r) {
        const uint8_t* blk = w + r * row_bytes + b * kBlockBytes;
        if (prefetch_ahead != 0)
          for (int64_t line = 0; line < kBlockBytes; line += 64)
            prefetch_at(blk + prefetch_ahead + line);
        const Q4KScales s = q4_k_scales(blk);
        _mm256_store_ps(dsc[r], s.dsc);
        for (int t = 0; t < NT; ++t)
          macc[t][r] =
              _mm256_fmadd_ps(s.dm, _mm256_loadu_ps(x.sum + t * n_x_blocks + 8 * b), macc[t][r]);
      }
      for (int g = 0; g < 4; ++g) {
        __m256i lo[NR], hi[NR];
        for (int r = 0; r < NR; ++r) {
          const __m256i v = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(w + r * row_bytes + b * kBlockBytes + 16 + 32 * g));
          lo[r] = _mm256_and_si256(v, low4);
          hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        for (int t = 0; t < NT; ++t) {
          const int8_t* xq = x.qs + t * cols + b * 256 + 64 * g;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
          const float* dx = x.d + t * n_x_blocks + 8 * b + 2 * g;
          const __m256 dx0 = _mm256_broadcast_ss(dx), dx1 = _mm256_broadcast_ss(dx + 1);
          for (int r = 0; r < NR; ++r) {
            const __m256i p0 = dot4(lo[r], x0);
            const __m256i p1 = dot4(hi[r], x1);
            acc[t][r][0] =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0),
                                _mm256_mul_ps(_mm256_set1_ps(dsc[r][2 * g]), dx0), acc[t][r][0]);
            acc[t][r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1),
                                           _mm256_mul_ps(_mm256_set1_ps(dsc[r][2 * g + 1]), dx1),
                                           acc[t][r][1]);
          }
        }
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < NR; ++r)
        y[t * ldy + r] =
            reduce_add(_mm256_add_ps(acc[t][r][0], acc[t][r][1])) - reduce_add(macc[t][r]);
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
  for (; r < r1; ++r) Tile::template run<1, 1>(w + r * row_bytes, row_bytes, x, cols, y + r, 0, 0);
}

// 2 rows x 2 tokens: 8 (Q4_K: 12) accumulators of 16 ymm.
template <class Tile>
void matmul_q8(const uint8_t* w, Q8Acts x, int64_t n_tokens, float* y, int64_t ldy, int64_t cols,
               int64_t r0, int64_t r1) {
  const int64_t row_bytes = cols / Tile::kBlockElems * Tile::kBlockBytes;
  const int64_t n_x_blocks = cols / 32;
  for (int64_t r = r0; r < r1; r += 2) {
    const uint8_t* wr = w + r * row_bytes;
    const bool two_rows = r + 1 < r1;
    for (int64_t t = 0; t < n_tokens; t += 2) {
      const Q8Acts xt{x.qs + t * cols, x.d + t * n_x_blocks, x.sum + t * n_x_blocks};
      float* yt = y + t * ldy + r;
      const bool two_tokens = t + 1 < n_tokens;
      if (two_rows && two_tokens) Tile::template run<2, 2>(wr, row_bytes, xt, cols, yt, ldy, 0);
      if (two_rows && !two_tokens) Tile::template run<2, 1>(wr, row_bytes, xt, cols, yt, ldy, 0);
      if (!two_rows && two_tokens) Tile::template run<1, 2>(wr, row_bytes, xt, cols, yt, ldy, 0);
      if (!two_rows && !two_tokens) Tile::template run<1, 1>(wr, row_bytes, xt, cols, yt, ldy, 0);
    }
  }
}

// quant.h's activation rule; vcvtps2dq rounds to nearest even (the default MXCSR mode), and
// |q| <= 127 so the saturating packs never saturate. The packs interleave 128-bit lanes;
// vpermd puts the 8 groups of 4 back in order. The quant sum is exact in int32.
void quantize_acts(const float* x, int64_t n_blocks, Q8ActsOut out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int8_t* qs = out.qs;
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
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vid));
    const __m256i q16a = _mm256_packs_epi32(q[0], q[1]), q16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs), q8);
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    out.d[b] = db;
    out.sum[b] = db * float(_mm_cvtsi128_si32(s4));
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

#if TS_QUANT_AVX2_VNNI
}  // namespace ts::cpu::avx2vnni
#else
}  // namespace ts::cpu::avx2
#endif
