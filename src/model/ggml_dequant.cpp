#include "model/ggml_dequant.h"

#include <cstring>

#include "core/dtype.h"
#include "core/status.h"

namespace ts::model {
namespace {

float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// Q4_0 / Q4_1: 32 weights, a 4-bit quant per weight; low nibbles are weights 0..15, high
// nibbles 16..31. Q4_0: (q - 8) * d; Q4_1: q * d + m.
void q4(const uint8_t* b, float* y, bool has_min) {
  const float d = half(b);
  const float m = has_min ? half(b + 2) : 0.0f;
  const uint8_t* qs = b + (has_min ? 4 : 2);
  const int off = has_min ? 0 : 8;
  for (int j = 0; j < 16; ++j) {
    y[j] = float((qs[j] & 0x0F) - off) * d + m;
    y[j + 16] = float((qs[j] >> 4) - off) * d + m;
  }
}

// Q5_0 / Q5_1: as Q4 with a fifth bit per weight in the 32-bit qh (bit j for weight j).
void q5(const uint8_t* b, float* y, bool has_min) {
  const float d = half(b);
  const float m = has_min ? half(b + 2) : 0.0f;
  uint32_t qh;
  std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
  const uint8_t* qs = b + (has_min ? 8 : 6);
  const int off = has_min ? 0 : 16;
  for (int j = 0; j < 16; ++j) {
    const int h0 = int(((qh >> j) << 4) & 0x10);
    const int h1 = int((qh >> (j + 12)) & 0x10);
    y[j] = float(((qs[j] & 0x0F) | h0) - off) * d + m;
    y[j + 16] = float(((qs[j] >> 4) | h1) - off) * d + m;
  }
}

// Q2_K: 16 sub-blocks of 16, each with a 4-bit scale (low nibble) and min (high nibble);
// 2-bit quants, four weights per byte at shifts 0, 2, 4, 6.
void q2_k(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = half(b + 80), dmin = half(b + 82);
  int is = 0;
  for (int n = 0; n < 256; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      for (int half16 = 0; half16 < 2; ++half16) {
        const uint8_t sc = scales[is++];
        const float dl = d * float(sc & 0xF), ml = dmin * float(sc >> 4);
        for (int l = 0; l < 16; ++l) *y++ = dl * float((q[l + 16 * half16] >> shift) & 3) - ml;
      }
      shift += 2;
    }
    q += 32;
  }
}

// Q3_K: 16 sub-blocks of 16 with 6-bit scales (biased by 32) packed in 12 bytes; 2 low bits
// per weight in qs, the high bit in hmask (a clear bit subtracts 4).
void q3_k(const uint8_t* b, float* y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const float d_all = half(b + 108);
  constexpr uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
  uint32_t aux[4];
  std::memcpy(aux, b + 96, 12);
  const uint32_t tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  int8_t scales[16];
  std::memcpy(scales, aux, 16);
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < 256; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      for (int half16 = 0; half16 < 2; ++half16) {
        const float dl = d_all * float(scales[is++] - 32);
        for (int l = 0; l < 16; ++l) {
          const int k = l + 16 * half16;
          *y++ = dl * float(int((q[k] >> shift) & 3) - ((hm[k] & m) ? 0 : 4));
        }
      }
      shift += 2;
      m = uint8_t(m << 1);
    }
    q += 32;
  }
}

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K block (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins; 4 low bits in qs (two sub-blocks per
// 32 bytes, low then high nibbles), the fifth bit in qh (bit pairs advancing per 64 weights).
void q5_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  int is = 0;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < 256; j += 64) {
    uint8_t sc, m;
    scale_min_k4(is + 0, scales, &sc, &m);
    const float d1 = d * float(sc), m1 = dmin * float(m);
    scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = d * float(sc), m2 = dmin * float(m);
    for (int l = 0; l < 32; ++l) *y++ = d1 * float((ql[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * float((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    ql += 32;
    is += 2;
    u1 = uint8_t(u1 << 2);
    u2 = uint8_t(u2 << 2);
  }
}

// Q6_K: 16 sub-blocks of 16 with int8 scales; 4 low bits in ql, 2 high bits in qh, biased by
// 32. Each 128-weight half: weights l, l+32, l+64, l+96 share byte l of qh.
void q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  for (int n = 0; n < 256; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = int((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = int((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * float(sc[is + 0]) * float(q1);
      y[l + 32] = d * float(sc[is + 2]) * float(q2);
      y[l + 64] = d * float(sc[is + 4]) * float(q3);
      y[l + 96] = d * float(sc[is + 6]) * float(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// IQ4_NL / IQ4_XS: 4-bit indices into one non-linear table of int8 levels.
constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

// 32 weights at scale d from 16 bytes: weight j from the low nibble of byte j, weight j + 16
// from its high nibble.
void iq4_32(const uint8_t* qs, float d, float* y) {
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(kIq4Levels[qs[j] & 0xF]);
    y[j + 16] = d * float(kIq4Levels[qs[j] >> 4]);
  }
}

void iq4_nl(const uint8_t* b, float* y) { iq4_32(b + 2, half(b), y); }

// IQ4_XS: 8 sub-blocks of 32, each with a 6-bit scale (low 4 bits in scales_l, nibble ib % 2
// of byte ib / 2; high 2 bits in scales_h, bits 2 ib), biased by 32.
void iq4_xs(const uint8_t* b, float* y) {
  const float d = half(b);
  const unsigned scales_h = unsigned(b[2]) | unsigned(b[3]) << 8;
  const uint8_t* scales_l = b + 4;
  const uint8_t* qs = b + 8;
  for (int ib = 0; ib < 8; ++ib) {
    const int ls =
        int(((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4));
    iq4_32(qs + 16 * ib, d * float(ls - 32), y + 32 * ib);
  }
}

struct Kind {
  uint32_t type;
  int64_t elems;
  size_t bytes;
  void (*fn)(const uint8_t*, float*);
};

constexpr Kind kKinds[] = {
    {2, 32, 18, [](const uint8_t* b, float* y) { q4(b, y, false); }},
    {3, 32, 20, [](const uint8_t* b, float* y) { q4(b, y, true); }},
    {6, 32, 22, [](const uint8_t* b, float* y) { q5(b, y, false); }},
    {7, 32, 24, [](const uint8_t* b, float* y) { q5(b, y, true); }},
    {10, 256, 84, q2_k},
    {11, 256, 110, q3_k},
    {13, 256, 176, q5_k},
    {14, 256, 210, q6_k},
    {20, 32, 18, iq4_nl},
    {23, 256, 136, iq4_xs},
};

const Kind* kind_of(uint32_t type) {
  for (const Kind& k : kKinds)
    if (k.type == type) return &k;
  return nullptr;
}

}  // namespace

bool ggml_can_dequantize(uint32_t ggml_type) { return kind_of(ggml_type) != nullptr; }

void ggml_dequantize_row(uint32_t ggml_type, const uint8_t* src, float* dst, int64_t n) {
  const Kind* k = kind_of(ggml_type);
  TS_CHECK(k && n % k->elems == 0, "ggml_dequantize_row: unsupported type or partial block");
  for (int64_t i = 0; i < n / k->elems; ++i) k->fn(src + size_t(i) * k->bytes, dst + i * k->elems);
}

}  // namespace ts::model
