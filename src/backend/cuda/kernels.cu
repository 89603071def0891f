#include "backend/cuda/kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdlib>
#include <string_view>
#include <utility>

namespace ts::cuda {
namespace {

// ---------------------------------------------------------------- device helpers

// Programmatic dependent launch (sm_90): every kernel is launched with
// programmaticStreamSerializationAllowed, so the next kernel in the stream (or graph) is
// scheduled while this one finishes instead of after; each kernel's first statement,
// pdl_wait(), blocks until the kernels before it have completed and their writes are
// visible, then lets the next one launch. Every kernel calls it, so the ordering is as
// strict as a plain stream's (completion is transitive: no kernel completes before its
// predecessor). TURBOSPARK_CUDA_PDL=0 launches plainly (to measure what it saves).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

bool pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("TURBOSPARK_CUDA_PDL");
    return !(e && std::string_view(e) == "0");
  }();
  return on;
}

template <class... P, class... A>
void launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                   A&&... args) {
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  // An error stays the runtime's last error, which the session checks after the step.
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

__device__ __forceinline__ float bf16_bits(uint32_t h) { return __uint_as_float(h << 16); }
__device__ __forceinline__ float f16_bits(uint32_t h) {
  return __half2float(__ushort_as_half(uint16_t(h)));
}

__host__ __device__ __forceinline__ size_t dtype_row_bytes_dev(DType t, int64_t cols) {
  switch (t) {
    case DType::kF32: return size_t(cols) * 4;
    case DType::kF16:
    case DType::kBF16: return size_t(cols) * 2;
    case DType::kQ8_0: return size_t(cols / 32) * 34;
    case DType::kQ4_K: return size_t(cols / 256) * 144;
  }
  return 0;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Eight BF16 / F16 weights (one 16-byte load) as F32, in column order.
template <DType T>
__device__ __forceinline__ void unpack8(uint4 raw, float wf[8]) {
  const uint32_t u[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (T == DType::kBF16) {
      wf[2 * i] = bf16_bits(u[i] & 0xffffu);
      wf[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    } else {
      wf[2 * i] = f16_bits(u[i] & 0xffffu);
      wf[2 * i + 1] = f16_bits(u[i] >> 16);
    }
  }
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
  return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// 6-bit scale and min of sub-block j of a Q4_K block (llama.cpp get_scale_min_k4).
__device__ __forceinline__ void q4k_scale_min(const uint8_t* sc, int j, float* s, float* m) {
  if (j < 4) {
    *s = float(sc[j] & 63);
    *m = float(sc[j + 4] & 63);
  } else {
    *s = float((sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4));
    *m = float((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
  }
}

constexpr int kRowWarps = 4;  // warps per block in the row kernels

// acc[t] += d * sum(q[i] * x[t][i]) over one Q8_0 block (f16 d, int8 qs[32]) at blk;
// xb[t * cols] is the block's first activation of token t (16-byte aligned).
template <int NT>
__device__ __forceinline__ void q8_0_block_dot(const uint16_t* blk, const float* xb, int cols,
                                               int nt, float (&acc)[NT]) {
  const float d = f16_bits(blk[0]);
  float wq[32];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const uint16_t v = blk[1 + i];
    wq[2 * i] = float(int8_t(v & 0xff));
    wq[2 * i + 1] = float(int8_t(v >> 8));
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
    if (t < nt) {
      const float4* xv = reinterpret_cast<const float4*>(xb + size_t(t) * cols);
      float sum = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        sum += dot4(make_float4(wq[4 * i], wq[4 * i + 1], wq[4 * i + 2], wq[4 * i + 3]), xv[i]);
      acc[t] += d * sum;
    }
}

// Blocks are 34 bytes: a lane reading its own block would issue 2-byte loads 34 bytes apart.
// Instead the warp copies blocks [b0, b0 + nbt) (nbt <= 64) of the row into its shared tile
// with coalesced 16-byte loads (rows of a multiple of 256 columns are 16-byte aligned), and
// lanes then compute on whole blocks from the tile.
//
// The copies are cp.async (global -> shared without registers): all of a warp's 16-byte
// pieces are in flight at once, rather than each load waiting for the store before it.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// 16 bytes, or 16 zero bytes when !valid (gmem is then not read).
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(n));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Starts the warp's copy of `bytes` (a multiple of 16; both ends 16-byte aligned) to dst.
__device__ __forceinline__ void warp_copy_async(uint8_t* dst, const uint8_t* src, int bytes,
                                                int lane) {
  for (int i = lane * 16; i < bytes; i += 32 * 16) cp_async16(dst + i, src + i);
}

// Waits for the warp's copies and makes them visible to all its lanes.
__device__ __forceinline__ void warp_copy_wait() {
  cp_async_wait_all();
  __syncwarp();
}

__device__ __forceinline__ const uint8_t* q8_0_tile(const uint8_t* row, int b0, int nbt,
                                                    int lane) {
  __shared__ __align__(16) uint8_t tiles[kRowWarps][64 * 34];
  uint8_t* tile = tiles[threadIdx.x / 32];
  __syncwarp();  // the previous tile is no longer read
  warp_copy_async(tile, row + size_t(b0) * 34, nbt * 34, lane);
  warp_copy_wait();
  return tile;
}

// One warp's share of acc[t] += row . x[t] for t < nt. x rows are `cols` floats apart and
// 16-byte aligned; every lane ends with a partial sum (reduce with warp_sum).
template <DType T, int NT>
__device__ __forceinline__ void row_dot(const uint8_t* row, const float* x, int cols, int nt,
                                        float (&acc)[NT], int lane) {
  if constexpr (T == DType::kF32) {
    const float* w = reinterpret_cast<const float*>(row);
    if ((cols & 3) == 0) {
#pragma unroll 4
      for (int c = lane * 4; c < cols; c += 128) {
        const float4 wv = __ldg(reinterpret_cast<const float4*>(w + c));
#pragma unroll
        for (int t = 0; t < NT; ++t)
          if (t < nt) acc[t] += dot4(wv, *reinterpret_cast<const float4*>(x + size_t(t) * cols + c));
      }
    } else {
      for (int c = lane; c < cols; c += 32) {
        const float wv = __ldg(w + c);
#pragma unroll
        for (int t = 0; t < NT; ++t)
          if (t < nt) acc[t] += wv * x[size_t(t) * cols + c];
      }
    }
  } else if constexpr (T == DType::kBF16 || T == DType::kF16) {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
    if ((cols & 7) == 0) {
#pragma unroll 4
      for (int c = lane * 8; c < cols; c += 256) {
        float wf[8];
        unpack8<T>(__ldg(reinterpret_cast<const uint4*>(w + c)), wf);
#pragma unroll
        for (int t = 0; t < NT; ++t)
          if (t < nt) {
            const float4* xv = reinterpret_cast<const float4*>(x + size_t(t) * cols + c);
            acc[t] += dot4(make_float4(wf[0], wf[1], wf[2], wf[3]), xv[0]) +
                      dot4(make_float4(wf[4], wf[5], wf[6], wf[7]), xv[1]);
          }
      }
    } else {
      for (int c = lane; c < cols; c += 32) {
        const float wv = T == DType::kBF16 ? bf16_bits(w[c]) : f16_bits(w[c]);
#pragma unroll
        for (int t = 0; t < NT; ++t)
          if (t < nt) acc[t] += wv * x[size_t(t) * cols + c];
      }
    }
  } else if constexpr (T == DType::kQ8_0) {
    const int nb = cols / 32;
    if ((cols & 255) == 0) {
      for (int b0 = 0; b0 < nb; b0 += 64) {
        const int nbt = min(64, nb - b0);
        const uint8_t* tile = q8_0_tile(row, b0, nbt, lane);
        for (int b = lane; b < nbt; b += 32)
          q8_0_block_dot<NT>(reinterpret_cast<const uint16_t*>(tile + b * 34),
                             x + (b0 + b) * 32, cols, nt, acc);
      }
      return;
    }
    for (int b = lane; b < nb; b += 32)
      q8_0_block_dot<NT>(reinterpret_cast<const uint16_t*>(row + size_t(b) * 34), x + b * 32,
                         cols, nt, acc);
  } else if constexpr (T == DType::kQ4_K) {
    // One 32-weight sub-block per lane per step: w = d * sc * q - dmin * m.
    const int nsb = cols / 32;
    for (int sb = lane; sb < nsb; sb += 32) {
      const uint8_t* blk = row + size_t(sb / 8) * 144;
      const int j = sb % 8;
      const uint16_t* dd = reinterpret_cast<const uint16_t*>(blk);
      float sc, mn;
      q4k_scale_min(blk + 4, j, &sc, &mn);
      const float d = f16_bits(__ldg(dd)) * sc, dmin = f16_bits(__ldg(dd + 1)) * mn;
      const uint32_t* qs = reinterpret_cast<const uint32_t*>(blk + 16 + 32 * (j / 2));
      const int shift = 4 * (j & 1);
      float wq[32];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t v = __ldg(qs + i) >> shift;
#pragma unroll
        for (int b = 0; b < 4; ++b) wq[4 * i + b] = float((v >> (8 * b)) & 15u);
      }
#pragma unroll
      for (int t = 0; t < NT; ++t)
        if (t < nt) {
          const float4* xv = reinterpret_cast<const float4*>(x + size_t(t) * cols + sb * 32);
          float sq = 0, sx = 0;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float4 xi = xv[i];
            sq += dot4(make_float4(wq[4 * i], wq[4 * i + 1], wq[4 * i + 2], wq[4 * i + 3]), xi);
            sx += xi.x + xi.y + xi.z + xi.w;
          }
          acc[t] += d * sq - dmin * sx;
        }
    }
  }
}

// acc[t] += row . x[t] for Q8_0 weights and Q8 activations (xq int8 [t][cols], xd one scale
// per 32 values): per block d_w * d_x * sum(q_w * q_x), the integer sum by dp4a. Rows are
// staged through a shared tile as in row_dot; precondition cols % 256 == 0.
// Blocks [b0, b0 + nbt) of a row staged at `tile` (block b0 first): the lane's blocks
// b0 + lane, b0 + lane + 32, ... in that order.
template <int NT>
__device__ __forceinline__ void q8q8_tile_dot(const uint8_t* tile, int b0, int nbt,
                                              const int8_t* xq, const float* xd, int cols, int nt,
                                              float (&acc)[NT], int lane) {
  const int nb = cols / 32;
  for (int b = lane; b < nbt; b += 32) {
    const uint16_t* blk = reinterpret_cast<const uint16_t*>(tile + b * 34);
    const float dw = f16_bits(blk[0]);
    int w32[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w32[i] = int(uint32_t(blk[1 + 2 * i]) | uint32_t(blk[2 + 2 * i]) << 16);
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (t < nt) {
        const int4* xv = reinterpret_cast<const int4*>(xq + size_t(t) * cols + (b0 + b) * 32);
        const int4 x0 = xv[0], x1 = xv[1];
        int s = __dp4a(w32[0], x0.x, 0);
        s = __dp4a(w32[1], x0.y, s);
        s = __dp4a(w32[2], x0.z, s);
        s = __dp4a(w32[3], x0.w, s);
        s = __dp4a(w32[4], x1.x, s);
        s = __dp4a(w32[5], x1.y, s);
        s = __dp4a(w32[6], x1.z, s);
        s = __dp4a(w32[7], x1.w, s);
        acc[t] += dw * xd[size_t(t) * nb + b0 + b] * float(s);
      }
  }
}

template <int NT>
__device__ __forceinline__ void row_dot_q8q8(const uint8_t* row, const int8_t* xq,
                                             const float* xd, int cols, int nt, float (&acc)[NT],
                                             int lane) {
  const int nb = cols / 32;
  for (int b0 = 0; b0 < nb; b0 += 64) {
    const int nbt = min(64, nb - b0);
    q8q8_tile_dot<NT>(q8_0_tile(row, b0, nbt, lane), b0, nbt, xq, xd, cols, nt, acc, lane);
  }
}

// Rows staged whole by the MoE kernels: up to this many bytes per warp (8 down rows of 1,024
// columns, or a gate and an up row of 4,096), all copies in flight at once. Same lane order
// as row_dot_q8q8, so the same sums to the bit.
constexpr int kStagedBytes = 8 * 1088;

// row . x for any weight type; Q8_0 rows take the Q8 activations (xq, xd) when given.
template <DType T, int NT>
__device__ __forceinline__ void row_dot_any(const uint8_t* row, const float* x, const int8_t* xq,
                                            const float* xd, int cols, int nt,
                                            float (&acc)[NT], int lane) {
  if constexpr (T == DType::kQ8_0) {
    if (xq) {
      row_dot_q8q8<NT>(row, xq, xd, cols, nt, acc, lane);
      return;
    }
  }
  row_dot<T, NT>(row, x, cols, nt, acc, lane);
}

// ---------------------------------------------------------------- kernels

constexpr int kWarps = kRowWarps;

// Up to three matrices of one dtype and width in one launch (q, k, v): rows are numbered
// across the parts, each part writes its own output.
struct GemvParams {
  const uint8_t* w[3];
  int64_t rows[3];
  float* y[3];
  int parts;
  int64_t total_rows;
  size_t row_bytes;
  int cols;
  const float* x;
  const int8_t* xq;  // x as Q8 blocks (Q8_0 weights only), or null
  const float* xd;
  int n;
  bool accumulate;
};

template <DType T, int NT>
__global__ void gemv_kernel(GemvParams p) {
  pdl_wait();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t r = int64_t(blockIdx.x) * kWarps + warp;
  if (r >= p.total_rows) return;
  int part = 0;
  while (part + 1 < p.parts && r >= p.rows[part]) r -= p.rows[part++];
  const int t0 = blockIdx.y * NT;
  const int nt = min(NT, p.n - t0);
  float acc[NT] = {};
  row_dot_any<T, NT>(p.w[part] + size_t(r) * p.row_bytes, p.x + size_t(t0) * p.cols,
                     p.xq ? p.xq + size_t(t0) * p.cols : nullptr,
                     p.xd ? p.xd + size_t(t0) * (p.cols / 32) : nullptr, p.cols, nt, acc, lane);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float v = warp_sum(acc[t]);
    if (lane == 0 && t < nt) {
      float* y = p.y[part] + size_t(t0 + t) * size_t(p.rows[part]) + size_t(r);
      *y = p.accumulate ? *y + v : v;
    }
  }
}

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

// Value v at index `at` of a row being quantized, where the calling warp's 32 lanes hold
// one whole Q8 block (at = block start + lane): the block's bytes exactly as
// quantize_act_kernel writes them.
__device__ __forceinline__ void warp_quantize_q8(float v, size_t at, QAct q) {
  float amax = fabsf(v);
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
  q.q[at] = int8_t(__float2int_rn(v * id));
  if (at % 32 == 0) q.d[at / 32] = db;
}

__global__ void rmsnorm_kernel(const float* x, const float* w, float* y, int cols, float eps,
                               QAct q) {
  pdl_wait();
  const float* xr = x + size_t(blockIdx.x) * cols;
  float* yr = y + size_t(blockIdx.x) * cols;
  float ss = 0;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) ss += xr[i] * xr[i];
  __shared__ float part[32];
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.0f;
    v = warp_sum(v);
    if (threadIdx.x == 0) part[0] = v;
  }
  __syncthreads();
  const float inv = rsqrtf(part[0] / float(cols) + eps);
  for (int i = threadIdx.x; i < cols; i += blockDim.x) {
    const float v = xr[i] * inv * w[i];
    yr[i] = v;
    // A warp's lanes hold one whole Q8 block (blockDim and cols are multiples of 32).
    if (q.q) warp_quantize_q8(v, size_t(blockIdx.x) * cols + i, q);
  }
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

// grid (n, max(n_heads, n_kv_heads)), block head_dim / 2 threads.
__global__ void rope_kv_kernel(RopeKvArgs a) {
  pdl_wait();
  // Threads i >= half (the block is whole warps) only join the norm's reductions.
  const int t = blockIdx.x, h = blockIdx.y, half = a.head_dim / 2;
  const bool live = int(threadIdx.x) < half;
  const int i = live ? int(threadIdx.x) : 0;
  const int q_dim = a.n_heads * a.head_dim, kv_dim = a.n_kv_heads * a.head_dim;
  const int position = *a.pos + t;
  // transformers: freqs = position * inv_freq in float32, then cos/sin.
  const float freq = float(position) * a.inv_freq[i];
  const float c = float(cos(double(freq))), s = float(sin(double(freq)));
  // Per-head RMSNorm (qwen3_moe) before the rotation: the block reduces its head's squares.
  __shared__ float part[32];
  auto head_norm = [&](float& x0, float& x1, const float* w) {
    float ss = warp_sum(x0 * x0 + x1 * x1);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
    __syncthreads();
    float total = 0;
    for (int wi = 0; wi < int((blockDim.x + 31) / 32); ++wi) total += part[wi];
    __syncthreads();
    const float inv = rsqrtf(total / float(a.head_dim) + a.eps);
    x0 = x0 * inv * w[i];
    x1 = x1 * inv * w[i + half];
  };
  if (h < a.n_heads) {
    float* xh = a.q + size_t(t) * q_dim + size_t(h) * a.head_dim;
    float x0 = live ? xh[i] : 0.0f, x1 = live ? xh[i + half] : 0.0f;
    if (a.q_norm) head_norm(x0, x1, a.q_norm);
    if (live) {
      xh[i] = x0 * c - x1 * s;
      xh[i + half] = x1 * c + x0 * s;
    }
  }
  if (h < a.n_kv_heads) {
    const size_t src = size_t(t) * kv_dim + size_t(h) * a.head_dim;
    const size_t dst = size_t(position) * kv_dim + size_t(h) * a.head_dim;
    float x0 = live ? a.k[src + i] : 0.0f, x1 = live ? a.k[src + i + half] : 0.0f;
    if (a.k_norm) head_norm(x0, x1, a.k_norm);
    if (live) {
      const float k0 = x0 * c - x1 * s, k1 = x1 * c + x0 * s;
      const float v0 = a.v[src + i], v1 = a.v[src + i + half];
      a.k_cache[dst + i] = k0;
      a.k_cache[dst + i + half] = k1;
      a.v_cache[dst + i] = v0;
      a.v_cache[dst + i + half] = v1;
      if (a.k_bf16) {
        __nv_bfloat16* kb = static_cast<__nv_bfloat16*>(a.k_bf16);
        __nv_bfloat16* vb = static_cast<__nv_bfloat16*>(a.v_bf16);
        kb[dst + i] = __float2bfloat16_rn(k0);
        kb[dst + i + half] = __float2bfloat16_rn(k1);
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

__global__ void attention_split_kernel(AttentionArgs a) {
  pdl_wait();
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
        const float* k = a.k_cache + size_t(j + b) * kv_dim + size_t(g) * hd;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int dim = lane + 32 * i;
          if (dim < hd) s[b] += q[i] * k[dim];
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
      const float* v = a.v_cache + size_t(j + b) * kv_dim + size_t(g) * hd;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int dim = lane + 32 * i;
        if (dim < hd) acc[i] += p[b] * v[dim];
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

__global__ void __launch_bounds__(32 * kGqaMaxWarps) attention_gqa_kernel(AttentionArgs a) {
  pdl_wait();
  extern __shared__ float4 gqa_smem4[];
  float* smem = reinterpret_cast<float*>(gqa_smem4);
  const int g = blockIdx.x, split = blockIdx.y, t = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
  const int hd = a.head_dim, group = a.n_heads / a.n_kv_heads, kv_dim = a.n_kv_heads * hd;
  const int ks = hd + 4;  // padded K row: lanes reading float4s of different keys miss banks
  float* Ks = smem;
  float* Vs = Ks + kGqaTile * ks;
  float* qs = Vs + kGqaTile * hd;
  const int n_keys = *a.pos + t + 1;
  const int per = (n_keys + a.n_splits - 1) / a.n_splits;
  const int chunk = (per + kGqaTile - 1) / kGqaTile * kGqaTile;
  const int j0 = split * chunk, j1 = min(n_keys, j0 + chunk);
  const float scale = rsqrtf(float(hd));
  const int h0 = g * group;
  for (int i = threadIdx.x; i < group * hd; i += blockDim.x)
    qs[i] = a.q[size_t(t) * a.n_heads * hd + size_t(h0) * hd + i];
  float m[kGqaMaxHeadsPerWarp], l[kGqaMaxHeadsPerWarp], acc[kGqaMaxHeadsPerWarp][kGqaPerLane];
#pragma unroll
  for (int x = 0; x < kGqaMaxHeadsPerWarp; ++x) {
    m[x] = -INFINITY;
    l[x] = 0.0f;
#pragma unroll
    for (int i = 0; i < kGqaPerLane; ++i) acc[x][i] = 0.0f;
  }
  const int hd4 = hd / 4;
  for (int jt = j0; jt < j1; jt += kGqaTile) {
    const int nk = min(kGqaTile, j1 - jt);
    __syncthreads();  // the previous tile is no longer read (and q is written, first time)
    for (int i = threadIdx.x; i < kGqaTile * hd4; i += blockDim.x) {
      const int j = i / hd4, c4 = i % hd4;
      float4 kv4 = make_float4(0.f, 0.f, 0.f, 0.f), vv4 = kv4;
      if (j < nk) {
        const size_t at = size_t(jt + j) * kv_dim + size_t(g) * hd;
        kv4 = reinterpret_cast<const float4*>(a.k_cache + at)[c4];
        vv4 = reinterpret_cast<const float4*>(a.v_cache + at)[c4];
      }
      reinterpret_cast<float4*>(Ks + j * ks)[c4] = kv4;
      reinterpret_cast<float4*>(Vs + j * hd)[c4] = vv4;
    }
    __syncthreads();
#pragma unroll
    for (int x = 0; x < kGqaMaxHeadsPerWarp; ++x) {
      const int hh = warp + n_warps * x;
      if (hh >= group) break;
      const float4* q4 = reinterpret_cast<const float4*>(qs + hh * hd);
      const float4* k4 = reinterpret_cast<const float4*>(Ks + lane * ks);
      float s = 0.0f;
#pragma unroll 8
      for (int c = 0; c < hd4; ++c) s += dot4(q4[c], k4[c]);
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
          if (dim < hd) acc[x][i] += pj * Vs[j * hd + dim];
        }
      }
      m[x] = m_new;
    }
  }
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

// grid (n_heads, n), block 128, n_splits floats of dynamic shared memory: merges the splits.
// The splits' (m, l) are read by all threads at once and the weights exp(m_s - M) kept in
// shared memory, so no loop waits on a load before issuing the next (a serial walk over 66
// splits was ~66 dependent L2 round trips); the sums still run over s in order, as before.
__global__ void attention_merge_kernel(AttentionArgs a) {
  pdl_wait();
  extern __shared__ float merge_w[];  // [n_splits]: m_s, then exp(m_s - M)
  __shared__ int first_empty;
  __shared__ float warp_m[4];
  const int h = blockIdx.x, t = blockIdx.y, hd = a.head_dim, n_splits = a.n_splits;
  const float* part = a.partial + (size_t(t) * a.n_heads + h) * n_splits * (hd + 2);
  if (threadIdx.x == 0) first_empty = n_splits;
  __syncthreads();
  // Splits past the last key are empty (m = -inf) and only trail: the first one ends the list.
  for (int s = threadIdx.x; s < n_splits; s += blockDim.x) {
    const float ms = part[s * (hd + 2)];
    merge_w[s] = ms;
    if (ms == -INFINITY) atomicMin(&first_empty, s);
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
  for (int s = 0; s < used; ++s) L += part[s * (hd + 2) + 1] * merge_w[s];
  const float inv = 1.0f / L;
  float* o = a.out + size_t(t) * a.n_heads * hd + size_t(h) * hd;
  for (int dim = threadIdx.x; dim < hd; dim += blockDim.x) {
    float v = 0;
#pragma unroll 8
    for (int s = 0; s < used; ++s) v += part[s * (hd + 2) + 2 + dim] * merge_w[s];
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

__global__ void attention_prefill_kernel(AttentionArgs a) {
  pdl_wait();
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
      sk[kj][dim] = kp <= last_key ? a.k_cache[at] : 0.0f;
      sv[kj][dim] = kp <= last_key ? a.v_cache[at] : 0.0f;
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

// Prefill attention on tensor cores, one pass (flash attention 2): BF16 mma.sync
// m16n8k16 with F32 accumulation. A block takes kFaQ queries of one head, 16 per warp, and
// walks the keys in tiles of kFaK staged as BF16 in shared memory. Scores, probabilities and
// the output stay in registers: a thread holds rows lane/4 and lane/4 + 8 of its warp's 16,
// the C fragment of S = Q K^T for two adjacent 8-key tiles is already the A fragment of P for
// P V, and the online softmax rescales O by row. Max and sum in the log2 domain (exp2f).
constexpr int kFaQ = 64, kFaK = 64, kFaHd = 128;
constexpr int kFaLd =
    kFaHd + 8;  // BF16 row stride of the Q / K / V tiles (ldmatrix: no bank conflicts)
constexpr size_t kFaSmem = size_t(kFaQ + 2 * kFaK) * kFaLd * 2;

// Rows [r0, r0 + rows) of a [*, stride] F32 matrix, columns [col0, col0 + HD), as BF16 in
// s[row][0..HD) (row stride kFaLd); rows past `valid` are zero. Every load of a thread is
// issued before the first is used (float4, fully unrolled), so a tile costs one memory latency.
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

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
// d += a b: 16x16 (row) x 16x8 (col), BF16 in, F32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

// kAsync: keys and values from the BF16 copies of the cache by cp.async (AttentionArgs).
template <int HD, bool kAsync>
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
  if constexpr (kAsync) copy_tile(a.k_bf16, 0, ks);
  for (int k0 = 0; k0 <= last_key; k0 += kFaK) {
    if constexpr (kAsync) {
      // Keys of this tile in; the previous tile's values no longer read: fetch this tile's
      // values while its scores compute.
      cp_async_wait_all();
      __syncthreads();
      copy_tile(a.v_bf16, k0, vs);
    } else {
      __syncthreads();  // the previous tile is no longer read
      const size_t base = size_t(k0) * kv_dim;
      // In halves: 8 float4 loads in flight per thread, so the loads do not hold the registers
      // the output needs (3 blocks per SM).
#pragma unroll
      for (int r = 0; r < kFaK; r += kFaK / 2) {
        fa_stage<HD, kFaK / 2>(a.k_cache + base, size_t(kv_dim), r, last_key + 1 - k0,
                               size_t(g) * HD, ks + r * kFaLd);
        fa_stage<HD, kFaK / 2>(a.v_cache + base, size_t(kv_dim), r, last_key + 1 - k0,
                               size_t(g) * HD, vs + r * kFaLd);
      }
      __syncthreads();
    }
    // Whether any key of the tile is at or before the warp's queries.
    const bool work = active && k0 <= q_first + 15;
    if (!kAsync && !work) continue;
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
      // Scale, mask (keys after the row's position), row maxima over the quad.
      const bool masked = k0 + kFaK - 1 > q_first;
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < kSt; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int key = k0 + j * 8 + tig * 2 + c;
          s[j][c] = masked && key > qpos0 ? -INFINITY : s[j][c] * scale2;
          s[j][2 + c] = masked && key > qpos1 ? -INFINITY : s[j][2 + c] * scale2;
          mx0 = fmaxf(mx0, s[j][c]);
          mx1 = fmaxf(mx1, s[j][2 + c]);
        }
      }
#pragma unroll
      for (int x = 1; x <= 2; x <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
      }
      const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
      // A row with no key yet keeps m = -inf: subtract 0 then (its p are all 0).
      const float u0 = n0 == -INFINITY ? 0.0f : n0, u1 = n1 == -INFINITY ? 0.0f : n1;
      const float c0 = exp2f(m0 - u0), c1 = exp2f(m1 - u1);
      m0 = n0;
      m1 = n1;
      float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
      for (int j = 0; j < kSt; ++j) {
        s[j][0] = exp2f(s[j][0] - u0);
        s[j][1] = exp2f(s[j][1] - u0);
        s[j][2] = exp2f(s[j][2] - u1);
        s[j][3] = exp2f(s[j][3] - u1);
        sum0 += s[j][0] + s[j][1];
        sum1 += s[j][2] + s[j][3];
      }
      l0 = l0 * c0 + sum0;
      l1 = l1 * c1 + sum1;
#pragma unroll
      for (int j = 0; j < kOt; ++j) {
        o[j][0] *= c0;
        o[j][1] *= c0;
        o[j][2] *= c1;
        o[j][3] *= c1;
      }
    }  // work
    if constexpr (kAsync) {
      // Values in; the keys no longer read: fetch the next tile's keys during P V.
      cp_async_wait_all();
      __syncthreads();
      if (k0 + kFaK <= last_key) copy_tile(a.k_bf16, k0 + kFaK, ks);
      if (!work) continue;
    }
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
#pragma unroll
  for (int x = 1; x <= 2; x <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, x);
    l1 += __shfl_xor_sync(0xffffffffu, l1, x);
  }
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

// One warp per token; lane i holds experts i, i + 32, ...
__global__ void route_kernel(RouteArgs a) {
  pdl_wait();
  constexpr int kPer = kMaxExperts / 32;
  const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (t >= a.n) return;
  const float* lg = a.logits + size_t(t) * a.n_experts;
  float p[kPer];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < a.n_experts ? lg[e] : -INFINITY;
    mx = fmaxf(mx, p[i]);
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < a.n_experts ? expf(p[i] - mx) : 0.0f;
    sum += p[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kPer; ++i) p[i] = lane + 32 * i < a.n_experts ? p[i] / sum : -1.0f;
  float picked_sum = 0, mine_w = 0.0f;
  int mine_e = 0;
  for (int r = 0; r < a.top_k; ++r) {
    float best = -2.0f;
    int best_e = INT_MAX;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (p[i] > best) {  // strictly greater: the lower id wins ties within a lane
        best = p[i];
        best_e = lane + 32 * i;
      }
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ob > best || (ob == best && oe < best_e)) {
        best = ob;
        best_e = oe;
      }
    }
    // Taken (unrolled: a computed index would move p to local memory).
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (lane + 32 * i == best_e) p[i] = -1.0f;
    // Lane r % 32 keeps rank r's id and weight until its group of 32 ranks is written.
    if (lane == r % 32) {
      mine_e = best_e;
      mine_w = best;
    }
    picked_sum += best;
    if (r % 32 == 31 || r == a.top_k - 1) {
      // Up to 32 ranks: picked_sum is complete here, so the weights are written renormalized
      // once; more ranks are written raw and divided after the last.
      const int base = r - r % 32;
      const bool norm_now = a.renormalize && a.top_k <= 32;
      if (lane <= r % 32) {
        a.ids[size_t(t) * a.top_k + base + lane] = mine_e;
        if (a.host_ids) a.host_ids[size_t(t) * a.top_k + base + lane] = mine_e;
        a.weights[size_t(t) * a.top_k + base + lane] = norm_now ? mine_w / picked_sum : mine_w;
        if (a.hist) atomicAdd(a.hist + mine_e, 1ull);
      }
    }
  }
  if (a.renormalize && a.top_k > 32) {
    __syncwarp();
    for (int r = lane; r < a.top_k; r += 32) a.weights[size_t(t) * a.top_k + r] /= picked_sum;
  }
  if (a.host_flag) {
    // Every lane's host writes are visible system-wide before lane 0 raises the flag.
    __threadfence_system();
    __syncwarp();
    if (lane == 0) *reinterpret_cast<volatile int*>(a.host_flag) = 1;
  }
}

// grid (ceil(d_expert / kWarps), n * top_k): warp per (slot, row).
template <DType T>
__device__ __forceinline__ void gate_up_rows(const MoeArgs& a) {
  pdl_wait();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = blockIdx.x * kWarps + warp, s = blockIdx.y;
  if (r >= a.d_expert || (a.slot_mask && a.slot_mask[s] != a.mask_value)) return;
  const int e = a.ids[s], t = s / a.top_k;
  const size_t rb = dtype_row_bytes_dev(T, a.d_model);
  const float* x = a.xn + size_t(t) * a.d_model;
  float g[1] = {}, u[1] = {};
  const uint8_t* gr = static_cast<const uint8_t*>(a.gate[e]) + size_t(r) * rb;
  const uint8_t* ur = static_cast<const uint8_t*>(a.up[e]) + size_t(r) * rb;
  const int8_t* xq = a.xq ? a.xq + size_t(t) * a.d_model : nullptr;
  const float* xd = a.xd ? a.xd + size_t(t) * (a.d_model / 32) : nullptr;
  if constexpr (T == DType::kQ8_0) {
    if (xq && 2 * rb <= size_t(kStagedBytes)) {
      // Both rows in flight at once.
      __shared__ __align__(16) uint8_t staged[kRowWarps][kStagedBytes];
      uint8_t* tile = staged[warp];
      warp_copy_async(tile, gr, int(rb), lane);
      warp_copy_async(tile + rb, ur, int(rb), lane);
      warp_copy_wait();
      const int nb = a.d_model / 32;
      q8q8_tile_dot<1>(tile, 0, nb, xq, xd, a.d_model, 1, g, lane);
      q8q8_tile_dot<1>(tile + rb, 0, nb, xq, xd, a.d_model, 1, u, lane);
      const float gv = warp_sum(g[0]), uv = warp_sum(u[0]);
      if (lane == 0) a.h[size_t(s) * a.d_expert + r] = gv / (1.0f + expf(-gv)) * uv;
      return;
    }
  }
  row_dot_any<T, 1>(gr, x, xq, xd, a.d_model, 1, g, lane);
  row_dot_any<T, 1>(ur, x, xq, xd, a.d_model, 1, u, lane);
  const float gv = warp_sum(g[0]), uv = warp_sum(u[0]);
  if (lane == 0) a.h[size_t(s) * a.d_expert + r] = gv / (1.0f + expf(-gv)) * uv;
}

template <DType T>
__global__ void moe_gate_up_kernel(MoeArgs a) {
  gate_up_rows<T>(a);
}
// BF16 / F16: 12 blocks of 4 warps per SM (40 registers), so qwen3-30b-a3b's 1,536 blocks
// (8 experts x 768 rows) run in one wave instead of 1.16.
template <DType T>
__global__ void __launch_bounds__(32 * kWarps, 12) moe_gate_up_wide_kernel(MoeArgs a) {
  gate_up_rows<T>(a);
}

// grid (ceil(d_model / kWarps), n): warp per (token, row), ranks summed in order. For the
// shapes moe_down_rank_kernel does not take (top_k > 8, long rows such as Mixtral's 14,336,
// Q8_0 rows over 1,024 columns, F32 and Q4_K).
template <DType T>
__global__ void moe_down_sum_kernel(MoeArgs a) {
  pdl_wait();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = blockIdx.x * kWarps + warp, t = blockIdx.y;
  if (r >= a.d_model) return;
  const size_t rb = dtype_row_bytes_dev(T, a.d_expert);
  float total = 0;
  if constexpr (T == DType::kQ8_0) {
    if (a.hq && size_t(a.top_k) * rb <= size_t(kStagedBytes)) {
      // All top_k rows in flight at once, then the same sums as below.
      __shared__ __align__(16) uint8_t staged[kRowWarps][kStagedBytes];
      uint8_t* tile = staged[warp];
      // Lane k looks up rank k's row and weight: two memory latencies for all ranks, not
      // two per rank before its copy can start.
      const uint8_t* row = nullptr;
      float wk = 0.0f;
      if (lane < a.top_k) {
        row = static_cast<const uint8_t*>(a.down[a.ids[t * a.top_k + lane]]) + size_t(r) * rb;
        wk = a.weights[t * a.top_k + lane];
      }
      for (int k = 0; k < a.top_k; ++k)
        warp_copy_async(tile + size_t(k) * rb,
                        reinterpret_cast<const uint8_t*>(__shfl_sync(
                            0xffffffffu, reinterpret_cast<unsigned long long>(row), k)),
                        int(rb), lane);
      warp_copy_wait();
      const int nb = a.d_expert / 32;
      for (int k = 0; k < a.top_k; ++k) {
        const int s = t * a.top_k + k;
        float acc[1] = {};
        q8q8_tile_dot<1>(tile + size_t(k) * rb, 0, nb, a.hq + size_t(s) * a.d_expert,
                         a.hd + size_t(s) * nb, a.d_expert, 1, acc, lane);
        total += __shfl_sync(0xffffffffu, wk, k) * warp_sum(acc[0]);
      }
      if (lane == 0) {
        float* o = a.out + size_t(t) * a.d_model + r;
        *o = a.accumulate ? *o + total : total;
      }
      return;
    }
  }
  for (int k = 0; k < a.top_k; ++k) {
    const int s = t * a.top_k + k;
    float acc[1] = {};
    const uint8_t* dr = static_cast<const uint8_t*>(a.down[a.ids[s]]) + size_t(r) * rb;
    row_dot_any<T, 1>(dr, a.h + size_t(s) * a.d_expert,
                      a.hq ? a.hq + size_t(s) * a.d_expert : nullptr,
                      a.hd ? a.hd + size_t(s) * (a.d_expert / 32) : nullptr, a.d_expert, 1, acc,
                      lane);
    total += a.weights[s] * warp_sum(acc[0]);
  }
  if (lane == 0) {
    float* o = a.out + size_t(t) * a.d_model + r;
    *o = a.accumulate ? *o + total : total;
  }
}

// Phase 2 with a warp per (output row, rank): grid (d_model, n), block 32 * top_k (top_k <=
// kMaxRankWarps). Warp k computes rank k's dot product for row r (BF16/F16: lane j takes
// 8-column chunks j, j + 32, ...; Q8_0: the row staged, lane j takes blocks j, j + 32, ... as
// moe_down_sum_kernel's staged path), reduced by warp_sum; the sums meet in shared memory and
// one thread adds them, weighted, in rank order. Per token the sum is over ranks in order
// whatever the residency, and each warp has a single short row in flight instead of one warp
// waiting on all top_k.
constexpr int kMaxRankWarps = 8;
constexpr int kRankRowBytes = 1088;  // Q8_0 rows staged per warp: up to 1,024 columns

template <DType T>
__global__ void __launch_bounds__(32 * kMaxRankWarps) moe_down_rank_kernel(MoeArgs a) {
  pdl_wait();
  const int k = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = blockIdx.x, t = blockIdx.y, s = t * a.top_k + k;
  const size_t rb = dtype_row_bytes_dev(T, a.d_expert);
  const uint8_t* row = static_cast<const uint8_t*>(a.down[a.ids[s]]) + size_t(r) * rb;
  __shared__ float sums[kMaxRankWarps];
  float acc = 0.0f;
  if constexpr (T == DType::kQ8_0) {
    __shared__ __align__(16) uint8_t staged[kMaxRankWarps][kRankRowBytes];
    warp_copy_async(staged[k], row, int(rb), lane);
    warp_copy_wait();
    const int nb = a.d_expert / 32;
    float ak[1] = {};
    q8q8_tile_dot<1>(staged[k], 0, nb, a.hq + size_t(s) * a.d_expert, a.hd + size_t(s) * nb,
                     a.d_expert, 1, ak, lane);
    acc = ak[0];
  } else {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
    const float* h = a.h + size_t(s) * a.d_expert;
#pragma unroll 4
    for (int c = lane * 8; c < a.d_expert; c += 256) {
      float wf[8];
      unpack8<T>(__ldg(reinterpret_cast<const uint4*>(w + c)), wf);
      const float4* xv = reinterpret_cast<const float4*>(h + c);
      const float4 x0 = xv[0], x1 = xv[1];
      const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) acc += wf[2 * i] * xs[2 * i] + wf[2 * i + 1] * xs[2 * i + 1];
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) sums[k] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0;
    for (int j = 0; j < a.top_k; ++j) total += a.weights[t * a.top_k + j] * sums[j];
    float* o = a.out + size_t(t) * a.d_model + r;
    *o = a.accumulate ? *o + total : total;
  }
}

// Whether moe_down_rank_kernel takes phase 2 (else moe_down_sum_kernel).
bool moe_down_by_rank(const MoeArgs& a) {
  if (a.top_k < 1 || a.top_k > kMaxRankWarps) return false;
  if (a.down_dtype == DType::kBF16 || a.down_dtype == DType::kF16)
    return a.d_expert % 8 == 0 && a.d_expert <= 4096;
  return a.down_dtype == DType::kQ8_0 && a.hq && a.d_expert % 256 == 0 &&
         size_t(a.d_expert / 32) * 34 <= size_t(kRankRowBytes);
}

__device__ __forceinline__ void store_as(void* dst, DType type, size_t i, float v) {
  if (type == DType::kF32) static_cast<float*>(dst)[i] = v;
  else if (type == DType::kBF16) static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16(v);
  else static_cast<__half*>(dst)[i] = __float2half(v);
}

__global__ void gather_rows_kernel(const float* src, const int* src_row, int d, void* dst,
                                   DType type) {
  pdl_wait();
  const int i = blockIdx.y;
  const float* row = src + size_t(src_row[i]) * d;
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < d; c += gridDim.x * blockDim.x)
    store_as(dst, type, size_t(i) * d + c, row[c]);
}

__global__ void convert_kernel(const float* src, void* dst, DType type, int64_t n) {
  pdl_wait();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    store_as(dst, type, size_t(i), src[i]);
}

// Element (r, c) of any matrix as F32.
__device__ float matrix_elem(const uint8_t* w, DType type, size_t row_bytes, int64_t r,
                             int64_t c) {
  const uint8_t* row = w + size_t(r) * row_bytes;
  switch (type) {
    case DType::kF32: return reinterpret_cast<const float*>(row)[c];
    case DType::kBF16: return bf16_bits(reinterpret_cast<const uint16_t*>(row)[c]);
    case DType::kF16: return f16_bits(reinterpret_cast<const uint16_t*>(row)[c]);
    case DType::kQ8_0: {
      const uint8_t* blk = row + size_t(c / 32) * 34;
      const float d = f16_bits(blk[0] | (uint32_t(blk[1]) << 8));
      return d * float(int8_t(blk[2 + c % 32]));
    }
    case DType::kQ4_K: {
      const uint8_t* blk = row + size_t(c / 256) * 144;
      const int in = int(c % 256), j = in / 32;
      float sc, mn;
      q4k_scale_min(blk + 4, j, &sc, &mn);
      const float d = f16_bits(blk[0] | (uint32_t(blk[1]) << 8));
      const float dmin = f16_bits(blk[2] | (uint32_t(blk[3]) << 8));
      const uint8_t q = blk[16 + 32 * (j / 2) + in % 32];
      return d * sc * float((j & 1) ? q >> 4 : q & 15) - dmin * mn;
    }
  }
  return 0.0f;
}

__global__ void dequantize_kernel(const uint8_t* w, DType type, size_t row_bytes, int64_t rows,
                                  int64_t cols, void* dst, DType dst_type) {
  pdl_wait();
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x)
    store_as(dst, dst_type, size_t(i), matrix_elem(w, type, row_bytes, i / cols, i % cols));
}

// Q8_0 -> BF16 by warps of 32 blocks (1,088 bytes in, 2,048 out): the blocks staged in
// shared memory with 16-byte copies when the source allows, converted a block per lane, and
// written back 16 bytes per lane in order. grid (ceil(max blocks / 256), 3, count).
constexpr int kDqWarps = 8;
__global__ void __launch_bounds__(32 * kDqWarps) dequantize_q8_kernel(Q8Dequant a) {
  pdl_wait();
  const int m = blockIdx.y, j = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t nb = a.blocks[m];
  if (nb == 0) return;
  const uint8_t* src;
  if (a.experts) {
    const int e = a.experts[j];
    src = static_cast<const uint8_t*>(a.src_tab[m][e]);
    if (a.dst_tab[m] && blockIdx.x == 0 && threadIdx.x == 0)
      a.dst_tab[m][e] = static_cast<uint8_t*>(a.dst) + size_t(j) * a.dst_stride + a.dst_off[m];
  } else {
    src = static_cast<const uint8_t*>(a.direct[m]);
  }
  uint16_t* dst = reinterpret_cast<uint16_t*>(static_cast<uint8_t*>(a.dst) +
                                              size_t(j) * a.dst_stride + a.dst_off[m]);
  const int64_t b0 = (int64_t(blockIdx.x) * kDqWarps + warp) * 32;
  if (b0 >= nb) return;
  const int n = nb - b0 < 32 ? int(nb - b0) : 32;
  __shared__ __align__(16) uint8_t in[kDqWarps][32 * 34];
  __shared__ __align__(16) uint16_t out[kDqWarps][32 * 32];
  const uint8_t* from = src + size_t(b0) * 34;
  if (n == 32 && (reinterpret_cast<uintptr_t>(from) & 15) == 0) {
    warp_copy_async(in[warp], from, 32 * 34, lane);
    warp_copy_wait();
  } else {
    for (int i = lane; i < n * 17; i += 32)
      reinterpret_cast<uint16_t*>(in[warp])[i] = reinterpret_cast<const uint16_t*>(from)[i];
    __syncwarp();
  }
  if (lane < n) {
    const uint16_t* blk = reinterpret_cast<const uint16_t*>(in[warp] + lane * 34);
    const float d = f16_bits(blk[0]);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t two = blk[1 + i];
      const __nv_bfloat162 v =
          __floats2bfloat162_rn(d * float(int8_t(two & 0xff)), d * float(int8_t(two >> 8)));
      *reinterpret_cast<__nv_bfloat162*>(&out[warp][lane * 32 + 2 * i]) = v;
    }
  }
  __syncwarp();
  // n blocks = n * 64 bytes = n * 4 chunks of 16 bytes.
  uint16_t* to = dst + size_t(b0) * 32;
  for (int c = lane; c < n * 4; c += 32)
    reinterpret_cast<uint4*>(to)[c] = reinterpret_cast<const uint4*>(out[warp])[c];
}

__global__ void slot_sum_kernel(const float* rows, const int* row_of, const float* weights, int k,
                                int d, float* out) {
  pdl_wait();
  const int t = blockIdx.y;
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < d; c += gridDim.x * blockDim.x) {
    float total = 0;
    for (int r = 0; r < k; ++r)
      total += weights[t * k + r] * rows[size_t(row_of[t * k + r]) * d + c];
    out[size_t(t) * d + c] = total;
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

// ---------------------------------------------------------------- launch helpers

unsigned grid_for(int64_t n, int block = 256) {
  return unsigned(std::min<int64_t>((n + block - 1) / block, 65535 * 4));
}

template <int NT>
void launch_gemv(const DevMatrix& w, const GemvParams& p, cudaStream_t s) {
  const dim3 grid(unsigned((p.total_rows + kWarps - 1) / kWarps), unsigned((p.n + NT - 1) / NT));
  switch (w.dtype) {
    case DType::kF32: launch_kernel(gemv_kernel<DType::kF32, NT>, grid, 32 * kWarps, 0, s, p); break;
    case DType::kF16: launch_kernel(gemv_kernel<DType::kF16, NT>, grid, 32 * kWarps, 0, s, p); break;
    case DType::kBF16: launch_kernel(gemv_kernel<DType::kBF16, NT>, grid, 32 * kWarps, 0, s, p); break;
    case DType::kQ8_0: launch_kernel(gemv_kernel<DType::kQ8_0, NT>, grid, 32 * kWarps, 0, s, p); break;
    case DType::kQ4_K: launch_kernel(gemv_kernel<DType::kQ4_K, NT>, grid, 32 * kWarps, 0, s, p); break;
  }
}

// ---- expert-grouped GEMMs (prefill) on tensor cores
// Q8_0 weights: a block computes a [kGroupTile rows, kGroupTile outputs] tile of one expert with 4
// warps (32 x 32 each, 2 x 2 WMMA fragments of 16 x 16), stepping through the weight columns 32 at
// a time (one Q8_0 block): the x rows and the weight rows of the step are staged as BF16 in shared
// memory. Every output element is a sum over columns in one fixed order, so results do not depend
// on where the weights live.
constexpr int kGK = 32;              // columns per step
constexpr int kGLd = kGK + 8;        // shared row stride in BF16 (80 bytes: WMMA needs 32-byte
                                     // aligned fragment rows, the pad spreads banks)
constexpr int kGCLd = kGroupTile + 4;  // epilogue row stride in floats

// A thread's share of one 32-column step of a [kGroupTile, 32] tile, held in registers so
// the next step's loads are in flight while the current step computes: BF16 rows as two
// 16-byte chunks; Q8_0 rows as half a block (d and 16 quants).
struct StepRegs {
  uint4 v[2];
  uint16_t d;
};

// Rows [0, rows) of a [*, k] BF16 matrix at base, columns k0..k0+31 (zero past rows / k; k a
// multiple of 8).
__device__ __forceinline__ void load_bf16(const uint8_t* base, int rows, int k, int k0, StepRegs& r) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = threadIdx.x + 128 * i, row = c / (kGK / 8), col = k0 + (c % (kGK / 8)) * 8;
    r.v[i] = make_uint4(0, 0, 0, 0);
    if (row < rows && col < k) r.v[i] = *reinterpret_cast<const uint4*>(base + (size_t(row) * k + col) * 2);
  }
}
__device__ __forceinline__ void store_bf16(const StepRegs& r, __nv_bfloat16* s) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = threadIdx.x + 128 * i, row = c / (kGK / 8), q = c % (kGK / 8);
    *reinterpret_cast<uint4*>(s + row * kGLd + q * 8) = r.v[i];
  }
}
// Q8_0 rows (k a multiple of 32): thread t takes half of row t / 2's block. Blocks are 34
// bytes apart, so a half-block's 16 quants start 2-byte aligned: read as 4 or 5 aligned
// 32-bit words (the last one a 16-bit read) and shifted into place, never past the block.
__device__ __forceinline__ void load_q8_0(const uint8_t* base, int rows, int k, int k0, StepRegs& r) {
  const int row = threadIdx.x / 2, half = threadIdx.x % 2;
  r.d = 0;
  r.v[0] = make_uint4(0, 0, 0, 0);
  if (row >= rows) return;
  const uint8_t* blk = base + size_t(row) * size_t(k / 32) * 34 + size_t(k0 / 32) * 34;
  r.d = *reinterpret_cast<const uint16_t*>(blk);
  const uint8_t* q = blk + 2 + half * 16;
  const uint32_t* w =
      reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(q) & ~uintptr_t(3));
  uint32_t x[4];
  if ((reinterpret_cast<uintptr_t>(q) & 3) == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = w[i];
  } else {  // 2 bytes past a word boundary
    uint32_t y[5];
#pragma unroll
    for (int i = 0; i < 4; ++i) y[i] = w[i];
    y[4] = *reinterpret_cast<const uint16_t*>(w + 4);  // only its low half is used
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = __funnelshift_r(y[i], y[i + 1], 16);
  }
  r.v[0] = make_uint4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void store_q8_0(const StepRegs& r, __nv_bfloat16* s) {
  const int row = threadIdx.x / 2, half = threadIdx.x % 2;
  const float d = f16_bits(r.d);
  const uint32_t w[4] = {r.v[0].x, r.v[0].y, r.v[0].z, r.v[0].w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t word = w[i / 2] >> (16 * (i % 2));
    const __nv_bfloat162 v = __floats2bfloat162_rn(d * float(int8_t(word & 0xff)),
                                                   d * float(int8_t((word >> 8) & 0xff)));
    o[i] = *reinterpret_cast<const uint32_t*>(&v);
  }
  uint4* dst = reinterpret_cast<uint4*>(s + row * kGLd + half * 16);
  dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
  dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

// The BF16 branches are not reached since BF16 weights take grouped_mma_kernel; they stay
// because without them the compiler gives the Q8_0 kernel 128 registers instead of 164 (4
// blocks per SM instead of the 3 it was measured with, and 4 measured slower: docs/PERF.md)
// until that is measured again.
__device__ __forceinline__ void load_weights(const void* w, DType t, int n, int k, int n0, int k0,
                                             StepRegs& r) {
  const int rows = min(kGroupTile, n - n0);
  if (t == DType::kQ8_0)
    load_q8_0(static_cast<const uint8_t*>(w) + size_t(n0) * size_t(k / 32) * 34, rows, k, k0, r);
  else
    load_bf16(static_cast<const uint8_t*>(w) + size_t(n0) * size_t(k) * 2, rows, k, k0, r);
}
__device__ __forceinline__ void store_weights(const StepRegs& r, DType t, __nv_bfloat16* s) {
  if (t == DType::kQ8_0) store_q8_0(r, s);
  else store_bf16(r, s);
}

template <bool kGateUp>
__global__ void __launch_bounds__(128) grouped_gemm_kernel(GroupedArgs a) {
  pdl_wait();
  namespace wmma = nvcuda::wmma;
  using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  constexpr int kStage = kGroupTile * kGLd;  // BF16 elements per staged tile
  constexpr int kEpi = kGroupTile * kGCLd;   // floats per epilogue tile
  constexpr size_t kIn = size_t(3 * kStage * 2), kOut = size_t((kGateUp ? 2 : 1) * kEpi * 4);
  constexpr size_t kBytes = kIn > kOut ? kIn : kOut;
  __shared__ __align__(128) unsigned char smem[kBytes];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* w0s = xs + kStage;
  __nv_bfloat16* w1s = w0s + kStage;

  const GroupTile tile = a.tiles[blockIdx.y];
  const int n0 = blockIdx.x * kGroupTile;
  const void* w0 = a.direct0 ? a.direct0 : a.w0[tile.expert];
  const void* w1 = kGateUp ? (a.direct1 ? a.direct1 : a.w1[tile.expert]) : nullptr;
  const uint8_t* x = static_cast<const uint8_t*>(a.x) + size_t(tile.row0) * size_t(a.k) * 2;
  const int warp = threadIdx.x / 32, wr = (warp / 2) * 32, wc = (warp % 2) * 32;

  Acc acc0[2][2], acc1[2][2];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      wmma::fill_fragment(acc0[i][j], 0.0f);
      wmma::fill_fragment(acc1[i][j], 0.0f);
    }
  StepRegs rx, r0w, r1w;
  load_bf16(x, tile.m, a.k, 0, rx);
  load_weights(w0, a.dtype, a.n, a.k, n0, 0, r0w);
  if (kGateUp) load_weights(w1, a.dtype, a.n, a.k, n0, 0, r1w);
  for (int k0 = 0; k0 < a.k; k0 += kGK) {
    store_bf16(rx, xs);
    store_weights(r0w, a.dtype, w0s);
    if (kGateUp) store_weights(r1w, a.dtype, w1s);
    __syncthreads();
    if (k0 + kGK < a.k) {  // the next step's loads overlap this step's MMAs
      load_bf16(x, tile.m, a.k, k0 + kGK, rx);
      load_weights(w0, a.dtype, a.n, a.k, n0, k0 + kGK, r0w);
      if (kGateUp) load_weights(w1, a.dtype, a.n, a.k, n0, k0 + kGK, r1w);
    }
    for (int kk = 0; kk < kGK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], xs + (wr + 16 * i) * kGLd + kk, kGLd);
      for (int j = 0; j < 2; ++j) {
        // W rows are output columns: W^T as a column-major [k, n] operand.
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
        wmma::load_matrix_sync(fb, w0s + (wc + 16 * j) * kGLd + kk, kGLd);
        for (int i = 0; i < 2; ++i) wmma::mma_sync(acc0[i][j], fa[i], fb, acc0[i][j]);
        if (kGateUp) {
          wmma::load_matrix_sync(fb, w1s + (wc + 16 * j) * kGLd + kk, kGLd);
          for (int i = 0; i < 2; ++i) wmma::mma_sync(acc1[i][j], fa[i], fb, acc1[i][j]);
        }
      }
    }
    __syncthreads();
  }
  float* c0 = reinterpret_cast<float*>(smem);
  float* c1 = c0 + kEpi;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      const int at = (wr + 16 * i) * kGCLd + wc + 16 * j;
      wmma::store_matrix_sync(c0 + at, acc0[i][j], kGCLd, wmma::mem_row_major);
      if (kGateUp) wmma::store_matrix_sync(c1 + at, acc1[i][j], kGCLd, wmma::mem_row_major);
    }
  __syncthreads();
  for (int e = threadIdx.x; e < kGroupTile * kGroupTile; e += blockDim.x) {
    const int r = e / kGroupTile, c = e % kGroupTile, col = n0 + c;
    if (r >= tile.m || col >= a.n) continue;
    const size_t o = size_t(tile.row0 + r) * size_t(a.n) + size_t(col);
    if (kGateUp) {
      // silu(g) * u as silu_mul_kernel computes it, rounded as convert_f32 rounds.
      const float g = c0[r * kGCLd + c], u = c1[r * kGCLd + c];
      static_cast<__nv_bfloat16*>(a.out)[o] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
    } else {
      static_cast<float*>(a.out)[o] = c0[r * kGCLd + c];
    }
  }
}

