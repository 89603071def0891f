// RoPE + KV append, and attention: decode split over the keys (by KV head or by query head)
// with a merge, the F32 tiled prefill kernel, and the tensor-core prefill kernel (flash
// attention 2 on mma.sync).
#include <climits>
#include <type_traits>

#include "backend/cuda/device_util.cuh"
#include "backend/cuda/kernels.cuh"

namespace ts::cuda {
namespace {

// grid (n, max(n_heads, n_kv_heads)), block head_dim / 2 threads. What no kernel of the step
// writes (the position, written before the step's first kernel; the frequencies and the norm
// weights) is read before the wait, with the angle computed from it; after the wait every
// input of the block (q, k and v) is loaded at once, so the block waits on one L2 round trip,
// not one per input and norm.
__global__ void rope_kv_kernel(RopeKvArgs a) {
  // Threads i >= half (the block is whole warps) only join the norm's reductions.
  const int t = blockIdx.x, h = blockIdx.y, half = a.head_dim / 2;
  const bool live = int(threadIdx.x) < half;
  const int i = live ? int(threadIdx.x) : 0;
  const int q_dim = a.n_heads * a.head_dim, kv_dim = a.n_kv_heads * a.head_dim;
  const bool is_q = h < a.n_heads, is_kv = h < a.n_kv_heads;
  const int position = *a.pos + t;
  // Partial RoPE (rot_dim < head_dim) turns pairs (j, j + rot_dim / 2) of the first rot_dim
  // values; this thread's pair (i, i + half) is then not a rotation pair (rotate_partial).
  const int rot_half = a.rot_dim > 0 && a.rot_dim < a.head_dim ? a.rot_dim / 2 : half;
  // transformers: freqs = position * inv_freq in float32, then cos/sin.
  const float freq = float(position) * (i < rot_half ? a.inv_freq[i] : 0.0f);
  const float c = float(cos(double(freq))), s = float(sin(double(freq)));
  const bool q_norm = is_q && a.q_norm, k_norm = is_kv && a.k_norm;
  const float qw0 = q_norm ? a.q_norm[i] : 0.0f, qw1 = q_norm ? a.q_norm[i + half] : 0.0f;
  const float kw0 = k_norm ? a.k_norm[i] : 0.0f, kw1 = k_norm ? a.k_norm[i + half] : 0.0f;
  pdl_wait();
  float* xh = a.q + size_t(t) * q_dim + size_t(h) * a.head_dim;
  const size_t src = size_t(t) * kv_dim + size_t(h) * a.head_dim;
  const size_t dst = size_t(position) * kv_dim + size_t(h) * a.head_dim;
  float q0 = 0.0f, q1 = 0.0f, k0 = 0.0f, k1 = 0.0f, v0 = 0.0f, v1 = 0.0f;
  if (is_q && live) {
    q0 = xh[i];
    q1 = xh[i + half];
  }
  if (is_kv && live) {
    k0 = a.k[src + i];
    k1 = a.k[src + i + half];
    v0 = a.v[src + i];
    v1 = a.v[src + i + half];
  }
  // Per-head RMSNorm (qwen3_moe) before the rotation: the block reduces its head's squares.
  __shared__ float part[32];
  auto head_norm = [&](float& x0, float& x1, float w0, float w1) {
    float ss = warp_sum(x0 * x0 + x1 * x1);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
    __syncthreads();
    float total = 0;
    for (int wi = 0; wi < int((blockDim.x + 31) / 32); ++wi) total += part[wi];
    __syncthreads();
    const float inv = rsqrtf(total / float(a.head_dim) + a.eps);
    x0 = x0 * inv * w0;
    x1 = x1 * inv * w1;
  };
  // Partial RoPE: the normed head goes through shared memory, each value meets its partner
  // there, and values past rot_dim pass unturned (r0 / r1 are then the outputs).
  __shared__ float head[2][kMaxHeadDim];
  auto rotate_partial = [&](int which, float x0, float x1, float& r0, float& r1) {
    if (live) {
      head[which][i] = x0;
      head[which][i + half] = x1;
    }
    __syncthreads();
    auto turned = [&](int e, float x) {
      if (e >= 2 * rot_half) return x;
      const int j = e < rot_half ? e : e - rot_half;
      const float f = float(position) * a.inv_freq[j];
      const float cj = float(cos(double(f))), sj = float(sin(double(f)));
      return e < rot_half ? x * cj - head[which][e + rot_half] * sj
                          : x * cj + head[which][e - rot_half] * sj;
    };
    r0 = turned(i, x0);
    r1 = turned(i + half, x1);
  };
  const bool partial = rot_half < half;
  if (is_q) {
    if (q_norm) head_norm(q0, q1, qw0, qw1);
    float r0 = q0 * c - q1 * s, r1 = q1 * c + q0 * s;
    if (partial) rotate_partial(0, q0, q1, r0, r1);
    if (live) {
      xh[i] = r0;
      xh[i + half] = r1;
    }
  }
  if (is_kv) {
    if (k_norm) head_norm(k0, k1, kw0, kw1);
    float r0 = k0 * c - k1 * s, r1 = k1 * c + k0 * s;
    if (partial) rotate_partial(1, k0, k1, r0, r1);
    if (live) {
      if (a.k_cache) {
        a.k_cache[dst + i] = r0;
        a.k_cache[dst + i + half] = r1;
        a.v_cache[dst + i] = v0;
        a.v_cache[dst + i + half] = v1;
      }
      if (a.k_bf16) {
        __nv_bfloat16* kb = static_cast<__nv_bfloat16*>(a.k_bf16);
        __nv_bfloat16* vb = static_cast<__nv_bfloat16*>(a.v_bf16);
        kb[dst + i] = __float2bfloat16_rn(r0);
        kb[dst + i + half] = __float2bfloat16_rn(r1);
        vb[dst + i] = __float2bfloat16_rn(v0);
        vb[dst + i + half] = __float2bfloat16_rn(v1);
      }
    }
  }
}

// grid (n_heads, n, n_splits), block 128: each warp runs an online softmax over its keys;
// the block merges its warps and writes (m, l, acc[head_dim]) for its split.
constexpr int kAttnWarps = 4;
constexpr int kPerLane = kMaxHeadDim / 32;

// The cache rows a kernel over element type T reads: the F32 cache or the BF16 one.
template <typename T>
__device__ __forceinline__ const T* kv_rows(const float* f32, const void* bf16) {
  if constexpr (std::is_same_v<T, float>)
    return f32;
  else
    return static_cast<const T*>(bf16);
}

template <typename T>
__global__ void attention_split_kernel(AttentionArgs a) {
  pdl_wait();
  const T* k_cache = kv_rows<T>(a.k_cache, a.k_bf16);
  const T* v_cache = kv_rows<T>(a.v_cache, a.v_bf16);
  const int h = blockIdx.x, t = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hd = a.head_dim, group = a.n_heads / a.n_kv_heads, g = h / group;
  const int kv_dim = a.n_kv_heads * hd;
  const int n_keys = *a.pos + t + 1;
  const int chunk = (n_keys + a.n_splits - 1) / a.n_splits;
  const int j0 = split * chunk, j1 = min(n_keys, j0 + chunk);
  const float scale = rsqrtf(float(hd));
  const float* qr = a.q + size_t(t) * a.n_heads * hd + size_t(h) * hd;
  float q[kPerLane], acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int dim = lane + 32 * i;
    q[i] = dim < hd ? qr[dim] : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  // Keys in groups of kBatch per warp: their loads and reductions are independent, so they
  // overlap instead of paying one memory round trip per key.
  constexpr int kBatch = 4;
  for (int j = j0 + warp * kBatch; j < j1; j += kAttnWarps * kBatch) {
    const int nk = min(kBatch, j1 - j);
    float s[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      s[b] = 0.0f;
      if (b < nk) {
        const T* k = k_cache + size_t(j + b) * kv_dim + size_t(g) * hd;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int dim = lane + 32 * i;
          if (dim < hd) s[b] += q[i] * kv_f32(k[dim]);
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int b = 0; b < kBatch; ++b) s[b] += __shfl_xor_sync(0xffffffffu, s[b], o);
    float m_new = m;
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      s[b] = b < nk ? s[b] * scale : -INFINITY;
      m_new = fmaxf(m_new, s[b]);
    }
    const float corr = expf(m - m_new);
    float p[kBatch];
    l *= corr;
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      p[b] = expf(s[b] - m_new);
      l += p[b];
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] *= corr;
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (b >= nk) break;
      const T* v = v_cache + size_t(j + b) * kv_dim + size_t(g) * hd;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int dim = lane + 32 * i;
        if (dim < hd) acc[i] += p[b] * kv_f32(v[dim]);
      }
    }
    m = m_new;
  }
  __shared__ float sm_m[kAttnWarps], sm_l[kAttnWarps];
  __shared__ float sm_acc[kAttnWarps][kMaxHeadDim];
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int dim = lane + 32 * i;
    if (dim < hd) sm_acc[warp][dim] = acc[i];
  }
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, sm_m[w]);
  float* out = a.partial + ((size_t(t) * a.n_heads + h) * a.n_splits + split) * (hd + 2);
  for (int dim = threadIdx.x; dim < hd; dim += blockDim.x) {
    float v = 0;
    for (int w = 0; w < kAttnWarps; ++w)
      if (sm_m[w] > -INFINITY) v += sm_acc[w][dim] * expf(sm_m[w] - M);
    out[2 + dim] = v;
  }
  if (threadIdx.x == 0) {
    float L = 0;
    for (int w = 0; w < kAttnWarps; ++w)
      if (sm_m[w] > -INFINITY) L += sm_l[w] * expf(sm_m[w] - M);
    out[0] = M;
    out[1] = L;
  }
}

