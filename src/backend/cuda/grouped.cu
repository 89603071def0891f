// Prefill helpers for the routed experts: gather / convert / dequantize, the rank-order slot
// sum, and the expert-grouped GEMMs on tensor cores (WMMA for Q8_0 blocks read in place,
// mma.sync for BF16).
#include "backend/cuda/kernels.cuh"

#include <mma.h>

#include "backend/cuda/device_util.cuh"

namespace ts::cuda {
namespace {

__global__ void gather_rows_kernel(const float* src, const int* src_row, int d, void* dst,
                                   DType type) {
  pdl_wait();
  const int i = blockIdx.y;
  const float* row = src + size_t(src_row[i]) * d;
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < d; c += gridDim.x * blockDim.x)
    store_as(dst, type, size_t(i) * d + c, row[c]);
}

// Two pairs of 16-bit values (BF16 or F16) as one 8-byte store's bits.
template <class Pair>
__device__ __forceinline__ uint2 pair_bits(Pair lo, Pair hi) {
  uint2 u;
  u.x = *reinterpret_cast<const uint32_t*>(&lo);
  u.y = *reinterpret_cast<const uint32_t*>(&hi);
  return u;
}

// Four elements a thread (d % 4 == 0), the grid striding over every row: the same values as
// gather_rows_kernel. That kernel's block of one row's 256 elements was mostly latency (a
// 512-token chunk's gather took ~46 us a layer for 20 MB: docs/PERF.md).
template <DType T>
__global__ void gather_rows4_kernel(const float* src, const int* src_row, int d, int64_t n4,
                                    void* dst) {
  pdl_wait();
  const int d4 = d / 4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / d4;
    const int c4 = int(i - r * d4);
    const float4 v = reinterpret_cast<const float4*>(src + size_t(src_row[r]) * d)[c4];
    if constexpr (T == DType::kF32) {
      static_cast<float4*>(dst)[i] = v;
    } else if constexpr (T == DType::kBF16) {
      static_cast<uint2*>(dst)[i] =
          pair_bits(__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w));
    } else {
      static_cast<uint2*>(dst)[i] =
          pair_bits(__floats2half2_rn(v.x, v.y), __floats2half2_rn(v.z, v.w));
    }
  }
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
      return q4k_value(d, sc, dmin, mn, (j & 1) ? q >> 4 : q & 15);
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

// Matrix blockIdx.y of list entry blockIdx.z of a dequantization (its source; block 0's
// thread 0 also points the entry's table at its copy), and where its copy goes.
__device__ __forceinline__ const uint8_t* dequant_source(const ExpertDequant& a) {
  const int m = blockIdx.y, j = blockIdx.z;
  if (!a.experts) return static_cast<const uint8_t*>(a.direct[m]);
  const int e = a.experts[j];
  if (a.dst_tab[m] && blockIdx.x == 0 && threadIdx.x == 0)
    a.dst_tab[m][e] = static_cast<uint8_t*>(a.dst) + size_t(j) * a.dst_stride + a.dst_off[m];
  return static_cast<const uint8_t*>(a.src_tab[m][e]);
}
__device__ __forceinline__ uint16_t* dequant_dest(const ExpertDequant& a) {
  return reinterpret_cast<uint16_t*>(static_cast<uint8_t*>(a.dst) +
                                     size_t(blockIdx.z) * a.dst_stride + a.dst_off[blockIdx.y]);
}

