// Reference quantization and dequantization of one row (quant.h has the byte layouts), and
// the reference quantization of activations for the integer dot products.
//
// Exactness: an f16 scale has 11 significant bits, a 6-bit scale or min 6, a quant at most
// 8, so d * qs (Q8_0), d * sc, dmin * m and (d * sc) * q (Q4_K) are exact in F32; the only
// rounding is Q4_K's final subtraction. Fused or not, every SIMD dequantization therefore
// gives the same bits as dequantize_row.
#include "backend/cpu/quant.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "core/status.h"

namespace ts::cpu {
namespace {

// Round half away from zero, as roundf; |v| is small here.
int round_int(float v) { return int(std::lround(v)); }

// ---- Q8_0 ------------------------------------------------------------------------------

// Blocks are copied through memcpy: rows of a file or pack need not be 2-byte aligned.
void quantize_q8_0(const float* x, uint8_t* out, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, x += kQ8_0BlockElems, out += kQ8_0BlockBytes) {
    float amax = 0.0f;
    for (int i = 0; i < kQ8_0BlockElems; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    BlockQ8_0 blk;
    blk.d = f32_to_f16(d);
    for (int i = 0; i < kQ8_0BlockElems; ++i)
      blk.qs[i] = int8_t(std::clamp(round_int(x[i] * id), -127, 127));
    std::memcpy(out, &blk, sizeof blk);
  }
}

void dequantize_q8_0(const uint8_t* in, float* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, y += kQ8_0BlockElems, in += kQ8_0BlockBytes) {
    BlockQ8_0 blk;
    std::memcpy(&blk, in, sizeof blk);
    const float d = f16_to_f32(blk.d);
    for (int i = 0; i < kQ8_0BlockElems; ++i) y[i] = d * float(blk.qs[i]);
  }
}

// ---- Q4_K ------------------------------------------------------------------------------

constexpr int kSub = 32;       // weights per sub-block
constexpr int kNSub = 8;       // sub-blocks per block
constexpr int kQMax = 15;      // 4-bit quants
constexpr int kScaleMax = 63;  // 6-bit scales and mins

struct SubFit {
  float scale = 0.0f;  // x ~= scale * q - min
  float min = 0.0f;    // >= 0
};

// Weighted least-squares scale and min of one sub-block, x ~= scale * q - min with q in
// [0, 15] and min >= 0. The importance of each weight is rms(x) + |x| (llama.cpp's choice:
// large weights matter more). Tries 21 grids spanning [min(x, 0), max(x)] with 14..16
// steps, refits scale and min to each grid's quants in closed form, and keeps the fit of
// least weighted squared error.
SubFit fit_sub_block(const float* x) {
  float lo = x[0], hi = x[0], sum_x2 = 0.0f;
  for (int i = 0; i < kSub; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sum_x2 += x[i] * x[i];
  }
  lo = std::min(lo, 0.0f);
  if (hi == lo) return {0.0f, -lo};
  const float rms = std::sqrt(sum_x2 / kSub);
  float w[kSub];
  float sum_w = 0.0f, sum_wx = 0.0f;
  for (int i = 0; i < kSub; ++i) {
    w[i] = rms + std::fabs(x[i]);
    sum_w += w[i];
    sum_wx += w[i] * x[i];
  }
  auto error_of = [&](float scale, float min) {
    float err = 0.0f;
    for (int i = 0; i < kSub; ++i) {
      int q = std::clamp(round_int((x[i] + min) / scale), 0, kQMax);
      float diff = scale * float(q) - min - x[i];
      err += w[i] * diff * diff;
    }
    return err;
  };
  SubFit best{(hi - lo) / kQMax, -lo};
  float best_err = error_of(best.scale, best.min);
  for (int step = 0; step <= 20; ++step) {
    const float iscale = (float(kQMax) - 1.0f + 0.1f * float(step)) / (hi - lo);
    float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
    for (int i = 0; i < kSub; ++i) {
      const float l = float(std::clamp(round_int(iscale * (x[i] - lo)), 0, kQMax));
      sum_l += w[i] * l;
      sum_l2 += w[i] * l * l;
      sum_xl += w[i] * l * x[i];
    }
    // Minimise sum w (scale * l + offset - x)^2 over scale, offset (offset = -min).
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (det <= 0.0f) continue;
    float scale = (sum_w * sum_xl - sum_wx * sum_l) / det;
    float offset = (sum_l2 * sum_wx - sum_l * sum_xl) / det;
    if (offset > 0.0f) {  // the format's min is subtracted, so the offset must be <= 0
      offset = 0.0f;
      scale = sum_xl / sum_l2;
    }
    if (!(scale > 0.0f)) continue;
    const float err = error_of(scale, -offset);
    if (err < best_err) {
      best_err = err;
      best = {scale, -offset};
    }
  }
  return best;
}

void pack_scale_min(uint8_t* scales, int j, int sc, int m) {
  if (j < 4) {
    scales[j] = uint8_t(sc);
    scales[j + 4] = uint8_t(m);
  } else {
    scales[j + 4] = uint8_t((sc & 15) | (m & 15) << 4);
    scales[j - 4] = uint8_t(scales[j - 4] | (sc >> 4) << 6);
    scales[j] = uint8_t(scales[j] | (m >> 4) << 6);
  }
}

void quantize_q4_k(const float* x, uint8_t* out, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, x += kQ4_KBlockElems, out += kQ4_KBlockBytes) {
    SubFit fit[kNSub];
    float max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < kNSub; ++j) {
      fit[j] = fit_sub_block(x + j * kSub);
      max_scale = std::max(max_scale, fit[j].scale);
      max_min = std::max(max_min, fit[j].min);
    }
    BlockQ4_K blk;
    std::memset(&blk, 0, sizeof blk);
    blk.d = f32_to_f16(max_scale / kScaleMax);
    blk.dmin = f32_to_f16(max_min / kScaleMax);
    // 6-bit scales against the stored (f16-rounded) super-block scales.
    const float d = f16_to_f32(blk.d), dmin = f16_to_f32(blk.dmin);
    for (int j = 0; j < kNSub; ++j) {
      int sc = d > 0.0f ? std::clamp(round_int(fit[j].scale / d), 0, kScaleMax) : 0;
      int m = dmin > 0.0f ? std::clamp(round_int(fit[j].min / dmin), 0, kScaleMax) : 0;
      pack_scale_min(blk.scales, j, sc, m);
    }
    // Quants refit to the scales as stored.
    uint8_t q[kQ4_KBlockElems];
    for (int j = 0; j < kNSub; ++j) {
      uint8_t sc, m;
      q4_k_scale_min(blk.scales, j, &sc, &m);
      const float dj = d * float(sc), mj = dmin * float(m);
      for (int i = 0; i < kSub; ++i)
        q[j * kSub + i] =
            dj > 0.0f ? uint8_t(std::clamp(round_int((x[j * kSub + i] + mj) / dj), 0, kQMax)) : 0;
    }
    for (int g = 0; g < 4; ++g)
      for (int l = 0; l < 32; ++l)
        blk.qs[32 * g + l] = uint8_t(q[64 * g + l] | q[64 * g + 32 + l] << 4);
    std::memcpy(out, &blk, sizeof blk);
  }
}