// Decode attention by KV head: grid (n_kv_heads, n_splits, n), block min(group, 8) warps. A
// block takes the group of query heads sharing one KV head and a range of keys, and walks it
// in tiles of 32 keys staged once in shared memory (so K and V are read once per KV head, not
// once per query head). Lane j scores key j of the tile for each head of its warp (warp w of
// W owns heads w, w + W, ...), then the warp updates that head's online softmax and output
// (lane holds dims lane, lane + 32, ...). Writes (m, l, acc[head_dim]) per head and split for the merge.
// Splits take whole tiles, so short contexts leave later splits empty (m = -inf).
constexpr int kGqaTile = 32, kGqaMaxWarps = 8, kGqaMaxHeadsPerWarp = 4, kGqaPerLane = 4;  // head_dim <= 128

__host__ __device__ constexpr size_t gqa_smem_floats(int group, int hd) {
  return size_t(kGqaTile) * size_t(hd + 4) + size_t(kGqaTile) * size_t(hd) + size_t(group) * size_t(hd);
}

// One block's split of attention_gqa_kernel (KV head g, split `split` of n_splits, token t)
// over cache rows of type T (F32 or BF16, staged as such and widened where read): leaves
// (m, l, acc) of each of the warp's heads (warp w of W owns heads w, w + W, ...) in
// registers. smem: gqa_smem_floats(group, head_dim) floats (BF16 rows use less of it).
template <typename T>
__device__ __forceinline__ void gqa_split(const AttentionArgs& a, int g, int split, int n_splits,
                                          int t, float* smem, float (&m)[kGqaMaxHeadsPerWarp],
                                          float (&l)[kGqaMaxHeadsPerWarp],
                                          float (&acc)[kGqaMaxHeadsPerWarp][kGqaPerLane]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
  const int hd = a.head_dim, group = a.n_heads / a.n_kv_heads, kv_dim = a.n_kv_heads * hd;
  // Padded K row: lanes reading four elements of different keys miss banks (F32 rows of hd + 4
  // floats; BF16 rows of hd + 4 elements, 8-byte pieces: 16 lanes a phase on 32 banks).
  const int ks = hd + 4;
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + kGqaTile * ks;
  float* qs = reinterpret_cast<float*>(Vs + kGqaTile * hd);  // 16-byte aligned: hd % 4 == 0
  const T* k_cache = kv_rows<T>(a.k_cache, a.k_bf16);
  const T* v_cache = kv_rows<T>(a.v_cache, a.v_bf16);
  // Four elements at a time: 16-byte copies of F32, 8-byte copies of BF16.
  const auto copy4 = [](T* dst, const T* src) {
    if constexpr (sizeof(T) == 4)
      cp_async16(dst, src);
    else
      cp_async8(dst, src);
  };
  const auto zero4 = [](T* dst) {
    if constexpr (sizeof(T) == 4)
      *reinterpret_cast<float4*>(dst) = make_float4(0.f, 0.f, 0.f, 0.f);
    else
      *reinterpret_cast<uint2*>(dst) = make_uint2(0u, 0u);
  };
  const int n_keys = *a.pos + t + 1;
  const int per = (n_keys + n_splits - 1) / n_splits;
  const int chunk = (per + kGqaTile - 1) / kGqaTile * kGqaTile;
  const int j0 = split * chunk, j1 = min(n_keys, j0 + chunk);
  const float scale = rsqrtf(float(hd));
  const int h0 = g * group;
  // Tile keys [jt, jt + kGqaTile) in shared memory, keys past the split zero; only those in
  // [lo, hi) are read (the rest of the tile is written by the other call).
  const int hd4 = hd / 4;
  const auto stage = [&](int jt, int nk, int lo, int hi) {
    for (int i = threadIdx.x; i < kGqaTile * hd4; i += blockDim.x) {
      const int j = i / hd4, c4 = i % hd4;
      const bool in = j < nk && jt + j >= lo && jt + j < hi;
      if (j < nk && !in) continue;
      if (in) {
        const size_t at = size_t(jt + j) * kv_dim + size_t(g) * hd + size_t(c4) * 4;
        copy4(Ks + j * ks + c4 * 4, k_cache + at);
        copy4(Vs + j * hd + c4 * 4, v_cache + at);
      } else {
        zero4(Ks + j * ks + c4 * 4);
        zero4(Vs + j * hd + c4 * 4);
      }
    }
  };
  // The position is written before the step's first kernel, and keys before it by earlier
  // steps: the first tile's old keys are staged before the wait, overlapping the kernels
  // before (the step's own keys, written by rope_kv_append, after it). All copies are
  // asynchronous: the block reaches its wait at once, and after it the queries and the new
  // keys arrive in one round trip.
  const int old_keys = *a.pos;
  if (j0 < j1) stage(j0, min(kGqaTile, j1 - j0), 0, old_keys);
  pdl_wait();
  const float* q = a.q + size_t(t) * a.n_heads * hd + size_t(h0) * hd;
  if (j0 < j1)
    for (int i = threadIdx.x; i < group * hd4; i += blockDim.x) cp_async16(qs + 4 * i, q + 4 * i);
#pragma unroll
  for (int x = 0; x < kGqaMaxHeadsPerWarp; ++x) {
    m[x] = -INFINITY;
    l[x] = 0.0f;
#pragma unroll
    for (int i = 0; i < kGqaPerLane; ++i) acc[x][i] = 0.0f;
  }
  for (int jt = j0; jt < j1; jt += kGqaTile) {
    const int nk = min(kGqaTile, j1 - jt);
    if (jt == j0) {
      stage(jt, nk, old_keys, INT_MAX);  // the first tile's new keys
    } else {
      __syncthreads();  // the previous tile is no longer read
      stage(jt, nk, 0, INT_MAX);
    }
    cp_async_wait_all();
    __syncthreads();
#pragma unroll
    for (int x = 0; x < kGqaMaxHeadsPerWarp; ++x) {
      const int hh = warp + n_warps * x;
      if (hh >= group) break;
      const float4* q4 = reinterpret_cast<const float4*>(qs + hh * hd);
      const T* kr = Ks + lane * ks;
      float s = 0.0f;
#pragma unroll 8
      for (int c = 0; c < hd4; ++c) s += dot4(q4[c], kv_load4(kr + 4 * c));
      s = lane < nk ? s * scale : -INFINITY;
      float mt = s;
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
      const float m_new = fmaxf(m[x], mt);
      const float corr = expf(m[x] - m_new);
      const float p = lane < nk ? expf(s - m_new) : 0.0f;
      l[x] = l[x] * corr + warp_sum(p);
#pragma unroll
      for (int i = 0; i < kGqaPerLane; ++i) acc[x][i] *= corr;
#pragma unroll 4
      for (int j = 0; j < nk; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
        for (int i = 0; i < kGqaPerLane; ++i) {
          const int dim = lane + 32 * i;
          if (dim < hd) acc[x][i] += pj * kv_f32(Vs[j * hd + dim]);
        }
      }
      m[x] = m_new;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(32 * kGqaMaxWarps) attention_gqa_kernel(AttentionArgs a) {
  extern __shared__ float4 gqa_smem4[];
  const int g = blockIdx.x, split = blockIdx.y, t = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
  const int hd = a.head_dim, group = a.n_heads / a.n_kv_heads, h0 = g * group;
  float m[kGqaMaxHeadsPerWarp], l[kGqaMaxHeadsPerWarp], acc[kGqaMaxHeadsPerWarp][kGqaPerLane];
  gqa_split<T>(a, g, split, a.n_splits, t, reinterpret_cast<float*>(gqa_smem4), m, l, acc);
#pragma unroll
  for (int x = 0; x < kGqaMaxHeadsPerWarp; ++x) {
    const int hh = warp + n_warps * x;
    if (hh >= group) break;
    float* out = a.partial + ((size_t(t) * a.n_heads + h0 + hh) * a.n_splits + split) * (hd + 2);
#pragma unroll
    for (int i = 0; i < kGqaPerLane; ++i) {
      const int dim = lane + 32 * i;
      if (dim < hd) out[2 + dim] = acc[x][i];
    }
    if (lane == 0) {
      out[0] = m[x];
      out[1] = l[x];
    }
  }
}

// Decode attention of one token as one thread block cluster per KV head: grid (n_kv_heads,
// kClusterSplits), cluster (1, kClusterSplits), the block of attention_gqa_kernel. Block r of
// a cluster takes split r of kClusterSplits as attention_gqa_kernel does and leaves its
// (m, l, acc) in its shared memory; after a cluster barrier, block r merges heads r, r +
// kClusterSplits, ... of the group from all the cluster's blocks (distributed shared memory)
// as attention_merge_kernel does, and writes the output (and its Q8 copy): no partial rows
// through L2 and no merge launch. Up to kClusterSplits * 32 keys every split is one 32-key
// tile, as in the split path with more splits: the same sums in the same order, so the same
// bytes as attention_gqa_kernel + attention_merge_kernel. (More keys give longer splits:
// correct, but other sums.)
__host__ __device__ constexpr size_t gqa_cluster_smem_floats(int group, int hd) {
  return gqa_smem_floats(group, hd) + size_t(group) * size_t(hd + 2);
}
// The cluster kernel's shared memory may pass the 48 KiB default (set per launch); a step
// launches only 8 blocks per KV head (32 for 4 KV heads), so occupancy does not bound it.
constexpr size_t kGqaClusterMaxSmem = 96 * 1024;

template <typename T>
__global__ void __launch_bounds__(32 * kGqaMaxWarps) attention_gqa_cluster_kernel(AttentionArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ float4 gqa_smem4[];
  float* smem = reinterpret_cast<float*>(gqa_smem4);
  const int g = blockIdx.x, rank = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
  const int hd = a.head_dim, group = a.n_heads / a.n_kv_heads, h0 = g * group;
  float* mine = smem + gqa_smem_floats(group, hd);  // [group][m, l, acc[hd]]
  float m[kGqaMaxHeadsPerWarp], l[kGqaMaxHeadsPerWarp], acc[kGqaMaxHeadsPerWarp][kGqaPerLane];
  gqa_split<T>(a, g, rank, kClusterSplits, 0, smem, m, l, acc);
#pragma unroll
  for (int x = 0; x < kGqaMaxHeadsPerWarp; ++x) {
    const int hh = warp + n_warps * x;
    if (hh >= group) break;
    float* out = mine + size_t(hh) * (hd + 2);
#pragma unroll
    for (int i = 0; i < kGqaPerLane; ++i) {
      const int dim = lane + 32 * i;
      if (dim < hd) out[2 + dim] = acc[x][i];
    }
    if (lane == 0) {
      out[0] = m[x];
      out[1] = l[x];
    }
  }
  cluster_sync();
  // This block's heads of the group, each merged over the splits in order (as the merge).
  const float* part[kClusterSplits];
#pragma unroll
  for (int s = 0; s < kClusterSplits; ++s) part[s] = cluster_map(mine, s);
  const int my_heads = (group - rank + kClusterSplits - 1) / kClusterSplits;
  // hd % 32 == 0 where there is a Q8 copy: a warp's 32 items are one head's whole Q8 block.
  const int items = my_heads * hd, rounded = (items + 31) / 32 * 32;
  for (int i = threadIdx.x; i < rounded; i += blockDim.x) {
    const bool live = i < items;
    const int hh = rank + kClusterSplits * (live ? i / hd : 0), dim = live ? i % hd : 0;
    float ms[kClusterSplits], ls[kClusterSplits], vs[kClusterSplits];
#pragma unroll
    for (int s = 0; s < kClusterSplits; ++s) {
      const float* ps = part[s] + size_t(hh) * (hd + 2);
      ms[s] = ps[0];
      ls[s] = ps[1];
      vs[s] = ps[2 + dim];
    }
    // Splits past the last key are empty (m = -inf) and only trail.
    int used = kClusterSplits;
#pragma unroll
    for (int s = kClusterSplits - 1; s >= 0; --s)
      if (ms[s] == -INFINITY) used = s;
    float M = -INFINITY;
#pragma unroll
    for (int s = 0; s < kClusterSplits; ++s)
      if (s < used) M = fmaxf(M, ms[s]);
    float w[kClusterSplits];
#pragma unroll
    for (int s = 0; s < kClusterSplits; ++s) w[s] = s < used ? expf(ms[s] - M) : 0.0f;
    float L = 0;
#pragma unroll
    for (int s = 0; s < kClusterSplits; ++s)
      if (s < used) L += ls[s] * w[s];
    const float inv = 1.0f / L;
    float v = 0;
#pragma unroll
    for (int s = 0; s < kClusterSplits; ++s)
      if (s < used) v += vs[s] * w[s];
    v *= inv;
    const size_t at = size_t(h0 + hh) * hd + dim;
    if (live) a.out[at] = v;
    // With a Q8 copy hd % 32 == 0: items is whole warps, every lane live.
    if (a.out_q.q) warp_quantize_q8(v, at, a.out_q);
  }
  // No block leaves while another may still read its shared memory.
  cluster_sync();
#endif
}

// grid (n_heads, n), block 128, 2 * n_splits floats of dynamic shared memory: merges the
// splits. Everything is loaded at once, right after the wait: each split's (m, l) pair into
// shared memory, and each thread's output values of the first kMergePre splits into
// registers (72: the 66 splits of a decode over 4 KV heads; more, with fewer KV heads, are
// loaded in the sum). No loop waits on a load before issuing the next: a serial walk over 66
// splits was ~66 dependent L2 round trips, and 8 at a time still 8 (12 us a layer at 4,096
// keys in Nsight Compute; +3-4% decode there: docs/PERF.md). The sums run over s in order.
constexpr int kMergePre = 72;

__global__ void attention_merge_kernel(AttentionArgs a) {
  pdl_wait();
  extern __shared__ float merge_smem[];
  float* merge_w = merge_smem;               // [n_splits]: m_s, then exp(m_s - M)
  float* merge_l = merge_smem + a.n_splits;  // [n_splits]: l_s
  __shared__ int first_empty;
  __shared__ float warp_m[4];
  const int h = blockIdx.x, t = blockIdx.y, hd = a.head_dim, n_splits = a.n_splits;
  const float* part = a.partial + (size_t(t) * a.n_heads + h) * n_splits * (hd + 2);
  // This thread's first output dimension (head_dim <= blockDim: its only one).
  const int dim0 = threadIdx.x;
  float pre[kMergePre];
#pragma unroll
  for (int s = 0; s < kMergePre; ++s)
    pre[s] = s < n_splits && dim0 < hd ? part[s * (hd + 2) + 2 + dim0] : 0.0f;
  if (threadIdx.x == 0) first_empty = n_splits;
  __syncthreads();
  // Splits past the last key are empty (m = -inf) and only trail: the first one ends the list.
  // (head_dim is even, RoPE's pairs, so each split's (m, l) pair is 8-byte aligned.)
  for (int s = threadIdx.x; s < n_splits; s += blockDim.x) {
    const float2 ml = *reinterpret_cast<const float2*>(part + s * (hd + 2));
    merge_w[s] = ml.x;
    merge_l[s] = ml.y;
    if (ml.x == -INFINITY) atomicMin(&first_empty, s);
  }
  __syncthreads();
  const int used = first_empty;
  float M = -INFINITY;
  for (int s = threadIdx.x; s < used; s += blockDim.x) M = fmaxf(M, merge_w[s]);
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  if (threadIdx.x % 32 == 0) warp_m[threadIdx.x / 32] = M;
  __syncthreads();
  M = fmaxf(fmaxf(warp_m[0], warp_m[1]), fmaxf(warp_m[2], warp_m[3]));
  for (int s = threadIdx.x; s < used; s += blockDim.x) merge_w[s] = expf(merge_w[s] - M);
  __syncthreads();
  float L = 0;
#pragma unroll 8
  for (int s = 0; s < used; ++s) L += merge_l[s] * merge_w[s];
  const float inv = 1.0f / L;
  float* o = a.out + size_t(t) * a.n_heads * hd + size_t(h) * hd;
  for (int dim = dim0; dim < hd; dim += blockDim.x) {
    float v = 0;
    int s = 0;
    if (dim == dim0) {
#pragma unroll
      for (; s < kMergePre; ++s)
        if (s < used) v += pre[s] * merge_w[s];
      s = min(used, kMergePre);
    }
#pragma unroll 8
    for (; s < used; ++s) v += part[s * (hd + 2) + 2 + dim] * merge_w[s];
    v *= inv;
    o[dim] = v;
    // head_dim % 32 == 0 (attention() checks): a warp's lanes hold one whole Q8 block.
    if (a.out_q.q) warp_quantize_q8(v, size_t(t) * a.n_heads * hd + size_t(h) * hd + dim, a.out_q);
  }
}

// Prefill attention, tiled: a block takes kPrefillQ queries of one head and walks the keys
// in tiles of 32 through shared memory, so each key is read once per query tile (not once
// per query). Warp w owns queries w, w + 4, ...; lane j scores key j of the tile, then the
// warp updates its online softmax and output (lane holds dims lane, lane + 32, ...).
constexpr int kPrefillQ = 16, kPrefillK = 32, kPrefillHd = 128;

template <typename T>
__global__ void attention_prefill_kernel(AttentionArgs a) {
  pdl_wait();
  const T* k_cache = kv_rows<T>(a.k_cache, a.k_bf16);
  const T* v_cache = kv_rows<T>(a.v_cache, a.v_bf16);
  constexpr int kPer = kPrefillHd / 32, kRows = kPrefillQ / kAttnWarps;
  __shared__ __align__(16) float sq[kPrefillQ][kPrefillHd];
  // +4 floats per row: lanes read rows as float4 without bank conflicts.
  __shared__ __align__(16) float sk[kPrefillK][kPrefillHd + 4];
  __shared__ float sv[kPrefillK][kPrefillHd];
  const int h = blockIdx.x, t0 = blockIdx.y * kPrefillQ, hd = a.head_dim;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = h / (a.n_heads / a.n_kv_heads), kv_dim = a.n_kv_heads * hd, q_dim = a.n_heads * hd;
  const int pos0 = *a.pos, nq = min(kPrefillQ, a.n - t0);
  const float scale = rsqrtf(float(hd));
  for (int i = threadIdx.x; i < kPrefillQ * hd; i += blockDim.x) {
    const int qi = i / hd, dim = i % hd;
    sq[qi][dim] = qi < nq ? a.q[size_t(t0 + qi) * q_dim + size_t(h) * hd + dim] : 0.0f;
  }
  float m[kRows], l[kRows], acc[kRows][kPer];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) acc[r][i] = 0.0f;
  }
  const int last_key = pos0 + t0 + nq - 1;
  for (int k0 = 0; k0 <= last_key; k0 += kPrefillK) {
    __syncthreads();
    for (int i = threadIdx.x; i < kPrefillK * hd; i += blockDim.x) {
      const int kj = i / hd, dim = i % hd, kp = k0 + kj;
      const size_t at = size_t(kp) * kv_dim + size_t(g) * hd + dim;
      sk[kj][dim] = kp <= last_key ? kv_f32(k_cache[at]) : 0.0f;
      sv[kj][dim] = kp <= last_key ? kv_f32(v_cache[at]) : 0.0f;
    }
    __syncthreads();
    // Scores of the warp's queries against key k0 + lane; each key row read once.
    float s[kRows] = {};
    const float4* kr = reinterpret_cast<const float4*>(&sk[lane][0]);
    for (int d4 = 0; d4 < hd / 4; ++d4) {
      const float4 kv = kr[d4];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        s[r] += dot4(reinterpret_cast<const float4*>(&sq[warp + kAttnWarps * r][0])[d4], kv);
    }
    float p[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int qi = warp + kAttnWarps * r, qpos = pos0 + t0 + qi;
      const bool active = qi < nq && k0 <= qpos;  // warp-uniform
      p[r] = 0.0f;
      if (!active) continue;
      const float sc = k0 + lane <= qpos ? s[r] * scale : -INFINITY;
      float mt = sc;
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
      const float m_new = fmaxf(m[r], mt);
      const float corr = expf(m[r] - m_new);
      p[r] = expf(sc - m_new);
      l[r] = l[r] * corr + warp_sum(p[r]);
#pragma unroll
      for (int i = 0; i < kPer; ++i) acc[r][i] *= corr;
      m[r] = m_new;
    }
    for (int j = 0; j < kPrefillK; ++j) {
      float vv[kPer];
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int dim = lane + 32 * i;
        vv[i] = dim < hd ? sv[j][dim] : 0.0f;
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float pj = __shfl_sync(0xffffffffu, p[r], j);
#pragma unroll
        for (int i = 0; i < kPer; ++i) acc[r][i] += pj * vv[i];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int qi = warp + kAttnWarps * r;
    if (qi >= nq) continue;
    float* o = a.out + size_t(t0 + qi) * q_dim + size_t(h) * hd;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int dim = lane + 32 * i;
      if (dim < hd) o[dim] = acc[r][i] / l[r];
    }
  }
}

// A thread's two rows (lane / 4 and lane / 4 + 8 of an m16n8 C fragment) reduced over the
// quad of lanes holding their columns.
__device__ __forceinline__ void quad_max2(float& a, float& b) {
#pragma unroll
  for (int x = 1; x <= 2; x <<= 1) {
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, x));
    b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, x));
  }
}
__device__ __forceinline__ void quad_sum2(float& a, float& b) {
#pragma unroll
  for (int x = 1; x <= 2; x <<= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, x);
    b += __shfl_xor_sync(0xffffffffu, b, x);
  }
}

