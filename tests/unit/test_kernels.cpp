// Tests of the CPU matvec / matmul kernels (every ISA this CPU has x every weight dtype)
// against a double-precision reference, and of the scalar dtype conversions they build on.
//
// Inputs are random with a fresh seed per test (printed on failure through SCOPED_TRACE);
// outputs are poisoned with NaN before each call so unwritten elements and writes outside
// [r0, r1) show. Pointers are deliberately misaligned (2 bytes for 16-bit weights, 4 for F32
// weights and X) since weights come from mmapped files at arbitrary tensor offsets.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/kernels.h"
#include "core/dtype.h"
#include "core/thread_pool.h"

namespace ts::cpu {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t fresh_seed() {
  std::random_device rd;
  return rd();
}

// A weight matrix in its storage type, at a misaligned address, plus its values as doubles
// (converted with core/dtype.h, the reference conversions).
class Weights {
 public:
  Weights(DType wt, int64_t rows, int64_t cols, std::mt19937& rng) : wt_(wt) {
    size_t elem = dtype_size(wt);
    // +elem bytes of offset from a 64-byte aligned start: 2-byte (F16/BF16) or 4-byte (F32)
    // alignment only, and the extra 64 bytes leave room for it.
    storage_.resize(size_t(rows * cols) * elem + 64 + elem);
    data_ = storage_.data() + (64 - reinterpret_cast<uintptr_t>(storage_.data()) % 64) % 64 + elem;
    values_.resize(size_t(rows * cols));
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    std::uniform_int_distribution<int> scale(-16, 2);
    for (size_t i = 0; i < values_.size(); ++i) {
      // Mostly O(1) values; one in eight spread over 2^-16..2^2, which reaches F16
      // subnormals and exercises the conversions' exponent handling.
      float v = unit(rng);
      if (rng() % 8 == 0) v = std::ldexp(v, scale(rng));
      store(i, v);
    }
  }

  const void* data() const { return data_; }
  double value(int64_t i) const { return values_[size_t(i)]; }

 private:
  void store(size_t i, float v) {
    switch (wt_) {
      case DType::kF32:
        std::memcpy(data_ + i * 4, &v, 4);
        values_[i] = v;
        return;
      case DType::kF16: {
        uint16_t h = f32_to_f16(v);
        std::memcpy(data_ + i * 2, &h, 2);
        values_[i] = f16_to_f32(h);
        return;
      }
      case DType::kBF16: {
        uint16_t h = f32_to_bf16(v);
        std::memcpy(data_ + i * 2, &h, 2);
        values_[i] = bf16_to_f32(h);
        return;
      }
      case DType::kQ8_0:
      case DType::kQ4_K:  // tests/unit/test_quant.cpp
        FAIL() << "float dtypes only";
    }
  }

  DType wt_;
  std::vector<uint8_t> storage_;
  uint8_t* data_ = nullptr;
  std::vector<double> values_;
};

// n floats in [-1, 1] at a 4-byte (not 16-byte) aligned address.
class Activations {
 public:
  Activations(int64_t n, std::mt19937& rng) : storage_(size_t(n) + 16) {
    size_t misalign = (16 - (reinterpret_cast<uintptr_t>(storage_.data()) / 4) % 16) % 16;
    data_ = storage_.data() + misalign + 1;
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) data_[i] = unit(rng);
  }
  const float* data() const { return data_; }
  float operator[](int64_t i) const { return data_[i]; }

 private:
  std::vector<float> storage_;
  float* data_;
};

struct Reference {
  double value;  // sum_c w[c] * x[c] in double
  double abs;    // sum_c |w[c] * x[c]|: the scale any summation order's error is relative to
};

Reference dot_reference(const Weights& w, int64_t row, const float* x, int64_t cols,
                        bool round_x_to_bf16) {
  Reference ref{0.0, 0.0};
  for (int64_t c = 0; c < cols; ++c) {
    double xc = round_x_to_bf16 ? bf16_to_f32(f32_to_bf16(x[c])) : x[c];
    double p = w.value(row * cols + c) * xc;
    ref.value += p;
    ref.abs += std::fabs(p);
  }
  return ref;
}

