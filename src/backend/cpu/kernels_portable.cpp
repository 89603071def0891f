// Portable C++ matvec / matmul: the reference the SIMD paths are tested against, and the
// fallback on CPUs without AVX2. Weights convert through the scalar functions of
// core/dtype.h; every row is one dot product with a fixed order (kLanes interleaved partial
// sums, then added in index order), so results do not depend on the row range of a call.
// matmul_rows uses the same dot product as matvec_rows: the two agree bitwise.
//
// Quantized weights (Q8_0, Q4_K) take the integer path of quant.h instead: X is quantized
// to Q8 blocks, and q8_0_dot / q4_k_dot are the reference of quant.h's accumulation order,
// which the SIMD paths match bit for bit.
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

// Converts one weight row to F32 so the dot product (and its order) is shared by the float
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
    case DType::kQ4_K:  // matvec_rows / matmul_rows take the integer dots instead
      break;
  }
  TS_CHECK(false, "row_to_f32: F32, F16 or BF16 weights only");
}

// Reused across calls so decode does not allocate per matvec; one per thread because the
// pool runs several matvec_rows at once.
std::vector<float>& row_buffer(int64_t cols) {
  thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < cols) buf.resize(size_t(cols));
  return buf;
}

// quant.h's accumulators: 16 lanes for the integer dots, 8 for Q4_K's mins.
struct Accumulators {
  float acc[16] = {};
  float macc[8] = {};
  // acc[8 (g mod 2) + l] += p_l * scale for the 32 quants of weight block g (qw(i) gives
  // quant i) against the activation quants xq.
  template <class Quant>
  void add_block(int64_t g, const Quant& qw, const int8_t* xq, float scale) {
    for (int l = 0; l < 8; ++l) {
      int32_t p = 0;
      for (int i = 4 * l; i < 4 * l + 4; ++i) p += int32_t(qw(i)) * xq[i];
      float& a = acc[8 * (g % 2) + l];
      a = std::fma(float(p), scale, a);
    }
  }
  static float halving_sum(float* v, int n) {
    for (int h = n / 2; h >= 1; h /= 2)
      for (int i = 0; i < h; ++i) v[i] += v[i + h];
    return v[0];
  }
  float result() { return halving_sum(acc, 16) - halving_sum(macc, 8); }
};

// One weight row . one Q8 activation row (x.qs, x.d, x.sum already at the row), in quant.h's
// order.
float q8_0_dot(const uint8_t* w, Q8Acts x, int64_t n_blocks) {
  Accumulators a;
  for (int64_t g = 0; g < n_blocks; ++g, w += kQ8_0BlockBytes) {
    BlockQ8_0 blk;
    std::memcpy(&blk, w, sizeof blk);
    a.add_block(
        g, [&](int i) { return blk.qs[i]; }, x.qs + 32 * g, f16_to_f32(blk.d) * x.d[g]);
  }
  return a.result();
}

float q4_k_dot(const uint8_t* w, Q8Acts x, int64_t n_blocks) {
  Accumulators a;
  for (int64_t b = 0; b < n_blocks; ++b, w += kQ4_KBlockBytes) {
    BlockQ4_K blk;
    std::memcpy(&blk, w, sizeof blk);
    const float d = f16_to_f32(blk.d), dmin = f16_to_f32(blk.dmin);
    for (int j = 0; j < 8; ++j) {
      const int64_t g = 8 * b + j;
      uint8_t sc, m;
      q4_k_scale_min(blk.scales, j, &sc, &m);
      // Sub-block j: nibble (j % 2) of qs[32 (j / 2), 32 (j / 2) + 32) (quant.h's layout).
      const uint8_t* qs = blk.qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      a.add_block(
          g, [&](int i) { return int8_t((qs[i] >> shift) & 15); }, x.qs + 32 * g,
          (d * float(sc)) * x.d[g]);
      a.macc[j] = std::fma(dmin * float(m), x.sum[g], a.macc[j]);
    }
  }
  return a.result();
}

// Quantized X for calls that bring F32 activations, reused across calls (per thread).
struct ActsScratch {
  std::vector<int8_t> qs;
  std::vector<float> d, sum;
};

Q8Acts quantize_to_scratch(const float* x, int64_t n_tokens, int64_t cols) {
  thread_local ActsScratch s;
  s.qs.resize(size_t(n_tokens * cols));
  s.d.resize(size_t(n_tokens * cols / kQ8_0BlockElems));
  s.sum.resize(s.d.size());
  quantize_acts_q8(x, n_tokens, cols, {s.qs.data(), s.d.data(), s.sum.data()});
  return {s.qs.data(), s.d.data(), s.sum.data()};
}

}  // namespace

void matvec_rows_q8(const void* w, DType wt, Q8Acts x, float* y, int64_t cols, int64_t r0,
                    int64_t r1) {
  matmul_rows_q8(w, wt, x, 1, y, 0, cols, r0, r1);
}

void matmul_rows_q8(const void* w, DType wt, Q8Acts x, int64_t n_tokens, float* y, int64_t ldy,
                    int64_t cols, int64_t r0, int64_t r1) {
  const int64_t n_blocks = cols / (wt == DType::kQ8_0 ? kQ8_0BlockElems : kQ4_KBlockElems);
  const int64_t row_bytes = int64_t(dtype_row_bytes(wt, cols));
  const int64_t n_x_blocks = cols / 32;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wr = static_cast<const uint8_t*>(w) + r * row_bytes;
    for (int64_t t = 0; t < n_tokens; ++t) {
      const Q8Acts xt{x.qs + t * cols, x.d + t * n_x_blocks, x.sum + t * n_x_blocks};
      y[t * ldy + r] = wt == DType::kQ8_0 ? q8_0_dot(wr, xt, n_blocks) : q4_k_dot(wr, xt, n_blocks);
    }
  }
}

void matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                 int64_t r1) {
  if (dtype_is_quantized(wt))
    return matvec_rows_q8(w, wt, quantize_to_scratch(x, 1, cols), y, cols, r0, r1);
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
  if (dtype_is_quantized(wt))
    return matmul_rows_q8(w, wt, quantize_to_scratch(x, n_tokens, cols), n_tokens, y, ldy, cols, r0,
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
