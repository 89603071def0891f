// Portable C++ matvec / matmul: the reference the SIMD paths are tested against, and the
// fallback on CPUs without AVX2. Weights convert through the scalar functions of
// core/dtype.h; every row is one dot product with a fixed order (kLanes interleaved partial
// sums, then added in index order), so results do not depend on the row range of a call.
// matmul_rows uses the same dot product as matvec_rows: the two agree bitwise.
//
// Q8_0 weights take the integer path of quant.h instead: X is quantized to Q8 blocks and
// q8_0_dot is the reference of quant.h's accumulation order, which the SIMD paths match bit
// for bit.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cpu/quant.h"
#include "core/dtype.h"
#include "core/status.h"

namespace ts::cpu::portable {
namespace {

// Eight interleaved partial sums: independent dependency chains the compiler can keep in
// SIMD registers without reassociating (we never build with -ffast-math), so the reference
// is not ~8x slower than it needs to be.
constexpr int64_t kLanes = 8;

float dot_f32(const float* w, const float* x, int64_t cols) {
  float acc[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= cols; c += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += w[c + l] * x[c + l];
  }
  for (int64_t l = 0; c + l < cols; ++l) acc[l] += w[c + l] * x[c + l];
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

// Converts one weight row to F32 so the dot product (and its order) is shared by all
// dtypes.
void row_to_f32(const void* w, DType wt, int64_t cols, int64_t r, float* out) {
  switch (wt) {
    case DType::kF32: {
      const float* src = static_cast<const float*>(w) + r * cols;
      for (int64_t c = 0; c < cols; ++c) out[c] = src[c];
      return;
    }
    case DType::kF16: {
      const uint16_t* src = static_cast<const uint16_t*>(w) + r * cols;
      for (int64_t c = 0; c < cols; ++c) out[c] = f16_to_f32(src[c]);
      return;
    }
    case DType::kBF16: {
      const uint16_t* src = static_cast<const uint16_t*>(w) + r * cols;
      for (int64_t c = 0; c < cols; ++c) out[c] = bf16_to_f32(src[c]);
      return;
    }
    case DType::kQ8_0:  // (matvec_rows / matmul_rows take q8_0_dot instead)
    case DType::kQ4_K:  // the reference dequantization (backend/cpu/quant.h)
      return dequantize_row(wt, static_cast<const uint8_t*>(w) + r * dtype_row_bytes(wt, cols),
                            out, cols);
  }
  TS_CHECK(false, "unknown weight dtype");
}

// Reused across calls so decode does not allocate per matvec; one per thread because the
// pool runs several matvec_rows at once.
std::vector<float>& row_buffer(int64_t cols) {
  thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < cols) buf.resize(size_t(cols));
  return buf;
}

// One Q8_0 weight row . one Q8 activation row, in quant.h's order: per block, 8 exact
// integer lane sums of 4 products, each added to accumulator 8 (b mod 2) + lane by an FMA
// with d_w * d_x; then the halving sum of the 16 accumulators.
float q8_0_dot(const uint8_t* w, const int8_t* xq, const float* xd, int64_t n_blocks) {
  constexpr int kAcc = 16, kLaneBytes = 4;
  float acc[kAcc] = {};
  for (int64_t b = 0; b < n_blocks; ++b, w += kQ8_0BlockBytes, xq += kQ8_0BlockElems) {
    BlockQ8_0 blk;
    std::memcpy(&blk, w, sizeof blk);
    const float d = f16_to_f32(blk.d) * xd[b];
    for (int l = 0; l < kQ8_0BlockElems / kLaneBytes; ++l) {
      int32_t p = 0;
      for (int i = kLaneBytes * l; i < kLaneBytes * (l + 1); ++i) p += int32_t(blk.qs[i]) * xq[i];
      float& a = acc[8 * (b % 2) + l];
      a = std::fma(float(p), d, a);
    }
  }
  for (int h = kAcc / 2; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) acc[i] += acc[i + h];
  return acc[0];
}

// Quantized X for calls that bring F32 activations, reused across calls (per thread).
struct ActsScratch {
  std::vector<int8_t> qs;
  std::vector<float> d;
};

Q8Acts quantize_to_scratch(const float* x, int64_t n_tokens, int64_t cols) {
  thread_local ActsScratch s;
  s.qs.resize(size_t(n_tokens * cols));
  s.d.resize(size_t(n_tokens * cols / kQ8_0BlockElems));
  quantize_acts_q8(x, n_tokens, cols, s.qs.data(), s.d.data());
  return {s.qs.data(), s.d.data()};
}

}  // namespace

void q8_0_matvec_rows(const void* w, Q8Acts x, float* y, int64_t cols, int64_t r0, int64_t r1) {
  q8_0_matmul_rows(w, x, 1, y, 0, cols, r0, r1);
}

void q8_0_matmul_rows(const void* w, Q8Acts x, int64_t n_tokens, float* y, int64_t ldy,
                      int64_t cols, int64_t r0, int64_t r1) {
  const int64_t n_blocks = cols / kQ8_0BlockElems;
  const int64_t row_bytes = n_blocks * int64_t(kQ8_0BlockBytes);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wr = static_cast<const uint8_t*>(w) + r * row_bytes;
    for (int64_t t = 0; t < n_tokens; ++t)
      y[t * ldy + r] = q8_0_dot(wr, x.qs + t * cols, x.d + t * n_blocks, n_blocks);
  }
}

void matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                 int64_t r1) {
  if (wt == DType::kQ8_0)
    return q8_0_matvec_rows(w, quantize_to_scratch(x, 1, cols), y, cols, r0, r1);
  if (wt == DType::kF32) {
    const float* wf = static_cast<const float*>(w);
    for (int64_t r = r0; r < r1; ++r) y[r] = dot_f32(wf + r * cols, x, cols);
    return;
  }
  float* row = row_buffer(cols).data();
  for (int64_t r = r0; r < r1; ++r) {
    row_to_f32(w, wt, cols, r, row);
    y[r] = dot_f32(row, x, cols);
  }
}

void matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y, int64_t ldy,
                 int64_t cols, int64_t r0, int64_t r1) {
  if (wt == DType::kQ8_0)
    return q8_0_matmul_rows(w, quantize_to_scratch(x, n_tokens, cols), n_tokens, y, ldy, cols, r0,
                            r1);
  // Row outer, tokens inner: each weight row is converted once and stays in cache while
  // every token uses it.
  float* row = row_buffer(cols).data();
  for (int64_t r = r0; r < r1; ++r) {
    const float* wr = row;
    if (wt == DType::kF32) {
      wr = static_cast<const float*>(w) + r * cols;
    } else {
      row_to_f32(w, wt, cols, r, row);
    }
    for (int64_t t = 0; t < n_tokens; ++t) y[t * ldy + r] = dot_f32(wr, x + t * cols, cols);
  }
}

}  // namespace ts::cpu::portable