// F32 accumulation of a few thousand terms in any fixed order: error well under 1e-5 of
// sum |w x| (the worst case bound is cols * 2^-24; random rounding errors grow ~sqrt).
constexpr double kF32RelTol = 1e-5;
constexpr double kAbsTol = 1e-30;

std::string seed_trace(uint32_t seed) { return "seed=" + std::to_string(seed); }

class KernelTest : public ::testing::TestWithParam<std::tuple<Isa, DType>> {
 protected:
  void SetUp() override {
    isa_ = std::get<0>(GetParam());
    wt_ = std::get<1>(GetParam());
    if (!isa_supported(isa_)) {
      GTEST_SKIP() << "CPU lacks " << isa_name(isa_) << " (has " << isa_name(detect_isa()) << ")";
    }
    saved_isa_ = active_isa();
    set_active_isa(isa_);
    ASSERT_EQ(active_isa(), isa_);
  }
  void TearDown() override { set_active_isa(saved_isa_); }

  Isa isa_ = Isa::kPortable;
  DType wt_ = DType::kF32;
  Isa saved_isa_ = Isa::kPortable;
};

const int64_t kCols[] = {1, 7, 33, 127, 257, 1000, 4099};
const int64_t kRows[] = {1, 3, 17};
const int64_t kTokens[] = {1, 5, 13};

// Row ranges to test for a matrix of `rows` rows: all of it, and an inner range so rows on
// both sides must stay untouched.
std::vector<std::pair<int64_t, int64_t>> row_ranges(int64_t rows) {
  std::vector<std::pair<int64_t, int64_t>> ranges{{0, rows}};
  if (rows >= 3) ranges.emplace_back(1, rows - 1);
  return ranges;
}

TEST_P(KernelTest, MatvecMatchesReference) {
  uint32_t seed = fresh_seed();
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937 rng(seed);
  const bool rounds_x = matmul_rounds_x_to_bf16(isa_, wt_);
  for (int64_t cols : kCols) {
    for (int64_t rows : kRows) {
      Weights w(wt_, rows, cols, rng);
      Activations x(cols, rng);
      for (auto [r0, r1] : row_ranges(rows)) {
        SCOPED_TRACE("rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) + " range=[" +
                     std::to_string(r0) + "," + std::to_string(r1) + ")");
        // One guard element on each side catches writes before row 0 or past the last row.
        std::vector<float> buf(size_t(rows) + 2, kNaN);
        float* y = buf.data() + 1;
        matvec_rows(w.data(), wt_, x.data(), y, cols, r0, r1);
        EXPECT_TRUE(std::isnan(buf.front()) && std::isnan(buf.back())) << "wrote out of bounds";
        for (int64_t r = 0; r < rows; ++r) {
          if (r < r0 || r >= r1) {
            EXPECT_TRUE(std::isnan(y[r])) << "row " << r << " outside the range was written";
            continue;
          }
          // X rounded as the kernel rounds it (BF16 weights on AVX-512): F32 accumulation
          // error only.
          Reference ref = dot_reference(w, r, x.data(), cols, rounds_x);
          ASSERT_FALSE(std::isnan(y[r])) << "row " << r << " not written";
          EXPECT_NEAR(y[r], ref.value, kF32RelTol * ref.abs + kAbsTol) << "row " << r;
        }
      }
    }
  }
}

TEST_P(KernelTest, MatmulMatchesReference) {
  uint32_t seed = fresh_seed();
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937 rng(seed);
  bool rounds_x = matmul_rounds_x_to_bf16(isa_, wt_);
  for (int64_t cols : kCols) {
    for (int64_t rows : kRows) {
      for (int64_t n_tokens : kTokens) {
        Weights w(wt_, rows, cols, rng);
        Activations x(n_tokens * cols, rng);
        int64_t ldy = rows + 3;  // padding columns in Y must stay untouched
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
              float got = y[t * ldy + r];
              if (r < r0 || r >= r1) {
                EXPECT_TRUE(std::isnan(got)) << "t=" << t << " r=" << r << " was written";
                continue;
              }
              ASSERT_FALSE(std::isnan(got)) << "t=" << t << " r=" << r << " not written";
              const float* xt = x.data() + t * cols;
              Reference exact = dot_reference(w, r, xt, cols, false);
              if (rounds_x) {
                // Against X rounded as the kernel rounds it: only F32 accumulation error.
                Reference rounded = dot_reference(w, r, xt, cols, true);
                EXPECT_NEAR(got, rounded.value, kF32RelTol * rounded.abs + kAbsTol)
                    << "t=" << t << " r=" << r << " (vs BF16-rounded X)";
                // Against exact X: each x moves by at most 2^-9 |x|.
                EXPECT_NEAR(got, exact.value, std::ldexp(exact.abs, -8) + kAbsTol)
                    << "t=" << t << " r=" << r << " (vs F32 X)";
              } else {
                EXPECT_NEAR(got, exact.value, kF32RelTol * exact.abs + kAbsTol)
                    << "t=" << t << " r=" << r;
              }
            }
          }
        }
      }
    }
  }
}