// One step of the online softmax (log2 domain) for a thread's two rows of N 8-key S
// fragments, already scaled and masked (-inf): s becomes the probabilities, (m, l) advance,
// and c0 / c1 are what the rows' outputs are rescaled by. A row with no key yet keeps
// m = -inf (it subtracts 0 then: its p are all 0).
template <int N>
__device__ __forceinline__ void softmax_step2(float (&s)[N][4], float& m0, float& m1, float& l0,
                                              float& l1, float& c0, float& c1) {
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    mx0 = fmaxf(fmaxf(mx0, s[j][0]), s[j][1]);
    mx1 = fmaxf(fmaxf(mx1, s[j][2]), s[j][3]);
  }
  quad_max2(mx0, mx1);
  const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
  const float u0 = n0 == -INFINITY ? 0.0f : n0, u1 = n1 == -INFINITY ? 0.0f : n1;
  c0 = exp2f(m0 - u0);
  c1 = exp2f(m1 - u1);
  m0 = n0;
  m1 = n1;
  float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    s[j][0] = exp2f(s[j][0] - u0);
    s[j][1] = exp2f(s[j][1] - u0);
    s[j][2] = exp2f(s[j][2] - u1);
    s[j][3] = exp2f(s[j][3] - u1);
    sum0 += s[j][0] + s[j][1];
    sum1 += s[j][2] + s[j][3];
  }
  l0 = l0 * c0 + sum0;
  l1 = l1 * c1 + sum1;
}

