// AVX-512 (F/BW/VL/DQ + BF16) matvec and matmul. Compiled with AVX-512 flags for this file
// only; dispatch.cpp calls it only when the CPU and OS support them.
//
// matmul: register tiles of kTileRows rows x kTileTokens tokens, so each W vector loaded is
// used kTileTokens times. BF16 W rounds X to BF16 once per call (round to nearest even) and
// uses vdpbf16ps; F32 / F16 W keep X in F32, convert W in registers (F16: vcvtph2ps) and use
// FMA. matvec is matmul of one token (its tiles read W ahead with software prefetch).
//
// Determinism: an output element is one accumulator chain over its row's columns in index
// order, the tail in the same accumulator, reduced in a fixed order. Tiles of any size run
// the same per-element operations, so neither the [r0, r1) range nor the number of tokens in
// a call changes a result, and matvec equals matmul per token (batch invariance).
//
// ODR hazard: this file is compiled with -mavx512*, so any inline function or template from
// a shared header that it instantiates could be emitted here with AVX-512 instructions and
// picked by the linker for callers on CPUs without them. Hence everything here lives in an
// anonymous namespace and uses only intrinsics and library calls: no inline functions or templates
// with code from std:: or core/ (nm shows only the two entry points defined here, even at
// -O0).

// g++ 12.2's AVX-512 intrinsics start many results from _mm512_undefined_ps(), which
// -W(maybe-)uninitialized flags inside the header (GCC PR 105593, fixed in 12.3/13). The
// warnings point into the header, so silencing them there hides nothing of ours.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>
#include <new>
#include <utility>

#include "backend/cpu/kernels.h"
#include "backend/cpu/quant.h"

