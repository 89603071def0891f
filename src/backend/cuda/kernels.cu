// Element-wise and row kernels: embedding, RMSNorm (with the Q8 copy of its output),
// bias / residual adds, SiLU*up, the MoE residual, quantizers, and the random fills and
// routing of synthetic models.
#include "backend/cuda/kernels.cuh"

#include "backend/cuda/device_util.cuh"

namespace ts::cuda {
namespace {

__global__ void embed_kernel(const uint8_t* table, DType type, size_t row_bytes, const int* ids,
                             int d, float* x) {
  pdl_wait();
  const int t = blockIdx.y;
  const uint8_t* row = table + size_t(ids[t]) * row_bytes;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x) {
    float v;
    if (type == DType::kF32) v = reinterpret_cast<const float*>(row)[i];
    else if (type == DType::kBF16) v = bf16_bits(reinterpret_cast<const uint16_t*>(row)[i]);
    else v = f16_bits(reinterpret_cast<const uint16_t*>(row)[i]);
    x[size_t(t) * d + i] = v;
  }
}

// The thread's first kRmsPre norm weights are loaded before the wait (weights: no kernel
// writes them), overlapping the kernel before.
constexpr int kRmsPre = 4;

__global__ void rmsnorm_kernel(const float* x, const float* w, float* y, int cols, float eps,
                               QAct q) {
  float wr[kRmsPre];
#pragma unroll
  for (int u = 0; u < kRmsPre; ++u) {
    const int i = threadIdx.x + u * blockDim.x;
    wr[u] = i < cols ? w[i] : 0.0f;
  }
  pdl_wait();
  const float* xr = x + size_t(blockIdx.x) * cols;
  float* yr = y + size_t(blockIdx.x) * cols;
  float xv[kRmsPre];
  const float inv = block_rms_inv(xr, cols, eps, xv);
  const auto put = [&](int i, float xi, float wi) {
    const float v = xi * inv * wi;
    yr[i] = v;
    // A warp's lanes hold one whole Q8 block (blockDim and cols are multiples of 32).
    if (q.q) warp_quantize_q8(v, size_t(blockIdx.x) * cols + i, q);
  };
#pragma unroll
  for (int u = 0; u < kRmsPre; ++u) {
    const int i = threadIdx.x + u * blockDim.x;
    if (i < cols) put(i, xv[u], wr[u]);
  }
  for (int i = threadIdx.x + kRmsPre * blockDim.x; i < cols; i += blockDim.x) put(i, xr[i], w[i]);
}

__global__ void add_bias_kernel(float* y, const float* b, int64_t total, int dim) {
  pdl_wait();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] += b[i % dim];
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
  pdl_wait();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] += y[i];
}

__global__ void silu_mul_kernel(const float* g, const float* u, float* h, int64_t n) {
  pdl_wait();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    h[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

__global__ void moe_residual_kernel(float* x, const float* moe, const float* shared,
                                    const float* shared_z, int n, int d) {
  pdl_wait();
  const int64_t total = int64_t(n) * d;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    float tmp = moe[i];
    if (shared) {
      const float g = shared_z ? 1.0f / (1.0f + expf(-shared_z[i / d])) : 1.0f;
      tmp += g * shared[i];
    }
    x[i] += tmp;
  }
}

// One thread per 32-value block: d = max|x| / 127, q = round(x / d) (llama.cpp reference).
__global__ void quantize_q8_0_kernel(const float* x, uint8_t* out, int64_t n_blocks) {
  pdl_wait();
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < n_blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    const float* xb = x + b * 32;
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(xb[i]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t* ob = out + b * 34;
    // Blocks are 34 bytes apart: d is 2-byte aligned.
    *reinterpret_cast<uint16_t*>(ob) = __half_as_ushort(__float2half(d));
    for (int i = 0; i < 32; ++i) ob[2 + i] = uint8_t(int8_t(roundf(xb[i] * id)));
  }
}

// Activations as Q8 blocks: one thread per 32 values, d = max|x| / 127, q = round(x / d).
__global__ void quantize_act_kernel(const float* x, int8_t* q, float* d, int64_t n_blocks) {
  pdl_wait();
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < n_blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    const float4* xb = reinterpret_cast<const float4*>(x + b * 32);
    float v[32];
    float amax = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 f = xb[i];
      v[4 * i] = f.x;
      v[4 * i + 1] = f.y;
      v[4 * i + 2] = f.z;
      v[4 * i + 3] = f.w;
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
    const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
    d[b] = db;
    int32_t packed[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t w = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) w |= uint32_t(uint8_t(int8_t(__float2int_rn(v[4 * i + j] * id)))) << (8 * j);
      packed[i] = int32_t(w);
    }
    int4* qb = reinterpret_cast<int4*>(q + b * 32);
    qb[0] = make_int4(packed[0], packed[1], packed[2], packed[3]);
    qb[1] = make_int4(packed[4], packed[5], packed[6], packed[7]);
  }
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void fill_uniform_kernel(void* dst, DType type, int64_t n, float scale, uint64_t seed) {
  pdl_wait();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t z = mix64(seed * 0x9e3779b97f4a7c15ull + uint64_t(i));
    const float u = float(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    store_as(dst, type, size_t(i), (2.0f * u - 1.0f) * scale);
  }
}