// The grouped GEMMs for BF16 weights, with larger warp tiles: a block computes
// [kGroupTile = 64 rows, kMmaN = 128 outputs] of one expert with 4 warps, each all 64 rows x 32
// outputs (of gate and of up in phase 1), on mma.sync m16n8k16 with ldmatrix fragments: per
// 16 columns a warp loads 4 fragments of x and 2 (+2) of the weights for 16 (32) MMAs — half
// the shared-memory reads per MMA of the WMMA kernel above, which ncu showed bound by that
// pipe (docs/PERF.md). Steps of 32 columns through two cp.async buffers (zero-filled past the
// edges), one barrier a step. Q8_0 weights stay on the kernel above: this one's Q8_0 loader
// (a thread per weight row) measured slower (docs/PERF.md).
constexpr int kMmaN = 128, kMmaLd = kGK + 8;  // 80-byte rows: ldmatrix without bank conflicts
constexpr int kMmaStage = (kGroupTile + 2 * kMmaN) * kMmaLd;  // BF16 elements per stage
constexpr size_t kMmaSmem = size_t(2 * kMmaStage) * 2;

// As cp_async16; with valid false nothing is read and the 16 bytes are zeroed.

// Rows [0, rows) of a [*, k] BF16 matrix, columns k0..k0+31, into s (row stride kMmaLd):
// ROWS x 4 16-byte pieces, zero past rows / k (k a multiple of 8).
template <int ROWS>
__device__ __forceinline__ void mma_copy_bf16(const uint8_t* base, int rows, int k, int k0,
                                              __nv_bfloat16* s) {
#pragma unroll
  for (int i = 0; i < ROWS * 4 / 128; ++i) {
    const int c = threadIdx.x + 128 * i, row = c / 4, col = k0 + (c % 4) * 8;
    const bool ok = row < rows && col < k;
    const uint8_t* src = ok ? base + (size_t(row) * k + col) * 2 : base;
    cp_async16_zfill(s + row * kMmaLd + (c % 4) * 8, src, ok);
  }
}