// Rows computed in one call, row by row, and in uneven pieces must agree bit for bit: the
// threads of the parallel wrappers see arbitrary ranges.
TEST_P(KernelTest, RowPartitionDoesNotChangeResults) {
  uint32_t seed = fresh_seed();
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937 rng(seed);
  const int64_t rows = 37, cols = 1000, n_tokens = 9;
  Weights w(wt_, rows, cols, rng);
  Activations x(n_tokens * cols, rng);

  std::vector<float> whole(rows, kNaN), pieces(rows, kNaN);
  matvec_rows(w.data(), wt_, x.data(), whole.data(), cols, 0, rows);
  for (int64_t r = 0; r < rows; ++r)
    matvec_rows(w.data(), wt_, x.data(), pieces.data(), cols, r, r + 1);
  EXPECT_EQ(0, std::memcmp(whole.data(), pieces.data(), whole.size() * sizeof(float)))
      << "matvec: row-by-row differs from one call";
  std::fill(pieces.begin(), pieces.end(), kNaN);
  const int64_t cuts[] = {0, 5, 6, 19, 30, rows};  // pieces of 5, 1, 13, 11, 7 rows
  for (size_t i = 0; i + 1 < std::size(cuts); ++i)
    matvec_rows(w.data(), wt_, x.data(), pieces.data(), cols, cuts[i], cuts[i + 1]);
  EXPECT_EQ(0, std::memcmp(whole.data(), pieces.data(), whole.size() * sizeof(float)))
      << "matvec: uneven pieces differ from one call";

  std::vector<float> mm_whole(size_t(n_tokens * rows), kNaN), mm_pieces(mm_whole.size(), kNaN);
  matmul_rows(w.data(), wt_, x.data(), n_tokens, mm_whole.data(), rows, cols, 0, rows);
  for (int64_t r = 0; r < rows; ++r)
    matmul_rows(w.data(), wt_, x.data(), n_tokens, mm_pieces.data(), rows, cols, r, r + 1);
  EXPECT_EQ(0, std::memcmp(mm_whole.data(), mm_pieces.data(), mm_whole.size() * sizeof(float)))
      << "matmul: row-by-row differs from one call";

  // The header promises more: an element depends only on its W row and X row, so a token
  // gets the same result whatever other tokens share its call.
  std::fill(mm_pieces.begin(), mm_pieces.end(), kNaN);
  for (int64_t t = 0; t < n_tokens; ++t)
    matmul_rows(w.data(), wt_, x.data() + t * cols, 1, mm_pieces.data() + t * rows, rows, cols, 0,
                rows);
  EXPECT_EQ(0, std::memcmp(mm_whole.data(), mm_pieces.data(), mm_whole.size() * sizeof(float)))
      << "matmul: token-by-token differs from one call";

  // And matvec gives each token matmul's bits: decode equals prefill, and a sequence's rows
  // are the same alone or batched with other sequences' rows (runtime batching).
  std::fill(mm_pieces.begin(), mm_pieces.end(), kNaN);
  for (int64_t t = 0; t < n_tokens; ++t)
    matvec_rows(w.data(), wt_, x.data() + t * cols, mm_pieces.data() + t * rows, cols, 0, rows);
  EXPECT_EQ(0, std::memcmp(mm_whole.data(), mm_pieces.data(), mm_whole.size() * sizeof(float)))
      << "matvec differs from matmul's rows";
  for (float v : mm_pieces) ASSERT_FALSE(std::isnan(v));
}

