// CPU element-wise and attention ops of the forward pass. Each has the obvious scalar
// definition written out; they are a small share of the time next to the matrix kernels
// (kernels.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/dtype.h"

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

// Rotates the first `dim` values after `offset` in each of n_heads heads of x (heads
// `head_stride` floats apart) for one position: pairs (i, i + dim/2) (transformers'
// rotate_half) or, interleaved, (2i, 2i + 1); pair i turns by position * inv_freq[i], with
// cos and sin multiplied by attention_factor (YaRN's mscale; 1 otherwise).
struct RopeTable {
  int head_stride = 0;
  int offset = 0;
  int dim = 0;
  bool interleaved = false;
  float attention_factor = 1.0f;
  std::span<const float> inv_freq;  // [dim / 2]
};
void rope_apply(float* x, int n_heads, const RopeTable& rope, int position);

// h[i] = silu(g[i]) * u[i]
void silu_mul(const float* g, const float* u, float* h, int64_t n);

// gpt-oss's clamped SwiGLU, as transformers' GptOssExperts._apply_gate: with g = min(g[i],
// limit) and u = clamp(u[i], -limit, limit), h[i] = (u + 1) * (g * sigmoid(alpha * g)).
void clamped_swiglu(const float* g, const float* u, float* h, int64_t n, float limit, float alpha);

// Where a sequence's cache rows lie: position j is row blocks[j / block_tokens] *
// block_tokens + j % block_tokens of the cache (a paged KV cache), or row j when blocks is
// null (one contiguous range).
struct KvRows {
  const int* blocks = nullptr;
  int block_tokens = 0;
  size_t row(int j) const {
    if (!blocks) return size_t(j);
    return size_t(blocks[j / block_tokens]) * size_t(block_tokens) + size_t(j % block_tokens);
  }
};

// Causal grouped-query attention for n_tokens queries at positions pos0 .. pos0+n_tokens-1,
// over a cache whose rows for positions 0 .. pos0+n_tokens-1 are filled. The query at p sees
// keys j <= p, and with a window only those with p - j < window. With sinks, head h's softmax
// takes sinks[h] as one more logit in its denominator, whose share no value receives:
// p_j = exp(s_j - m) / (sum_i exp(s_i - m) + exp(sinks[h] - m)), m the max over both. Each
// query's result depends only on it and its keys: the same bits whatever else a call holds.
struct AttentionArgs {
  const float* q;       // [n_tokens, n_heads * head_dim]
  const float* k_cache;  // rows of n_kv_heads * head_dim, placed by `rows`
  const float* v_cache;  // rows of n_kv_heads * head_dim, placed by `rows`
  KvRows rows;
  float* out;           // [n_tokens, n_heads * head_dim]
  int n_tokens;
  int pos0;
  int n_heads;
  int n_kv_heads;
  int head_dim;
  float scale;          // of q.k before the softmax
  int window = 0;       // > 0: a sliding window of that many keys (the query's own included)
  std::span<const float> sinks = {};  // [n_heads], or empty: no sink
};
void attention(ThreadPool& pool, const AttentionArgs& a);

// Multi-head latent attention (DeepSeek MLA) in the absorbed form, causal, for n_tokens
// queries at positions pos0 .. pos0+n_tokens-1 over a latent cache whose rows 0 ..
// pos0+n_tokens-1 are filled. Per head h, with W_UK_h / W_UV_h the nope_dim / v_dim rows of
// kv_b that belong to it: q_lat = W_UK_h^T q_nope, score_j = (q_lat . c_j + q_rope . k_j) *
// scale, out = W_UV_h (sum_j p_j c_j). Only the cache is read per position; each kv_b row
// is converted to F32 once per call. Bit-identical for any thread count (one head per job).
struct MlaArgs {
  const float* q;       // [n_tokens, n_heads * (nope_dim + rope_dim)], rope part rotated
  const float* cache;   // rows of kv_lora_rank + rope_dim: latent c_j, then rotated key k_j
  KvRows rows;          // where position j's row lies
  const void* kv_b;     // [n_heads * (nope_dim + v_dim), kv_lora_rank] in kv_b_dtype
  DType kv_b_dtype;
  float* out;           // [n_tokens, n_heads * v_dim]
  int n_tokens;
  int pos0;
  int n_heads;
  int nope_dim;
  int rope_dim;
  int v_dim;
  int kv_lora_rank;
  float scale;
};
void mla_attention(ThreadPool& pool, const MlaArgs& a);

// Gated DeltaNet's token mixing (model::DeltaNetSpec) over one sequence's n tokens, in
// order, from the state its earlier tokens left (zeros at the start), which it updates:
//   x = SiLU(causal depthwise conv of q|k|v over the conv state and the new rows);
//   per value head h (key head h / (n_v_heads / n_k_heads)): q, k L2-normalised (eps 1e-6),
//   q / sqrt(k_dim); decay = exp(-exp(a_log) * softplus(a + dt_bias)), beta = sigmoid(b);
//   S *= decay; S += k (beta (v - S^T k))^T; out = S^T q.
// One thread per channel (the conv) and per head (the rule): the same bits on any pool.
struct DeltaNetArgs {
  const float* qkv;      // [n, conv_dim]: q | k | v rows before the conv
  const float* b;        // [n, n_v_heads]
  const float* a;        // [n, n_v_heads]
  const float* conv;     // [conv_dim, kernel] taps
  const float* a_log;    // [n_v_heads]
  const float* dt_bias;  // [n_v_heads]
  float* conv_state;     // [conv_dim, kernel - 1]: each channel's last inputs, oldest first
  float* state;          // [n_v_heads, k_dim, v_dim]
  float* x;              // [n, conv_dim] scratch: the conv's output
  float* out;            // [n, n_v_heads * v_dim]
  int n;
  int n_k_heads, n_v_heads, k_dim, v_dim, kernel;
};
void gated_delta_net(ThreadPool& pool, const DeltaNetArgs& a);

}  // namespace ts::cpu
