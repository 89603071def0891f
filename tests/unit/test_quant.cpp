// Block-quantized weights (Q8_0, Q4_K): GGUF byte layouts by known answers, quantization
// error bounds, the activation quantization of the integer products (every ISA
// byte-identical to the reference, ties to even), the kernels against double references (on
// the quantized activations, and within the activation rounding of the exact product), every
// path bit for bit against the portable one and the portable one against an independent
// write-up of quant.h's order (odd row counts, poisoned outputs, row ranges), matmul
// against matvec, determinism under row splits, and the dtype / safetensors plumbing.
//
// Inputs are random with a fresh seed per test (printed on failure through SCOPED_TRACE).
// Quantized matrices sit at an odd address: rows of a file need not be aligned.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cpu/quant.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "io/safetensors.h"

namespace ts::cpu {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t fresh_seed() {
  std::random_device rd;
  return rd();
}
std::string seed_trace(uint32_t seed) { return "seed=" + std::to_string(seed); }

// ---- known answers ---------------------------------------------------------------------

TEST(QuantKnownAnswer, Q8_0LayoutAndFormula) {
  // Two blocks, bytes written by hand: f16 d (little-endian) then 32 int8 quants.
  std::vector<uint8_t> raw(2 * 34);
  raw[0] = 0x00, raw[1] = 0x38;    // d = 0.5
  raw[34] = 0x01, raw[35] = 0x80;  // d = f16 0x8001 = -2^-24 (negative subnormal)
  const int8_t q0[32] = {-127, -100, -64, -33, -8, -2, -1, 0, 1,    2, 3, 5,  8, 13, 21, 34,
                         55,   89,   127, 126, 64, 32, 16, 8, -128, 7, 9, 11, 0, -5, -9, 4};
  for (int i = 0; i < 32; ++i) {
    raw[size_t(2 + i)] = uint8_t(q0[i]);
    raw[size_t(36 + i)] = uint8_t(int8_t(i * 8 - 124));
  }
  std::vector<float> y(64, kNaN);
  dequantize_row(DType::kQ8_0, raw.data(), y.data(), 64);
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(y[size_t(i)], 0.5f * float(q0[i])) << i;
    EXPECT_EQ(y[size_t(32 + i)], -std::ldexp(1.0f, -24) * float(i * 8 - 124)) << i;
  }
}

TEST(QuantKnownAnswer, Q4_KLayoutAndFormula) {
  // Sub-block scales and mins using all 6 bits, packed by hand (llama.cpp get_scale_min_k4):
  // bytes 0-3 low 6 bits of sc[0..3] + top 2 bits of sc[4..7]; bytes 4-7 the same for
  // the mins; bytes 8-11 low nibbles of sc[4..7] | low nibbles of m[4..7] << 4.
  const int sc[8] = {1, 17, 33, 63, 5, 40, 62, 21};
  const int m[8] = {0, 63, 2, 48, 36, 7, 59, 16};
  const uint8_t scales[12] = {0x01, 0x91, 0xe1, 0x7f, 0x80, 0x3f,
                              0xc2, 0x70, 0x45, 0x78, 0xbe, 0x05};
  std::vector<uint8_t> raw(144);
  raw[0] = 0x00, raw[1] = 0x34;  // d = 0.25
  raw[2] = 0x66, raw[3] = 0x2e;  // dmin = f16 0x2e66 = 0.0999755859375
  std::memcpy(&raw[4], scales, 12);
  // Quant of weight i, stored in llama.cpp's nibble order: in each 64-weight group g, weight
  // 64g + l is the low nibble of qs[32g + l] and weight 64g + 32 + l its high nibble.
  auto quant = [](int i) { return (i * 7 + 3 + i / 32) % 16; };
  for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; ++l)
      raw[size_t(16 + 32 * g + l)] = uint8_t(quant(64 * g + l) | quant(64 * g + 32 + l) << 4);
  std::vector<float> y(256, kNaN);
  dequantize_row(DType::kQ4_K, raw.data(), y.data(), 256);
  const double d = 0.25, dmin = 0.0999755859375;
  for (int i = 0; i < 256; ++i) {
    const int j = i / 32;
    // d * sc * q and dmin * m are exact; the format rounds once, at the subtraction.
    const float want = float(d * sc[j] * quant(i) - dmin * m[j]);
    EXPECT_EQ(y[size_t(i)], want) << "weight " << i << " sub-block " << j;
  }
  for (int j = 0; j < 8; ++j) {
    uint8_t s, mm;
    q4_k_scale_min(scales, j, &s, &mm);
    EXPECT_EQ(s, sc[j]) << j;
    EXPECT_EQ(mm, m[j]) << j;
  }
}

