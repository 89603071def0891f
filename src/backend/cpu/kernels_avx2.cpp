// AVX2 + FMA + F16C matvec and matmul. Compiled with those flags for this file only;
// dispatch.cpp calls it only when the CPU and OS support them.
//
// X stays F32 on every path; W converts in registers (BF16: zero-extend and shift left 16;
// F16: vcvtph2ps). matmul uses register tiles of kTileRows rows x kTileTokens tokens so each
// W vector loaded is used kTileTokens times; matvec (decode) runs the same per-element
// arithmetic over kMatvecTileRows rows at once (that many independent chains, enough to stay
// bound by memory), reading W ahead with software prefetch.
//
// Determinism: an output element is one accumulator chain over its row's columns in index
// order, the tail in the same accumulator, reduced in a fixed order. Tiles of any size run
// the same per-element operations, so neither the [r0, r1) range nor the number of tokens in
// a call changes a result, and matvec equals matmul per token (batch invariance).
//
// ODR hazard: this file is compiled with -mavx2 -mfma -mf16c, so any inline function or
// template from a shared header instantiated here could be emitted with AVX2 instructions
// and picked by the linker for callers on older CPUs. Hence everything lives in an
// anonymous namespace and uses only intrinsics and library calls: no inline functions or templates
// with code from std:: or core/ (nm shows only the two entry points defined here, even at
// -O0).
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>

#include "backend/cpu/kernels.h"
#include "backend/cpu/quant.h"