// Q8_0 -> BF16 by warps of 32 blocks (1,088 bytes in, 2,048 out): the blocks staged in
// shared memory with 16-byte copies when the source allows, converted a block per lane, and
// written back 16 bytes per lane in order. grid (ceil(max blocks / 256), 3, count).
constexpr int kDqWarps = 8;
__device__ __forceinline__ void dequantize_q8_blocks(const ExpertDequant& a) {
  const int m = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t nb = a.blocks[m];
  if (nb == 0) return;
  const uint8_t* src = dequant_source(a);
  uint16_t* dst = dequant_dest(a);
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

// Q4_K -> BF16 with the Q8_0 code's grid: a warp per 4 super-blocks (1,024 values), lane l
// writing values 8l .. 8l + 7 of each (sub-block l / 4: one scale and min, 8 quants from one
// 8-byte load where the source allows) as one 16-byte store.
__device__ __forceinline__ void dequantize_q4k_blocks(const ExpertDequant& a) {
  const int m = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t nsb = a.blocks[m] / 8;
  if (nsb == 0) return;
  const uint8_t* src = dequant_source(a);
  uint16_t* dst = dequant_dest(a);
  const int64_t sb0 = (int64_t(blockIdx.x) * kDqWarps + warp) * 4;
  const int sub = lane / 4;
  for (int64_t sb = sb0; sb < nsb && sb < sb0 + 4; ++sb) {
    const uint8_t* blk = src + size_t(sb) * 144;
    const float d = f16_bits(blk[0] | (uint32_t(blk[1]) << 8));
    const float dmin = f16_bits(blk[2] | (uint32_t(blk[3]) << 8));
    float sc, mn;
    q4k_scale_min(blk + 4, sub, &sc, &mn);
    const uint8_t* qp = blk + 16 + 32 * (sub / 2) + 8 * (lane % 4);
    uint8_t q[8];
    if ((reinterpret_cast<uintptr_t>(qp) & 7) == 0) {
      *reinterpret_cast<uint2*>(q) = *reinterpret_cast<const uint2*>(qp);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) q[i] = qp[i];
    }
    uint4 out;
    uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q0 = (sub & 1) ? q[2 * i] >> 4 : q[2 * i] & 15;
      const int q1 = (sub & 1) ? q[2 * i + 1] >> 4 : q[2 * i + 1] & 15;
      const __nv_bfloat162 v =
          __floats2bfloat162_rn(q4k_value(d, sc, dmin, mn, q0), q4k_value(d, sc, dmin, mn, q1));
      o[i] = *reinterpret_cast<const uint32_t*>(&v);
    }
    *reinterpret_cast<uint4*>(dst + size_t(sb) * 256 + 8 * lane) = out;
  }
}

// Each block dequantizes its matrix (blockIdx.y) by that matrix's type.
__global__ void __launch_bounds__(32 * kDqWarps) dequantize_experts_kernel(ExpertDequant a) {
  pdl_wait();
  if (a.type[blockIdx.y] == DType::kQ4_K)
    dequantize_q4k_blocks(a);
  else
    dequantize_q8_blocks(a);
}

__global__ void slot_sum_kernel(const float* rows, const int* row_of, const float* weights, int k,
                                int d, float* out) {
  pdl_wait();
  const int t = blockIdx.y;
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < d; c += gridDim.x * blockDim.x) {
    float total = 0;
    for (int r = 0; r < k; ++r)
      total = fmaf(weights[t * k + r], rows[size_t(row_of[t * k + r]) * d + c], total);
    out[size_t(t) * d + c] = total;
  }
}

// Four elements a thread (d % 4 == 0), the grid striding over every token: the same sums, in
// rank order, as slot_sum_kernel.
__global__ void slot_sum4_kernel(const float* rows, const int* row_of, const float* weights, int k,
                                 int d, int64_t n4, float* out) {
  pdl_wait();
  const int d4 = d / 4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / d4;
    const int c4 = int(i - t * d4);
    float4 total = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int r = 0; r < k; ++r) {
      const float w = weights[t * k + r];
      const float4 v = reinterpret_cast<const float4*>(rows + size_t(row_of[t * k + r]) * d)[c4];
      total.x = fmaf(w, v.x, total.x);
      total.y = fmaf(w, v.y, total.y);
      total.z = fmaf(w, v.z, total.z);
      total.w = fmaf(w, v.w, total.w);
    }
    reinterpret_cast<float4*>(out)[i] = total;
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
  if (past_plan(a)) return;
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
// pipe (docs/PERF.md). Steps of 32 columns through kMmaStages cp.async buffers (zero-filled
// past the edges), one barrier a step. Q8_0 weights stay on the kernel above when read in
// place (this one's Q8_0 loader, a thread per weight row, measured slower); long chunks run
// it on BF16 copies of them (dequantize_experts_bf16).
constexpr int kMmaN = 128, kMmaLd = kGK + 8;  // 80-byte rows: ldmatrix without bank conflicts
// BF16 elements per stage: x, w0 and (gate|up only) w1 tiles.
template <bool kGateUp>
constexpr int kMmaStage = (kGroupTile + (kGateUp ? 2 : 1) * kMmaN) * kMmaLd;
template <bool kGateUp, int kStages>
constexpr size_t kMmaSmem = size_t(kStages * kMmaStage<kGateUp>) * 2;
// cp.async buffers: 3 measured 5-7% faster prefill than 2 (docs/PERF.md); 4 no better.
constexpr int kMmaStages = 3;

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

// Runs `steps` steps through kStages cp.async buffers: issue(step, buffer) starts a step's
// copies, compute(buffer) runs once they landed, kStages - 1 steps in flight ahead of it. One
// commit group per step (empty past the last step, so the count of pending groups is always the
// same); a step's buffer is refilled only after every thread passed the barrier that follows
// its reading.
template <int kStages, class Issue, class Compute>
__device__ __forceinline__ void cp_async_pipeline(int steps, const Issue& issue,
                                                  const Compute& compute) {
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < steps) issue(st, st);
    cp_async_commit();
  }
  for (int step = 0; step < steps; ++step) {
    cp_async_wait_group<kStages - 2>();  // this step's copies landed
    __syncthreads();
    // The previous step's buffer: its readers passed the barrier.
    const int next = step + kStages - 1;
    if (next < steps) issue(next, next % kStages);
    cp_async_commit();
    compute(step % kStages);
  }
}