// Prefill attention on tensor cores, one pass (flash attention 2): BF16 mma.sync
// m16n8k16 with F32 accumulation. A block takes kFaQ queries of one head, 16 per warp, and
// walks the keys in tiles of kFaK copied from the BF16 cache into shared memory (cp.async, the
// next tile's keys while the current tile's P V computes). Scores, probabilities and
// the output stay in registers: a thread holds rows lane/4 and lane/4 + 8 of its warp's 16,
// the C fragment of S = Q K^T for two adjacent 8-key tiles is already the A fragment of P for
// P V, and the online softmax rescales O by row. Max and sum in the log2 domain (exp2f).
constexpr int kFaQ = 64, kFaK = 64, kFaHd = 128;
constexpr int kFaLd =
    kFaHd + 8;  // BF16 row stride of the Q / K / V tiles (ldmatrix: no bank conflicts)
constexpr size_t kFaSmem = size_t(kFaQ + 2 * kFaK) * kFaLd * 2;

// Rows [r0, r0 + rows) of a [*, stride] F32 matrix (the queries), columns [col0, col0 + HD),
// as BF16 in s[row][0..HD) (row stride kFaLd); rows past `valid` are zero. Every load of a
// thread is issued before the first is used (float4, fully unrolled): one memory latency.
template <int HD, int ROWS>
__device__ __forceinline__ void fa_stage(const float* src, size_t stride, int r0, int valid,
                                         size_t col0, __nv_bfloat16* s) {
  constexpr int kVec = ROWS * HD / 4, kPer = (kVec + 127) / 128;
  float4 v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = threadIdx.x + 128 * i, r = e / (HD / 4), c4 = e % (HD / 4);
    v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (e < kVec && r0 + r < valid)
      v[i] = *reinterpret_cast<const float4*>(src + size_t(r0 + r) * stride + col0 + size_t(c4) * 4);
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = threadIdx.x + 128 * i, r = e / (HD / 4), c4 = e % (HD / 4);
    if (e >= kVec) continue;
    __nv_bfloat162* d = reinterpret_cast<__nv_bfloat162*>(s + r * kFaLd + c4 * 4);
    d[0] = __floats2bfloat162_rn(v[i].x, v[i].y);
    d[1] = __floats2bfloat162_rn(v[i].z, v[i].w);
  }
}