void dequantize_q4_k(const uint8_t* in, float* y, int64_t n_blocks) {
  for (int64_t b = 0; b < n_blocks; ++b, in += kQ4_KBlockBytes) {
    BlockQ4_K blk;
    std::memcpy(&blk, in, sizeof blk);
    const float d = f16_to_f32(blk.d), dmin = f16_to_f32(blk.dmin);
    for (int g = 0; g < 4; ++g) {
      uint8_t sc0, m0, sc1, m1;
      q4_k_scale_min(blk.scales, 2 * g, &sc0, &m0);
      q4_k_scale_min(blk.scales, 2 * g + 1, &sc1, &m1);
      const float d0 = d * float(sc0), min0 = dmin * float(m0);
      const float d1 = d * float(sc1), min1 = dmin * float(m1);
      const uint8_t* qs = blk.qs + 32 * g;
      for (int l = 0; l < 32; ++l) *y++ = d0 * float(qs[l] & 15) - min0;
      for (int l = 0; l < 32; ++l) *y++ = d1 * float(qs[l] >> 4) - min1;
    }
  }
}

}  // namespace

void quantize_row(DType t, const float* x, void* out, int64_t cols) {
  TS_CHECK(dtype_is_quantized(t) && dtype_row_ok(t, cols), "quantize_row: bad type or length");
  if (t == DType::kQ8_0) {
    quantize_q8_0(x, static_cast<uint8_t*>(out), cols / kQ8_0BlockElems);
  } else {
    quantize_q4_k(x, static_cast<uint8_t*>(out), cols / kQ4_KBlockElems);
  }
}

void quantize_acts_q8(const float* x, int64_t n_tokens, int64_t cols, Q8ActsOut out) {
  TS_CHECK(cols % kQ8_0BlockElems == 0, "quantize_acts_q8: cols must be whole 32-blocks");
  const int64_t n_blocks = n_tokens * cols / kQ8_0BlockElems;
  int8_t* qs = out.qs;
  for (int64_t b = 0; b < n_blocks; ++b, x += kQ8_0BlockElems, qs += kQ8_0BlockElems) {
    float amax = 0.0f;
    for (int i = 0; i < kQ8_0BlockElems; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float db = amax / 127.0f;
    const float id = db >= FLT_MIN ? 1.0f / db : 0.0f;
    // nearbyint rounds in the current mode: ties to even, as the SIMD conversions (the
    // program never changes the rounding mode).
    int32_t sum = 0;
    for (int i = 0; i < kQ8_0BlockElems; ++i) {
      qs[i] = int8_t(std::nearbyint(x[i] * id));
      sum += qs[i];
    }
    out.d[b] = db;
    out.sum[b] = db * float(sum);
  }
}

void dequantize_row(DType t, const void* q, float* out, int64_t cols) {
  TS_CHECK(dtype_is_quantized(t) && dtype_row_ok(t, cols), "dequantize_row: bad type or length");
  if (t == DType::kQ8_0) {
    dequantize_q8_0(static_cast<const uint8_t*>(q), out, cols / kQ8_0BlockElems);
  } else {
    dequantize_q4_k(static_cast<const uint8_t*>(q), out, cols / kQ4_KBlockElems);
  }
}

}  // namespace ts::cpu