// The mma.sync kernels' epilogue: the thread's accumulators of rows 16 i + grp (+ 8) of the
// tile and outputs col0 + 8 j + 2 tig (+ 1), through store_grouped_pair.
template <bool kGateUp, int kMF, int kNT>
__device__ __forceinline__ void store_mma_tile(const GroupedArgs& a, const GroupTile& tile,
                                               int col0, const float (&acc0)[kMF][kNT][4],
                                               const float (&acc1)[kGateUp ? kMF : 1][kNT][4]) {
  const int lane = threadIdx.x % 32, grp = lane / 4, tig = lane % 4;
  const bool pairs = a.n % 2 == 0;
#pragma unroll
  for (int i = 0; i < kMF; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * i + grp + 8 * h;
      if (r >= tile.m) continue;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const int col = col0 + 8 * j + 2 * tig;
        if (col >= a.n) continue;
        const size_t o = size_t(tile.row0 + r) * size_t(a.n) + size_t(col);
        const int iu = kGateUp ? i : 0;  // phase 2 has no up (acc1 is one row)
        store_grouped_pair<kGateUp>(a.out, o, acc0[i][j][2 * h], acc0[i][j][2 * h + 1],
                                    acc1[iu][j][2 * h], acc1[iu][j][2 * h + 1], col + 1 < a.n,
                                    pairs);
      }
    }
}

template <bool kGateUp, int kStages>
__global__ void __launch_bounds__(128) grouped_mma_kernel(GroupedArgs a) {
  pdl_wait();
  if (past_plan(a)) return;
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
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
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
  constexpr int kStage = kMmaStage<kGateUp>;
  const auto xs_of = [&](int b) { return stage0 + b * kStage; };
  const auto w0s_of = [&](int b) { return stage0 + b * kStage + kGroupTile * kMmaLd; };
  const auto w1s_of = [&](int b) { return stage0 + b * kStage + (kGroupTile + kMmaN) * kMmaLd; };
  const auto issue = [&](int step, int b) {  // a step's loads into buffer b
    mma_copy_bf16<kGroupTile>(x, tile.m, a.k, step * kGK, xs_of(b));
    mma_copy_bf16<kMmaN>(w0, n_rows, a.k, step * kGK, w0s_of(b));
    if (kGateUp) mma_copy_bf16<kMmaN>(w1, n_rows, a.k, step * kGK, w1s_of(b));
  };
  cp_async_pipeline<kStages>(steps, issue, [&](int b) {
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
  });
  store_mma_tile<kGateUp>(a, tile, n0 + wc, acc0, acc1);
}

// The grouped GEMMs for Q8_0 weights (k a multiple of 128) and Q4_K weights read in place: the
// warp layout of grouped_mma_kernel (64 rows x kN outputs a block, each warp all 64 rows x
// kN / 4 outputs on mma.sync m16n8k16), with the weights' raw bytes staged by cp.async — Q8_0
// 128 columns a stage (4 blocks, 136 bytes a row, 8-byte pieces), Q4_K 256 (one super-block,
// 144 bytes a row, 16-byte pieces) —, kQStages stages in flight, and each B fragment
// dequantized from shared memory as it is needed: the thread's two pairs of quants with their
// block's scale (Q4_K: sub-block scale and min, q4k_value's steps), rounded to BF16 (the value
// dequantize_bf16 gives). The WMMA kernel above stages a single 32-column step through
// registers, one step ahead: at ~32 rows per expert (a 512-token prompt over 128 experts) it
// read Q8_0 weights at ~20% of DRAM bandwidth (docs/PERF.md). Row fragments past the tile's
// rows are skipped (warp-uniform). Every output sums its columns in one fixed order, wherever
// the weights live. Phase 1 on F16 x (kF16; the session keeps it to inputs F16 can hold)
// builds F16 fragments instead — Q8_0: one byte permute makes a pair of halves 1024 + q + 128,
// an exact subtraction gives q, one multiply the nearest F16 of d q; Q4_K: a permute and a
// mask make 1024 + q, an exact subtraction, one fused multiply-add by d sc and -dmin m — on
// F16 MMAs: a fifth fewer instructions than the BF16 conversions, which bound the kernel.
//
// Columns a stage, bytes a weight row takes in it, cp.async piece: Q8_0 or Q4_K.
template <bool kQ4K>
constexpr int kQStep = kQ4K ? 256 : 128;
template <bool kQ4K>
constexpr int kQRowBytes = kQ4K ? 144 : 136;
template <bool kQ4K>
constexpr int kQPiece = kQ4K ? 16 : 8;
// x rows in BF16, 16 bytes past the step (272 / 528 bytes: ldmatrix without conflicts).
template <bool kQ4K>
constexpr int kQXLd = kQStep<kQ4K> + 8;
// Outputs per block: phase 1 64, phase 2 128 (Q8_0 on 64-row tiles: 168 registers and 70 KB
// of shared memory each, 3 blocks an SM); two stages. Measured against 128 / 128, 64 / 64,
// 128 / 64 and three or four stages (fewer blocks an SM): docs/PERF.md.
constexpr int kQGateUpN = 64, kQDownN = 128, kQStages = 2;
template <bool kGateUp, int kN, int kM, bool kQ4K>
constexpr size_t kQStage = size_t(kM) * kQXLd<kQ4K> * 2 +
                           size_t(kGateUp ? 2 : 1) * kN* kQRowBytes<kQ4K>;
