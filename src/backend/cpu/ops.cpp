#include "backend/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/quant.h"
#include "core/thread_pool.h"

namespace ts::cpu {
namespace {

// Eight independent partial sums: vectorisable without -ffast-math, and not latency-bound.
float dot(const float* a, const float* b, int n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) s[0] += a[i] * b[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

}  // namespace

void rmsnorm_rows(const float* x, const float* w, float* y, int64_t n_rows, int64_t n, float eps) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
    float inv = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
    float* yr = y + r * n;
    for (int64_t i = 0; i < n; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

bool rmsnorm_fits_f16(std::span<const float> w) {
  float most = 0.0f;
  for (float v : w) {
    if (!std::isfinite(v)) return false;
    most = std::max(most, std::fabs(v));
  }
  return !w.empty() && double(most) * std::sqrt(double(w.size())) <= 60000.0;
}

void rope_apply(float* x, int n_heads, const RopeTable& rope, int position) {
  const int half = rope.dim / 2;
  for (int i = 0; i < half; ++i) {
    // transformers computes freqs = position * inv_freq in float32, then cos/sin.
    float freq = float(position) * rope.inv_freq[size_t(i)];
    float c = float(std::cos(double(freq))), s = float(std::sin(double(freq)));
    if (rope.attention_factor != 1.0f) {
      c *= rope.attention_factor;
      s *= rope.attention_factor;
    }
    const int ia = rope.interleaved ? 2 * i : i, ib = rope.interleaved ? 2 * i + 1 : i + half;
    for (int h = 0; h < n_heads; ++h) {
      float* xh = x + size_t(h) * size_t(rope.head_stride) + size_t(rope.offset);
      float a = xh[ia], b = xh[ib];
      xh[ia] = a * c - b * s;
      xh[ib] = b * c + a * s;
    }
  }
}

void silu_mul(const float* g, const float* u, float* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void clamped_swiglu(const float* g, const float* u, float* h, int64_t n, float limit, float alpha) {
  for (int64_t i = 0; i < n; ++i) {
    const float gate = std::min(g[i], limit), up = std::clamp(u[i], -limit, limit);
    const float glu = gate / (1.0f + std::exp(-gate * alpha));
    h[i] = (up + 1.0f) * glu;
  }
}

void attention(ThreadPool& pool, const AttentionArgs& a) {
  const int group = a.n_heads / a.n_kv_heads;
  const int q_dim = a.n_heads * a.head_dim, kv_dim = a.n_kv_heads * a.head_dim;
  const float scale = a.scale;
  const int64_t jobs = int64_t(a.n_tokens) * a.n_heads;
  pool.parallel_for(jobs, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores(size_t(a.pos0 + a.n_tokens));
    for (int64_t job = b; job < e; ++job) {
      const int t = int(job / a.n_heads), h = int(job % a.n_heads), g = h / group;
      const int n_keys = a.pos0 + t + 1;
      const int first = a.window > 0 ? std::max(0, n_keys - a.window) : 0;
      const float* q = a.q + size_t(t) * q_dim + size_t(h) * a.head_dim;
      float mx = a.sinks.empty() ? -INFINITY : a.sinks[size_t(h)];
      for (int j = first; j < n_keys; ++j) {
        scores[size_t(j)] =
            dot(q, a.k_cache + a.rows.row(j) * kv_dim + size_t(g) * a.head_dim, a.head_dim) *
            scale;
        mx = std::max(mx, scores[size_t(j)]);
      }
      float sum = 0;
      for (int j = first; j < n_keys; ++j) {
        scores[size_t(j)] = std::exp(scores[size_t(j)] - mx);
        sum += scores[size_t(j)];
      }
      if (!a.sinks.empty()) sum += std::exp(a.sinks[size_t(h)] - mx);
      const float inv = 1.0f / sum;
      float* o = a.out + size_t(t) * q_dim + size_t(h) * a.head_dim;
      std::fill(o, o + a.head_dim, 0.0f);
      for (int j = first; j < n_keys; ++j) {
        const float p = scores[size_t(j)] * inv;
        const float* v = a.v_cache + a.rows.row(j) * kv_dim + size_t(g) * a.head_dim;
        for (int d = 0; d < a.head_dim; ++d) o[d] += p * v[d];
      }
    }
  });
}

void mla_attention(ThreadPool& pool, const MlaArgs& a) {
  const int qk = a.nope_dim + a.rope_dim, row = a.kv_lora_rank + a.rope_dim;
  const int64_t r = a.kv_lora_rank;
  const size_t kv_b_row = dtype_row_bytes(a.kv_b_dtype, r);
  auto load_rows = [&](int first, int n, float* dst) {
    const uint8_t* src = static_cast<const uint8_t*>(a.kv_b) + size_t(first) * kv_b_row;
    for (int i = 0; i < n; ++i, src += kv_b_row, dst += r) {
      if (dtype_is_quantized(a.kv_b_dtype))
        dequantize_row(a.kv_b_dtype, src, dst, r);
      else
        float_row_to_f32(src, a.kv_b_dtype, dst, r);
    }
  };
  pool.parallel_for(a.n_heads, 1, [&](int64_t b, int64_t e) {
    std::vector<float> uk(size_t(a.nope_dim) * size_t(r)), uv(size_t(a.v_dim) * size_t(r));
    std::vector<float> q_lat(static_cast<size_t>(r)), o_lat(static_cast<size_t>(r));
    std::vector<float> scores(static_cast<size_t>(a.pos0 + a.n_tokens));
    for (int64_t h = b; h < e; ++h) {
      const int first = int(h) * (a.nope_dim + a.v_dim);
      load_rows(first, a.nope_dim, uk.data());
      load_rows(first + a.nope_dim, a.v_dim, uv.data());
      for (int t = 0; t < a.n_tokens; ++t) {
        const float* q = a.q + size_t(t) * size_t(a.n_heads) * qk + size_t(h) * qk;
        std::fill(q_lat.begin(), q_lat.end(), 0.0f);
        for (int i = 0; i < a.nope_dim; ++i) {
          const float qi = q[i];
          const float* w = uk.data() + size_t(i) * size_t(r);
          for (int64_t j = 0; j < r; ++j) q_lat[size_t(j)] += qi * w[j];
        }
        const int n_keys = a.pos0 + t + 1;
        float mx = -INFINITY;
        for (int j = 0; j < n_keys; ++j) {
          const float* c = a.cache + a.rows.row(j) * size_t(row);
          const float s = (dot(q_lat.data(), c, int(r)) + dot(q + a.nope_dim, c + r, a.rope_dim)) *
                          a.scale;
          scores[size_t(j)] = s;
          mx = std::max(mx, s);
        }
        float sum = 0;
        for (int j = 0; j < n_keys; ++j) {
          scores[size_t(j)] = std::exp(scores[size_t(j)] - mx);
          sum += scores[size_t(j)];
        }
        const float inv = 1.0f / sum;
        std::fill(o_lat.begin(), o_lat.end(), 0.0f);
        for (int j = 0; j < n_keys; ++j) {
          const float p = scores[size_t(j)] * inv;
          const float* c = a.cache + a.rows.row(j) * size_t(row);
          for (int64_t d = 0; d < r; ++d) o_lat[size_t(d)] += p * c[d];
        }
        float* o = a.out + size_t(t) * size_t(a.n_heads) * a.v_dim + size_t(h) * a.v_dim;
        for (int i = 0; i < a.v_dim; ++i) o[i] = dot(uv.data() + size_t(i) * size_t(r), o_lat.data(), int(r));
      }
    }
  });
}

}  // namespace ts::cpu