// Random Q4_K blocks for synthetic weights: d = 2 * scale / (15 * 63), dmin = scale / 63,
// and random bytes for the packed 6-bit scales/mins and the nibbles, so every value lies in
// [-scale, 2 * scale].
__global__ void fill_q4k_kernel(uint8_t* dst, int64_t n_blocks, float scale, uint64_t seed) {
  pdl_wait();
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < n_blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    uint8_t* blk = dst + b * 144;
    const __half d = __float2half(2.0f * scale / (15.0f * 63.0f)), dmin = __float2half(scale / 63.0f);
    memcpy(blk, &d, 2);
    memcpy(blk + 2, &dmin, 2);
    for (int i = 0; i < 140; i += 4) {
      const uint32_t z = uint32_t(mix64(seed * 0x9e3779b97f4a7c15ull + uint64_t(b) * 64 + i));
      memcpy(blk + 4 + i, &z, 4);
    }
  }
}

// logits[t, e] = bias[e] + Gumbel noise from a hash of (seed, position, e): top-k of these is
// One token's routing by a RouterSpec other than plain softmax, by one thread, in
// model::select_experts' order of operations: scores (softmax or sigmoid), choice scores
// (+ bias), groups outside the topk_group best made ineligible, top_k by choice score (ties
// to the lower id, NaN last), weights = unbiased scores, renormalised (+1e-20 for sigmoid),
// times scale. Up to kMaxExperts experts in local memory; a MoE layer's few tokens.
__global__ void route_spec_kernel(RouteArgs a) {
  pdl_wait();
  const int t = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (t >= a.n) return;
  const int n = a.n_experts;
  const float* lg = a.logits + size_t(t) * n;
  float p[kMaxExperts], choice[kMaxExperts];
  bool taken[kMaxExperts];
  if (a.sigmoid) {
    for (int e = 0; e < n; ++e) p[e] = 1.0f / (1.0f + expf(-lg[e]));
  } else {
    float mx = -INFINITY, sum = 0;
    for (int e = 0; e < n; ++e) mx = fmaxf(mx, lg[e]);
    for (int e = 0; e < n; ++e) sum += p[e] = expf(lg[e] - mx);
    for (int e = 0; e < n; ++e) p[e] /= sum;
  }
  for (int e = 0; e < n; ++e) {
    choice[e] = p[e] + (a.bias ? a.bias[e] : 0.0f);
    taken[e] = false;
  }
  auto above = [](float x, int ix, float y, int iy) {
    if (isnan(y)) return !isnan(x) || ix < iy;
    if (isnan(x)) return false;
    return x > y || (x == y && ix < iy);
  };
  if (a.n_group > 1) {
    const int gs = n / a.n_group;
    float g_score[64];
    bool g_taken[64];
    for (int g = 0; g < a.n_group; ++g) {
      float first = -INFINITY, second = -INFINITY;
      for (int e = g * gs; e < (g + 1) * gs; ++e) {
        const float v = choice[e];
        if (v > first || isnan(v)) {
          second = first;
          first = v;
        } else if (v > second) {
          second = v;
        }
      }
      g_score[g] = a.group_max ? first : first + second;
      g_taken[g] = false;
    }
    for (int r = 0; r < a.topk_group; ++r) {
      int best = -1;
      for (int g = 0; g < a.n_group; ++g)
        if (!g_taken[g] && (best < 0 || above(g_score[g], g, g_score[best], best))) best = g;
      g_taken[best] = true;
    }
    for (int g = 0; g < a.n_group; ++g)
      if (!g_taken[g])
        for (int e = g * gs; e < (g + 1) * gs; ++e) taken[e] = true;
  }
  int* ids = a.ids + size_t(t) * a.top_k;
  float* w = a.weights + size_t(t) * a.top_k;
  float sum = 0;
  for (int r = 0; r < a.top_k; ++r) {
    int best = -1;
    for (int e = 0; e < n; ++e)
      if (!taken[e] && (best < 0 || above(choice[e], e, choice[best], best))) best = e;
    taken[best] = true;
    ids[r] = best;
    w[r] = p[best];
    sum += p[best];
    if (a.hist) atomicAdd(a.hist + best, 1ull);
  }
  if (a.sigmoid) sum += 1e-20f;
  for (int r = 0; r < a.top_k; ++r) {
    if (a.renormalize) w[r] /= sum;
    if (a.scale != 1.0f) w[r] *= a.scale;
  }
  if (a.host_ids) {
    for (int r = 0; r < a.top_k; ++r) a.host_ids[r] = ids[r];
    __threadfence_system();
    *reinterpret_cast<volatile int*>(a.host_flag) = 1;
  }
}