template <int HD>
__global__ void __launch_bounds__(128, 3) attention_tc_kernel(AttentionArgs a) {
  pdl_wait();
  extern __shared__ __align__(128) unsigned char fa_smem[];
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(fa_smem);
  __nv_bfloat16* ks = qs + kFaQ * kFaLd;
  __nv_bfloat16* vs = ks + kFaK * kFaLd;
  constexpr int kSt = kFaK / 8, kOt = HD / 8;  // 8-column tiles of S and of O
  const int h = blockIdx.x;
  const int t0 = (gridDim.y - 1 - blockIdx.y) * kFaQ;  // the longest query tiles first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  const int grp = lane / 4, tig = lane % 4;
  const int g = h / (a.n_heads / a.n_kv_heads), kv_dim = a.n_kv_heads * HD, q_dim = a.n_heads * HD;
  const int pos0 = *a.pos, nq = min(kFaQ, a.n - t0), last_key = pos0 + t0 + nq - 1;
  const float scale2 = rsqrtf(float(HD)) * 1.4426950408889634f;  // log2(e) / sqrt(hd)
  fa_stage<HD, kFaQ>(a.q + size_t(t0) * q_dim, size_t(q_dim), 0, nq, size_t(h) * HD, qs);
  const int q_first = pos0 + t0 + r0;                  // the warp's first query position
  const int qpos0 = q_first + grp, qpos1 = qpos0 + 8;  // this thread's two rows
  const bool active = r0 < nq;
  float o[kOt][4];
#pragma unroll
  for (int j = 0; j < kOt; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // l: this thread's columns only
  // ldmatrix row addresses: lane supplies row lane % 8 of matrix lane / 8.
  const int mi = lane / 8, mr = lane % 8;
  // From the BF16 copies of the cache: cp.async of keys [k0, k0 + kFaK) of the group's head
  // into a tile, rows past last_key zero.
  const auto copy_tile = [&](const void* cache, int k0, __nv_bfloat16* tile) {
    constexpr int kPieces = kFaK * HD / 8;  // 16-byte pieces
#pragma unroll
    for (int i = 0; i < kPieces / 128; ++i) {
      const int c = threadIdx.x + 128 * i, r = c / (HD / 8), p = c % (HD / 8);
      const bool ok = k0 + r <= last_key;
      const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(cache) +
                                 (ok ? size_t(k0 + r) * kv_dim + size_t(g) * HD + p * 8 : 0);
      cp_async16_zfill(tile + r * kFaLd + p * 8, src, ok);
    }
    cp_async_commit();
  };
  copy_tile(a.k_bf16, 0, ks);
  for (int k0 = 0; k0 <= last_key; k0 += kFaK) {
    // Keys of this tile in; the previous tile's values no longer read: fetch this tile's
    // values while its scores compute.
    cp_async_wait_all();
    __syncthreads();
    copy_tile(a.v_bf16, k0, vs);
    // Whether any key of the tile is at or before the warp's queries.
    const bool work = active && k0 <= q_first + 15;
    float s[kSt][4];
    if (work) {
#pragma unroll
      for (int j = 0; j < kSt; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        unsigned qa[4];
        ldsm_x4(qa, qs + (r0 + (mi % 2) * 8 + mr) * kFaLd + kk * 16 + (mi / 2) * 8);
#pragma unroll
        for (int jj = 0; jj < kSt / 2; ++jj) {
          unsigned kb[4];
          ldsm_x4(kb, ks + (jj * 16 + (mi / 2) * 8 + mr) * kFaLd + kk * 16 + (mi % 2) * 8);
          mma_bf16(s[2 * jj], qa, kb[0], kb[1]);
          mma_bf16(s[2 * jj + 1], qa, kb[2], kb[3]);
        }
      }
      // Scale, mask (keys after the row's position), then the softmax step.
      const bool masked = k0 + kFaK - 1 > q_first;
#pragma unroll
      for (int j = 0; j < kSt; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int key = k0 + j * 8 + tig * 2 + c;
          s[j][c] = masked && key > qpos0 ? -INFINITY : s[j][c] * scale2;
          s[j][2 + c] = masked && key > qpos1 ? -INFINITY : s[j][2 + c] * scale2;
        }
      }
      float c0, c1;
      softmax_step2(s, m0, m1, l0, l1, c0, c1);
#pragma unroll
      for (int j = 0; j < kOt; ++j) {
        o[j][0] *= c0;
        o[j][1] *= c0;
        o[j][2] *= c1;
        o[j][3] *= c1;
      }
    }  // work
    // Values in; the keys no longer read: fetch the next tile's keys during P V.
    cp_async_wait_all();
    __syncthreads();
    if (k0 + kFaK <= last_key) copy_tile(a.k_bf16, k0 + kFaK, ks);
    if (!work) continue;
      // O += P V: the S fragments of keys [16 kk, 16 kk + 16) are P's A fragment.
#pragma unroll
    for (int kk = 0; kk < kFaK / 16; ++kk) {
      const unsigned pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]),
                              pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int jj = 0; jj < kOt / 2; ++jj) {
        unsigned vb[4];
        ldsm_x4_trans(vb, vs + (kk * 16 + (mi % 2) * 8 + mr) * kFaLd + jj * 16 + (mi / 2) * 8);
        mma_bf16(o[2 * jj], pa, vb[0], vb[1]);
        mma_bf16(o[2 * jj + 1], pa, vb[2], vb[3]);
      }
    }
  }
  if (!active) return;
  quad_sum2(l0, l1);
  const float i0 = 1.0f / l0, i1 = 1.0f / l1;
  const int row0 = r0 + grp, row1 = row0 + 8;