// The pool's split must not show in the output. Shapes are large enough that both wrappers
// split rows into several chunks (matvec grain ~128 KiB of W, matmul ~4 MFLOP).
TEST_P(KernelTest, ParallelWrappersMatchSingleThread) {
  uint32_t seed = fresh_seed();
  SCOPED_TRACE(seed_trace(seed));
  std::mt19937 rng(seed);
  const int64_t rows = 2000, cols = 640, n_tokens = 8;
  Weights w(wt_, rows, cols, rng);
  Activations x(n_tokens * cols, rng);
  ThreadPool pool1(1), pool2(2);

  std::vector<float> single(rows, kNaN), one(rows, kNaN), two(rows, kNaN);
  matvec_rows(w.data(), wt_, x.data(), single.data(), cols, 0, rows);
  matvec(pool1, w.data(), wt_, x.data(), one.data(), rows, cols);
  matvec(pool2, w.data(), wt_, x.data(), two.data(), rows, cols);
  EXPECT_EQ(0, std::memcmp(single.data(), one.data(), single.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(single.data(), two.data(), single.size() * sizeof(float)));

  std::vector<float> mm_single(size_t(n_tokens * rows), kNaN), mm_two(mm_single.size(), kNaN);
  matmul_rows(w.data(), wt_, x.data(), n_tokens, mm_single.data(), rows, cols, 0, rows);
  matmul(pool2, w.data(), wt_, x.data(), n_tokens, mm_two.data(), rows, cols);
  EXPECT_EQ(0, std::memcmp(mm_single.data(), mm_two.data(), mm_single.size() * sizeof(float)));
  // Bitwise equality alone would pass if nothing were written at all.
  for (float v : mm_two) ASSERT_FALSE(std::isnan(v));
  for (float v : two) ASSERT_FALSE(std::isnan(v));
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<Isa, DType>>& info) {
  return std::string(isa_name(std::get<0>(info.param))) + "_" +
         std::string(dtype_name(std::get<1>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(
    AllIsasAndDtypes, KernelTest,
    ::testing::Combine(::testing::Values(Isa::kPortable, Isa::kAvx2, Isa::kAvx2Vnni, Isa::kAvx512),
                       ::testing::Values(DType::kF32, DType::kF16, DType::kBF16)),
    param_name);

TEST(IsaDispatch, SetActiveIsaClampsToSupported) {
  Isa saved = active_isa();
  set_active_isa(Isa::kAvx512);
  EXPECT_EQ(active_isa(), detect_isa());
  // AVX-VNNI without AVX-512 (Alder Lake) or AVX-512 without AVX-VNNI (Ice Lake, Zen 4):
  // kAvx2Vnni falls back to kAvx2 where the CPU has AVX2 only.
  set_active_isa(Isa::kAvx2Vnni);
  const Isa want = isa_supported(Isa::kAvx2Vnni) ? Isa::kAvx2Vnni
                   : isa_supported(Isa::kAvx2)   ? Isa::kAvx2
                                                 : Isa::kPortable;
  EXPECT_EQ(active_isa(), want);
  set_active_isa(Isa::kPortable);
  EXPECT_EQ(active_isa(), Isa::kPortable);
  set_active_isa(saved);
  EXPECT_TRUE(isa_supported(Isa::kPortable));
  EXPECT_TRUE(isa_supported(detect_isa()));
  EXPECT_EQ(isa_name(Isa::kPortable), "portable");
  EXPECT_EQ(isa_name(Isa::kAvx2), "avx2");
  EXPECT_EQ(isa_name(Isa::kAvx2Vnni), "avx2vnni");
  EXPECT_EQ(isa_name(Isa::kAvx512), "avx512");
}

TEST(IsaDispatch, DetectAgreesWithCompilerRuntime) {
  // libgcc's own cpuid reading (which also checks the OS saves the registers) as a second
  // opinion on detect_isa's cpuid / xgetbv decoding.
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                __builtin_cpu_supports("avx512bf16");
  bool avx_vnni = avx2 && __builtin_cpu_supports("avxvnni");
  Isa expected = avx512     ? Isa::kAvx512
                 : avx_vnni ? Isa::kAvx2Vnni
                 : avx2     ? Isa::kAvx2
                            : Isa::kPortable;
  EXPECT_EQ(isa_name(detect_isa()), isa_name(expected));
  EXPECT_EQ(isa_supported(Isa::kAvx2), avx2);
  EXPECT_EQ(isa_supported(Isa::kAvx2Vnni), avx_vnni);
  EXPECT_EQ(isa_supported(Isa::kAvx512), avx512);
}

TEST(IsaDispatchDeathTest, RejectsUnknownDtype) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  float w[4] = {1, 2, 3, 4}, x[4] = {1, 1, 1, 1}, y[1];
  EXPECT_DEATH(matvec_rows(w, static_cast<DType>(7), x, y, 4, 0, 1), "F32, F16 or BF16");
}

}  // namespace
}  // namespace ts::cpu

// ---- core/dtype.h ----------------------------------------------------------------------

namespace ts {
namespace {

uint32_t f32_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float f32_from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

bool f16_is_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

// The value of an F16 bit pattern from its definition, independent of dtype.h.
double f16_value(uint16_t h) {
  int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double v = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
  if (exp == 31) v = mant == 0 ? std::numeric_limits<double>::infinity() : std::nan("");
  return sign ? -v : v;
}

TEST(DtypeF16, DecodesEveryPatternExactly) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = f16_to_f32(uint16_t(h));
    double want = f16_value(uint16_t(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << h;
    } else {
      EXPECT_EQ(double(f), want) << std::hex << h;
      EXPECT_EQ(std::signbit(f), bool(h & 0x8000)) << std::hex << h;  // -0 stays -0
    }
  }
}

TEST(DtypeF16, RoundTripsEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    uint16_t back = f32_to_f16(f16_to_f32(uint16_t(h)));
    if (f16_is_nan(uint16_t(h))) {
      EXPECT_TRUE(f16_is_nan(back)) << std::hex << h << " -> " << back;
    } else {
      EXPECT_EQ(back, h) << std::hex << h;
    }
  }
}

// Rounding to nearest even on the values where it matters: each F16 value, the midpoints
// to its neighbours and one F32 ulp either side of them, across normals, subnormals, the
// subnormal/normal boundary and overflow.
std::vector<float> f16_rounding_cases() {
  std::vector<float> cases;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    double lo = f16_value(uint16_t(h));
    double hi = h + 1 < 0x7c00 ? f16_value(uint16_t(h + 1)) : 65536.0;  // 65536: overflow edge
    float mid = float((lo + hi) / 2);  // exact in F32: 11 significant bits + 1
    for (float v : {float(lo), mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      cases.push_back(v);
      cases.push_back(-v);
    }
  }
  for (float v : {1e-10f, 2.9802322e-08f, 1e6f, 1e38f, std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::denorm_min()})
    cases.push_back(v);
  return cases;
}

TEST(DtypeF16, EncodeRoundsToNearestEven) {
  // From the definition: the result is a nearest F16, ties to an even mantissa, and values
  // at or past 65520 become infinity.
  for (float v : f16_rounding_cases()) {
    uint16_t h = f32_to_f16(v);
    double got = f16_value(h), a = std::fabs(double(v));
    ASSERT_EQ(std::signbit(got), std::signbit(v)) << v;
    if (a >= 65520.0) {
      EXPECT_EQ(h & 0x7fff, 0x7c00) << v;
      continue;
    }
    uint16_t mag = h & 0x7fff;
    double err = std::fabs(std::fabs(got) - a);
    // Distances from v to the neighbours of the chosen value: neither may be closer, and on
    // a tie the chosen mantissa is even.
    double to_below = mag > 0 ? std::fabs(a - f16_value(uint16_t(mag - 1))) : 1e300;
    double to_above = std::fabs(f16_value(uint16_t(mag + 1)) - a);
    EXPECT_LE(err, to_below) << v;
    EXPECT_LE(err, to_above) << v;
    if (err == to_below || err == to_above) {
      EXPECT_EQ(mag & 1, 0) << v;
    }
  }
}

__attribute__((target("f16c"))) uint16_t hw_f32_to_f16(float v) {
  return uint16_t(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
}

TEST(DtypeF16, EncodeMatchesF16C) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "CPU lacks F16C";
  std::vector<float> cases = f16_rounding_cases();
  uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int i = 0; i < 1000000; ++i) cases.push_back(f32_from_bits(rng()));  // any pattern
  for (float v : cases) {
    uint16_t got = f32_to_f16(v), want = hw_f32_to_f16(v);
    if (std::isnan(v)) {
      EXPECT_TRUE(f16_is_nan(got)) << std::hex << f32_bits(v);
    } else {
      EXPECT_EQ(got, want) << std::hex << "f32 bits " << f32_bits(v);
    }
  }
}

