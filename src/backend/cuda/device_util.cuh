// Device helpers shared by the CUDA kernel files (internal to src/backend/cuda): programmatic
// dependent launch and the launch wrapper, BF16 / F16 bits, warp reductions, the warp's Q8
// quantization of a row, cp.async copies, ldmatrix / mma.sync fragments. In an anonymous
// namespace: every kernel file has its own copy of each.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <utility>

#include "backend/cuda/kernels.cuh"

namespace ts::cuda {
namespace {

// ---------------------------------------------------------------- device helpers

// Programmatic dependent launch (sm_90): every kernel is launched with
// programmaticStreamSerializationAllowed, so the next kernel in the stream (or graph) is
// scheduled while this one finishes instead of after. pdl_wait() blocks until the kernel
// before has completed and its writes are visible, then lets the next kernel launch (once
// every block of this one has). Every kernel calls it before it reads anything an earlier
// kernel wrote, so the ordering is as strict as a plain stream's (completion is transitive:
// no kernel completes before its wait returns, so before its predecessor completes). What
// no kernel of the step writes (weights, earlier steps' KV rows) may be read before it:
// kernels stage such data there, overlapping the kernel before. (Letting the next kernel
// launch before the wait measured slower: docs/PERF.md.)
// TURBOSPARK_CUDA_PDL=0 launches plainly (to measure what it saves).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A grouped GEMM block's tile is not in the plan it was launched on (GroupedArgs::plan):
// past the plan's tile count, or the launch is for tiles of another height. Uniform over the
// block; read after pdl_wait (the plan is the step's own).
__device__ __forceinline__ bool past_plan(const GroupedArgs& a) {
  return a.plan && (int(blockIdx.y) >= a.plan[0] || a.plan[1] != a.tile_rows);
}

inline bool pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("TURBOSPARK_CUDA_PDL");
    return !(e && std::string_view(e) == "0");
  }();
  return on;
}

// With `cluster`: thread block clusters of that shape (sm_90).
template <class... P, class... A>
inline void launch_kernel_ex(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t s, const dim3* cluster, A&&... args) {
  cudaLaunchAttribute attr[2] = {};
  unsigned n = 0;
  if (pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster->x;
    attr[n].val.clusterDim.y = cluster->y;
    attr[n++].val.clusterDim.z = cluster->z;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  // An error stays the runtime's last error, which the session checks after the step.
  (void)cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

template <class... P, class... A>
inline void launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                          A&&... args) {
  launch_kernel_ex(kernel, grid, block, smem, s, nullptr, std::forward<A>(args)...);
}

// launch_kernel with thread block clusters of `cluster` blocks (sm_90).
template <class... P, class... A>
inline void launch_cluster_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                                  dim3 cluster, cudaStream_t s, A&&... args) {
  launch_kernel_ex(kernel, grid, block, smem, s, &cluster, std::forward<A>(args)...);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Every block of the cluster arrives; shared-memory writes before it are visible to the
// cluster's blocks after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The address of *p (this block's shared memory) in block `rank` of the cluster.
template <class T>
__device__ __forceinline__ const T* cluster_map(const T* p, int rank) {
  uint64_t out;
  asm volatile("mapa.u64 %0, %1, %2;\n"
               : "=l"(out)
               : "l"(reinterpret_cast<uint64_t>(p)), "r"(rank));
  return reinterpret_cast<const T*>(out);
}
#endif

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

// 1 / RMS of a row for RMSNorm from each thread's sum of squares, summed by the whole block
// (thread i takes i, i + blockDim.x, ...; warps, then the warp sums in order): the same bits
// for the same blockDim, whichever kernel calls it. Every thread of the block must call it.
__device__ __forceinline__ float block_rms_inv_of(float ss, int cols, float eps) {
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
  return rsqrtf(part[0] / float(cols) + eps);
}

// The same sum from the row xr, keeping the thread's first N elements of the row (xv[u] =
// xr[threadIdx.x + u * blockDim.x], 0 past cols) in registers, so the normalization after it
// reads them there instead of loading x a second time: in decode these one-block norms run
// while the next kernel's blocks stream their weights, and their loads wait behind that
// traffic (docs/PERF.md, "A timeline of the decode step on the H100").
template <int N>
__device__ __forceinline__ float block_rms_inv(const float* xr, int cols, float eps,
                                               float (&xv)[N]) {
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const int i = int(threadIdx.x) + u * int(blockDim.x);
    xv[u] = i < cols ? xr[i] : 0.0f;
  }
  float ss = 0;
#pragma unroll
  for (int u = 0; u < N; ++u)
    if (int(threadIdx.x) + u * int(blockDim.x) < cols) ss += xv[u] * xv[u];
  for (int i = int(threadIdx.x) + N * int(blockDim.x); i < cols; i += blockDim.x)
    ss += xr[i] * xr[i];
  return block_rms_inv_of(ss, cols, eps);
}