// Blocks an SM the registers are held to (shared memory allows as many): Q8_0 three on tiles of
// 64 rows, four on tiles of 32; Q4_K (two stages of 104 KB on tiles of 64 rows) two.
template <int kM, bool kQ4K>
constexpr int kQMinBlocks = kM == kQuantSmallTile ? 4
                            : kQ4K                ? 2
                                                  : 3;
// kF16: phase 1 on F16 x (GroupedArgs::x_f16), the weights converted to F16 and the products
// on F16 MMAs; else BF16.
template <bool kGateUp, int kN, int kM, bool kQ4K, bool kF16>
__global__ void __launch_bounds__(128, (kQMinBlocks<kM, kQ4K>))
    grouped_quant_mma_kernel(GroupedArgs a) {
  constexpr int kStep = kQStep<kQ4K>, kRowBytes = kQRowBytes<kQ4K>, kPiece = kQPiece<kQ4K>;
  constexpr int kXLd = kQXLd<kQ4K>;
  pdl_wait();
  if (past_plan(a)) return;
  constexpr int kNT = kN / 32;  // 8-output tiles per warp
  constexpr int kMF = kM / 16;  // 16-row fragments per tile
  extern __shared__ __align__(128) unsigned char q_smem[];
  const GroupTile tile = a.tiles[blockIdx.y];
  const int n0 = blockIdx.x * kN;
  const int n_rows = min(kN, a.n - n0);  // weight rows of this block
  const size_t w_row = kQ4K ? size_t(a.k / 256) * 144 : size_t(a.k / 32) * 34;
  const uint8_t* w0 =
      static_cast<const uint8_t*>(a.direct0 ? a.direct0 : a.w0[tile.expert]) + size_t(n0) * w_row;
  const uint8_t* w1 = kGateUp
                          ? static_cast<const uint8_t*>(a.direct1 ? a.direct1 : a.w1[tile.expert]) +
                                size_t(n0) * w_row
                          : nullptr;
  const uint8_t* x = static_cast<const uint8_t*>(a.x) + size_t(tile.row0) * size_t(a.k) * 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / 4, tig = lane % 4;
  const int mi = lane / 8, mr = lane % 8, wc = warp * (kN / 4);
  const int steps = a.k / kStep;
  const int m_frags = (tile.m + 15) / 16;

  float acc0[kMF][kNT][4], acc1[kGateUp ? kMF : 1][kNT][4];
#pragma unroll
  for (int i = 0; i < kMF; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        acc0[i][j][c] = 0.0f;
        if (kGateUp) acc1[i][j][c] = 0.0f;
      }
  // Stage layout: x [kM][kXLd] BF16, then w0 [kN][kRowBytes] and w1 [kN][kRowBytes] raw bytes.
  const auto xs_of = [&](int b) {
    return reinterpret_cast<__nv_bfloat16*>(q_smem + size_t(b) * kQStage<kGateUp, kN, kM, kQ4K>);
  };
  const auto ws_of = [&](int b, int m) {
    return q_smem + size_t(b) * kQStage<kGateUp, kN, kM, kQ4K> + size_t(kM) * kXLd * 2 +
           size_t(m) * kN * kRowBytes;
  };
  const auto issue = [&](int step, int b) {  // a step's copies into buffer b
    __nv_bfloat16* xs = xs_of(b);
    const int k0 = step * kStep;
#pragma unroll
    for (int i = 0; i < kM * (kStep / 8) / 128; ++i) {
      const int c = threadIdx.x + 128 * i, row = c / (kStep / 8), piece = c % (kStep / 8);
      const bool ok = row < tile.m;
      const uint8_t* src = ok ? x + (size_t(row) * a.k + k0 + piece * 8) * 2 : x;
      cp_async16_zfill(xs + row * kXLd + piece * 8, src, ok);
    }
#pragma unroll
    for (int m = 0; m < (kGateUp ? 2 : 1); ++m) {
      const uint8_t* w = (m == 0 ? w0 : w1) + size_t(step) * kRowBytes;
      uint8_t* ws = ws_of(b, m);
      for (int c = threadIdx.x; c < kN * (kRowBytes / kPiece); c += 128) {
        const int row = c / (kRowBytes / kPiece), piece = c % (kRowBytes / kPiece);
        const bool ok = row < n_rows;
        const uint8_t* src = ok ? w + size_t(row) * w_row + piece * kPiece : w;
        if constexpr (kQ4K)
          cp_async16_zfill(ws + row * kRowBytes + piece * kPiece, src, ok);
        else
          cp_async8_zfill(ws + row * kRowBytes + piece * kPiece, src, ok);
      }
    }
  };
  // B fragment of 8 outputs (rows r0 .. r0 + 7 of the staged weights) and 16 columns at c0:
  // the thread's row r0 + grp, columns c0 + 2 tig (+1) and c0 + 8 + 2 tig (+1).
  const auto b_frag = [&](const uint8_t* ws, int r0, int c0, unsigned& b0, unsigned& b1) {
    if constexpr (kQ4K) {
      // One super-block a row: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
      // quants (column c in byte 16 + 32 (c / 64) + c % 32, the high nibble for odd sub-blocks
      // of 32). The 16 columns lie in one sub-block.
      const uint8_t* blk = ws + (r0 + grp) * kRowBytes;
      const int sub = c0 / 32;
      const float d = f16_bits(*reinterpret_cast<const uint16_t*>(blk));
      const float dmin = f16_bits(*reinterpret_cast<const uint16_t*>(blk + 2));
      float sc, mn;
      q4k_scale_min(blk + 4, sub, &sc, &mn);
      const uint8_t* q = blk + 16 + 32 * (sub / 2) + c0 % 32 + 2 * tig;
      const uint32_t p = (uint32_t(*reinterpret_cast<const uint16_t*>(q)) |
                          uint32_t(*reinterpret_cast<const uint16_t*>(q + 8)) << 16) >>
                         (4 * (sub & 1));
      if constexpr (kF16) {
        // Each nibble pair made halves 1024 + q (a permute and a mask), less 1024 (exact),
        // times d sc less dmin m, each rounded to F16, in one fused step.
        const __half2 s2 = __float2half2_rn(__fmul_rn(d, sc));
        const __half2 m2 = __float2half2_rn(-__fmul_rn(dmin, mn));
        const __half2 k1024 = half2_bits(0x64006400u);
        const uint32_t h01 = (__byte_perm(p, 0, 0x4140) & 0x000f000fu) | 0x64006400u;
        const uint32_t h23 = (__byte_perm(p, 0, 0x4342) & 0x000f000fu) | 0x64006400u;
        b0 = half2_word(__hfma2(__hsub2(half2_bits(h01), k1024), s2, m2));
        b1 = half2_word(__hfma2(__hsub2(half2_bits(h23), k1024), s2, m2));
        return;
      }
      b0 = pack_bf16(q4k_value(d, sc, dmin, mn, int(p & 15)),
                     q4k_value(d, sc, dmin, mn, int((p >> 8) & 15)));
      b1 = pack_bf16(q4k_value(d, sc, dmin, mn, int((p >> 16) & 15)),
                     q4k_value(d, sc, dmin, mn, int((p >> 24) & 15)));
      return;
    }
    const uint8_t* blk = ws + (r0 + grp) * kRowBytes + (c0 / 32) * 34;
    if constexpr (kF16) {
      // F16 values: each quant pair biased to unsigned and made the low bytes of the halves
      // 1024 + q + 128 by one byte permute, less 1152 (exact), times the block's scale (one
      // rounding: the F16 nearest d q).
      const uint32_t dh = *reinterpret_cast<const uint16_t*>(blk);
      const uint8_t* q = blk + 2 + c0 % 32 + 2 * tig;
      const uint32_t u = (uint32_t(*reinterpret_cast<const uint16_t*>(q)) |
                          uint32_t(*reinterpret_cast<const uint16_t*>(q + 8)) << 16) ^
                         0x80808080u;
      const __half2 d2 = half2_bits(dh | dh << 16), k1152 = half2_bits(0x64806480u);
      b0 = half2_word(__hmul2(__hsub2(half2_bits(__byte_perm(u, 0x64646464u, 0x4140)), k1152), d2));
      b1 = half2_word(__hmul2(__hsub2(half2_bits(__byte_perm(u, 0x64646464u, 0x4342)), k1152), d2));
      return;
    }
    const float d = f16_bits(*reinterpret_cast<const uint16_t*>(blk));
    const uint8_t* q = blk + 2 + c0 % 32 + 2 * tig;
    // The four quants biased to unsigned (q + 128) and each made the low byte of the float
    // 2^23 + q + 128: one byte permute and one exact subtraction a value on full-rate pipes,
    // where int8 -> float conversions run at a fraction of the rate and bound the kernel.
    const uint32_t u = (uint32_t(*reinterpret_cast<const uint16_t*>(q)) |
                        uint32_t(*reinterpret_cast<const uint16_t*>(q + 8)) << 16) ^
                       0x80808080u;
    constexpr float kMagic = 8388736.0f;  // 2^23 + 128
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      v[i] = __int_as_float(int(__byte_perm(u, 0x4b000000u, 0x7650u + unsigned(i)))) - kMagic;
    b0 = pack_bf16(d * v[0], d * v[1]);
    b1 = pack_bf16(d * v[2], d * v[3]);
  };
  // The fragments' type: F16 or BF16.
  const auto mma = [](float(&d)[4], const unsigned(&fa)[4], unsigned b0, unsigned b1) {
    if constexpr (kF16)
      mma_f16(d, fa, b0, b1);
    else
      mma_bf16(d, fa, b0, b1);
  };
  cp_async_pipeline<kQStages>(steps, issue, [&](int b) {
    const __nv_bfloat16* xs = xs_of(b);
    const uint8_t* ws0 = ws_of(b, 0);
    const uint8_t* ws1 = ws_of(b, 1);
#pragma unroll 2
    for (int kk = 0; kk < kStep; kk += 16) {
      unsigned fa[kMF][4];
#pragma unroll
      for (int i = 0; i < kMF; ++i)
        if (i < m_frags)
          ldsm_x4(fa[i], xs + (16 * i + (mi % 2) * 8 + mr) * kXLd + kk + (mi / 2) * 8);
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        unsigned b0, b1;
        b_frag(ws0, wc + 8 * j, kk, b0, b1);
#pragma unroll
        for (int i = 0; i < kMF; ++i)
          if (i < m_frags) mma(acc0[i][j], fa[i], b0, b1);
        if (kGateUp) {
          b_frag(ws1, wc + 8 * j, kk, b0, b1);
#pragma unroll
          for (int i = 0; i < kMF; ++i)
            if (i < m_frags) mma(acc1[i][j], fa[i], b0, b1);
        }
      }
    }
  });
  store_mma_tile<kGateUp>(a, tile, n0 + wc, acc0, acc1);
}

