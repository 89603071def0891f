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

void gated_delta_net(ThreadPool& pool, const DeltaNetArgs& a) {
  const int key_dim = a.n_k_heads * a.k_dim, value_dim = a.n_v_heads * a.v_dim;
  const int conv_dim = 2 * key_dim + value_dim, taps = a.kernel, hist = a.kernel - 1;
  // The conv, channel by channel over the tokens; the state keeps each channel's last inputs.
  pool.parallel_for(conv_dim, 16, [&](int64_t c0, int64_t c1) {
    std::vector<float> win(size_t(hist) + size_t(a.n));
    for (int64_t c = c0; c < c1; ++c) {
      float* st = a.conv_state + size_t(c) * size_t(hist);
      std::copy_n(st, hist, win.begin());
      for (int t = 0; t < a.n; ++t) win[size_t(hist + t)] = a.qkv[size_t(t) * conv_dim + size_t(c)];
      const float* w = a.conv + size_t(c) * size_t(taps);
      for (int t = 0; t < a.n; ++t) {
        float acc = 0;
        for (int i = 0; i < taps; ++i) acc += w[i] * win[size_t(t + i)];
        a.x[size_t(t) * conv_dim + size_t(c)] = acc / (1.0f + std::exp(-acc));  // SiLU
      }
      std::copy_n(win.end() - hist, hist, st);
    }
  });
  // The gated delta rule, head by head over the tokens.
  const int per_key = a.n_v_heads / a.n_k_heads;
  const float q_scale = 1.0f / std::sqrt(float(a.k_dim));
  pool.parallel_for(a.n_v_heads, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> q(size_t(a.k_dim)), k(size_t(a.k_dim)), kv(size_t(a.v_dim));
    const auto l2 = [](const float* src, float* dst, int n) {
      float ss = 0;
      for (int i = 0; i < n; ++i) ss += src[i] * src[i];
      const float inv = 1.0f / std::sqrt(ss + 1e-6f);
      for (int i = 0; i < n; ++i) dst[i] = src[i] * inv;
    };
    for (int64_t h = h0; h < h1; ++h) {
      const int kh = int(h) / per_key;
      float* S = a.state + size_t(h) * size_t(a.k_dim) * size_t(a.v_dim);
      const float a_coef = -std::exp(a.a_log[h]);
      for (int t = 0; t < a.n; ++t) {
        const float* xt = a.x + size_t(t) * conv_dim;
        l2(xt + size_t(kh) * a.k_dim, q.data(), a.k_dim);
        for (float& v : q) v *= q_scale;
        l2(xt + key_dim + size_t(kh) * a.k_dim, k.data(), a.k_dim);
        const float* v = xt + 2 * key_dim + size_t(h) * a.v_dim;
        const float z = a.a[size_t(t) * a.n_v_heads + size_t(h)] + a.dt_bias[h];
        const float softplus = z > 20.0f ? z : std::log1p(std::exp(z));  // torch's threshold
        const float decay = std::exp(a_coef * softplus);
        const float beta = 1.0f / (1.0f + std::exp(-a.b[size_t(t) * a.n_v_heads + size_t(h)]));
        std::fill(kv.begin(), kv.end(), 0.0f);
        for (int i = 0; i < a.k_dim; ++i) {
          float* row = S + size_t(i) * a.v_dim;
          for (int j = 0; j < a.v_dim; ++j) {
            row[j] *= decay;
            kv[size_t(j)] += row[j] * k[size_t(i)];
          }
        }
        for (int j = 0; j < a.v_dim; ++j) kv[size_t(j)] = (v[j] - kv[size_t(j)]) * beta;  // delta
        float* o = a.out + size_t(t) * value_dim + size_t(h) * a.v_dim;
        std::fill(o, o + a.v_dim, 0.0f);
        for (int i = 0; i < a.k_dim; ++i) {
          float* row = S + size_t(i) * a.v_dim;
          for (int j = 0; j < a.v_dim; ++j) {
            row[j] += k[size_t(i)] * kv[size_t(j)];
            o[j] += row[j] * q[size_t(i)];
          }
        }
      }
    }
  });
}

}  // namespace ts::cpu