template <bool kGateUp>
__global__ void __launch_bounds__(128) grouped_mma_kernel(GroupedArgs a) {
  pdl_wait();
  extern __shared__ __align__(128) unsigned char mma_smem[];
  __nv_bfloat16* const stage0 = reinterpret_cast<__nv_bfloat16*>(mma_smem);
  const GroupTile tile = a.tiles[blockIdx.y];
  const int n0 = blockIdx.x * kMmaN;
  const int n_rows = min(kMmaN, a.n - n0);  // weight rows of this block
  const uint8_t* w0 = static_cast<const uint8_t*>(a.direct0 ? a.direct0 : a.w0[tile.expert]);
  const uint8_t* w1 =
      kGateUp ? static_cast<const uint8_t*>(a.direct1 ? a.direct1 : a.w1[tile.expert]) : nullptr;
  const size_t w_row = size_t(a.k) * 2;  // BF16 rows
  w0 += size_t(n0) * w_row;
  if (kGateUp) w1 += size_t(n0) * w_row;
  const uint8_t* x = static_cast<const uint8_t*>(a.x) + size_t(tile.row0) * size_t(a.k) * 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / 4, tig = lane % 4;
  const int mi = lane / 8, mr = lane % 8, wc = warp * 32;
  const int steps = (a.k + kGK - 1) / kGK;

  float acc0[4][4][4], acc1[kGateUp ? 4 : 1][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        acc0[i][j][c] = 0.0f;
        if (kGateUp) acc1[i][j][c] = 0.0f;
      }
  // Stage layout: x [64][kMmaLd], w0 [128][kMmaLd], w1 [128][kMmaLd].
  const auto xs_of = [&](int b) { return stage0 + b * kMmaStage; };
  const auto w0s_of = [&](int b) { return stage0 + b * kMmaStage + kGroupTile * kMmaLd; };
  const auto w1s_of = [&](int b) { return stage0 + b * kMmaStage + (kGroupTile + kMmaN) * kMmaLd; };
  const auto issue = [&](int step, int b) {  // a step's loads into buffer b
    mma_copy_bf16<kGroupTile>(x, tile.m, a.k, step * kGK, xs_of(b));
    mma_copy_bf16<kMmaN>(w0, n_rows, a.k, step * kGK, w0s_of(b));
    if (kGateUp) mma_copy_bf16<kMmaN>(w1, n_rows, a.k, step * kGK, w1s_of(b));
    cp_async_commit();
  };
  issue(0, 0);
  cp_async_wait_all();
  __syncthreads();
  for (int step = 0; step < steps; ++step) {
    const int b = step & 1;
    const bool more = step + 1 < steps;
    // Buffer b ^ 1's last readers (the previous step) passed the previous barrier.
    if (more) issue(step + 1, b ^ 1);
    const __nv_bfloat16* xs = xs_of(b);
    const __nv_bfloat16* ws0 = w0s_of(b);
    const __nv_bfloat16* ws1 = w1s_of(b);
#pragma unroll
    for (int kk = 0; kk < kGK; kk += 16) {
      unsigned fa[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        ldsm_x4(fa[i], xs + (16 * i + (mi % 2) * 8 + mr) * kMmaLd + kk + (mi / 2) * 8);
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        unsigned fb[4];
        ldsm_x4(fb, ws0 + (wc + 16 * jj + (mi / 2) * 8 + mr) * kMmaLd + kk + (mi % 2) * 8);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          mma_bf16(acc0[i][2 * jj], fa[i], fb[0], fb[1]);
          mma_bf16(acc0[i][2 * jj + 1], fa[i], fb[2], fb[3]);
        }
        if (kGateUp) {
          ldsm_x4(fb, ws1 + (wc + 16 * jj + (mi / 2) * 8 + mr) * kMmaLd + kk + (mi % 2) * 8);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            mma_bf16(acc1[i][2 * jj], fa[i], fb[0], fb[1]);
            mma_bf16(acc1[i][2 * jj + 1], fa[i], fb[2], fb[3]);
          }
        }
      }
    }
    if (more) cp_async_wait_all();
    __syncthreads();
  }
  // Thread holds rows 16 i + grp (+ 8), outputs wc + 8 j + 2 tig (+ 1).
  const bool pairs = a.n % 2 == 0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * i + grp + 8 * h;
      if (r >= tile.m) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = n0 + wc + 8 * j + 2 * tig;
        if (col >= a.n) continue;
        const size_t o = size_t(tile.row0 + r) * size_t(a.n) + size_t(col);
        float v[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (kGateUp) {
            // silu(g) * u as silu_mul_kernel computes it, rounded as convert_f32 rounds.
            const float g = acc0[i][j][2 * h + c], u = acc1[i][j][2 * h + c];
            v[c] = g / (1.0f + expf(-g)) * u;
          } else {
            v[c] = acc0[i][j][2 * h + c];
          }
        }
        const bool both = col + 1 < a.n;
        if (kGateUp) {
          __nv_bfloat16* out = static_cast<__nv_bfloat16*>(a.out) + o;
          if (both && pairs) {
            *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(v[0], v[1]);
          } else {
            out[0] = __float2bfloat16(v[0]);
            if (both) out[1] = __float2bfloat16(v[1]);
          }
        } else {
          float* out = static_cast<float*>(a.out) + o;
          if (both && pairs) {
            *reinterpret_cast<float2*>(out) = make_float2(v[0], v[1]);
          } else {
            out[0] = v[0];
            if (both) out[1] = v[1];
          }
        }
      }
    }
}

}  // namespace