// group_plan: one block. Counts per expert (shared-memory atomics), the prefix and the tile
// rule by thread 0, then the slots placed blockDim at a time: a slot's row is its expert's
// next free row, plus the slots of that expert in earlier warps of the round
// (wc[warp][expert]), plus those in earlier lanes of its own warp (__match_any_sync) — the
// slot order, as the host's counting sort had it.
constexpr int kPlanThreads = 1024, kPlanWarps = kPlanThreads / 32;

__global__ void __launch_bounds__(kPlanThreads) group_plan_kernel(GroupPlanArgs a) {
  __shared__ int first[kMaxExperts + 1], next[kMaxExperts], tile0[kMaxExperts];
  __shared__ uint8_t wc[kPlanWarps][kMaxExperts];
  __shared__ int plan_tile_rows, plan_tiled;
  pdl_wait();
  const int ne = a.n_experts, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int e = tid; e < ne; e += kPlanThreads) next[e] = 0;
  for (int i = tid; i < kPlanWarps * ne; i += kPlanThreads) wc[i / ne][i % ne] = 0;
  __syncthreads();
  for (int s = tid; s < a.ns; s += kPlanThreads) atomicAdd(&next[a.ids[s]], 1);
  __syncthreads();
  if (tid == 0) {
    int at = 0, used = 0, most = 0;
    for (int e = 0; e < ne; ++e) {
      const int c = next[e];
      first[e] = at;
      next[e] = at;
      at += c;
      used += c > 0;
      most = max(most, c);
    }
    first[ne] = at;
    const bool dq = a.dq_min_rows > 0 && (!a.in_place || a.ns >= a.dq_min_rows * used);
    const int tr = dq                                         ? a.dq_tile
                   : a.small_tile > 0 && most <= a.small_tile ? a.small_tile
                                                              : a.tile;
    const bool tiled = a.in_place || dq;
    int nt = 0;
    for (int e = 0; e < ne; ++e) {
      tile0[e] = nt;
      if (tiled) nt += (first[e + 1] - first[e] + tr - 1) / tr;
    }
    int* sum = a.summary;
    sum[ne + 1] = used;
    sum[ne + 2] = most;
    sum[ne + 3] = nt;
    sum[ne + 4] = tr;
    sum[ne + 5] = dq;
    plan_tile_rows = tr;
    plan_tiled = tiled;
  }
  __syncthreads();
  for (int e = tid; e <= ne; e += kPlanThreads) a.summary[e] = first[e];
  if (plan_tiled) {
    const int tr = plan_tile_rows;
    for (int e = tid; e < ne; e += kPlanThreads) {
      int t = tile0[e];
      for (int off = first[e]; off < first[e + 1]; off += tr)
        a.tiles[t++] = GroupTile{e, off, min(tr, first[e + 1] - off)};
    }
  }
  for (int s0 = 0; s0 < a.ns; s0 += kPlanThreads) {
    const int s = s0 + tid;
    const int e = s < a.ns ? a.ids[s] : -1;
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(same & ((1u << lane) - 1u));
    if (e >= 0 && rank == 0) wc[warp][e] = uint8_t(__popc(same));
    __syncthreads();
    if (e >= 0) {
      int before = 0;
      for (int w = 0; w < warp; ++w) before += wc[w][e];
      const int row = next[e] + before + rank;
      a.src[row] = s / a.k;
      a.row_of[s] = row;
    }
    __syncthreads();
    for (int x = tid; x < ne; x += kPlanThreads) {
      int round = 0;
      for (int w = 0; w < kPlanWarps; ++w) {
        round += wc[w][x];
        wc[w][x] = 0;
      }
      next[x] += round;
    }
    __syncthreads();
  }
}

}  // namespace

