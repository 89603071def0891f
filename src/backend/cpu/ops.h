// CPU element-wise and attention ops of the forward pass. Each has the obvious scalar
// definition written out; they are a small share of the time next to the matrix kernels
// (kernels.h).
#pragma once

#include <cstdint>
#include <span>

namespace ts {
class ThreadPool;
}

namespace ts::cpu {

// y[i] = x[i] / sqrt(mean(x^2) + eps) * w[i], over rows of length n (in place allowed).
void rmsnorm_rows(const float* x, const float* w, float* y, int64_t n_rows, int64_t n, float eps);

// Whether every output of rmsnorm_rows with weights w lies within F16's range (65,504),
// whatever the row: |x_i| / rms(x) <= sqrt(n) (one element holding all of the row's energy),
// so |y_i| <= sqrt(n) max |w_i|, held to 60,000 for the rounding of rms in F32. False for
// empty or non-finite weights. (The CUDA prefill gathers the experts' input in F16 on it.)
bool rmsnorm_fits_f16(std::span<const float> w);

// Rotates pairs (i, i + head_dim/2) of each head (the rotate_half convention of
// transformers) of x [n_heads * head_dim] for one position.
struct RopeTable {
  int head_dim = 0;
  std::span<const float> inv_freq;  // [head_dim / 2]
};
void rope_apply(float* x, int n_heads, const RopeTable& rope, int position);

// h[i] = silu(g[i]) * u[i]
void silu_mul(const float* g, const float* u, float* h, int64_t n);

// Causal grouped-query attention for n_tokens queries at positions pos0 .. pos0+n_tokens-1,
// over a cache whose rows 0 .. pos0+n_tokens-1 are filled.
struct AttentionArgs {
  const float* q;       // [n_tokens, n_heads * head_dim]
  const float* k_cache;  // [n_ctx, n_kv_heads * head_dim]
  const float* v_cache;  // [n_ctx, n_kv_heads * head_dim]
  float* out;           // [n_tokens, n_heads * head_dim]
  int n_tokens;
  int pos0;
  int n_heads;
  int n_kv_heads;
  int head_dim;
};
void attention(ThreadPool& pool, const AttentionArgs& a);

}  // namespace ts::cpu
