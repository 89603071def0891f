// ggml's reference dequantization (ggml-quants.c, dequantize_row_*) of the block types a GGUF
// model file may hold that the kernels do not read in place: Q4_0, Q4_1, Q5_0, Q5_1, Q2_K,
// Q3_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS (Q8_0 and Q4_K are read as they are;
// backend/cpu/quant.h). Used to
// requantize such tensors to Q8_0 at load (model/gguf_model.cpp). Block layouts:
//   Q4_0  {f16 d; u8 qs[16]}                          32 weights, 18 bytes
//   Q4_1  {f16 d, m; u8 qs[16]}                       32 weights, 20 bytes
//   Q5_0  {f16 d; u8 qh[4]; u8 qs[16]}                32 weights, 22 bytes
//   Q5_1  {f16 d, m; u8 qh[4]; u8 qs[16]}             32 weights, 24 bytes
//   Q2_K  {u8 scales[16]; u8 qs[64]; f16 d, dmin}     256 weights, 84 bytes
//   Q3_K  {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}          256 weights, 110 bytes
//   Q5_K  {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}      256 weights, 176 bytes
//   Q6_K  {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}            256 weights, 210 bytes
//   IQ4_NL {f16 d; u8 qs[16]}                         32 weights, 18 bytes
//   IQ4_XS {f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]}       256 weights, 136 bytes
#pragma once

#include <cstdint>

namespace ts::model {

// Whether ggml_dequantize_row handles this ggml type id.
bool ggml_can_dequantize(uint32_t ggml_type);

// Dequantizes `n` weights (a whole number of blocks) of type `ggml_type` from `src` into
// `dst`. Precondition: ggml_can_dequantize(ggml_type).
void ggml_dequantize_row(uint32_t ggml_type, const uint8_t* src, float* dst, int64_t n);

}  // namespace ts::model