namespace ts::cpu::avx2 {
namespace {

constexpr int64_t kLanes = 8;       // F32 lanes per ymm
constexpr int kMatvecTileRows = 6;  // 6 rows = 6 accumulator chains + 1 X vector
constexpr int kTileRows = 3;        // matmul register tile: 3 x 4 = 12 accumulators
constexpr int kTileTokens = 4;      //   + 3 W vectors + 1 X vector = 16 ymm
// matvec reads each row this far ahead with software prefetch. Hardware prefetch alone left
// BF16 matvec (4096 x 4096, from DRAM) at ~17 GB/s; 1-2 KiB ahead gave ~21 (F32: 22 -> 25);
// 4-8 KiB was worse again (bench lab runs, interleaved variants, medians of 12).
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kRowBlockBytes = 256 << 10;  // W rows revisited per token tile: keep in L2

int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// F32 tails use vmaskmovps, which does not fault on masked-off lanes.
__m256i tail_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// AVX2 has no masked 16-bit load: copy the n (< 8) remaining elements into a zeroed block.
__m128i load_tail_u16(const uint16_t* p, int64_t n) {
  alignas(16) uint16_t buf[8] = {};
  std::memcpy(buf, p, size_t(n) * sizeof(uint16_t));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
}

// W element type -> 8 F32 lanes; load_tail reads only the first n (< 8) elements.
struct LoadF32 {
  using T = float;
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load_tail(const float* p, int64_t n) { return _mm256_maskload_ps(p, tail_mask(n)); }
};

struct LoadF16 {
  using T = uint16_t;
  static __m256 load(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static __m256 load_tail(const uint16_t* p, int64_t n) {
    return _mm256_cvtph_ps(load_tail_u16(p, n));
  }
};

struct LoadBf16 {
  using T = uint16_t;
  static __m256 widen(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static __m256 load(const uint16_t* p) {
    return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static __m256 load_tail(const uint16_t* p, int64_t n) { return widen(load_tail_u16(p, n)); }
};

// Fixed-order horizontal sum of 8 lanes.
float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---- matvec ----------------------------------------------------------------------------

// y[i] = W[i, :] . x for the NR consecutive rows starting at w (row stride cols), with
// fma_tile's arithmetic: one accumulator per row over the columns in index order, the tail
// in the same accumulator. NR rows give NR independent chains, enough to keep one token
// bound by memory; each row is read kPrefetchBytes ahead.
template <class L, int NR>
void matvec_tile(const typename L::T* w, int64_t cols, const float* x, float* y) {
  constexpr int64_t kStep = 64 / int64_t(sizeof(typename L::T));  // one cache line of W
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + kStep <= cols; c += kStep) {
    for (int r = 0; r < NR; ++r) {
      // Integer arithmetic: the address may lie past the end of W (prefetch never faults).
      uintptr_t ahead = reinterpret_cast<uintptr_t>(w + r * cols + c) + kPrefetchBytes;
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    }
    for (int64_t j = 0; j < kStep; j += kLanes) {
      __m256 xv = _mm256_loadu_ps(x + c + j);
      for (int r = 0; r < NR; ++r)
        acc[r] = _mm256_fmadd_ps(L::load(w + r * cols + c + j), xv, acc[r]);
    }
  }
  for (; c + kLanes <= cols; c += kLanes) {
    __m256 xv = _mm256_loadu_ps(x + c);
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(L::load(w + r * cols + c), xv, acc[r]);
  }
  if (c < cols) {
    __m256 xv = _mm256_maskload_ps(x + c, tail_mask(cols - c));
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm256_fmadd_ps(L::load_tail(w + r * cols + c, cols - c), xv, acc[r]);
  }
  for (int r = 0; r < NR; ++r) y[r] = reduce_add(acc[r]);
}

template <class L>
void matvec_typed(const void* w_any, const float* x, float* y, int64_t cols, int64_t r0,
                  int64_t r1) {
  const auto* w = static_cast<const typename L::T*>(w_any);
  int64_t r = r0;
  for (; r + kMatvecTileRows <= r1; r += kMatvecTileRows)
    matvec_tile<L, kMatvecTileRows>(w + r * cols, cols, x, y + r);
  for (; r < r1; ++r) matvec_tile<L, 1>(w + r * cols, cols, x, y + r);
}

// ---- matmul ----------------------------------------------------------------------------

// One register tile's operands, already offset to its first row and first token.
struct TileArgs {
  const void* w;   // first row; row stride cols elements
  const float* x;  // first token; token stride cols
  float* y;        // y[t * ldy + r]
  int64_t ldy;
  int64_t cols;
};
using TileFn = void (*)(const TileArgs&);

// Y[t, r] accumulates in one ymm per (r, t).
template <class L, int NR, int NT>
void fma_tile(const TileArgs& a) {
  const auto* w = static_cast<const typename L::T*>(a.w);
  const int64_t cols = a.cols;
  __m256 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + kLanes <= cols; c += kLanes) {
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = L::load(w + r * cols + c);
    for (int t = 0; t < NT; ++t) {
      __m256 xv = _mm256_loadu_ps(a.x + t * cols + c);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  if (c < cols) {
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = L::load_tail(w + r * cols + c, cols - c);
    __m256i mask = tail_mask(cols - c);
    for (int t = 0; t < NT; ++t) {
      __m256 xv = _mm256_maskload_ps(a.x + t * cols + c, mask);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) a.y[t * a.ldy + r] = reduce_add(acc[r][t]);
}

// Tile instances for every (rows, tokens) up to the full tile, so edges of the output run
// the same per-element code as the interior.
template <class L>
struct TileTable {
  TileFn fn[kTileRows][kTileTokens] = {};
  constexpr TileTable() { fill(std::make_integer_sequence<int, kTileRows>{}); }
  template <int... NR>
  constexpr void fill(std::integer_sequence<int, NR...>) {
    (fill_row<NR>(std::make_integer_sequence<int, kTileTokens>{}), ...);
  }
  template <int NR, int... NT>
  constexpr void fill_row(std::integer_sequence<int, NT...>) {
    ((fn[NR][NT] = &fma_tile<L, NR + 1, NT + 1>), ...);
  }
};

struct MatmulJob {
  const void* w;   // [rows, cols]
  const float* x;  // [n_tokens, cols]
  int64_t n_tokens;
  float* y;  // y[t * ldy + r]
  int64_t ldy;
  int64_t cols;
  int64_t r0, r1;
};

// Row blocks sized for L2, token tiles, then row tiles: a token tile's X stays in L1 (or
// L2 for wide rows) while the block's W rows stream from L2.
template <class L>
void matmul_typed(const MatmulJob& job) {
  static constexpr TileTable<L> table;
  const auto* w = static_cast<const typename L::T*>(job.w);
  const int64_t cols = job.cols;
  int64_t row_bytes = cols * int64_t(sizeof(typename L::T));
  int64_t block = row_bytes > 0 ? kRowBlockBytes / row_bytes : job.r1 - job.r0;
  block = block < kTileRows ? kTileRows : block / kTileRows * kTileRows;
  for (int64_t rb = job.r0; rb < job.r1; rb += block) {
    int64_t re = min64(rb + block, job.r1);
    for (int64_t t = 0; t < job.n_tokens; t += kTileTokens) {
      int64_t nt = min64(kTileTokens, job.n_tokens - t);
      for (int64_t r = rb; r < re; r += kTileRows) {
        int64_t nr = min64(kTileRows, re - r);
        TileArgs args{.w = w + r * cols,
                      .x = job.x + t * cols,
                      .y = job.y + t * job.ldy + r,
                      .ldy = job.ldy,
                      .cols = cols};
        table.fn[nr - 1][nt - 1](args);
      }
    }
  }
}

}  // namespace

void matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                 int64_t r1) {
  switch (wt) {
    case DType::kF32:
      return matvec_typed<LoadF32>(w, x, y, cols, r0, r1);
    case DType::kF16:
      return matvec_typed<LoadF16>(w, x, y, cols, r0, r1);
    case DType::kBF16:
      return matvec_typed<LoadBf16>(w, x, y, cols, r0, r1);
    case DType::kQ8_0:
    case DType::kQ4_K:  // quant_avx2.cpp
      return quant_matvec_rows(w, wt, x, y, cols, r0, r1);
  }
}

void matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y, int64_t ldy,
                 int64_t cols, int64_t r0, int64_t r1) {
  MatmulJob job{
      .w = w, .x = x, .n_tokens = n_tokens, .y = y, .ldy = ldy, .cols = cols, .r0 = r0, .r1 = r1};
  switch (wt) {
    case DType::kF32:
      return matmul_typed<LoadF32>(job);
    case DType::kF16:
      return matmul_typed<LoadF16>(job);
    case DType::kBF16:
      return matmul_typed<LoadBf16>(job);
    case DType::kQ8_0:
    case DType::kQ4_K:  // quant_avx2.cpp
      return quant_matmul_rows(w, wt, x, n_tokens, y, ldy, cols, r0, r1);
  }
}

}  // namespace ts::cpu::avx2