// ---------------------------------------------------------------- host launchers

// Blocks for a grid-striding loop over n items of 256-thread blocks: enough to fill the
// GPU several times over, never more than there are items.
static unsigned stride_grid(int64_t n) {
  return unsigned(std::clamp<int64_t>((n + 255) / 256, 1, 2048));
}

void gather_rows(const float* src, const int* src_row, int n_rows, int d, void* dst,
                 DType dst_type, cudaStream_t s) {
  if (d % 4 != 0) {
    const dim3 grid(unsigned((d + 255) / 256), unsigned(n_rows));
    launch_kernel(gather_rows_kernel, grid, 256, 0, s, src, src_row, d, dst, dst_type);
    return;
  }
  const int64_t n4 = int64_t(n_rows) * (d / 4);
  auto kernel = dst_type == DType::kF32    ? gather_rows4_kernel<DType::kF32>
                : dst_type == DType::kBF16 ? gather_rows4_kernel<DType::kBF16>
                                           : gather_rows4_kernel<DType::kF16>;
  launch_kernel(kernel, stride_grid(n4), 256, 0, s, src, src_row, d, n4, dst);
}

void convert_f32(const float* src, void* dst, DType dst_type, int64_t n, cudaStream_t s) {
  launch_kernel(convert_kernel, grid_for(n), 256, 0, s, src, dst, dst_type, n);
}

