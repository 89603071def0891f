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
// (d * sc) * q - dmin * m (two more): dequantize_row is the reference every SIMD path
// reproduces bit for bit, so a matmul on quantized weights is the F32 matmul of the
// dequantized matrix.
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

// Per-ISA matvec / matmul for quantized weights, with the contracts of kernels.h's
// matvec_rows / matmul_rows (w row-major, row r at byte r * dtype_row_bytes(wt, cols)).
// kernels.h's per-ISA entry points forward quantized dtypes here; the portable path
// dequantizes each row with dequantize_row and shares the float dot product.
//
// matvec (decode) reads each block once and dequantizes in registers; matmul (prefill)
// dequantizes a block of rows into a per-thread F32 buffer once per call and runs the F32
// matmul of its ISA on it, so Y equals that ISA's F32 matmul of the dequantized rows.
namespace avx2 {
void quant_matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                       int64_t r1);
void quant_matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y,
                       int64_t ldy, int64_t cols, int64_t r0, int64_t r1);
}  // namespace avx2
namespace avx512 {
void quant_matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                       int64_t r1);
void quant_matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y,
                       int64_t ldy, int64_t cols, int64_t r0, int64_t r1);
}  // namespace avx512

}  // namespace ts::cpu