namespace ts::cpu::avx512 {
namespace {

constexpr int64_t kLanes = 16;       // F32 lanes per zmm
constexpr int64_t kBf16PerVec = 32;  // BF16 elements (16 pairs) per zmm for vdpbf16ps
constexpr int kTileRows = 4;         // matmul register tile: 4 x 6 = 24 accumulators
constexpr int kTileTokens = 6;       //   + 4 W vectors + 1 X vector = 29 of 32 zmm
// matvec reads each row this far ahead with software prefetch. Hardware prefetch alone left
// BF16 matvec (4096 x 4096, from DRAM) at ~17 GB/s; 1-2 KiB ahead gave ~21 (F32: 22 -> 25);
// 4-8 KiB was worse again (bench lab runs, interleaved variants, medians of 12).
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kRowBlockBytes = 256 << 10;  // W rows revisited per token tile: keep in L2

int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

__mmask16 tail_mask16(int64_t n) { return __mmask16((1u << n) - 1u); }
__mmask32 tail_mask32(int64_t n) { return __mmask32((uint64_t(1) << n) - 1u); }

// Fixed-order horizontal sum of 16 lanes.
float reduce_add(__m512 v) {
  __m512 s = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(s);
}

// W element type -> 16 F32 lanes. load_tail reads only the first n (< 16) elements; masked
// loads do not fault on the lanes they skip, so reading past the end of W is never done.
struct LoadF32 {
  using T = float;
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load_tail(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(tail_mask16(n), p);
  }
};

struct LoadF16 {
  using T = uint16_t;
  static __m512 load(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512 load_tail(const uint16_t* p, int64_t n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask16(n), p));
  }
};

struct LoadBf16 {
  using T = uint16_t;
  static __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __m512 load(const uint16_t* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512 load_tail(const uint16_t* p, int64_t n) {
    return widen(_mm256_maskz_loadu_epi16(tail_mask16(n), p));
  }
};

// ---- matmul ----------------------------------------------------------------------------

// One register tile's operands, already offset to its first row and first token.
struct TileArgs {
  const void* w;  // first row; row stride cols elements
  const void* x;  // first token; token stride ldx elements
  float* y;       // y[t * ldy + r]
  int64_t ldx;
  int64_t ldy;
  int64_t cols;
};
using TileFn = void (*)(const TileArgs&);

// One token (matvec) is bound by memory: each row is read kPrefetchBytes ahead. A prefetch
// never faults and changes no arithmetic, so the address may lie past the end of W.
template <int NR>
void prefetch_rows(const void* at, int64_t row_bytes) {
  for (int r = 0; r < NR; ++r)
    _mm_prefetch(static_cast<const char*>(at) + r * row_bytes + kPrefetchBytes, _MM_HINT_T0);
}

// F32 activations, FMA: Y[t, r] accumulates in one zmm per (r, t).
template <class L, int NR, int NT>
void fma_tile(const TileArgs& a) {
  const auto* w = static_cast<const typename L::T*>(a.w);
  const auto* x = static_cast<const float*>(a.x);
  const int64_t cols = a.cols;
  __m512 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + kLanes <= cols; c += kLanes) {
    if constexpr (NT == 1) prefetch_rows<NR>(w + c, cols * int64_t(sizeof(typename L::T)));
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = L::load(w + r * cols + c);
    for (int t = 0; t < NT; ++t) {
      __m512 xv = _mm512_loadu_ps(x + t * a.ldx + c);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  if (c < cols) {
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = L::load_tail(w + r * cols + c, cols - c);
    for (int t = 0; t < NT; ++t) {
      __m512 xv = _mm512_maskz_loadu_ps(tail_mask16(cols - c), x + t * a.ldx + c);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) a.y[t * a.ldy + r] = reduce_add(acc[r][t]);
}

// BF16 W x BF16 X with vdpbf16ps: each lane adds a pair of products per instruction. X is
// the padded copy made by matmul_bf16 (ldx a multiple of 32, zeros past cols, 64-byte
// aligned), so only W needs a masked tail.
template <int NR, int NT>
void dpbf16_tile(const TileArgs& a) {
  const auto* w = static_cast<const uint16_t*>(a.w);
  const auto* x = static_cast<const uint16_t*>(a.x);
  const int64_t cols = a.cols;
  __m512 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + kBf16PerVec <= cols; c += kBf16PerVec) {
    if constexpr (NT == 1) prefetch_rows<NR>(w + c, cols * 2);
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_loadu_si512(w + r * cols + c);
    for (int t = 0; t < NT; ++t) {
      __m512i xv = _mm512_load_si512(x + t * a.ldx + c);
      for (int r = 0; r < NR; ++r)
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv[r], (__m512bh)xv);
    }
  }
  if (c < cols) {
    __m512i wv[NR];
    for (int r = 0; r < NR; ++r)
      wv[r] = _mm512_maskz_loadu_epi16(tail_mask32(cols - c), w + r * cols + c);
    for (int t = 0; t < NT; ++t) {
      __m512i xv = _mm512_load_si512(x + t * a.ldx + c);
      for (int r = 0; r < NR; ++r)
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv[r], (__m512bh)xv);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) a.y[t * a.ldy + r] = reduce_add(acc[r][t]);
}

// Tile instances for every (rows, tokens) up to the full tile, so edges of the output run
// the same per-element code as the interior. K::run<NR, NT> is one tile kernel.
template <class K>
struct TileTable {
  TileFn fn[kTileRows][kTileTokens] = {};
  constexpr TileTable() { fill(std::make_integer_sequence<int, kTileRows>{}); }
  template <int... NR>
  constexpr void fill(std::integer_sequence<int, NR...>) {
    (fill_row<NR>(std::make_integer_sequence<int, kTileTokens>{}), ...);
  }
  template <int NR, int... NT>
  constexpr void fill_row(std::integer_sequence<int, NT...>) {
    ((fn[NR][NT] = &K::template run<NR + 1, NT + 1>), ...);
  }
};

template <class L>
struct FmaTile {
  template <int NR, int NT>
  static void run(const TileArgs& a) {
    fma_tile<L, NR, NT>(a);
  }
};
struct DpBf16Tile {
  template <int NR, int NT>
  static void run(const TileArgs& a) {
    dpbf16_tile<NR, NT>(a);
  }
};

// A matmul_rows call with X possibly already converted (see matmul_bf16).
struct MatmulJob {
  const void* w;  // [rows, cols] of w_bytes-sized elements
  int64_t w_bytes;
  const void* x;  // [n_tokens, ldx] of x_bytes-sized elements
  int64_t x_bytes;
  int64_t ldx;
  int64_t n_tokens;
  float* y;  // y[t * ldy + r]
  int64_t ldy;
  int64_t cols;
  int64_t r0, r1;
};

// Row blocks sized for L2, token tiles, then row tiles: a token tile's X (kTileTokens rows)
// stays in L1 while the block's W rows stream from L2.
template <class K>
void run_tiles(const MatmulJob& job) {
  static constexpr TileTable<K> table;
  const auto* wb = static_cast<const char*>(job.w);
  const auto* xb = static_cast<const char*>(job.x);
  int64_t row_bytes = job.cols * job.w_bytes;
  int64_t block = row_bytes > 0 ? kRowBlockBytes / row_bytes : job.r1 - job.r0;
  block = block < kTileRows ? kTileRows : block / kTileRows * kTileRows;
  for (int64_t rb = job.r0; rb < job.r1; rb += block) {
    int64_t re = min64(rb + block, job.r1);
    for (int64_t t = 0; t < job.n_tokens; t += kTileTokens) {
      int64_t nt = min64(kTileTokens, job.n_tokens - t);
      for (int64_t r = rb; r < re; r += kTileRows) {
        int64_t nr = min64(kTileRows, re - r);
        TileArgs args{.w = wb + r * row_bytes,
                      .x = xb + t * job.ldx * job.x_bytes,
                      .y = job.y + t * job.ldy + r,
                      .ldx = job.ldx,
                      .ldy = job.ldy,
                      .cols = job.cols};
        table.fn[nr - 1][nt - 1](args);
      }
    }
  }
}

// Per-thread scratch for X rounded to BF16, reused across calls (prefill calls matmul per
// layer with the same shapes).
struct Bf16Scratch {
  uint16_t* data = nullptr;
  size_t size = 0;
  Bf16Scratch() = default;
  Bf16Scratch(const Bf16Scratch&) = delete;
  Bf16Scratch& operator=(const Bf16Scratch&) = delete;
  ~Bf16Scratch() { ::operator delete (data, std::align_val_t{64}); }
  uint16_t* get(size_t n) {
    if (n > size) {
      ::operator delete (data, std::align_val_t{64});
      data = static_cast<uint16_t*>(::operator new (n * sizeof(uint16_t), std::align_val_t{64}));
      size = n;
    }
    return data;
  }
};

// X [n_tokens, cols] F32 -> BF16 (round to nearest even) with rows padded to ldx, zeros in
// the padding so the tile loop needs no masked X loads.
void round_x_to_bf16(const float* x, int64_t n_tokens, int64_t cols, uint16_t* xb, int64_t ldx) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* src = x + t * cols;
    uint16_t* dst = xb + t * ldx;
    for (int64_t c = 0; c < ldx; c += kBf16PerVec) {
      int64_t n = min64(cols - c, kBf16PerVec);  // may be <= 0 in the padding
      __m512 lo, hi;
      if (n >= kBf16PerVec) {
        lo = _mm512_loadu_ps(src + c);
        hi = _mm512_loadu_ps(src + c + kLanes);
      } else {
        lo = n >= kLanes ? _mm512_loadu_ps(src + c)
                         : _mm512_maskz_loadu_ps(tail_mask16(n > 0 ? n : 0), src + c);
        hi = _mm512_maskz_loadu_ps(tail_mask16(n > kLanes ? n - kLanes : 0), src + c + kLanes);
      }
      _mm512_store_si512(dst + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// job.x is F32; rounds it to BF16 in per-thread scratch, then runs vdpbf16ps tiles.
void matmul_bf16(MatmulJob job) {
  thread_local Bf16Scratch scratch;
  int64_t ldx = (job.cols + kBf16PerVec - 1) / kBf16PerVec * kBf16PerVec;
  uint16_t* xb = scratch.get(size_t(job.n_tokens * ldx));
  round_x_to_bf16(static_cast<const float*>(job.x), job.n_tokens, job.cols, xb, ldx);
  job.w_bytes = 2;
  job.x = xb;
  job.x_bytes = 2;
  job.ldx = ldx;
  run_tiles<DpBf16Tile>(job);
}

}  // namespace

void matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                 int64_t r1) {
  switch (wt) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:  // one token of matmul: the same bits per row (kernels.h)
      return matmul_rows(w, wt, x, 1, y, 1, cols, r0, r1);
    case DType::kQ8_0:
    case DType::kQ4_K:  // quant_avx512.cpp
      return quant_matvec_rows(w, wt, x, y, cols, r0, r1);
  }
}

void matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y, int64_t ldy,
                 int64_t cols, int64_t r0, int64_t r1) {
  if (r0 >= r1 || n_tokens <= 0) return;
  MatmulJob job{.w = w,
                .w_bytes = 4,
                .x = x,
                .x_bytes = 4,
                .ldx = cols,
                .n_tokens = n_tokens,
                .y = y,
                .ldy = ldy,
                .cols = cols,
                .r0 = r0,
                .r1 = r1};
  switch (wt) {
    case DType::kF32:
      return run_tiles<FmaTile<LoadF32>>(job);
    case DType::kF16:
      job.w_bytes = 2;
      return run_tiles<FmaTile<LoadF16>>(job);
    case DType::kBF16:
      return matmul_bf16(job);
    case DType::kQ8_0:
    case DType::kQ4_K:  // quant_avx512.cpp
      return quant_matmul_rows(w, wt, x, n_tokens, y, ldy, cols, r0, r1);
  }
}

}  // namespace ts::cpu::avx512