// ---------------------------------------------------------------- host launchers

void gemv(const DevMatrix& w, const float* x, int n, float* y, bool accumulate, cudaStream_t s) {
  gemv_parts(&w, &y, 1, {x}, n, accumulate, s);
}

void quantize_act(const float* x, int64_t n, QAct out, cudaStream_t s) {
  launch_kernel(quantize_act_kernel, grid_for(n / 32), 256, 0, s, x, out.q, out.d, n / 32);
}

void gemv_parts(const DevMatrix* w, float* const* y, int parts, GemvInput in, int n,
                bool accumulate, cudaStream_t s) {
  GemvParams p{};
  p.parts = parts;
  for (int i = 0; i < parts; ++i) {
    p.w[i] = static_cast<const uint8_t*>(w[i].data);
    p.rows[i] = w[i].rows;
    p.y[i] = y[i];
    p.total_rows += w[i].rows;
  }
  p.row_bytes = w[0].row_bytes();
  p.cols = int(w[0].cols);
  p.x = in.x;
  p.xq = in.q.q;
  p.xd = in.q.d;
  p.n = n;
  p.accumulate = accumulate;
  if (n == 1) launch_gemv<1>(w[0], p, s);
  else launch_gemv<4>(w[0], p, s);
}

void embed_rows(const DevMatrix& table, const int* ids, int n, float* x, cudaStream_t s) {
  const dim3 grid(unsigned((table.cols + 255) / 256), unsigned(n));
  launch_kernel(embed_kernel, grid, 256, 0, s, static_cast<const uint8_t*>(table.data), table.dtype,
                                    table.row_bytes(), ids, int(table.cols), x);
}

