// ggml's block dequantization (src/model/ggml_dequant.*) against each type's layout written
// element by element (which byte and bits hold weight e, which scale multiplies it), on random
// blocks. The loops under test walk the blocks as ggml-quants.c does; the formulas here index
// them directly, so a wrong shift, offset or output order shows as a mismatch.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "core/dtype.h"
#include "model/ggml_dequant.h"

namespace {

using ts::model::ggml_dequantize_row;

float h(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return ts::f16_to_f32(v);
}

// Random bytes, with every f16 field set to a random finite half in [-2, 2].
std::vector<uint8_t> random_blocks(std::mt19937& rng, size_t block_bytes, int n_blocks,
                                   std::vector<size_t> half_offsets) {
  std::vector<uint8_t> b(block_bytes * size_t(n_blocks));
  for (uint8_t& x : b) x = uint8_t(rng());
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int i = 0; i < n_blocks; ++i)
    for (size_t off : half_offsets) {
      const uint16_t v = ts::f32_to_f16(u(rng));
      std::memcpy(&b[size_t(i) * block_bytes + off], &v, 2);
    }
  return b;
}

struct Type {
  const char* name;
  uint32_t id;
  int elems;
  size_t bytes;
  std::vector<size_t> halves;
  std::function<float(const uint8_t*, int)> element;  // weight e of one block
};

// IQ4_NL / IQ4_XS levels (ggml-common.h's kvalues_iq4nl).
constexpr int kIq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q4_K / Q5_K's 6-bit scale and min of sub-block j (scales: 12 bytes).
void k4_scale(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

const std::vector<Type>& types() {
  static const std::vector<Type> t = {
      {"Q4_0",
       2,
       32,
       18,
       {0},
       [](const uint8_t* b, int e) {
         const int q = e < 16 ? b[2 + e] & 0xF : b[2 + e - 16] >> 4;
         return float(q - 8) * h(b);
       }},
      {"Q4_1",
       3,
       32,
       20,
       {0, 2},
       [](const uint8_t* b, int e) {
         const int q = e < 16 ? b[4 + e] & 0xF : b[4 + e - 16] >> 4;
         return float(q) * h(b) + h(b + 2);
       }},
      {"Q5_0",
       6,
       32,
       22,
       {0},
       [](const uint8_t* b, int e) {
         uint32_t qh;
         std::memcpy(&qh, b + 2, 4);
         const int lo = e < 16 ? b[6 + e] & 0xF : b[6 + e - 16] >> 4;
         return float((lo | int(((qh >> e) & 1) << 4)) - 16) * h(b);
       }},
      {"Q5_1",
       7,
       32,
       24,
       {0, 2},
       [](const uint8_t* b, int e) {
         uint32_t qh;
         std::memcpy(&qh, b + 4, 4);
         const int lo = e < 16 ? b[8 + e] & 0xF : b[8 + e - 16] >> 4;
         return float(lo | int(((qh >> e) & 1) << 4)) * h(b) + h(b + 2);
       }},
      {"Q2_K",
       10,
       256,
       84,
       {80, 82},
       [](const uint8_t* b, int e) {
         const int hh = e / 128, s = (e % 128) / 32, l = e % 32;
         const int q = (b[16 + 32 * hh + l] >> (2 * s)) & 3;
         const int sc = b[e / 16];
         return h(b + 80) * float(sc & 0xF) * float(q) - h(b + 82) * float(sc >> 4);
       }},
      {"Q3_K",
       11,
       256,
       110,
       {108},
       [](const uint8_t* b, int e) {
         const int hh = e / 128, s = (e % 128) / 32, l = e % 32;
         const int low = (b[32 + 32 * hh + l] >> (2 * s)) & 3;
         const int hbit = (b[l] >> (4 * hh + s)) & 1;
         const int j = e / 16;
         const uint8_t* sc = b + 96;
         const int lo4 = j < 8 ? sc[j] & 0xF : sc[j - 8] >> 4;
         const int hi2 = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
         const int scale = (lo4 | (hi2 << 4)) - 32;
         return h(b + 108) * float(scale) * float(low - (hbit ? 0 : 4));
       }},
      {"Q5_K",
       13,
       256,
       176,
       {0, 2},
       [](const uint8_t* b, int e) {
         const int c = e / 64, r = e % 64, sub = e / 32;
         int q = r < 32 ? b[48 + 32 * c + r] & 0xF : b[48 + 32 * c + r - 32] >> 4;
         q |= ((b[16 + e % 32] >> sub) & 1) << 4;
         int sc, m;
         k4_scale(b + 4, sub, &sc, &m);
         return h(b) * float(sc) * float(q) - h(b + 2) * float(m);
       }},
      {"Q6_K",
       14,
       256,
       210,
       {208},
       [](const uint8_t* b, int e) {
         const int hh = e / 128, g = (e % 128) / 32, l = e % 32;
         const uint8_t byte = b[64 * hh + l + 32 * (g & 1)];
         const int lo = g < 2 ? byte & 0xF : byte >> 4;
         const int hi = (b[128 + 32 * hh + l] >> (2 * g)) & 3;
         const int8_t sc = int8_t(b[192 + e / 16]);
         return h(b + 208) * float(sc) * float((lo | (hi << 4)) - 32);
       }},
      {"IQ4_NL",
       20,
       32,
       18,
       {0},
       [](const uint8_t* b, int e) {
         const int q = e < 16 ? b[2 + e] & 0xF : b[2 + e - 16] >> 4;
         return h(b) * float(kIq4[q]);
       }},
      {"IQ4_XS",
       23,
       256,
       136,
       {0},
       [](const uint8_t* b, int e) {
         const int ib = e / 32, j = e % 32;
         const int q = j < 16 ? b[8 + 16 * ib + j] & 0xF : b[8 + 16 * ib + j - 16] >> 4;
         const int lo = ib % 2 == 0 ? b[4 + ib / 2] & 0xF : b[4 + ib / 2] >> 4;
         const int hi = ((b[2] | (b[3] << 8)) >> (2 * ib)) & 3;
         return h(b) * float((lo | (hi << 4)) - 32) * float(kIq4[q]);
       }},
  };
  return t;
}

TEST(GgmlDequant, EveryTypeMatchesItsLayoutElementByElement) {
  std::mt19937 rng(7);
  for (const Type& t : types()) {
    ASSERT_TRUE(ts::model::ggml_can_dequantize(t.id)) << t.name;
    const int n_blocks = 5;
    const std::vector<uint8_t> b = random_blocks(rng, t.bytes, n_blocks, t.halves);
    std::vector<float> got(size_t(t.elems * n_blocks), NAN);
    ggml_dequantize_row(t.id, b.data(), got.data(), t.elems * n_blocks);
    int bad = 0;
    for (int i = 0; i < n_blocks; ++i)
      for (int e = 0; e < t.elems; ++e) {
        const float want = t.element(b.data() + size_t(i) * t.bytes, e);
        const float g = got[size_t(i * t.elems + e)];
        if (want != g && ++bad <= 3)
          ADD_FAILURE() << t.name << " block " << i << " weight " << e << ": " << g << " vs "
                        << want;
      }
    EXPECT_EQ(bad, 0) << t.name;
  }
  EXPECT_FALSE(ts::model::ggml_can_dequantize(8)) << "Q8_0 is read in place";
  EXPECT_FALSE(ts::model::ggml_can_dequantize(39)) << "MXFP4 is not handled";
}

}  // namespace