// a draw without replacement from softmax(bias), new for every position.
__global__ void synthetic_route_kernel(float* logits, const float* bias, const int* pos, int n,
                                       int n_experts, uint64_t seed) {
  pdl_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n * n_experts) return;
  const int t = i / n_experts, e = i % n_experts;
  const uint64_t z = mix64(seed * 0x9e3779b97f4a7c15ull +
                           (uint64_t(uint32_t(*pos + t)) << 20) + uint64_t(e));
  const float u = (float(z >> 40) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
  logits[i] = (bias ? bias[e] : 0.0f) - logf(-logf(u));
}

__global__ void fill_value_kernel(float* dst, int64_t n, float v) {
  pdl_wait();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = v;
}

// 1 where this build's kernels were compiled for sm_90 (the cluster kernels are empty below).
__global__ void cluster_probe_kernel(int* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  *out = 1;
#else
  *out = 0;
#endif
}

}  // namespace

cudaError_t kernel_image_status() {
  cudaFuncAttributes a{};
  return cudaFuncGetAttributes(&a, add_kernel);
}

// ---------------------------------------------------------------- host launchers

bool cluster_launch_available() {
  static const bool ok = [] {
    int dev = 0, cluster = 0, got = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&cluster, cudaDevAttrClusterLaunch, dev) != cudaSuccess || !cluster)
      return false;
    int* flag = nullptr;
    if (cudaMalloc(&flag, sizeof(int)) != cudaSuccess) return false;
    cluster_probe_kernel<<<1, 1>>>(flag);
    const bool copied = cudaMemcpy(&got, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
    cudaFree(flag);
    return copied && got == 1;
  }();
  return ok;
}

void quantize_act(const float* x, int64_t n, QAct out, cudaStream_t s) {
  launch_kernel(quantize_act_kernel, grid_for(n / 32), 256, 0, s, x, out.q, out.d, n / 32);
}

void embed_rows(const DevMatrix& table, const int* ids, int n, float* x, cudaStream_t s) {
  const dim3 grid(unsigned((table.cols + 255) / 256), unsigned(n));
  launch_kernel(embed_kernel, grid, 256, 0, s, static_cast<const uint8_t*>(table.data), table.dtype,
                                    table.row_bytes(), ids, int(table.cols), x);
}

void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int cols, float eps,
             cudaStream_t s, QAct q) {
  const int block = rmsnorm_block(cols);
  if (cols % 32 != 0) q = {};  // callers quantize only widths of whole blocks
  launch_kernel(rmsnorm_kernel, unsigned(rows), block, 0, s, x, w, y, cols, eps, q);
}