void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int cols, float eps,
             cudaStream_t s, QAct q) {
  const int block = cols >= 1024 ? 1024 : cols >= 256 ? 256 : 64;
  if (cols % 32 != 0) q = {};  // callers quantize only widths of whole blocks
  launch_kernel(rmsnorm_kernel, unsigned(rows), block, 0, s, x, w, y, cols, eps, q);
}

void add_bias(float* y, const float* b, int n, int dim, cudaStream_t s) {
  launch_kernel(add_bias_kernel, grid_for(int64_t(n) * dim), 256, 0, s, y, b, int64_t(n) * dim, dim);
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

void attention(const AttentionArgs& args, cudaStream_t s) {
  AttentionArgs a = args;
  // The Q8 copy of the output (args.out_q): written by the merge where the heads are whole Q8
  // blocks, else by a quantize_act launch after the kernel.
  if (a.tensor_cores && a.n >= kTcAttentionMin && (a.head_dim == 64 || a.head_dim == 128)) {
    // Per device, so set at every launch (a host-side call); a failure shows at the launch.
    const bool async = a.k_bf16 && a.v_bf16;
    const auto kernel =
        a.head_dim == 64
            ? (async ? attention_tc_kernel<64, true> : attention_tc_kernel<64, false>)
            : (async ? attention_tc_kernel<128, true> : attention_tc_kernel<128, false>);
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kFaSmem));
    a.out_q = {};
    launch_kernel(kernel, dim3(unsigned(a.n_heads), unsigned((a.n + kFaQ - 1) / kFaQ)), 128, kFaSmem, s, a);
  } else if (a.n > 1 && a.head_dim <= kPrefillHd && a.head_dim % 4 == 0) {
    a.out_q = {};
    launch_kernel(attention_prefill_kernel, dim3(unsigned(a.n_heads), unsigned((a.n + kPrefillQ - 1) / kPrefillQ)), 32 * kAttnWarps, 0, s, a);
  } else {
    if (a.head_dim % 32 != 0) a.out_q = {};
    if (gqa_attention_applies(a.n_heads, a.n_kv_heads, a.head_dim)) {
      const int group = a.n_heads / a.n_kv_heads;
      const size_t smem = gqa_smem_floats(group, a.head_dim) * 4;
      launch_kernel(attention_gqa_kernel, dim3(unsigned(a.n_kv_heads), unsigned(a.n_splits), unsigned(a.n)),
                    32 * std::min(group, kGqaMaxWarps), smem, s, a);
    } else {
      launch_kernel(attention_split_kernel, dim3(unsigned(a.n_heads), unsigned(a.n), unsigned(a.n_splits)), 32 * kAttnWarps, 0, s, a);
    }
    launch_kernel(attention_merge_kernel, dim3(unsigned(a.n_heads), unsigned(a.n)), 128,
                  size_t(a.n_splits) * 4, s, a);
  }
  if (args.out_q.q && !a.out_q.q)
    quantize_act(a.out, int64_t(a.n) * a.n_heads * a.head_dim, args.out_q, s);
}