TEST(QuantDtype, BlockSizesAndNames) {
  EXPECT_EQ(dtype_row_bytes(DType::kQ8_0, 64), 68u);
  EXPECT_EQ(dtype_row_bytes(DType::kQ4_K, 512), 288u);
  EXPECT_EQ(dtype_row_bytes(DType::kBF16, 7), 14u);
  EXPECT_TRUE(dtype_row_ok(DType::kQ8_0, 96));
  EXPECT_FALSE(dtype_row_ok(DType::kQ8_0, 48));
  EXPECT_FALSE(dtype_row_ok(DType::kQ4_K, 128));
  EXPECT_TRUE(dtype_row_ok(DType::kF16, 7));
  EXPECT_EQ(dtype_name(DType::kQ8_0), "Q8_0");
  EXPECT_EQ(dtype_name(DType::kQ4_K), "Q4_K");
  EXPECT_EQ(sizeof(BlockQ8_0), 34u);
  EXPECT_EQ(sizeof(BlockQ4_K), 144u);
}

// ---- quantization error ----------------------------------------------------------------

// Values like trained weights: mostly uniform in [-a, a] per row (a varying over 2^-6..2),
// with an occasional outlier of 4x.
std::vector<float> weight_like(int64_t rows, int64_t cols, std::mt19937& rng) {
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exp2(-6, 1);
  std::vector<float> v(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float a = std::ldexp(1.0f, exp2(rng));
    for (int64_t c = 0; c < cols; ++c) {
      float x = a * unit(rng);
      if (rng() % 64 == 0) x *= 4.0f;
      v[size_t(r * cols + c)] = x;
    }
  }
  return v;
}

std::vector<float> round_trip(DType t, const std::vector<float>& x, int64_t cols) {
  const int64_t rows = int64_t(x.size()) / cols;
  std::vector<uint8_t> q(size_t(rows) * dtype_row_bytes(t, cols));
  std::vector<float> y(x.size(), kNaN);
  for (int64_t r = 0; r < rows; ++r) {
    quantize_row(t, &x[size_t(r * cols)], &q[size_t(r) * dtype_row_bytes(t, cols)], cols);
    dequantize_row(t, &q[size_t(r) * dtype_row_bytes(t, cols)], &y[size_t(r * cols)], cols);
  }
  return y;
}

TEST(QuantError, Q8_0WithinHalfAStepPerBlock) {
  uint32_t seed = fresh_seed();
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937 rng(seed);
  const int64_t cols = 1024;
  std::vector<float> x = weight_like(16, cols, rng);
  std::vector<float> y = round_trip(DType::kQ8_0, x, cols);
  for (size_t b = 0; b < x.size(); b += 32) {
    float amax = 0.0f;
    for (size_t i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    // Half a step of d = amax / 127, plus the f16 rounding of d (2^-11 relative) times
    // |q| <= 127.
    const float bound = amax / 127.0f * (0.5f + 127.0f * std::ldexp(1.0f, -11)) * 1.0001f;
    for (size_t i = b; i < b + 32; ++i)
      ASSERT_LE(std::fabs(x[i] - y[i]), bound) << "element " << i << " of block " << b / 32;
  }
  // All-zero input is exact (d = 0, no division by zero).
  std::vector<float> zeros(64, 0.0f);
  std::vector<float> z = round_trip(DType::kQ8_0, zeros, 64);
  for (float v : z) EXPECT_EQ(v, 0.0f);
}

// Q4_K: 16 levels over each 32-weight sub-block's range. For uniform data the RMS error of
// a plain min/max grid is range / 15 / sqrt(12) ~ 0.077 a; the weighted search should do
// at least that well (llama.cpp's reference lands at ~0.07 a on such data).
TEST(QuantError, Q4_KRelativeRmsError) {
  uint32_t seed = fresh_seed();
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937 rng(seed);
  const int64_t cols = 2048, rows = 16;
  std::vector<float> x = weight_like(rows, cols, rng);
  std::vector<float> y = round_trip(DType::kQ4_K, x, cols);
  for (int64_t r = 0; r < rows; ++r) {
    double err2 = 0, sig2 = 0, max_abs = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const double e = double(x[size_t(r * cols + c)]) - y[size_t(r * cols + c)];
      err2 += e * e;
      sig2 += double(x[size_t(r * cols + c)]) * x[size_t(r * cols + c)];
      max_abs = std::max(max_abs, std::fabs(double(x[size_t(r * cols + c)])));
    }
    const double rel_rms = std::sqrt(err2 / sig2);
    EXPECT_LT(rel_rms, 0.09) << "row " << r;  // measured ~0.06-0.07
    for (int64_t c = 0; c < cols; ++c) ASSERT_TRUE(std::isfinite(y[size_t(r * cols + c)]));
    (void)max_abs;
  }
  std::vector<float> zeros(256, 0.0f);
  for (float v : round_trip(DType::kQ4_K, zeros, 256)) EXPECT_EQ(v, 0.0f);
  // Constant positive sub-blocks need no min; values reproduce to within half a step.
  std::vector<float> ramp(256);
  for (int i = 0; i < 256; ++i) ramp[size_t(i)] = 0.5f + float(i % 32) / 62.0f;
  std::vector<float> back = round_trip(DType::kQ4_K, ramp, 256);
  for (int i = 0; i < 256; ++i) EXPECT_NEAR(back[size_t(i)], ramp[size_t(i)], 0.04) << i;
}