#pragma unroll
  for (int j = 0; j < kOt; ++j) {
    const int dim = j * 8 + tig * 2;
    if (row0 < nq)
      *reinterpret_cast<float2*>(a.out + size_t(t0 + row0) * q_dim + size_t(h) * HD + dim) =
          make_float2(o[j][0] * i0, o[j][1] * i0);
    if (row1 < nq)
      *reinterpret_cast<float2*>(a.out + size_t(t0 + row1) * q_dim + size_t(h) * HD + dim) =
          make_float2(o[j][2] * i1, o[j][3] * i1);
  }
}

// One token's attention by KV head on tensor cores (decode over the BF16 copies of the
// cache, for models whose weights are not F32 — the numerics of attention_tc_kernel): grid
// (n_kv_heads, n_splits), block 4 warps. The group's query heads (at most 16) are the rows of
// an m16n8k16 tile, so a warp scores 16 keys for all of them in 16 MMAs (head dim 128) where
// the CUDA-core kernel spends a warp per head and a shuffle per key. A block walks its split in
// tiles of kTdK keys, warp w taking keys [16 w, 16 w + 16) of each with its own online softmax
// (log2 domain, as the prefill kernel); the warps then meet in shared memory and the block
// writes (m, l, acc[head_dim]) per head for attention_merge_kernel (m in the natural log domain,
// as the CUDA-core kernel's). The first tile's old keys are copied before the wait.
constexpr int kTdK = 64, kTdRows = 16;

template <int HD>
constexpr size_t td_smem_bytes() {
  return size_t(kTdRows + 2 * kTdK) * (HD + 8) * 2;
}