void route(const RouteArgs& a, cudaStream_t s) {
  launch_kernel(route_kernel, unsigned((a.n + 3) / 4), 128, 0, s, a);
}

void moe_gate_up(const MoeArgs& a, cudaStream_t s) {
  const dim3 grid(unsigned((a.d_expert + kWarps - 1) / kWarps), unsigned(a.n * a.top_k));
  switch (a.gate_dtype) {
    case DType::kF32: launch_kernel(moe_gate_up_kernel<DType::kF32>, grid, 32 * kWarps, 0, s, a); break;
    case DType::kF16:
      launch_kernel(moe_gate_up_wide_kernel<DType::kF16>, grid, 32 * kWarps, 0, s, a);
      break;
    case DType::kBF16:
      launch_kernel(moe_gate_up_wide_kernel<DType::kBF16>, grid, 32 * kWarps, 0, s, a);
      break;
    case DType::kQ8_0: launch_kernel(moe_gate_up_kernel<DType::kQ8_0>, grid, 32 * kWarps, 0, s, a); break;
    case DType::kQ4_K: launch_kernel(moe_gate_up_kernel<DType::kQ4_K>, grid, 32 * kWarps, 0, s, a); break;
  }
}

void moe_down_sum(const MoeArgs& a, cudaStream_t s) {
  if (moe_down_by_rank(a)) {
    const dim3 grid(unsigned(a.d_model), unsigned(a.n));
    const unsigned block = unsigned(32 * a.top_k);
    switch (a.down_dtype) {
      case DType::kBF16: launch_kernel(moe_down_rank_kernel<DType::kBF16>, grid, block, 0, s, a); break;
      case DType::kF16: launch_kernel(moe_down_rank_kernel<DType::kF16>, grid, block, 0, s, a); break;
      default: launch_kernel(moe_down_rank_kernel<DType::kQ8_0>, grid, block, 0, s, a); break;
    }
    return;
  }
  const dim3 grid(unsigned((a.d_model + kWarps - 1) / kWarps), unsigned(a.n));
  switch (a.down_dtype) {
    case DType::kF32: launch_kernel(moe_down_sum_kernel<DType::kF32>, grid, 32 * kWarps, 0, s, a); break;
    case DType::kF16: launch_kernel(moe_down_sum_kernel<DType::kF16>, grid, 32 * kWarps, 0, s, a); break;
    case DType::kBF16: launch_kernel(moe_down_sum_kernel<DType::kBF16>, grid, 32 * kWarps, 0, s, a); break;
    case DType::kQ8_0: launch_kernel(moe_down_sum_kernel<DType::kQ8_0>, grid, 32 * kWarps, 0, s, a); break;
    case DType::kQ4_K: launch_kernel(moe_down_sum_kernel<DType::kQ4_K>, grid, 32 * kWarps, 0, s, a); break;
  }
}