// ---- activation quantization (products with quantized weights) ---------------------------

struct QuantizedX {
  std::vector<int8_t> qs;
  std::vector<float> d, sum;
  QuantizedX(int64_t n_tokens, int64_t cols)
      : qs(size_t(n_tokens * cols), 99),
        d(size_t(n_tokens * cols / 32), kNaN),
        sum(size_t(n_tokens * cols / 32), kNaN) {}
  Q8ActsOut out() { return {qs.data(), d.data(), sum.data()}; }
};

QuantizedX quantize_x(const float* x, int64_t n_tokens, int64_t cols) {
  QuantizedX q(n_tokens, cols);
  quantize_acts_q8(x, n_tokens, cols, q.out());
  return q;
}

TEST(QuantActs, KnownAnswersTiesToEvenAndTinyBlocks) {
  // amax 127: d = 1 and id = 1 exactly, so x * id is x and the ties are exact.
  std::vector<float> x(96, 0.0f);
  const float ties[] = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f, -126.5f, 3.49f, -3.51f};
  const int8_t want[] = {0, 2, 2, 0, -2, -2, 126, -126, 3, -4};
  x[0] = 127.0f;
  for (size_t i = 0; i < std::size(ties); ++i) x[1 + i] = ties[i];
  // Block 1: all zero. Block 2: below FLT_MIN * 127, quantized to zeros (id would overflow).
  for (int i = 64; i < 96; ++i) x[size_t(i)] = (i % 2 ? 1.0f : -1.0f) * 1e-37f;
  QuantizedX q = quantize_x(x.data(), 1, 96);
  EXPECT_EQ(q.d[0], 1.0f);
  EXPECT_EQ(q.qs[0], 127);
  EXPECT_EQ(q.sum[0], 127.0f + 0 + 2 + 2 + 0 - 2 - 2 + 126 - 126 + 3 - 4);
  for (size_t i = 0; i < std::size(ties); ++i) EXPECT_EQ(q.qs[1 + i], want[i]) << ties[i];
  EXPECT_EQ(q.d[1], 0.0f);
  EXPECT_EQ(q.d[2], 1e-37f / 127.0f);
  for (int i = 32; i < 96; ++i) EXPECT_EQ(q.qs[size_t(i)], 0) << i;
}