// The RMSNorm's block size for rows of `cols` (rmsnorm(), and the fused router launch, which
// must sum the same way).
inline int rmsnorm_block(int cols) { return cols >= 1024 ? 1024 : cols >= 256 ? 256 : 64; }

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

// KV cache elements: F32 rows (F32 models) or BF16 rows (every other model), read as F32
// (a BF16 value widens exactly, so a kernel over BF16 rows gives the bytes it gives over
// F32 rows holding the same rounded values).
__device__ __forceinline__ float kv_f32(float v) { return v; }
__device__ __forceinline__ float kv_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
// Four consecutive elements (16 bytes of F32 or 8 of BF16, aligned as such).
__device__ __forceinline__ float4 kv_load4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ float4 kv_load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(bf16_bits(u.x & 0xffffu), bf16_bits(u.x >> 16), bf16_bits(u.y & 0xffffu),
                     bf16_bits(u.y >> 16));
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

// q4k_scale_min from the 12 scale bytes held as three words (bytes 0-3, 4-7, 8-11), with
// shifts instead of indexing, so they stay in registers.
__device__ __forceinline__ void q4k_scale_min_words(uint32_t w0, uint32_t w1, uint32_t w2, int j,
                                                    float* s, float* m) {
  const auto byte = [](uint32_t w, int i) { return (w >> (8 * i)) & 255u; };
  if (j < 4) {
    *s = float(byte(w0, j) & 63);
    *m = float(byte(w1, j) & 63);
  } else {
    const int k = j - 4;
    *s = float((byte(w2, k) & 15) | ((byte(w0, k) >> 6) << 4));
    *m = float((byte(w2, k) >> 4) | ((byte(w1, k) >> 6) << 4));
  }
}

// A Q4_K weight, d * sc * q - dmin * m, rounded step by step (no contraction into an FMA), so
// every kernel that dequantizes Q4_K gives the same bits.
__device__ __forceinline__ float q4k_value(float d, float sc, float dmin, float mn, int q) {
  return __fsub_rn(__fmul_rn(__fmul_rn(d, sc), float(q)), __fmul_rn(dmin, mn));
}

// The copies are cp.async (global -> shared without registers): all of a warp's 16-byte
// pieces are in flight at once, rather than each load waiting for the store before it.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
// 8 bytes, or 8 zero bytes when !valid (gmem is then not read).
__device__ __forceinline__ void cp_async8_zfill(void* smem, const void* gmem, bool valid) {
  const int n = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(n));
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
// Waits until at most N of the thread's committed copy groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
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
// d += a b as mma_bf16, F16 in.
__device__ __forceinline__ void mma_f16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                        unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The two halves a 32-bit word holds (low one first), and back.
__device__ __forceinline__ __half2 half2_bits(uint32_t v) {
  return *reinterpret_cast<const __half2*>(&v);
}
__device__ __forceinline__ unsigned half2_word(__half2 h) {
  return *reinterpret_cast<const unsigned*>(&h);
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

// The grouped GEMMs' epilogue for two adjacent outputs (col, col + 1) of one row, at element
// o of out: phase 1 (kGateUp) BF16 silu(g) * u, as silu_mul_kernel computes it and
// convert_f32 rounds; phase 2 the F32 sums g. The second output only when `both` (col + 1 <
// n); one paired store when `pairs` (n even, so the pair is aligned).
template <bool kGateUp>
__device__ __forceinline__ void store_grouped_pair(void* out, size_t o, float g0, float g1,
                                                   float u0, float u1, bool both, bool pairs) {
  float v[2] = {g0, g1};
  if (kGateUp) {
    v[0] = g0 / (1.0f + expf(-g0)) * u0;
    v[1] = g1 / (1.0f + expf(-g1)) * u1;
  }
  if (kGateUp) {
    __nv_bfloat16* p = static_cast<__nv_bfloat16*>(out) + o;
    if (both && pairs) {
      *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v[0], v[1]);
    } else {
      p[0] = __float2bfloat16(v[0]);
      if (both) p[1] = __float2bfloat16(v[1]);
    }
  } else {
    float* p = static_cast<float*>(out) + o;
    if (both && pairs) {
      *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
    } else {
      p[0] = v[0];
      if (both) p[1] = v[1];
    }
  }
}

__device__ __forceinline__ void store_as(void* dst, DType type, size_t i, float v) {
  if (type == DType::kF32) static_cast<float*>(dst)[i] = v;
  else if (type == DType::kBF16) static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16(v);
  else static_cast<__half*>(dst)[i] = __float2half(v);
}

inline unsigned grid_for(int64_t n, int block = 256) {
  return unsigned(std::min<int64_t>((n + block - 1) / block, 65535 * 4));
}

}  // namespace
}  // namespace ts::cuda