void gather_rows(const float* src, const int* src_row, int n_rows, int d, void* dst,
                 DType dst_type, cudaStream_t s) {
  const dim3 grid(unsigned((d + 255) / 256), unsigned(n_rows));
  launch_kernel(gather_rows_kernel, grid, 256, 0, s, src, src_row, d, dst, dst_type);
}

void convert_f32(const float* src, void* dst, DType dst_type, int64_t n, cudaStream_t s) {
  launch_kernel(convert_kernel, grid_for(n), 256, 0, s, src, dst, dst_type, n);
}

void dequantize_bf16(const DevMatrix& w, void* dst, cudaStream_t s) {
  launch_kernel(dequantize_kernel, grid_for(w.rows * w.cols), 256, 0, s, 
      static_cast<const uint8_t*>(w.data), w.dtype, w.row_bytes(), w.rows, w.cols, dst,
      DType::kBF16);
}

void dequantize_q8_bf16(const Q8Dequant& a, cudaStream_t s) {
  const int64_t most = std::max({a.blocks[0], a.blocks[1], a.blocks[2]});
  if (most == 0 || a.count == 0) return;
  const dim3 grid(unsigned((most + 32 * kDqWarps - 1) / (32 * kDqWarps)), 3, unsigned(a.count));
  launch_kernel(dequantize_q8_kernel, grid, 32 * kDqWarps, 0, s, a);
}

