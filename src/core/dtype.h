// Element types of weights and their scalar conversions. The conversions here are the
// portable reference; SIMD kernels convert in registers and are tested against these.
//
// Block-quantized types store a row as consecutive blocks, with GGUF's exact byte layouts
// (llama.cpp ggml-common.h), so GGUF tensors can be used without conversion:
//   Q8_0  32 weights, 34 bytes:  f16 d | int8 qs[32]              w = d * qs[i]
//   Q4_K 256 weights, 144 bytes: f16 d | f16 dmin | u8 scales[12] | u8 qs[128]
//        8 sub-blocks of 32 with 6-bit scale sc and min m (packed as get_scale_min_k4);
//        w = d * sc * q - dmin * m, q the 4-bit quant. backend/cpu/quant.h has the details.
// A quantized row holds a whole number of blocks: dtype_row_ok() says whether `cols` fits.
// Element sizes (dtype_size) exist only for the float types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "core/status.h"

namespace ts {

enum class DType : uint8_t { kF32, kF16, kBF16, kQ8_0, kQ4_K };

constexpr int64_t kQ8_0BlockElems = 32;
constexpr uint64_t kQ8_0BlockBytes = 34;
constexpr int64_t kQ4_KBlockElems = 256;
constexpr uint64_t kQ4_KBlockBytes = 144;

constexpr bool dtype_is_quantized(DType t) { return t == DType::kQ8_0 || t == DType::kQ4_K; }

// Weights per block (1 for the float types) and bytes per block (the element size for them).
constexpr int64_t dtype_block_elems(DType t) {
  return t == DType::kQ8_0 ? kQ8_0BlockElems : t == DType::kQ4_K ? kQ4_KBlockElems : 1;
}
constexpr uint64_t dtype_block_bytes(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16:
    case DType::kBF16: return 2;
    case DType::kQ8_0: return kQ8_0BlockBytes;
    case DType::kQ4_K: return kQ4_KBlockBytes;
  }
  return 0;
}

// Bytes of one element; the float types only (a quantized weight has no byte size of its
// own: use dtype_row_bytes).
inline size_t dtype_size(DType t) {
  TS_CHECK(!dtype_is_quantized(t), "a quantized type has no element size: use dtype_row_bytes");
  return t == DType::kF32 ? 4 : 2;
}

// Whether a row of `cols` elements is a whole number of blocks.
constexpr bool dtype_row_ok(DType t, int64_t cols) {
  return cols >= 0 && cols % dtype_block_elems(t) == 0;
}

// Bytes of one row of `cols` elements; for quantized types cols must satisfy dtype_row_ok
// (callers with outside input check it first).
inline uint64_t dtype_row_bytes(DType t, int64_t cols) {
  TS_CHECK(dtype_row_ok(t, cols), "row length is not a whole number of quantization blocks");
  return uint64_t(cols / dtype_block_elems(t)) * dtype_block_bytes(t);
}

inline std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kQ8_0: return "Q8_0";
    case DType::kQ4_K: return "Q4_K";
  }
  return "?";
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | uint32_t(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, with overflow to inf and subnormals.
inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (x >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520 -> inf
  if (x < 0x38800000u) {                                  // subnormal or zero in f16
    if (x < 0x33000000u) return uint16_t(sign);
    uint32_t e = x >> 23;
    uint32_t m = (x & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // value / 2^-24 = m * 2^(e - 126); shift in [14, 24]
    uint32_t half = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t half = ((x >> 13) - (112u << 10));
  uint32_t rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1))) ++half;
  return uint16_t(sign | half);
}

// Converts n elements of a float-typed row (F32, F16, BF16) to F32: the one scalar path for
// embedding rows, norms and biases. Precondition: !dtype_is_quantized(t).
inline void float_row_to_f32(const void* src, DType t, float* dst, int64_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    switch (t) {
      case DType::kF32: std::memcpy(&dst[i], p + 4 * i, 4); break;
      case DType::kF16: std::memcpy(&h, p + 2 * i, 2); dst[i] = f16_to_f32(h); break;
      case DType::kBF16: std::memcpy(&h, p + 2 * i, 2); dst[i] = bf16_to_f32(h); break;
      case DType::kQ8_0:
      case DType::kQ4_K: return;  // callers check dtype_is_quantized first
    }
  }
}

}  // namespace ts