TEST(DtypeBf16, DecodeIsExactShift) {
  for (uint32_t h = 0; h < 65536; ++h) {
    EXPECT_EQ(f32_bits(bf16_to_f32(uint16_t(h))), h << 16);
    bool nan = (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0;
    if (!nan) {
      EXPECT_EQ(f32_to_bf16(bf16_to_f32(uint16_t(h))), h) << std::hex << h;
    }
  }
}

TEST(DtypeBf16, EncodeRoundsToNearestEvenOnHandPickedCases) {
  struct Case {
    uint32_t f32;
    uint16_t bf16;
    const char* what;
  };
  const Case cases[] = {
      {0x3f800000, 0x3f80, "1.0 exact"},
      {0x3f807fff, 0x3f80, "just below half: down"},
      {0x3f808000, 0x3f80, "tie, even below: down"},
      {0x3f808001, 0x3f81, "just above half: up"},
      {0x3f818000, 0x3f82, "tie, odd below: up to even"},
      {0xbf818000, 0xbf82, "negative tie, odd: away from zero to even"},
      {0xbf808000, 0xbf80, "negative tie, even"},
      {0x3fffffff, 0x4000, "mantissa carry into exponent"},
      {0x7f7fffff, 0x7f80, "max float rounds to infinity"},
      {0x7f7f7fff, 0x7f7f, "largest that stays finite"},
      {0x7f800000, 0x7f80, "infinity"},
      {0xff800000, 0xff80, "-infinity"},
      {0x80000000, 0x8000, "-0"},
      {0x00008000, 0x0000, "subnormal tie, even: to zero"},
      {0x00018000, 0x0002, "subnormal tie, odd: up"},
      {0x007fffff, 0x0080, "largest subnormal rounds to smallest normal"},
  };
  for (const Case& c : cases)
    EXPECT_EQ(f32_to_bf16(f32_from_bits(c.f32)), c.bf16) << c.what << std::hex << " " << c.f32;
  // NaNs stay NaN, including one whose payload lives only in the low 16 bits (truncation
  // would make it infinity).
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    uint16_t h = f32_to_bf16(f32_from_bits(nan));
    EXPECT_TRUE(std::isnan(bf16_to_f32(h))) << std::hex << nan;
    EXPECT_EQ(h >> 15, nan >> 31) << std::hex << nan;
  }
}

TEST(DtypeBf16, EncodeIsNearestOnRandomPatterns) {
  uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed=" + std::to_string(seed));
  std::mt19937 rng(seed);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t bits = rng();
    float v = f32_from_bits(bits);
    if (!std::isfinite(v)) continue;
    uint16_t h = f32_to_bf16(v);
    // The candidates: v with its low 16 bits cleared, and one BF16 ulp further from zero.
    // Pick the nearer by value (in double, exact here); a tie goes to the even mantissa.
    uint16_t toward_zero = uint16_t(bits >> 16), away = uint16_t(toward_zero + 1);
    double d0 = std::fabs(double(v) - bf16_to_f32(toward_zero));
    // Past the largest finite BF16 the next step is 2^128, which rounds to infinity.
    double away_value = std::isinf(bf16_to_f32(away)) ? std::copysign(std::ldexp(1.0, 128), v)
                                                      : double(bf16_to_f32(away));
    double d1 = std::fabs(away_value - double(v));
    uint16_t want = d0 < d1 ? toward_zero : d1 < d0 ? away : (toward_zero & 1) ? away : toward_zero;
    ASSERT_EQ(h, want) << std::hex << bits;
  }
}

}  // namespace
}  // namespace ts