namespace {

// Not a check: writes random blocks of every type and their dequantization into
// $TS_GGUF_OUT (blocks_<id>.bin, dequant_<id>.f32) for comparison with gguf-py's
// gguf.quants.dequantize where that package exists (tests/gpu/ggml_dequant_check.py).
TEST(GgmlDequantFiles, DISABLED_WriteRandomBlocks) {
  const char* out = std::getenv("TS_GGUF_OUT");
  ASSERT_TRUE(out && *out) << "set TS_GGUF_OUT to a directory";
  std::filesystem::create_directories(out);
  std::mt19937 rng(11);
  for (const Type& t : types()) {
    const int n_blocks = 64;
    const std::vector<uint8_t> b = random_blocks(rng, t.bytes, n_blocks, t.halves);
    std::vector<float> y(size_t(t.elems * n_blocks));
    ggml_dequantize_row(t.id, b.data(), y.data(), t.elems * n_blocks);
    const std::string base = std::string(out) + "/";
    std::ofstream(base + "blocks_" + std::to_string(t.id) + ".bin", std::ios::binary)
        .write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
    std::ofstream(base + "dequant_" + std::to_string(t.id) + ".f32", std::ios::binary)
        .write(reinterpret_cast<const char*>(y.data()), std::streamsize(y.size() * 4));
  }
}

}  // namespace