// Random blocks of very different scales (and the known-answer blocks above): every ISA
// writes the reference's bytes, and the reference is within half a step.
TEST(QuantActs, EveryIsaMatchesReferenceBytes) {
  uint32_t seed = fresh_seed();
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937 rng(seed);
  const int64_t n_tokens = 3, cols = 1056;
  std::vector<float> x = weight_like(n_tokens, cols, rng);
  std::uniform_int_distribution<int> exp2(-30, 10);
  for (size_t b = 0; b < x.size(); b += 32) {
    const float s = std::ldexp(1.0f, exp2(rng));
    for (size_t i = b; i < b + 32; ++i) x[i] *= s;
  }
  for (int i = 0; i < 32; ++i) x[size_t(i)] = float(i) - 15.5f;  // amax 15.5: inexact id
  for (int i = 64; i < 96; ++i) x[size_t(i)] = 0.0f;
  for (int i = 96; i < 128; ++i) x[size_t(i)] = float(i - 100) * 1e-39f;  // subnormal inputs
  x[128] = 127.0f, x[129] = 2.5f, x[130] = -0.5f;
  QuantizedX ref = quantize_x(x.data(), n_tokens, cols);
  for (size_t b = 0; b < ref.d.size(); ++b) {
    float amax = 0.0f;
    for (size_t i = 32 * b; i < 32 * b + 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    ASSERT_EQ(ref.d[b], amax / 127.0f) << "block " << b;
    int32_t q_sum = 0;
    for (size_t i = 32 * b; i < 32 * b + 32; ++i) q_sum += ref.qs[i];
    ASSERT_EQ(ref.sum[b], ref.d[b] * float(q_sum)) << "block " << b;
    for (size_t i = 32 * b; i < 32 * b + 32; ++i) {
      ASSERT_LE(std::abs(int(ref.qs[i])), 127);
      if (ref.d[b] < std::numeric_limits<float>::min()) continue;
      ASSERT_LE(std::fabs(double(x[i]) - double(ref.d[b]) * ref.qs[i]), ref.d[b] * 0.50001)
          << "element " << i;
    }
  }
  using Fn = void (*)(const float*, int64_t, int64_t, Q8ActsOut);
  const std::pair<Isa, Fn> isas[] = {{Isa::kAvx2, avx2::quantize_acts_q8},
                                     {Isa::kAvx2Vnni, avx2vnni::quantize_acts_q8},
                                     {Isa::kAvx512, avx512::quantize_acts_q8}};
  for (auto [isa, fn] : isas) {
    if (!isa_supported(isa)) continue;
    SCOPED_TRACE(std::string(isa_name(isa)));
    QuantizedX got(n_tokens, cols);
    fn(x.data(), n_tokens, cols, got.out());
    EXPECT_EQ(0, std::memcmp(got.qs.data(), ref.qs.data(), ref.qs.size()));
    EXPECT_EQ(0, std::memcmp(got.d.data(), ref.d.data(), ref.d.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(got.sum.data(), ref.sum.data(), ref.sum.size() * sizeof(float)));
  }
}

// ---- kernels ---------------------------------------------------------------------------

// A quantized [rows, cols] matrix at an odd address, with its dequantized values (the
// reference conversion) and, for Q4_K, each element's min term dmin * m.
class QuantWeights {
 public:
  // random_bytes: raw random blocks (every scale / min / quant bit pattern) with small
  // random d and dmin, instead of quantized weight-like values.
  QuantWeights(DType t, int64_t rows, int64_t cols, std::mt19937& rng, bool random_bytes)
      : t_(t), rows_(rows), cols_(cols), row_bytes_(dtype_row_bytes(t, cols)) {
    storage_.resize(size_t(rows) * row_bytes_ + 64);
    data_ = storage_.data() + (64 - reinterpret_cast<uintptr_t>(storage_.data()) % 64) % 64 + 1;
    if (random_bytes) {
      std::uniform_int_distribution<int> byte(0, 255);
      std::uniform_real_distribution<float> scale(0.0f, 0.02f);
      for (size_t i = 0; i < size_t(rows) * row_bytes_; ++i) data_[i] = uint8_t(byte(rng));
      const uint64_t block = dtype_block_bytes(t);
      for (size_t b = 0; b < size_t(rows) * row_bytes_; b += block) {
        uint16_t d = f32_to_f16(scale(rng)), dmin = f32_to_f16(scale(rng));
        std::memcpy(data_ + b, &d, 2);
        if (t == DType::kQ4_K) std::memcpy(data_ + b + 2, &dmin, 2);
      }
    } else {
      std::vector<float> x = weight_like(rows, cols, rng);
      for (int64_t r = 0; r < rows; ++r)
        quantize_row(t, &x[size_t(r * cols)], data_ + size_t(r) * row_bytes_, cols);
    }
    values_.resize(size_t(rows * cols));
    mins_.assign(size_t(rows * cols), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      dequantize_row(t, row(r), &values_[size_t(r * cols)], cols);
      if (t != DType::kQ4_K) continue;
      // Zero quants leave -dmin * m.
      std::vector<uint8_t> copy(row(r), row(r) + row_bytes_);
      for (size_t b = 0; b < row_bytes_; b += kQ4_KBlockBytes) std::memset(&copy[b + 16], 0, 128);
      dequantize_row(t, copy.data(), &mins_[size_t(r * cols)], cols);
    }
  }
  const uint8_t* data() const { return data_; }
  const uint8_t* row(int64_t r) const { return data_ + size_t(r) * row_bytes_; }
  float value(int64_t r, int64_t c) const { return values_[size_t(r * cols_ + c)]; }
  float min_term(int64_t r, int64_t c) const { return std::fabs(mins_[size_t(r * cols_ + c)]); }

 private:
  DType t_;
  int64_t rows_, cols_;
  uint64_t row_bytes_;
  std::vector<uint8_t> storage_;
  uint8_t* data_ = nullptr;
  std::vector<float> values_, mins_;
};

std::vector<float> activations(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = unit(rng);
  return x;
}

struct Reference {
  double value;  // sum_c w[c] x[c] in double
  double scale;  // sum_c (|w[c]| + |min term|) |x[c]|: what any F32 order's error scales with
};

Reference dot_reference(const QuantWeights& w, int64_t r, const float* x, int64_t cols) {
  Reference ref{0.0, 0.0};
  for (int64_t c = 0; c < cols; ++c) {
    ref.value += double(w.value(r, c)) * x[c];
    ref.scale += (std::fabs(double(w.value(r, c))) + w.min_term(r, c)) * std::fabs(x[c]);
  }
  return ref;
}

// The dequantized weights against the quantized activations d_x * q in double (scale: what
// F32 rounding scales with, Q4_K's min terms apart as in Reference), and the bound of the
// activation rounding against the exact product with x: sum_c |w_c| |x_c - d_x q_c| <=
// sum_b d_x[b] / 2 * sum_{c in b} |w_c|.
struct Q8Reference {
  Reference on_quantized;
  double act_bound;
};

Q8Reference dot_reference_q8(const QuantWeights& w, int64_t r, const QuantizedX& xq, int64_t t,
                             int64_t cols) {
  Q8Reference ref{{0.0, 0.0}, 0.0};
  for (int64_t c = 0; c < cols; ++c) {
    const double dx = xq.d[size_t((t * cols + c) / 32)];
    const double xv = dx * xq.qs[size_t(t * cols + c)];
    ref.on_quantized.value += double(w.value(r, c)) * xv;
    ref.on_quantized.scale += (std::fabs(double(w.value(r, c))) + w.min_term(r, c)) * std::fabs(xv);
    ref.act_bound += std::fabs(double(w.value(r, c))) * dx * 0.5;
  }
  return ref;
}

// quant.h's Q8_0 order written out again, independently of the portable kernel: all lane
// sums first, then the FMAs into 16 accumulators, then the halving sum.
float q8_0_contract(const uint8_t* row, const int8_t* xq, const float* xd, int64_t cols) {
  const int64_t n_blocks = cols / 32;
  std::vector<int32_t> lane(size_t(n_blocks * 8), 0);
  for (int64_t c = 0; c < cols; ++c)
    lane[size_t(c / 4)] += int32_t(int8_t(row[(c / 32) * 34 + 2 + c % 32])) * xq[c];
  float acc[16];
  std::fill(std::begin(acc), std::end(acc), 0.0f);
  for (int64_t b = 0; b < n_blocks; ++b) {
    uint16_t h;
    std::memcpy(&h, row + b * 34, 2);
    const float d = f16_to_f32(h) * xd[b];
    for (int l = 0; l < 8; ++l) {
      float& a = acc[(b % 2) * 8 + l];
      a = std::fma(float(lane[size_t(b * 8 + l)]), d, a);
    }
  }
  for (int i = 0; i < 8; ++i) acc[i] = acc[i] + acc[i + 8];
  for (int i = 0; i < 4; ++i) acc[i] = acc[i] + acc[i + 4];
  for (int i = 0; i < 2; ++i) acc[i] = acc[i] + acc[i + 2];
  return acc[0] + acc[1];
}

// The same for Q4_K: sub-block lane sums into the 16 accumulators, the mins into 8 more.
float q4_k_contract(const uint8_t* row, const QuantizedX& x, int64_t t, int64_t cols) {
  const int8_t* xq = x.qs.data() + t * cols;
  const float* xd = x.d.data() + t * cols / 32;
  const float* xs = x.sum.data() + t * cols / 32;
  float acc[16], macc[8];
  std::fill(std::begin(acc), std::end(acc), 0.0f);
  std::fill(std::begin(macc), std::end(macc), 0.0f);
  for (int64_t b = 0; b < cols / 256; ++b) {
    const uint8_t* blk = row + b * 144;
    uint16_t h[2];
    std::memcpy(h, blk, 4);
    const float d = f16_to_f32(h[0]), dmin = f16_to_f32(h[1]);
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      q4_k_scale_min(blk + 4, j, &sc, &m);
      const int64_t g = 8 * b + j;
      for (int l = 0; l < 8; ++l) {
        int32_t p = 0;
        for (int i = 4 * l; i < 4 * l + 4; ++i) {
          const int q =
              j % 2 == 0 ? blk[16 + 32 * (j / 2) + i] & 15 : blk[16 + 32 * (j / 2) + i] >> 4;
          p += q * xq[32 * g + i];
        }
        acc[(j % 2) * 8 + l] = std::fma(float(p), (d * float(sc)) * xd[g], acc[(j % 2) * 8 + l]);
      }
      macc[j] = std::fma(dmin * float(m), xs[g], macc[j]);
    }
  }
  for (int i = 0; i < 8; ++i) acc[i] = acc[i] + acc[i + 8];
  for (int i = 0; i < 4; ++i) acc[i] = acc[i] + acc[i + 4], macc[i] = macc[i] + macc[i + 4];
  for (int i = 0; i < 2; ++i) acc[i] = acc[i] + acc[i + 2], macc[i] = macc[i] + macc[i + 2];
  return (acc[0] + acc[1]) - (macc[0] + macc[1]);
}

float contract(DType t, const uint8_t* row, const QuantizedX& x, int64_t tok, int64_t cols) {
  if (t == DType::kQ8_0)
    return q8_0_contract(row, x.qs.data() + tok * cols, x.d.data() + tok * cols / 32, cols);
  return q4_k_contract(row, x, tok, cols);
}

// As test_kernels.cpp: F32 sums of a few thousand terms stay well under 1e-5 relative. Q4_K
// adds its mins apart (sum_j dmin m_j s_x[j]), so its error scales with the min terms too;
// the references' scales include them.
constexpr double kRelTol = 1e-5;
constexpr double kAbsTol = 1e-30;

class QuantKernelTest : public ::testing::TestWithParam<std::tuple<Isa, DType>> {
 protected:
  void SetUp() override {
    isa_ = std::get<0>(GetParam());
    wt_ = std::get<1>(GetParam());
    if (!isa_supported(isa_))
      GTEST_SKIP() << "CPU lacks " << isa_name(isa_) << " (has " << isa_name(detect_isa()) << ")";
    saved_isa_ = active_isa();
    set_active_isa(isa_);
  }
  void TearDown() override { set_active_isa(saved_isa_); }
  std::vector<int64_t> col_counts() const {
    if (wt_ == DType::kQ8_0) return {32, 64, 96, 288, 1056, 4096};
    return {256, 512, 768, 2816};
  }

  Isa isa_ = Isa::kPortable;
  DType wt_ = DType::kQ8_0;
  Isa saved_isa_ = Isa::kPortable;
};

const int64_t kRows[] = {1, 3, 5, 17};

std::vector<std::pair<int64_t, int64_t>> row_ranges(int64_t rows) {
  std::vector<std::pair<int64_t, int64_t>> ranges{{0, rows}};
  if (rows >= 3) ranges.emplace_back(1, rows - 1);
  return ranges;
}

// Every ISA against the double references and, bit for bit, the portable result, which is
// checked against an independent write-up of quant.h's order.
TEST_P(QuantKernelTest, MatvecMatchesReferenceAndPortable) {
  uint32_t seed = fresh_seed();
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937 rng(seed);
  for (bool random_bytes : {false, true}) {
    for (int64_t cols : col_counts()) {
      for (int64_t rows : kRows) {
        QuantWeights w(wt_, rows, cols, rng, random_bytes);
        std::vector<float> x = activations(cols, rng);
        const QuantizedX xq = quantize_x(x.data(), 1, cols);
        std::vector<float> portable_y(size_t(rows), kNaN);
        portable::matvec_rows(w.data(), wt_, x.data(), portable_y.data(), cols, 0, rows);
        for (auto [r0, r1] : row_ranges(rows)) {
          SCOPED_TRACE("rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) +
                       " range=[" + std::to_string(r0) + "," + std::to_string(r1) + ")" +
                       (random_bytes ? " random bytes" : " quantized values"));
          std::vector<float> buf(size_t(rows) + 2, kNaN);
          float* y = buf.data() + 1;
          matvec_rows(w.data(), wt_, x.data(), y, cols, r0, r1);
          EXPECT_TRUE(std::isnan(buf.front()) && std::isnan(buf.back())) << "wrote out of bounds";
          for (int64_t r = 0; r < rows; ++r) {
            if (r < r0 || r >= r1) {
              EXPECT_TRUE(std::isnan(y[r])) << "row " << r << " outside the range was written";
              continue;
            }
            ASSERT_FALSE(std::isnan(y[r])) << "row " << r << " not written";
            // Integer dots on quantized x: F32 rounding from the double product on the
            // quantized values, the activation rounding from the exact one, and the portable
            // bits exactly (quant.h's order).
            const Reference ref = dot_reference(w, r, x.data(), cols);
            const Q8Reference q8 = dot_reference_q8(w, r, xq, 0, cols);
            EXPECT_NEAR(y[r], q8.on_quantized.value, kRelTol * q8.on_quantized.scale + kAbsTol)
                << "row " << r;
            EXPECT_NEAR(y[r], ref.value, 1.0001 * q8.act_bound + kRelTol * ref.scale + kAbsTol)
                << "row " << r << " vs the exact product";
            EXPECT_EQ(y[r], portable_y[size_t(r)]) << "row " << r << " vs portable";
            EXPECT_EQ(portable_y[size_t(r)], contract(wt_, w.row(r), xq, 0, cols))
                << "row " << r << ": portable vs the contract";
          }
        }
      }
    }
  }
}

// Each (row, token) of a matmul is the matvec of that token, bit for bit, and the portable
// matmul's bits; close to the double reference on the quantized activations.
TEST_P(QuantKernelTest, MatmulMatchesItsDefinition) {
  uint32_t seed = fresh_seed();
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937 rng(seed);
  for (int64_t cols : col_counts()) {
    for (int64_t rows : {int64_t(1), int64_t(5), int64_t(17), int64_t(61)}) {
      for (int64_t n_tokens : {int64_t(1), int64_t(4), int64_t(7)}) {
        QuantWeights w(wt_, rows, cols, rng, (rows + n_tokens) % 2 == 0);
        std::vector<float> x = activations(n_tokens * cols, rng);
        const QuantizedX xq = quantize_x(x.data(), n_tokens, cols);
        const int64_t ldy = rows + 3;
        std::vector<float> want(size_t(n_tokens * ldy), kNaN), portable_y(want.size(), kNaN);
        for (int64_t t = 0; t < n_tokens; ++t)
          matvec_rows(w.data(), wt_, x.data() + t * cols, want.data() + t * ldy, cols, 0, rows);
        portable::matmul_rows(w.data(), wt_, x.data(), n_tokens, portable_y.data(), ldy, cols, 0,
                              rows);
        for (auto [r0, r1] : row_ranges(rows)) {
          SCOPED_TRACE("rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) +
                       " tokens=" + std::to_string(n_tokens) + " range=[" + std::to_string(r0) +
                       "," + std::to_string(r1) + ")");
          std::vector<float> buf(size_t(n_tokens * ldy) + 2, kNaN);
          float* y = buf.data() + 1;
          matmul_rows(w.data(), wt_, x.data(), n_tokens, y, ldy, cols, r0, r1);
          EXPECT_TRUE(std::isnan(buf.front()) && std::isnan(buf.back())) << "wrote out of bounds";
          for (int64_t t = 0; t < n_tokens; ++t) {
            for (int64_t r = 0; r < ldy; ++r) {
              const float got = y[t * ldy + r];
              if (r < r0 || r >= r1) {
                EXPECT_TRUE(std::isnan(got)) << "t=" << t << " r=" << r << " was written";
                continue;
              }
              ASSERT_FALSE(std::isnan(got)) << "t=" << t << " r=" << r << " not written";
              EXPECT_EQ(got, want[size_t(t * ldy + r)]) << "t=" << t << " r=" << r << " vs matvec";
              EXPECT_EQ(got, portable_y[size_t(t * ldy + r)])
                  << "t=" << t << " r=" << r << " vs portable";
              const Q8Reference ref = dot_reference_q8(w, r, xq, t, cols);
              EXPECT_NEAR(got, ref.on_quantized.value, kRelTol * ref.on_quantized.scale + kAbsTol)
                  << "t=" << t << " r=" << r;
            }
          }
        }
      }
    }
  }
}

TEST_P(QuantKernelTest, RowSplitsAndThreadsDoNotChangeResults) {
  uint32_t seed = fresh_seed();
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937 rng(seed);
  const int64_t rows = 301, cols = wt_ == DType::kQ8_0 ? 1056 : 1024, n_tokens = 9;
  QuantWeights w(wt_, rows, cols, rng, false);
  std::vector<float> x = activations(n_tokens * cols, rng);

  std::vector<float> whole(rows, kNaN), pieces(rows, kNaN), pooled(rows, kNaN);
  matvec_rows(w.data(), wt_, x.data(), whole.data(), cols, 0, rows);
  const int64_t cuts[] = {0, 1, 6, 7, 30, 101, 250, rows};
  for (size_t i = 0; i + 1 < std::size(cuts); ++i)
    matvec_rows(w.data(), wt_, x.data(), pieces.data(), cols, cuts[i], cuts[i + 1]);
  EXPECT_EQ(0, std::memcmp(whole.data(), pieces.data(), whole.size() * sizeof(float)));
  ThreadPool pool(2);
  matvec(pool, w.data(), wt_, x.data(), pooled.data(), rows, cols);
  EXPECT_EQ(0, std::memcmp(whole.data(), pooled.data(), whole.size() * sizeof(float)));
  for (float v : whole) ASSERT_FALSE(std::isnan(v));

  std::vector<float> mm_whole(size_t(n_tokens * rows), kNaN), mm_pieces(mm_whole.size(), kNaN);
  matmul_rows(w.data(), wt_, x.data(), n_tokens, mm_whole.data(), rows, cols, 0, rows);
  for (size_t i = 0; i + 1 < std::size(cuts); ++i)
    matmul_rows(w.data(), wt_, x.data(), n_tokens, mm_pieces.data(), rows, cols, cuts[i],
                cuts[i + 1]);
  EXPECT_EQ(0, std::memcmp(mm_whole.data(), mm_pieces.data(), mm_whole.size() * sizeof(float)));
  std::fill(mm_pieces.begin(), mm_pieces.end(), kNaN);
  for (int64_t t = 0; t < n_tokens; ++t)
    matmul_rows(w.data(), wt_, x.data() + t * cols, 1, mm_pieces.data() + t * rows, rows, cols, 0,
                rows);
  EXPECT_EQ(0, std::memcmp(mm_whole.data(), mm_pieces.data(), mm_whole.size() * sizeof(float)))
      << "token by token";
  std::fill(mm_pieces.begin(), mm_pieces.end(), kNaN);
  matmul(pool, w.data(), wt_, x.data(), n_tokens, mm_pieces.data(), rows, cols);
  EXPECT_EQ(0, std::memcmp(mm_whole.data(), mm_pieces.data(), mm_whole.size() * sizeof(float)))
      << "pool";
  for (float v : mm_whole) ASSERT_FALSE(std::isnan(v));
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<Isa, DType>>& info) {
  return std::string(isa_name(std::get<0>(info.param))) + "_" +
         std::string(dtype_name(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(AllIsas, QuantKernelTest,
                         ::testing::Combine(::testing::Values(Isa::kPortable, Isa::kAvx2,
                                                              Isa::kAvx2Vnni, Isa::kAvx512),
                                            ::testing::Values(DType::kQ8_0, DType::kQ4_K)),
                         param_name);

// ---- safetensors (pack-internal extension) ---------------------------------------------

class QuantSafetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ts_quant_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_F(QuantSafetensors, RoundTripAndShapeChecks) {
  EXPECT_EQ(io::parse_safetensors_dtype("Q8_0").value(), DType::kQ8_0);
  EXPECT_EQ(io::parse_safetensors_dtype("Q4_K").value(), DType::kQ4_K);
  std::vector<uint8_t> q8(3 * 68, 0x11), q4(2 * 144, 0x22);
  const std::string path = dir_ + "/q.safetensors";
  Status st = io::write_safetensors(path, {{"a", DType::kQ8_0, {3, 64}, q8.data(), q8.size()},
                                           {"b", DType::kQ4_K, {2, 256}, q4.data(), q4.size()}});
  ASSERT_TRUE(st.ok()) << st.error().message;
  auto set = io::TensorSet::open_file(path);
  ASSERT_TRUE(set.ok()) << set.error().message;
  const io::TensorView* a = set.value()->find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::kQ8_0);
  EXPECT_EQ(a->n_bytes, q8.size());
  EXPECT_EQ(0, std::memcmp(a->data, q8.data(), q8.size()));
  EXPECT_EQ(set.value()->find("b")->dtype, DType::kQ4_K);

  // Cols that are not whole blocks, or a 1-D shape, are named errors on write and read.
  Status bad = io::write_safetensors(dir_ + "/bad.safetensors",
                                     {{"c", DType::kQ8_0, {2, 48}, q8.data(), 2 * 51}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("multiple of 32"), std::string::npos) << bad.error().message;
  const std::string header =
      R"({"w": {"dtype": "Q4_K", "shape": [288], "data_offsets": [0, 144]}})";
  std::ofstream f(dir_ + "/bad2.safetensors", std::ios::binary);
  uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header << std::string(144, '\0');
  f.close();
  auto bad2 = io::TensorSet::open_file(dir_ + "/bad2.safetensors");
  ASSERT_FALSE(bad2.ok());
  EXPECT_NE(bad2.error().message.find("tensor w"), std::string::npos) << bad2.error().message;
  EXPECT_NE(bad2.error().message.find("2-D"), std::string::npos) << bad2.error().message;
}

}  // namespace
}  // namespace ts::cpu
