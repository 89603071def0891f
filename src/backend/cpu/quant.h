// Block-quantized weights (Q8_0, Q4_K) with GGUF's byte layouts: the reference
// quantize / dequantize of one row, the block structs, and the per-ISA matvec / matmul
// entry points that kernels.h's dispatch reaches for quantized weights.
//
// Layouts (llama.cpp ggml-common.h; all little-endian, blocks packed back to back, no
// padding, so a row of cols weights is cols / block_elems blocks):
//
//   Q8_0 (34 bytes, 32 weights)
//     [0, 2)    f16 d
//     [2, 34)   int8 qs[32]                      w[i] = d * qs[i]
//
//   Q4_K (144 bytes, 256 weights = 8 sub-blocks j of 32)
//     [0, 2)    f16 d       super-block scale of the sub-block scales
//     [2, 4)    f16 dmin    super-block scale of the sub-block mins
//     [4, 16)   u8 scales[12]: 6-bit scale sc[j] and min m[j] per sub-block
//                 j < 4:  sc = scales[j] & 63,  m = scales[j + 4] & 63
//                 j >= 4: sc = (scales[j + 4] & 15) | (scales[j - 4] >> 6) << 4
//                         m  = (scales[j + 4] >> 4) | (scales[j] >> 6) << 4
//     [16, 144) u8 qs[128]: 4-bit quants; 64-weight group g (sub-blocks 2g, 2g + 1) is
//               qs[32g, 32g + 32): weight 64g + l is the low nibble of qs[32g + l] and
//               weight 64g + 32 + l its high nibble (l < 32)
//                                                w = d * sc[j] * q - dmin * m[j]
//
// Dequantization computes, in F32 and in this order, d * sc (one rounding) then
// (d * sc) * q - dmin * m (two more): dequantize_row is the reference every SIMD
// dequantization reproduces bit for bit.
//
// Products with activations (matvec / matmul): integer dot products on int8 activations, as
// llama.cpp's q8_0 x q8_0 and q4_K x q8_K dots (and this project's CUDA Q8_0 gemv). Every
// token row of X is first quantized in 32-blocks (quantize_acts_q8; for q and d the same
// rule as cuda::quantize_act):
//   amax = max_i |x_i|,  d_x = amax / 127 (F32),  id = d_x >= FLT_MIN ? 1 / d_x : 0,
//   q_i = x_i * id rounded to nearest, ties to even,  s_x = d_x * float(sum_i q_i).
// |x_i * id| <= 127 (1 + 2^-22), so q_i lies in [-127, 127] with no clamp; a block whose d_x
// is below FLT_MIN (|x| < ~1.5e-36) quantizes to zeros instead of overflowing id. s_x (one
// rounding; the sum is exact) serves Q4_K's mins.
//
// Then, for a weight row and an activation row, with 32-block g of the row (Q8_0: block g;
// Q4_K: sub-block j = g mod 8 of super-block g / 8) and lane l in [0, 8):
//   p = sum_{i < 4} q_w[32g + 4l + i] * q_x[32g + 4l + i]                      (exact int)
//   acc[8 (g mod 2) + l] = fma(float(p), s_w[g] * d_x[g], acc[...])            (F32)
// with s_w[g] = d (Q8_0) or d * sc[j] (Q4_K, exact), times d_x one F32 rounding. Q4_K adds
// its mins in 8 more accumulators, one per sub-block index, super-block by super-block:
//   macc[j] = fma(dmin * m[j], s_x[g], macc[j])                       (dmin * m[j] exact)
// All accumulators start at +0. The result is the halving sum of acc (acc[i] += acc[i + h]
// for h = 8, 4, 2, 1 and i < h; then acc[0]), minus (Q4_K) the halving sum of macc
// (h = 4, 2, 1). This is the order of a 512-bit VNNI loop (two 32-blocks per zmm, 4 bytes
// per int32 lane) and of a 256-bit one with even / odd accumulators: portable::, avx2::,
// avx2vnni:: and avx512:: give the same bits, and matvec equals matmul for each (row, token).
//
// GCC fuses a * b + c into an FMA even at -std=c++20 and through intrinsics, so every F32
// product above feeds an FMA as a multiplicand or a conversion, never an addition: a fused
// and an unfused build give the same bits.
//
// Error against the exact product sum_c w_c x_c (w the dequantized weights): the activation
// rounding, |x_c - d_x q_c| <= d_x / 2 per element, so |y - w . x| <= sum_g d_x[g] / 2 *
// sum_{c in g} |w_c|, plus F32 rounding (Q4_K: relative to its scale and min terms apart).
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace ts::cpu {

struct BlockQ8_0 {
  uint16_t d;  // f16
  int8_t qs[32];
};
static_assert(sizeof(BlockQ8_0) == kQ8_0BlockBytes && kQ8_0BlockElems == 32);

struct BlockQ4_K {
  uint16_t d;     // f16
  uint16_t dmin;  // f16
  uint8_t scales[12];
  uint8_t qs[128];
};
static_assert(sizeof(BlockQ4_K) == kQ4_KBlockBytes && kQ4_KBlockElems == 256);

// 6-bit scale and min of sub-block j (0..7) of a Q4_K block (llama.cpp get_scale_min_k4).
inline void q4_k_scale_min(const uint8_t* scales, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = scales[j] & 63;
    *m = scales[j + 4] & 63;
  } else {
    *sc = uint8_t((scales[j + 4] & 15) | (scales[j - 4] >> 6) << 4);
    *m = uint8_t((scales[j + 4] >> 4) | (scales[j] >> 6) << 4);
  }
}