// Split `split` of KV head g: (m, l, acc[HD]) of the group's head r at rows + r * row_stride.
template <int HD>
__device__ __forceinline__ void tc_decode_split(const AttentionArgs& a, int g, int split,
                                                unsigned char* td_smem, float* rows,
                                                size_t row_stride) {
  constexpr int kLd = HD + 8, kOt = HD / 8;
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(td_smem);
  __nv_bfloat16* ks = qs + kTdRows * kLd;
  __nv_bfloat16* vs = ks + kTdK * kLd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / 4, tig = lane % 4;
  const int mi = lane / 8, mr = lane % 8;  // ldmatrix: lane supplies row mr of matrix mi
  const int group = a.n_heads / a.n_kv_heads, kv_dim = a.n_kv_heads * HD, h0 = g * group;
  const int old_keys = *a.pos, n_keys = old_keys + 1;
  const int per = (n_keys + a.n_splits - 1) / a.n_splits;
  const int chunk = (per + kTdK - 1) / kTdK * kTdK;
  const int j0 = split * chunk, j1 = min(n_keys, j0 + chunk);
  const float scale2 = rsqrtf(float(HD)) * 1.4426950408889634f;  // log2(e) / sqrt(hd)
  // Keys [k0, k0 + kTdK) of the KV head into a tile: those in [lo, hi) copied, keys past the
  // split zero, the others left to the other call.
  const auto copy_tile = [&](const void* cache, int k0, __nv_bfloat16* tile, int lo, int hi) {
    constexpr int kPieces = kTdK * HD / 8;  // 16-byte pieces
#pragma unroll
    for (int i = 0; i < kPieces / 128; ++i) {
      const int c = threadIdx.x + 128 * i, r = c / (HD / 8), p = c % (HD / 8);
      const int key = k0 + r;
      const bool ok = key < j1 && key >= lo && key < hi;
      if (key < j1 && !ok) continue;
      const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(cache) +
                                 (ok ? size_t(key) * kv_dim + size_t(g) * HD + p * 8 : 0);
      cp_async16_zfill(tile + r * kLd + p * 8, src, ok);
    }
  };
  if (j0 < j1) {
    copy_tile(a.k_bf16, j0, ks, 0, old_keys);
    copy_tile(a.v_bf16, j0, vs, 0, old_keys);
  }
  pdl_wait();
  // The group's queries as BF16 rows (rows past the group zero), and the new key and value.
  {
    constexpr int kVec = kTdRows * HD / 4, kPer = kVec / 128;
    float4 v[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = threadIdx.x + 128 * i, r = e / (HD / 4), c4 = e % (HD / 4);
      v[i] = r < group ? *reinterpret_cast<const float4*>(a.q + size_t(h0 + r) * HD + c4 * 4)
                       : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = threadIdx.x + 128 * i, r = e / (HD / 4), c4 = e % (HD / 4);
      __nv_bfloat162* d = reinterpret_cast<__nv_bfloat162*>(qs + r * kLd + c4 * 4);
      d[0] = __floats2bfloat162_rn(v[i].x, v[i].y);
      d[1] = __floats2bfloat162_rn(v[i].z, v[i].w);
    }
  }
  if (j0 < j1) {
    copy_tile(a.k_bf16, j0, ks, old_keys, INT_MAX);
    copy_tile(a.v_bf16, j0, vs, old_keys, INT_MAX);
  }
  cp_async_commit();
  float o[kOt][4];
#pragma unroll
  for (int j = 0; j < kOt; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // l: this thread's columns only
  unsigned qa[HD / 16][4];
  for (int k0 = j0; k0 < j1; k0 += kTdK) {
    if (k0 != j0) {
      __syncthreads();  // the previous tile is no longer read
      copy_tile(a.k_bf16, k0, ks, 0, INT_MAX);
      copy_tile(a.v_bf16, k0, vs, 0, INT_MAX);
      cp_async_commit();
    }
    cp_async_wait_all();
    __syncthreads();
    if (k0 == j0) {
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk)
        ldsm_x4(qa[kk], qs + ((mi % 2) * 8 + mr) * kLd + kk * 16 + (mi / 2) * 8);
    }
    const int kw = k0 + 16 * warp;  // the warp's first key
    if (kw >= j1) continue;
    float s[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      unsigned kb[4];
      ldsm_x4(kb, ks + (16 * warp + (mi / 2) * 8 + mr) * kLd + kk * 16 + (mi % 2) * 8);
      mma_bf16(s[0], qa[kk], kb[0], kb[1]);
      mma_bf16(s[1], qa[kk], kb[2], kb[3]);
    }
    // Scale, keys past the split out, then the softmax step (the warp's first key is live, so
    // every row's maximum is finite).
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const bool live = kw + j * 8 + tig * 2 + c < j1;
        s[j][c] = live ? s[j][c] * scale2 : -INFINITY;
        s[j][2 + c] = live ? s[j][2 + c] * scale2 : -INFINITY;
      }
    float c0, c1;
    softmax_step2(s, m0, m1, l0, l1, c0, c1);
    // O += P V: the S fragments of the warp's 16 keys are P's A fragment.
    const unsigned pa[4] = {pack_bf16(s[0][0], s[0][1]), pack_bf16(s[0][2], s[0][3]),
                            pack_bf16(s[1][0], s[1][1]), pack_bf16(s[1][2], s[1][3])};
#pragma unroll
    for (int jj = 0; jj < kOt / 2; ++jj) {
      o[2 * jj][0] *= c0;
      o[2 * jj][1] *= c0;
      o[2 * jj][2] *= c1;
      o[2 * jj][3] *= c1;
      o[2 * jj + 1][0] *= c0;
      o[2 * jj + 1][1] *= c0;
      o[2 * jj + 1][2] *= c1;
      o[2 * jj + 1][3] *= c1;
      unsigned vb[4];
      ldsm_x4_trans(vb, vs + (16 * warp + (mi % 2) * 8 + mr) * kLd + jj * 16 + (mi / 2) * 8);
      mma_bf16(o[2 * jj], pa, vb[0], vb[1]);
      mma_bf16(o[2 * jj + 1], pa, vb[2], vb[3]);
    }
  }
  quad_sum2(l0, l1);
  // The warps meet: (m, l) per row and O per row and dim, in the tiles' shared memory.
  __syncthreads();
  float* wml = reinterpret_cast<float*>(ks);  // [4 warps][16 rows][2]
  float* wo = wml + 4 * kTdRows * 2;          // [4 warps][16 rows][HD]
  if (tig == 0) {
    wml[(warp * kTdRows + grp) * 2] = m0;
    wml[(warp * kTdRows + grp) * 2 + 1] = l0;
    wml[(warp * kTdRows + grp + 8) * 2] = m1;
    wml[(warp * kTdRows + grp + 8) * 2 + 1] = l1;
  }
#pragma unroll
  for (int j = 0; j < kOt; ++j) {
    const int dim = j * 8 + tig * 2;
    *reinterpret_cast<float2*>(wo + (warp * kTdRows + grp) * HD + dim) =
        make_float2(o[j][0], o[j][1]);
    *reinterpret_cast<float2*>(wo + (warp * kTdRows + grp + 8) * HD + dim) =
        make_float2(o[j][2], o[j][3]);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * HD; i += 128) {
    const int r = i / HD, dim = i % HD;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) M = fmaxf(M, wml[(w * kTdRows + r) * 2]);
    float L = 0.0f, acc = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float mw = wml[(w * kTdRows + r) * 2];
      if (mw == -INFINITY) continue;  // a warp without keys
      const float e = exp2f(mw - M);
      L += wml[(w * kTdRows + r) * 2 + 1] * e;
      acc += wo[(w * kTdRows + r) * HD + dim] * e;
    }
    // An empty split (no keys): m = -inf, l = 0, as the CUDA-core kernel's.
    float* out = rows + size_t(r) * row_stride;
    out[2 + dim] = acc;
    if (dim == 0) {
      out[0] = M == -INFINITY ? -INFINITY : M * 0.6931471805599453f;  // to the natural log
      out[1] = L;
    }
  }
}