void dequantize_bf16(const DevMatrix& w, void* dst, cudaStream_t s) {
  launch_kernel(dequantize_kernel, grid_for(w.rows * w.cols), 256, 0, s, 
      static_cast<const uint8_t*>(w.data), w.dtype, w.row_bytes(), w.rows, w.cols, dst,
      DType::kBF16);
}

void dequantize_experts_bf16(const ExpertDequant& a, cudaStream_t s) {
  const int64_t most = std::max({a.blocks[0], a.blocks[1], a.blocks[2]});
  if (most == 0 || a.count == 0) return;
  const dim3 grid(unsigned((most + 32 * kDqWarps - 1) / (32 * kDqWarps)), 3, unsigned(a.count));
  launch_kernel(dequantize_experts_kernel, grid, 32 * kDqWarps, 0, s, a);
}

void to_f32(const DevMatrix& w, float* dst, cudaStream_t s) {
  launch_kernel(dequantize_kernel, grid_for(w.rows * w.cols), 256, 0, s, 
      static_cast<const uint8_t*>(w.data), w.dtype, w.row_bytes(), w.rows, w.cols, dst,
      DType::kF32);
}

void group_plan(const GroupPlanArgs& a, cudaStream_t s) {
  launch_kernel(group_plan_kernel, 1, kPlanThreads, 0, s, a);
}