void to_f32(const DevMatrix& w, float* dst, cudaStream_t s) {
  launch_kernel(dequantize_kernel, grid_for(w.rows * w.cols), 256, 0, s, 
      static_cast<const uint8_t*>(w.data), w.dtype, w.row_bytes(), w.rows, w.cols, dst,
      DType::kF32);
}

void slot_sum(const float* rows, const int* row_of, const float* weights, int n, int k, int d,
              float* out, cudaStream_t s) {
  const dim3 grid(unsigned((d + 255) / 256), unsigned(n));
  launch_kernel(slot_sum_kernel, grid, 256, 0, s, rows, row_of, weights, k, d, out);
}

bool grouped_supports(DType type, int64_t cols) {
  if (type == DType::kBF16) return cols % 8 == 0;
  if (type == DType::kQ8_0) return cols % 32 == 0;
  return false;
}

namespace {
// Both phases: BF16 weights on grouped_mma_kernel, Q8_0 on the WMMA grouped_gemm_kernel.
template <bool kGateUp>
void launch_grouped(const GroupedArgs& a, cudaStream_t s) {
  if (a.n_tiles == 0) return;
  if (a.dtype == DType::kBF16) {
    cudaFuncSetAttribute(grouped_mma_kernel<kGateUp>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         int(kMmaSmem));
    const dim3 grid(unsigned((a.n + kMmaN - 1) / kMmaN), unsigned(a.n_tiles));
    launch_kernel(grouped_mma_kernel<kGateUp>, grid, 128, kMmaSmem, s, a);
    return;
  }
  const dim3 grid(unsigned((a.n + kGroupTile - 1) / kGroupTile), unsigned(a.n_tiles));
  launch_kernel(grouped_gemm_kernel<kGateUp>, grid, 128, 0, s, a);
}
}  // namespace

void grouped_gate_up(const GroupedArgs& a, cudaStream_t s) { launch_grouped<true>(a, s); }

void grouped_down(const GroupedArgs& a, cudaStream_t s) { launch_grouped<false>(a, s); }

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

void synthetic_route(float* logits, const float* bias, const int* pos, int n, int n_experts,
                     uint64_t seed, cudaStream_t s) {
  const int total = n * n_experts;
  launch_kernel(synthetic_route_kernel, (total + 255) / 256, 256, 0, s, logits, bias, pos, n, n_experts, seed);
}

void fill_value(float* dst, int64_t n, float value, cudaStream_t s) {
  launch_kernel(fill_value_kernel, grid_for(n), 256, 0, s, dst, n, value);
}

}  // namespace ts::cuda