namespace {

// (v, i) ranks before (bv, bi): larger, or equal and earlier; bi < 0 is no candidate.
__device__ __forceinline__ bool pick_before(float v, int i, float bv, int bi) {
  return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

// The block's best (value, index) of its candidates; the result in thread 0.
__device__ __forceinline__ void block_best(float& bv, int& bi) {
  __shared__ float sv[32];
  __shared__ int si[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_down_sync(0xffffffffu, bv, o);
    const int oi = __shfl_down_sync(0xffffffffu, bi, o);
    if (pick_before(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (warp == 0) {
    const int warps = int(blockDim.x) / 32;
    bv = lane < warps ? sv[lane] : 0.0f;
    bi = lane < warps ? si[lane] : -1;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_down_sync(0xffffffffu, bv, o);
      const int oi = __shfl_down_sync(0xffffffffu, bi, o);
      if (pick_before(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
  }
}

__global__ void __launch_bounds__(256) greedy_pick_kernel(GreedyPick a) {
  pdl_wait();
  const int per = (a.vocab + int(gridDim.x) - 1) / int(gridDim.x);
  const int i0 = int(blockIdx.x) * per, i1 = min(a.vocab, i0 + per);
  float bv = 0.0f;
  int bi = -1;
  for (int i = i0 + int(threadIdx.x); i < i1; i += int(blockDim.x)) {
    const float v = a.logits[i];
    if (!isnan(v) && pick_before(v, i, bv, bi)) bv = v, bi = i;
  }
  block_best(bv, bi);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    a.part_v[blockIdx.x] = bv;
    a.part_i[blockIdx.x] = bi;
    __threadfence();
    last = atomicAdd(a.count, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  bv = 0.0f;
  bi = -1;
  for (int b = int(threadIdx.x); b < int(gridDim.x); b += int(blockDim.x)) {
    const float v = __ldcg(a.part_v + b);
    const int i = __ldcg(a.part_i + b);
    if (pick_before(v, i, bv, bi)) bv = v, bi = i;
  }
  block_best(bv, bi);
  if (threadIdx.x == 0) {
    const int id = bi < 0 || isnan(a.logits[0]) ? 0 : bi;
    *a.count = 0;
    a.tokens[0] = id;
    a.pos[0] += 1;
    const unsigned seq = *a.seq;
    *a.seq = seq + 1;
    a.ring[1 + int(seq % unsigned(a.ring_size))] = id;
    __threadfence_system();
    reinterpret_cast<volatile int*>(a.ring)[0] = int(seq + 1);
  }
}

}  // namespace

void add_bias(float* y, const float* b, int n, int dim, cudaStream_t s) {
  launch_kernel(add_bias_kernel, grid_for(int64_t(n) * dim), 256, 0, s, y, b, int64_t(n) * dim, dim);
}

void greedy_pick(const GreedyPick& a, cudaStream_t s) {
  launch_kernel(greedy_pick_kernel, kGreedyBlocks, 256, 0, s, a);
}

void add_inplace(float* x, const float* y, int64_t n, cudaStream_t s) {
  launch_kernel(add_kernel, grid_for(n), 256, 0, s, x, y, n);
}

void silu_mul(const float* g, const float* u, float* h, int64_t n, cudaStream_t s) {
  launch_kernel(silu_mul_kernel, grid_for(n), 256, 0, s, g, u, h, n);
}

void moe_residual(float* x, const float* moe, const float* shared, const float* shared_z, int n,
                  int d, cudaStream_t s) {
  launch_kernel(moe_residual_kernel, grid_for(int64_t(n) * d), 256, 0, s, x, moe, shared, shared_z, n, d);
}

void quantize_q8_0(const float* x, void* out, int64_t n, cudaStream_t s) {
  launch_kernel(quantize_q8_0_kernel, grid_for(n / 32), 256, 0, s, x, static_cast<uint8_t*>(out), n / 32);
}

void fill_uniform(void* dst, DType type, int64_t n, float scale, uint64_t seed, cudaStream_t s) {
  launch_kernel(fill_uniform_kernel, grid_for(n), 256, 0, s, dst, type, n, scale, seed);
}

void fill_q4_k_random(void* dst, int64_t n, float scale, uint64_t seed, cudaStream_t s) {
  const int64_t blocks = n / 256;
  launch_kernel(fill_q4k_kernel, grid_for(blocks), 256, 0, s, static_cast<uint8_t*>(dst), blocks, scale, seed);
}

void route_spec(const RouteArgs& a, cudaStream_t s) {
  launch_kernel(route_spec_kernel, unsigned((a.n + 31) / 32), 32, 0, s, a);
}

void synthetic_route(float* logits, const float* bias, const int* pos, int n, int n_experts,
                     uint64_t seed, cudaStream_t s) {
  const int total = n * n_experts;
  launch_kernel(synthetic_route_kernel, (total + 255) / 256, 256, 0, s, logits, bias, pos, n, n_experts, seed);
}

void fill_value(float* dst, int64_t n, float value, cudaStream_t s) {
  launch_kernel(fill_value_kernel, grid_for(n), 256, 0, s, dst, n, value);
}

}  // namespace ts::cuda