// Quantizes one row of `cols` F32 values into `out` (dtype_row_bytes(t, cols) bytes).
// Preconditions: t quantized, dtype_row_ok(t, cols), values finite.
// Q8_0 is llama.cpp's reference (d = max|x| / 127, round to nearest); Q4_K searches each
// sub-block's scale and min by weighted least squares over candidate scales (as llama.cpp's
// make_qkx2_quants does), then quantizes the scales to 6 bits and re-fits the quants.
void quantize_row(DType t, const float* x, void* out, int64_t cols);

// Dequantizes one row (the reference conversion; see the header comment).
void dequantize_row(DType t, const void* q, float* out, int64_t cols);

// Activations quantized as the header says: token row t of cols values is
// qs[t * cols, (t + 1) * cols), its block scales d[t * n, (t + 1) * n) and block sums
// times scales sum[t * n, (t + 1) * n), n = cols / 32.
struct Q8Acts {
  const int8_t* qs = nullptr;
  const float* d = nullptr;
  const float* sum = nullptr;
};
// Where quantize_acts_q8 writes them: n_tokens * cols bytes and n_tokens * cols / 32 floats
// each for d and sum.
struct Q8ActsOut {
  int8_t* qs = nullptr;
  float* d = nullptr;
  float* sum = nullptr;
};

// The reference activation quantization of n_tokens rows of cols F32 values (cols a
// multiple of 32, values finite).
void quantize_acts_q8(const float* x, int64_t n_tokens, int64_t cols, Q8ActsOut out);

// Per-ISA matvec / matmul for quantized weights (Q8_0, Q4_K), with the contracts of
// kernels.h's matvec_rows / matmul_rows (w row-major, row r at byte r * dtype_row_bytes(wt,
// cols)), on activations already quantized:
//   matvec_rows_q8: y[r] = W[r, :] . x (one token) for r in [r0, r1).
//   matmul_rows_q8: Y[t, r] = W[r, :] . X[t, :] for t < n_tokens, r in [r0, r1); Y row
//                   stride ldy.
// quant_matvec_rows / quant_matmul_rows take F32 x (kernels.h's per-ISA matvec_rows /
// matmul_rows forward quantized dtypes there): they quantize x into per-thread scratch and
// call these. kernels.h's parallel wrappers quantize X once per call instead, so the row
// chunks of a call share one quantization.
namespace portable {
void matvec_rows_q8(const void* w, DType wt, Q8Acts x, float* y, int64_t cols, int64_t r0,
                    int64_t r1);
void matmul_rows_q8(const void* w, DType wt, Q8Acts x, int64_t n_tokens, float* y, int64_t ldy,
                    int64_t cols, int64_t r0, int64_t r1);
}  // namespace portable
namespace avx2 {
void quantize_acts_q8(const float* x, int64_t n_tokens, int64_t cols, Q8ActsOut out);
void matvec_rows_q8(const void* w, DType wt, Q8Acts x, float* y, int64_t cols, int64_t r0,
                    int64_t r1);
void matmul_rows_q8(const void* w, DType wt, Q8Acts x, int64_t n_tokens, float* y, int64_t ldy,
                    int64_t cols, int64_t r0, int64_t r1);
void quant_matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                       int64_t r1);
void quant_matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y,
                       int64_t ldy, int64_t cols, int64_t r0, int64_t r1);
}  // namespace avx2
// avx2's kernels with AVX-VNNI's vpdpbusd for the int8 dots (quant_avx2_vnni.cpp).
namespace avx2vnni {
void quantize_acts_q8(const float* x, int64_t n_tokens, int64_t cols, Q8ActsOut out);
void matvec_rows_q8(const void* w, DType wt, Q8Acts x, float* y, int64_t cols, int64_t r0,
                    int64_t r1);
void matmul_rows_q8(const void* w, DType wt, Q8Acts x, int64_t n_tokens, float* y, int64_t ldy,
                    int64_t cols, int64_t r0, int64_t r1);
void quant_matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                       int64_t r1);
void quant_matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y,
                       int64_t ldy, int64_t cols, int64_t r0, int64_t r1);
}  // namespace avx2vnni
namespace avx512 {
void quantize_acts_q8(const float* x, int64_t n_tokens, int64_t cols, Q8ActsOut out);
void matvec_rows_q8(const void* w, DType wt, Q8Acts x, float* y, int64_t cols, int64_t r0,
                    int64_t r1);
void matmul_rows_q8(const void* w, DType wt, Q8Acts x, int64_t n_tokens, float* y, int64_t ldy,
                    int64_t cols, int64_t r0, int64_t r1);
void quant_matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                       int64_t r1);
void quant_matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y,
                       int64_t ldy, int64_t cols, int64_t r0, int64_t r1);
}  // namespace avx512

}  // namespace ts::cpu
