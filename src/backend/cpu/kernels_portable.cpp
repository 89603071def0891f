// Portable C++ matvec / matmul: the reference the SIMD paths are tested against, and the
// fallback on CPUs without AVX2. Weights convert through the scalar functions of
// core/dtype.h; every row is one dot product with a fixed order (kLanes interleaved partial
// sums, then added in index order), so results do not depend on the row range of a call.
// matmul_rows uses the same dot product as matvec_rows: the two agree bitwise.
#include <cstdint>
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
    case DType::kQ8_0:
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

}  // namespace

void matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                 int64_t r1) {
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