// (The partial rows' address passed in, not computed inside: 168 registers instead of 180, so
// three blocks fit an SM.)
template <int HD>
__global__ void __launch_bounds__(128) attention_tc_decode_kernel(AttentionArgs a) {
  extern __shared__ __align__(128) unsigned char td_smem[];
  const int g = blockIdx.x, split = blockIdx.y, h0 = g * (a.n_heads / a.n_kv_heads);
  tc_decode_split<HD>(a, g, split, td_smem,
                      a.partial + (size_t(h0) * a.n_splits + split) * (HD + 2),
                      size_t(a.n_splits) * (HD + 2));
}

}  // namespace

// ---------------------------------------------------------------- host launchers

void rope_kv_append(const RopeKvArgs& a, cudaStream_t s) {
  const dim3 grid(unsigned(a.n), unsigned(std::max(a.n_heads, a.n_kv_heads)));
  launch_kernel(rope_kv_kernel, grid, unsigned((a.head_dim / 2 + 31) / 32 * 32), 0, s, a);
}

bool gqa_attention_applies(int n_heads, int n_kv_heads, int head_dim) {
  // Head dims in whole float4s up to 128 (the per-lane registers), at most 32 query heads per
  // KV head (4 per warp of 8), and shared memory within the default 48 KiB.
  if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0 || head_dim % 4 != 0 || head_dim > 128) return false;
  const int group = n_heads / n_kv_heads;
  return group <= kGqaMaxWarps * kGqaMaxHeadsPerWarp && gqa_smem_floats(group, head_dim) * 4 <= 48 * 1024;
}

bool tc_decode_attention_applies(int n_heads, int n_kv_heads, int head_dim) {
  static const bool off = [] {
    const char* e = std::getenv("TURBOSPARK_CUDA_DECODE_TC");
    return e && std::string_view(e) == "0";
  }();
  return !off && (head_dim == 64 || head_dim == 128) && n_kv_heads > 0 &&
         n_heads % n_kv_heads == 0 && n_heads / n_kv_heads <= kTdRows;
}

bool cluster_attention_available() {
  static const bool off = [] {
    const char* e = std::getenv("TURBOSPARK_CUDA_ATTN_CLUSTER");
    return e && std::string_view(e) == "0";
  }();
  return !off && cluster_launch_available();
}

bool cluster_attention_applies(int n_heads, int n_kv_heads, int head_dim) {
  if (!gqa_attention_applies(n_heads, n_kv_heads, head_dim)) return false;
  const int group = n_heads / n_kv_heads;
  return gqa_cluster_smem_floats(group, head_dim) * 4 <= kGqaClusterMaxSmem &&
         cluster_attention_available();
}

void attention(const AttentionArgs& args, cudaStream_t s) {
  AttentionArgs a = args;
  // The Q8 copy of the output (args.out_q): written by the merge where the heads are whole Q8
  // blocks, else by a quantize_act launch after the kernel.
  const bool bf16 = a.k_bf16 != nullptr;
  if (bf16) a.k_cache = a.v_cache = nullptr;  // one cache type: the BF16 rows when given
  if (bf16 && a.n >= kTcAttentionMin && (a.head_dim == 64 || a.head_dim == 128)) {
    // Per device, so set at every launch (a host-side call); a failure shows at the launch.
    const auto kernel = a.head_dim == 64 ? attention_tc_kernel<64> : attention_tc_kernel<128>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kFaSmem));
    a.out_q = {};
    launch_kernel(kernel, dim3(unsigned(a.n_heads), unsigned((a.n + kFaQ - 1) / kFaQ)), 128, kFaSmem, s, a);
  } else if (a.n > 1 && a.head_dim <= kPrefillHd && a.head_dim % 4 == 0) {
    a.out_q = {};
    launch_kernel(bf16 ? attention_prefill_kernel<__nv_bfloat16> : attention_prefill_kernel<float>,
                  dim3(unsigned(a.n_heads), unsigned((a.n + kPrefillQ - 1) / kPrefillQ)),
                  32 * kAttnWarps, 0, s, a);
  } else {
    if (a.head_dim % 32 != 0) a.out_q = {};
    if (a.cluster && a.n == 1 && cluster_attention_applies(a.n_heads, a.n_kv_heads, a.head_dim)) {
      const int group = a.n_heads / a.n_kv_heads;
      const auto kernel =
          bf16 ? attention_gqa_cluster_kernel<__nv_bfloat16> : attention_gqa_cluster_kernel<float>;
      const size_t smem = gqa_cluster_smem_floats(group, a.head_dim) * 4;
      // Past the 48 KiB default (groups of 16 at head dim 128: Qwen3-235B-A22B's 64 query
      // heads on 4 KV heads). Per device, so set at every launch (a host-side call).
      if (smem > 48 * 1024)
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
      launch_cluster_kernel(kernel, dim3(unsigned(a.n_kv_heads), unsigned(kClusterSplits)),
                            32 * std::min(group, kGqaMaxWarps), smem,
                            dim3(1, unsigned(kClusterSplits)), s, a);
      if (args.out_q.q && !a.out_q.q)
        quantize_act(a.out, int64_t(a.n_heads) * a.head_dim, args.out_q, s);
      return;
    }
    if (a.n == 1 && bf16 && tc_decode_attention_applies(a.n_heads, a.n_kv_heads, a.head_dim)) {
      const auto kernel =
          a.head_dim == 64 ? attention_tc_decode_kernel<64> : attention_tc_decode_kernel<128>;
      const size_t smem = a.head_dim == 64 ? td_smem_bytes<64>() : td_smem_bytes<128>();
      launch_kernel(kernel, dim3(unsigned(a.n_kv_heads), unsigned(a.n_splits)), 128, smem, s, a);
    } else if (gqa_attention_applies(a.n_heads, a.n_kv_heads, a.head_dim)) {
      const int group = a.n_heads / a.n_kv_heads;
      const size_t smem = gqa_smem_floats(group, a.head_dim) * 4;
      launch_kernel(bf16 ? attention_gqa_kernel<__nv_bfloat16> : attention_gqa_kernel<float>,
                    dim3(unsigned(a.n_kv_heads), unsigned(a.n_splits), unsigned(a.n)),
                    32 * std::min(group, kGqaMaxWarps), smem, s, a);
    } else {
      launch_kernel(bf16 ? attention_split_kernel<__nv_bfloat16> : attention_split_kernel<float>,
                    dim3(unsigned(a.n_heads), unsigned(a.n), unsigned(a.n_splits)), 32 * kAttnWarps,
                    0, s, a);
    }
    launch_kernel(attention_merge_kernel, dim3(unsigned(a.n_heads), unsigned(a.n)), 128,
                  size_t(a.n_splits) * 8, s, a);
  }
  if (args.out_q.q && !a.out_q.q)
    quantize_act(a.out, int64_t(a.n) * a.n_heads * a.head_dim, args.out_q, s);
}

}  // namespace ts::cuda