void slot_sum(const float* rows, const int* row_of, const float* weights, int n, int k, int d,
              float* out, cudaStream_t s) {
  if (d % 4 != 0) {
    const dim3 grid(unsigned((d + 255) / 256), unsigned(n));
    launch_kernel(slot_sum_kernel, grid, 256, 0, s, rows, row_of, weights, k, d, out);
    return;
  }
  const int64_t n4 = int64_t(n) * (d / 4);
  launch_kernel(slot_sum4_kernel, stride_grid(n4), 256, 0, s, rows, row_of, weights, k, d, n4, out);
}

int grouped_tile_rows(DType type) {
  return type == DType::kBF16 && grouped_wgmma_available() ? kWgTile : kGroupTile;
}

bool grouped_supports(DType type, int64_t cols) {
  if (type == DType::kBF16) return cols % 8 == 0;
  if (type == DType::kQ8_0) return cols % 32 == 0;
  if (type == DType::kQ4_K) return cols % 256 == 0;
  return false;
}

bool grouped_takes_f16(DType type, int64_t cols) {
  return (type == DType::kQ8_0 && cols % kQStep<false> == 0) ||
         (type == DType::kQ4_K && cols % kQStep<true> == 0);
}

namespace {
// Q8_0 / Q4_K weights read in place: tiles of kQuantSmallTile or kGroupTile rows, F16 or BF16 x.
template <bool kGateUp, int kN, bool kQ4K, bool kF16>
void launch_quant(const GroupedArgs& a, cudaStream_t s) {
  const bool small = a.tile_rows <= kQuantSmallTile;
  const size_t smem = kQStages * (small ? kQStage<kGateUp, kN, kQuantSmallTile, kQ4K>
                                        : kQStage<kGateUp, kN, kGroupTile, kQ4K>);
  const auto kernel = small ? grouped_quant_mma_kernel<kGateUp, kN, kQuantSmallTile, kQ4K, kF16>
                            : grouped_quant_mma_kernel<kGateUp, kN, kGroupTile, kQ4K, kF16>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  const dim3 grid(unsigned((a.n + kN - 1) / kN), unsigned(a.n_tiles));
  launch_kernel(kernel, grid, 128, smem, s, a);
}

// Both phases: BF16 weights on the warpgroup-MMA kernels where the device and build have them
// (grouped_sm90.cu), else grouped_mma_kernel; Q8_0 (k a multiple of 128) and Q4_K read in place
// by grouped_quant_mma_kernel, other Q8_0 on the WMMA grouped_gemm_kernel.
template <bool kGateUp>
void launch_grouped(const GroupedArgs& a, cudaStream_t s) {
  if (a.n_tiles == 0) return;
  if (grouped_tile_rows(a.dtype) == kWgTile) {
    grouped_wgmma(kGateUp, a, s);
    return;
  }
  if (a.dtype == DType::kBF16) {
    grouped_mma(kGateUp, a, s);
    return;
  }
  if (grouped_takes_f16(a.dtype, a.k)) {  // Q8_0 / Q4_K read in place
    constexpr int kN = kGateUp ? kQGateUpN : kQDownN;
    const bool q4k = a.dtype == DType::kQ4_K;
    if constexpr (kGateUp) {  // phase 1 only: phase 2 reads BF16 h
      if (a.x_f16) {
        q4k ? launch_quant<true, kN, true, true>(a, s) : launch_quant<true, kN, false, true>(a, s);
        return;
      }
    }
    q4k ? launch_quant<kGateUp, kN, true, false>(a, s)
        : launch_quant<kGateUp, kN, false, false>(a, s);
    return;
  }
  const dim3 grid(unsigned((a.n + kGroupTile - 1) / kGroupTile), unsigned(a.n_tiles));
  launch_kernel(grouped_gemm_kernel<kGateUp>, grid, 128, 0, s, a);
}

template <bool kGateUp>
void launch_mma(const GroupedArgs& a, cudaStream_t s) {
  constexpr size_t smem = kMmaSmem<kGateUp, kMmaStages>;
  const auto kernel = grouped_mma_kernel<kGateUp, kMmaStages>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  const dim3 grid(unsigned((a.n + kMmaN - 1) / kMmaN), unsigned(a.n_tiles));
  launch_kernel(kernel, grid, 128, smem, s, a);
}
}  // namespace

void grouped_mma(bool gate_up, const GroupedArgs& a, cudaStream_t s) {
  if (a.n_tiles == 0) return;
  gate_up ? launch_mma<true>(a, s) : launch_mma<false>(a, s);
}

void grouped_gate_up(const GroupedArgs& a, cudaStream_t s) { launch_grouped<true>(a, s); }

void grouped_down(const GroupedArgs& a, cudaStream_t s) { launch_grouped<false>(a, s); }

}  // namespace ts::cuda
