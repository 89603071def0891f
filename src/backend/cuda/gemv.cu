// GEMV kernels (a warp per weight row; 16-byte loads; Q8_0 rows through shared tiles, with
// Q8 activations on dp4a), the router's top-k, and the routed-expert decode pass: phase 1
// (gate|up + SiLU) and phase 2 (down + weighted sum in rank order) through per-layer tables
// of expert addresses.
#include "backend/cuda/kernels.cuh"

#include "backend/cuda/device_util.cuh"

namespace ts::cuda {
namespace {

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

// A Q8_0 block's 32 quants as 8 words (blk: the block's 17 halfwords, the scale first).
__device__ __forceinline__ void q8_block_words(const uint16_t* blk, int (&w32)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
    w32[i] = int(uint32_t(blk[1 + 2 * i]) | uint32_t(blk[2 + 2 * i]) << 16);
}

// The 32 products of w32 and x0|x1 (int8 each) summed by dp4a.
__device__ __forceinline__ int dp4a8(const int (&w)[8], int4 x0, int4 x1) {
  int s = __dp4a(w[0], x0.x, 0);
  s = __dp4a(w[1], x0.y, s);
  s = __dp4a(w[2], x0.z, s);
  s = __dp4a(w[3], x0.w, s);
  s = __dp4a(w[4], x1.x, s);
  s = __dp4a(w[5], x1.y, s);
  s = __dp4a(w[6], x1.z, s);
  return __dp4a(w[7], x1.w, s);
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
    q8_block_words(blk, w32);
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (t < nt) {
        const int4* xv = reinterpret_cast<const int4*>(xq + size_t(t) * cols + (b0 + b) * 32);
        const int s = dp4a8(w32, xv[0], xv[1]);
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

// acc[t] += row . x[t] for Q4_K weights and Q8 activations (xq int8 [t][cols], xd one scale
// per 32 values), rows 16-byte aligned with cols % 256 == 0 (in global or shared memory).
// Lane p takes pairs of sub-blocks p, p + 32, ...: pair p is sub-blocks 2(p % 4) and
// 2(p % 4) + 1 of super-block p / 4, the low and high nibbles of the same 32 bytes (two
// 16-byte loads). Per sub-block, as the CPU's int8 kernels: d_x * (d * sc * sum(q * q_x) -
// dmin * m * sum(q_x)), the integer sums by dp4a.
template <int NT>
__device__ __forceinline__ void q4k_q8_dot(const uint8_t* row, const int8_t* xq, const float* xd,
                                           int cols, int nt, float (&acc)[NT], int lane) {
  const int pairs = cols / 64, nb = cols / 32;
  for (int p = lane; p < pairs; p += 32) {
    const uint8_t* blk = row + size_t(p / 4) * 144;
    const int j = 2 * (p % 4);
    const uint4 h = *reinterpret_cast<const uint4*>(blk);  // d, dmin, scales[12]
    const float d = f16_bits(h.x & 0xffff), dmin = f16_bits(h.x >> 16);
    float sc0, mn0, sc1, mn1;
    q4k_scale_min_words(h.y, h.z, h.w, j, &sc0, &mn0);
    q4k_scale_min_words(h.y, h.z, h.w, j + 1, &sc1, &mn1);
    const uint4* qv = reinterpret_cast<const uint4*>(blk + 16 + 32 * (p % 4));
    const uint4 q0 = qv[0], q1 = qv[1];
    const int qw[8] = {int(q0.x), int(q0.y), int(q0.z), int(q0.w),
                       int(q1.x), int(q1.y), int(q1.z), int(q1.w)};
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (t < nt) {
        const int4* xv = reinterpret_cast<const int4*>(xq + size_t(t) * cols + size_t(p) * 64);
        const int4 x0 = xv[0], x1 = xv[1], x2 = xv[2], x3 = xv[3];
        const int xa[16] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w,
                            x2.x, x2.y, x2.z, x2.w, x3.x, x3.y, x3.z, x3.w};
        int s0 = 0, s1 = 0, m0 = 0, m1 = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          s0 = __dp4a(qw[i] & 0x0f0f0f0f, xa[i], s0);
          s1 = __dp4a((qw[i] >> 4) & 0x0f0f0f0f, xa[8 + i], s1);
          m0 = __dp4a(0x01010101, xa[i], m0);
          m1 = __dp4a(0x01010101, xa[8 + i], m1);
        }
        const float* xs = xd + size_t(t) * nb + 2 * p;
        acc[t] += xs[0] * (d * sc0 * float(s0) - dmin * mn0 * float(m0)) +
                  xs[1] * (d * sc1 * float(s1) - dmin * mn1 * float(m1));
      }
  }
}

// Rows staged whole by the MoE kernels: up to this many bytes per warp (8 down rows of 1,024
// columns, or a gate and an up row of 4,096), all copies in flight at once. Same lane order
// as row_dot_q8q8, so the same sums to the bit.
constexpr int kStagedBytes = 8 * 1088;

// row . x for any weight type; Q8_0 and Q4_K rows take the Q8 activations (xq, xd) when
// given.
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
  if constexpr (T == DType::kQ4_K) {
    if (xq) {
      q4k_q8_dot<NT>(row, xq, xd, cols, nt, acc, lane);
      return;
    }
  }
  row_dot<T, NT>(row, x, cols, nt, acc, lane);
}

constexpr int kWarps = kRowWarps;

// bytes (even) from src to dst in shared memory by one warp: cp.async where both are
// 16-byte aligned (wait with warp_copy_wait), else 2-byte loads and stores.
__device__ __forceinline__ void warp_stage(uint8_t* dst, const uint8_t* src, int bytes, int lane) {
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0 &&
      bytes % 16 == 0) {
    warp_copy_async(dst, src, bytes, lane);
    return;
  }
  for (int i = lane * 2; i < bytes; i += 64)
    *reinterpret_cast<uint16_t*>(dst + i) = *reinterpret_cast<const uint16_t*>(src + i);
}

// A warp's share of row . x for a float row staged in shared memory (BF16 / F16: cols a
// multiple of 8; F32: of 4), in row_dot<T, 1>'s order: the same sums as from global memory.
template <DType T>
__device__ __forceinline__ float staged_row_dot(const uint8_t* rs, const float* x, int cols,
                                                int lane) {
  float acc = 0.0f;
  if constexpr (T == DType::kF32) {
    const float* w = reinterpret_cast<const float*>(rs);
#pragma unroll 4
    for (int c = lane * 4; c < cols; c += 128)
      acc += dot4(*reinterpret_cast<const float4*>(w + c), *reinterpret_cast<const float4*>(x + c));
  } else {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(rs);
#pragma unroll 4
    for (int c = lane * 8; c < cols; c += 256) {
      float wf[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(w + c), wf);
      const float4* xv = reinterpret_cast<const float4*>(x + c);
      acc += dot4(make_float4(wf[0], wf[1], wf[2], wf[3]), xv[0]) +
             dot4(make_float4(wf[4], wf[5], wf[6], wf[7]), xv[1]);
    }
  }
  return acc;
}

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
  const int8_t* xq;  // x as Q8 blocks (Q8_0 and Q4_K weights only), or null
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

// One token, rows of up to kStagedBytes (gemv_staged): the warp's whole row staged in one
// go in dynamic shared memory, the copy started before the wait (the weights do not depend
// on the kernels before, so it overlaps the previous kernel: programmatic dependent launch,
// pdl_wait). Q8_0 (with Q8 activations): lane j takes blocks j, j + 32, ... in order, as
// row_dot_q8q8 (which stages 64 blocks at a time, so a 4,096-column row such as
// qwen3-30b-a3b's wo waited on two copies one after the other); Q4_K (with Q8 activations)
// as q4k_q8_dot; BF16 / F16 in row_dot's order (staged_row_dot). The same sums as gemv_kernel
// either way.
template <DType T>
__global__ void gemv_staged_kernel(GemvParams p) {
  extern __shared__ float4 gemv_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t r = int64_t(blockIdx.x) * kWarps + warp;
  const bool has_row = r < p.total_rows;
  int part = 0;
  uint8_t* tile = reinterpret_cast<uint8_t*>(gemv_smem) + size_t(warp) * p.row_bytes;
  if (has_row) {
    while (part + 1 < p.parts && r >= p.rows[part]) r -= p.rows[part++];
    warp_stage(tile, p.w[part] + size_t(r) * p.row_bytes, int(p.row_bytes), lane);
  }
  pdl_wait();
  if (!has_row) return;
  warp_copy_wait();
  float v;
  if constexpr (T == DType::kQ8_0) {
    float acc[1] = {};
    q8q8_tile_dot<1>(tile, 0, p.cols / 32, p.xq, p.xd, p.cols, 1, acc, lane);
    v = warp_sum(acc[0]);
  } else if constexpr (T == DType::kQ4_K) {
    float acc[1] = {};
    q4k_q8_dot<1>(tile, p.xq, p.xd, p.cols, 1, acc, lane);
    v = warp_sum(acc[0]);
  } else {
    v = warp_sum(staged_row_dot<T>(tile, p.x, p.cols, lane));
  }
  if (lane == 0) {
    float* y = p.y[part] + size_t(r);
    *y = p.accumulate ? *y + v : v;
  }
}

// Whether a GEMV takes gemv_staged_kernel: one token; Q8_0 or Q4_K with Q8 activations and
// rows of a multiple of 256 columns, or BF16 / F16 rows of a multiple of 8; rows within
// kStagedBytes.
bool gemv_staged(DType t, const GemvParams& p) {
  if (p.n != 1 || p.row_bytes > size_t(kStagedBytes)) return false;
  if (t == DType::kQ8_0 || t == DType::kQ4_K) return p.xq && p.cols % 256 == 0;
  return (t == DType::kBF16 || t == DType::kF16) && p.cols % 8 == 0;
}

constexpr int kRoutePer = kMaxExperts / 32;
// The top-k in the expert phases (MoeArgs::route) holds a lane's probabilities in registers
// beside the phases' own: up to kMaxPhaseRouteExperts experts (the session checks).
constexpr int kPhaseRoutePer = kMaxPhaseRouteExperts / 32;

// Token t's softmax over its logits by one warp: lane holds experts lane, lane + 32, ...
// (-1 past n_experts). The logits are read from L2 (__ldcg): norm_route_kernel routes on
// logits other blocks of the same grid wrote. The loops stop at the last group of 32 that
// holds an expert (warp-uniform), so 128 experts take 4 of kRoutePer steps; the steps skipped
// would add 0 to the sum and -inf to the max, so the bits are those of the full loop.
template <int kPer = kRoutePer>
__device__ __forceinline__ void route_probs(const RouteArgs& a, int t, int lane, float (&p)[kPer]) {
  const int used = (a.n_experts + 31) / 32;
  const float* lg = a.logits + size_t(t) * a.n_experts;
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    p[i] = i < used && e < a.n_experts ? __ldcg(lg + e) : -INFINITY;
    mx = fmaxf(mx, p[i]);
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (i >= used) break;
    const int e = lane + 32 * i;
    p[i] = e < a.n_experts ? expf(p[i] - mx) : 0.0f;
    sum += p[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kPer; ++i) p[i] = lane + 32 * i < a.n_experts ? p[i] / sum : -1.0f;
}

// With host_flag: once the warp's lanes have written the host ids, *host_flag = 1 (every
// lane's host writes are visible system-wide first). Called by the whole warp.
__device__ __forceinline__ void raise_host_flag(const RouteArgs& a, int lane) {
  if (!a.host_flag) return;
  __threadfence_system();
  __syncwarp();
  if (lane == 0) *reinterpret_cast<volatile int*>(a.host_flag) = 1;
}

// Token t's routing by one warp: top_k rounds of a warp-wide argmax (ties to the lower id).
// Writes ids, weights and hist where a.ids is set; returns the id at rank `want` (every lane).
// Without a.ids the rounds stop at `want` (phase 1 ranking its own slot: slot_expert). Ranks
// that no probability fills (only with NaN probabilities) name expert 0 with weight 0, as
// block_route_one's do, so every id indexes the tables.
// kPer: groups of 32 experts a lane holds (n_experts <= 32 kPer; fewer take fewer registers,
// same bits).
template <int kPer = kRoutePer>
__device__ __forceinline__ int route_token(const RouteArgs& a, int t, int lane, int want = -1) {
  float p[kPer];
  route_probs(a, t, lane, p);
  float picked_sum = 0, mine_w = 0.0f;
  int mine_e = 0, wanted = 0;
  const int rounds = a.ids ? a.top_k : want + 1;
  // Groups of 32 past the last expert hold only -1 (none is ever picked while a probability
  // is left): the scans stop where route_probs' do.
  const int used = (a.n_experts + 31) / 32;
  for (int r = 0; r < rounds; ++r) {
    float best = -2.0f;
    int best_e = INT_MAX;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (i < used && p[i] > best) {  // strictly greater: the lower id wins ties in a lane
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
    if (!(best >= 0.0f)) {  // no probability left (NaN ones): expert 0, weight 0
      best_e = 0;
      best = 0.0f;
    }
    if (r == want) wanted = best_e;
    if (!a.ids) continue;
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
  if (!a.ids) return wanted;
  if (a.renormalize && a.top_k > 32) {
    __syncwarp();
    for (int r = lane; r < a.top_k; r += 32) a.weights[size_t(t) * a.top_k + r] /= picked_sum;
  }
  raise_host_flag(a, lane);
  return wanted;
}

// One token's routing by a whole block (norm_route_kernel's last): warp 0 takes the
// probabilities as route_token does, then every expert's rank at once (how many experts beat
// it: a higher probability, or the same and a lower id, route_token's order), g threads per
// expert counting a share each, instead of top_k rounds of a warp-wide argmax one after the
// other. A share is every g-th group of 4 experts, read as one float4 (the probabilities are
// padded to a multiple of 4 with -inf, which beats and ties nothing). The same ids and
// weights as route_token, summed in rank order.
__device__ __forceinline__ int rank_beats(float pj, int j, float pe, int e) {
  return int(pj > pe) | (int(pj == pe) & int(j < e));
}

__device__ __forceinline__ void block_route_one(const RouteArgs& a) {
  __shared__ float4 probs4[kMaxExperts / 4];
  __shared__ int sel_e[kMaxExperts];
  __shared__ float sel_p[kMaxExperts];
  float* probs = reinterpret_cast<float*>(probs4);
  const int lane = threadIdx.x % 32, ne = a.n_experts, groups = (ne + 3) / 4;
  if (threadIdx.x < 32) {
    // Slots no rank fills (only with NaN probabilities) still name an expert.
    for (int r = lane; r < a.top_k; r += 32) {
      sel_e[r] = 0;
      sel_p[r] = 0.0f;
    }
    float p[kRoutePer];
    route_probs(a, 0, lane, p);
#pragma unroll
    for (int i = 0; i < kRoutePer; ++i)
      if (lane + 32 * i < ne) probs[lane + 32 * i] = p[i];
    if (lane < 4 * groups - ne) probs[ne + lane] = -INFINITY;
  }
  __syncthreads();
  int g = 1;  // threads per expert: a power of two up to 32, so a group is within a warp
  while (g < 32 && 2 * g * ne <= int(blockDim.x)) g *= 2;
  const int per_pass = int(blockDim.x) / g;
  for (int e0 = 0; e0 < ne; e0 += per_pass) {
    const int e = e0 + int(threadIdx.x) / g, part = int(threadIdx.x) % g;
    const float pe = e < ne ? probs[e] : 0.0f;
    int rank = 0;
    if (e < ne) {
#pragma unroll 4
      for (int c = part; c < groups; c += g) {
        const float4 v = probs4[c];
        rank += rank_beats(v.x, 4 * c, pe, e) + rank_beats(v.y, 4 * c + 1, pe, e) +
                rank_beats(v.z, 4 * c + 2, pe, e) + rank_beats(v.w, 4 * c + 3, pe, e);
      }
    }
    for (int o = g / 2; o > 0; o >>= 1) rank += __shfl_xor_sync(0xffffffffu, rank, o);
    // A NaN probability (all are, where one logit is NaN or +inf) beats nothing and is beaten
    // by nothing, so its rank would be 0 for every expert: such experts take no rank, and
    // every rank names expert 0 with weight 0, as route_token's do.
    if (e < ne && part == 0 && rank < a.top_k && pe >= 0.0f) {
      sel_e[rank] = e;
      sel_p[rank] = pe;
    }
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  float picked_sum = 0;
  for (int r = 0; r < a.top_k; ++r) picked_sum += sel_p[r];
  for (int r = lane; r < a.top_k; r += 32) {
    const int e = sel_e[r];
    a.ids[r] = e;
    if (a.host_ids) a.host_ids[r] = e;
    a.weights[r] = a.renormalize ? sel_p[r] / picked_sum : sel_p[r];
    if (a.hist) atomicAdd(a.hist + e, 1ull);
  }
  raise_host_flag(a, lane);
}

// One warp per token.
__global__ void route_kernel(RouteArgs a) {
  pdl_wait();
  const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (t < a.n) route_token(a, t, lane);
}

// One token: block rmsnorm_block(d), a.rows experts per block (warps 0 .. rows - 1 score
// one each), dynamic shared memory norm_route_smem(d, rows, row bytes). Before the wait
// (the weights do not depend on earlier kernels, so this overlaps the previous kernel) the
// block stages the norm weights and its router rows in shared memory. Then every block
// normalizes x there (the bits rmsnorm_kernel writes), block 0 also to xn (and its Q8
// copy), and each scoring warp takes its row's dot product in row_dot's order (the logits
// gemv_kernel gives). Each block then makes its logits visible device-wide and counts
// itself; the last one resets the counter for the next launch and routes
// (block_route_one, reading the logits from L2).
constexpr int kNormRouteRows = 8;

__host__ __device__ constexpr size_t norm_route_smem(int d, int rows, size_t row_bytes) {
  return size_t(d) * 8 + size_t(rows) * row_bytes;
}

template <DType T, bool kRouteHere>
__global__ void __launch_bounds__(1024) norm_route_kernel(NormRouteArgs a) {
  extern __shared__ float4 norm_route_smem4[];
  const int d = a.d, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* xs = reinterpret_cast<float*>(norm_route_smem4);
  float* ws = xs + d;
  uint8_t* rs = reinterpret_cast<uint8_t*>(ws + d) + size_t(warp) * a.row_bytes;
  const int e = blockIdx.x * a.rows + warp;
  const bool scores = warp < a.rows && e < a.route.n_experts;
  for (int i = threadIdx.x; i < d; i += blockDim.x) ws[i] = a.norm_w[i];
  if (scores)
    warp_stage(rs, static_cast<const uint8_t*>(a.router) + size_t(e) * a.row_bytes,
               int(a.row_bytes), lane);
  pdl_wait();
  constexpr int kKeep = 4;  // x elements per thread held in registers (d <= 4,096 all)
  float xv[kKeep];
  const float inv = block_rms_inv(a.x, d, a.eps, xv);  // its barriers also publish ws
  const auto put = [&](int i, float xi) {
    const float v = xi * inv * ws[i];
    xs[i] = v;
    if (blockIdx.x == 0) {
      a.xn[i] = v;
      if (a.xq.q) warp_quantize_q8(v, size_t(i), a.xq);
    }
  };
#pragma unroll
  for (int u = 0; u < kKeep; ++u) {
    const int i = threadIdx.x + u * blockDim.x;
    if (i < d) put(i, xv[u]);
  }
  for (int i = threadIdx.x + kKeep * blockDim.x; i < d; i += blockDim.x) put(i, a.x[i]);
  warp_copy_wait();
  __syncthreads();
  if (scores) {
    const float acc = staged_row_dot<T>(rs, xs, d, lane);
    const float v = warp_sum(acc);
    if (lane == 0) a.logits[e] = v;
  }
  if constexpr (!kRouteHere) return;  // the expert phases rank the logits (MoeArgs::route)
  // The last block counts itself: the barrier orders every thread's writes before thread
  // 0's fence, which is cumulative, so one fence per block (as cooperative groups' grid sync)
  // instead of one per thread before the count and again after it (+0.7% decode, docs/PERF.md).
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(a.counter, 1u) == gridDim.x - 1;
    if (last) *a.counter = 0;
    __threadfence();
  }
  __syncthreads();
  if (!last) return;
  block_route_one(a.route);
}

// Slot s's expert in phase 1: read from ids, or (MoeArgs::route) ranked by warp 0 from the
// router's logits and handed to the block's other warps through `picked`, kRouteSmem bytes of
// dynamic shared memory that only launches with a route add (so the kernels' shared memory,
// and what fits beside them on an SM, is unchanged without one). Every thread of the block
// calls it. The phase kernels take it as a template choice (kRoute), so without a route they
// are the code they were before it existed.
constexpr size_t kRouteSmem = 16;

// Token t's expert at rank `want` in the phases (route_token's rounds, every lane); `record`:
// also writes ids, weights and hist (one block of the grid does).
__device__ __forceinline__ int phase_rank(RouteArgs ra, int t, int lane, int want, bool record) {
  if (!record) {
    ra.ids = nullptr;
    ra.hist = nullptr;
  }
  return route_token<kPhaseRoutePer>(ra, t, lane, want);
}

__device__ __forceinline__ int slot_expert(const MoeArgs& a, int s, int* picked) {
  if (threadIdx.x < 32) {
    const int e = phase_rank(a.route, 0, int(threadIdx.x), s, blockIdx.x == 0 && s == 0);
    if (threadIdx.x == 0) *picked = e;
  }
  __syncthreads();
  return *picked;
}

// grid (ceil(d_expert / kWarps), n * top_k): warp per (slot, row). kRoute: the slot's expert
// ranked here (MoeArgs::route), else read from ids.
template <DType T, bool kRoute>
__device__ __forceinline__ void gate_up_rows(const MoeArgs& a) {
  pdl_wait();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = blockIdx.x * kWarps + warp, s = blockIdx.y;
  int e = 0;
  if constexpr (kRoute) {
    extern __shared__ int4 gate_up_rows_smem[];  // kRouteSmem
    e = slot_expert(a, s, reinterpret_cast<int*>(gate_up_rows_smem));
  }
  if (r >= a.d_expert || (a.slot_mask && a.slot_mask[s] != a.mask_value)) return;
  if constexpr (!kRoute) e = a.ids[s];
  const int t = s / a.top_k;
  const size_t rb = dtype_row_bytes_dev(T, a.d_model);
  const float* x = a.xn + size_t(t) * a.d_model;
  float g[1] = {}, u[1] = {};
  const uint8_t* gr = static_cast<const uint8_t*>(a.gate[e]) + size_t(r) * rb;
  const uint8_t* ur = static_cast<const uint8_t*>(a.up[e]) + size_t(r) * rb;
  const int8_t* xq = a.xq ? a.xq + size_t(t) * a.d_model : nullptr;
  const float* xd = a.xd ? a.xd + size_t(t) * (a.d_model / 32) : nullptr;
  row_dot_any<T, 1>(gr, x, xq, xd, a.d_model, 1, g, lane);
  row_dot_any<T, 1>(ur, x, xq, xd, a.d_model, 1, u, lane);
  const float gv = warp_sum(g[0]), uv = warp_sum(u[0]);
  if (lane == 0) a.h[size_t(s) * a.d_expert + r] = gv / (1.0f + expf(-gv)) * uv;
}

template <DType T, bool kRoute>
__global__ void moe_gate_up_kernel(MoeArgs a) {
  gate_up_rows<T, kRoute>(a);
}

// Q8_0 experts with Q8 activations, rows of up to kStagedBytes / 2 (moe_gate_up_staged):
// the warp's gate and up rows staged at once in dynamic shared memory sized to them, and no
// other shared memory, so qwen3-30b-a3b's 1,536 blocks run in one wave (12 blocks of 4 warps
// per SM: 17 KB and at most 40 registers each; with a fixed 8.5 KB per warp plus the row
// kernels' tile it was 5 per SM, 2.3 waves). Same sums as gate_up_rows (q8q8_tile_dot's),
// with the lane's first block of x loaded before the wait for the rows (+1.1% decode,
// docs/PERF.md thirteenth session).
template <bool kRoute>
__global__ void __launch_bounds__(32 * kWarps, 12) moe_gate_up_q8_kernel(MoeArgs a) {
  pdl_wait();
  extern __shared__ float4 gate_up_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = blockIdx.x * kWarps + warp, s = blockIdx.y;
  int e = 0;
  if constexpr (kRoute)  // the route's scratch past the rows' tiles
    e = slot_expert(
        a, s,
        reinterpret_cast<int*>(reinterpret_cast<uint8_t*>(gate_up_smem) +
                               kWarps * 2 * dtype_row_bytes_dev(DType::kQ8_0, a.d_model)));
  if (r >= a.d_expert || (a.slot_mask && a.slot_mask[s] != a.mask_value)) return;
  if constexpr (!kRoute) e = a.ids[s];
  const int t = s / a.top_k;
  const size_t rb = dtype_row_bytes_dev(DType::kQ8_0, a.d_model);
  uint8_t* tile = reinterpret_cast<uint8_t*>(gate_up_smem) + size_t(warp) * 2 * rb;
  warp_copy_async(tile, static_cast<const uint8_t*>(a.gate[e]) + size_t(r) * rb, int(rb), lane);
  warp_copy_async(tile + rb, static_cast<const uint8_t*>(a.up[e]) + size_t(r) * rb, int(rb), lane);
  const int nb = a.d_model / 32;
  const int8_t* xq = a.xq + size_t(t) * a.d_model;
  const float* xd = a.xd + size_t(t) * nb;
  // The lane's first block of x, loaded while the rows stream (nb >= 8: d_model % 256 == 0).
  int4 f0 = make_int4(0, 0, 0, 0), f1 = f0;
  float fd = 0.0f;
  if (lane < nb) {
    f0 = reinterpret_cast<const int4*>(xq + lane * 32)[0];
    f1 = reinterpret_cast<const int4*>(xq + lane * 32)[1];
    fd = xd[lane];
  }
  warp_copy_wait();
  // q8q8_tile_dot's sums, gate and up side by side.
  float g = 0.0f, u = 0.0f;
  for (int b = lane; b < nb; b += 32) {
    int4 x0 = f0, x1 = f1;
    float xdb = fd;
    if (b != lane) {
      x0 = reinterpret_cast<const int4*>(xq + b * 32)[0];
      x1 = reinterpret_cast<const int4*>(xq + b * 32)[1];
      xdb = xd[b];
    }
    const uint8_t* gb = tile + b * 34;
    const uint8_t* ub = tile + rb + b * 34;
    int w[8];
    q8_block_words(reinterpret_cast<const uint16_t*>(gb), w);
    const int sg = dp4a8(w, x0, x1);
    q8_block_words(reinterpret_cast<const uint16_t*>(ub), w);
    const int su = dp4a8(w, x0, x1);
    g += f16_bits(reinterpret_cast<const uint16_t*>(gb)[0]) * xdb * float(sg);
    u += f16_bits(reinterpret_cast<const uint16_t*>(ub)[0]) * xdb * float(su);
  }
  const float gv = warp_sum(g), uv = warp_sum(u);
  if (lane == 0) a.h[size_t(s) * a.d_expert + r] = gv / (1.0f + expf(-gv)) * uv;
}

// Whether phase 1 takes moe_gate_up_q8_kernel (rows 16-byte aligned: a multiple of 256
// columns; both rows within kStagedBytes).
bool moe_gate_up_staged(const MoeArgs& a) {
  const size_t rb = dtype_row_bytes(DType::kQ8_0, a.d_model);
  return a.gate_dtype == DType::kQ8_0 && a.xq && a.d_model % 256 == 0 &&
         2 * rb <= size_t(kStagedBytes);
}
// BF16 / F16: 12 blocks of 4 warps per SM (40 registers), so qwen3-30b-a3b's 1,536 blocks
// (8 experts x 768 rows) run in one wave instead of 1.16 (gate_up_wide decides).
template <DType T, bool kRoute>
__global__ void __launch_bounds__(32 * kWarps, 12) moe_gate_up_wide_kernel(MoeArgs a) {
  gate_up_rows<T, kRoute>(a);
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

// Phase 2 with a warp per (rank, kRankRows output rows): grid (ceil(d_model / kRankRows), n),
// block 32 * top_k (top_k <= kMaxRankWarps), dynamic shared memory top_k * kRankRows rows.
// Warp k stages rank k's rows r0 .. r0 + kRankRows - 1 and computes their dot products
// (BF16/F16: lane j takes 8-column chunks j, j + 32, ..., as row_dot; Q8_0: blocks j, j + 32,
// ..., with Q8 h as moe_down_sum_kernel's staged path, with F32 h (no hq) each block's
// weights times h; Q4_K: with Q8 h as q4k_q8_dot), each reduced by warp_sum; the sums meet in
// shared memory and thread j adds row j's, weighted, in rank order. Per token the sum is over
// ranks in order whatever the residency. kRankRows rows per warp keep qwen3-30b-a3b's grid
// to one wave (512 blocks; a row per warp was 2,048 blocks, ~2 waves).
//
// The rows' copies start before the wait: the ids were written by the router, a kernel
// before the one before this (phase 1, and for Q4_K h's quantization after it), so complete
// once that one has passed its own wait, which it has when this one launches, the tables and the
// rows are weights, and with the GPU expert cache this launch also waits on the copies' event. Only
// h (and its Q8 copy), written by the kernel before, is read after the wait. With the top-k in
// phase 1 (MoeArgs::route) phase 1 writes the ids, so each warp ranks the router's logits itself.
constexpr int kMaxRankWarps = 8;
constexpr int kRankRows = 4;
constexpr int kRankRowBytes = 1088;  // Q8_0 rows staged per warp: up to 1,024 columns
constexpr size_t kRankMaxSmem = 96 * 1024;

// Q8_0 is held to 64 registers, 4 blocks of 256 threads per SM: with the F32-h loop below it
// would take 76 (3 per SM: qwen3-30b-a3b's 512 blocks in 1.3 waves). Not fewer: at 46 and 40
// registers (5 and 6 per SM) the kernel alone is as fast, but a decode step is 1-4% slower, as
// more of its blocks crowd onto the SMs phase 1 frees first (docs/PERF.md, thirteenth session).
template <DType T>
constexpr int kRankMinBlocks = T == DType::kQ8_0 ? 4 : 1;

template <DType T, bool kRoute>
__global__ void __launch_bounds__(32 * kMaxRankWarps, kRankMinBlocks<T>)
    moe_down_rank_kernel(MoeArgs a) {
  extern __shared__ float4 rank_smem[];
  const int k = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r0 = blockIdx.x * kRankRows, t = blockIdx.y, s = t * a.top_k + k;
  const int rows = min(kRankRows, a.d_model - r0);
  const size_t rb = dtype_row_bytes_dev(T, a.d_expert);
  int e;
  if constexpr (kRoute) {
    // The top-k in phase 1 (MoeArgs::route): the ids are phase 1's, the kernel just before,
    // so not to be read before the wait; the logits are the router's, two kernels back. Warp
    // k ranks them up to its own rank, as phase 1's blocks do (the weights, read after the
    // wait, are phase 1's).
    e = phase_rank(a.route, t, lane, k, false);
  } else {
    e = __ldcg(a.ids + s);
  }
  const uint8_t* row0 = reinterpret_cast<const uint8_t*>(
                            __ldcg(reinterpret_cast<const unsigned long long*>(a.down) + e)) +
                        size_t(r0) * rb;
  uint8_t* staged = reinterpret_cast<uint8_t*>(rank_smem) + size_t(k) * kRankRows * rb;
#pragma unroll
  for (int j = 0; j < kRankRows; ++j)
    if (j < rows) warp_stage(staged + size_t(j) * rb, row0 + size_t(j) * rb, int(rb), lane);
  pdl_wait();
  __shared__ float sums[kRankRows][kMaxRankWarps];
  float acc[kRankRows] = {};
  warp_copy_wait();
  if constexpr (T == DType::kQ4_K) {
#pragma unroll
    for (int j = 0; j < kRankRows; ++j) {
      float aj[1] = {};
      if (j < rows)
        q4k_q8_dot<1>(staged + size_t(j) * rb, a.hq + size_t(s) * a.d_expert,
                      a.hd + size_t(s) * (a.d_expert / 32), a.d_expert, 1, aj, lane);
      acc[j] = aj[0];
    }
  } else if constexpr (T == DType::kQ8_0) {
    const int nb = a.d_expert / 32;
    if (a.hq) {
#pragma unroll
      for (int j = 0; j < kRankRows; ++j) {
        float aj[1] = {};
        if (j < rows)
          q8q8_tile_dot<1>(staged + size_t(j) * rb, 0, nb, a.hq + size_t(s) * a.d_expert,
                           a.hd + size_t(s) * nb, a.d_expert, 1, aj, lane);
        acc[j] = aj[0];
      }
    } else {
      // F32 h: lane b takes block b (b + 32, ...) of every row, h read four values at a time
      // for all rows (each row's block sum in pair order, as one pass per row would).
      const float* h = a.h + size_t(s) * a.d_expert;
      for (int b = lane; b < nb; b += 32) {
        float sum[kRankRows] = {};
        const float4* hb = reinterpret_cast<const float4*>(h + b * 32);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float4 v = hb[i];
#pragma unroll
          for (int j = 0; j < kRankRows; ++j) {
            if (j >= rows) break;
            const uint16_t* blk =
                reinterpret_cast<const uint16_t*>(staged + size_t(j) * rb + b * 34);
            const uint16_t q0 = blk[1 + 2 * i], q1 = blk[2 + 2 * i];
            sum[j] += float(int8_t(q0 & 0xff)) * v.x + float(int8_t(q0 >> 8)) * v.y;
            sum[j] += float(int8_t(q1 & 0xff)) * v.z + float(int8_t(q1 >> 8)) * v.w;
          }
        }
#pragma unroll
        for (int j = 0; j < kRankRows; ++j) {
          if (j >= rows) break;
          const uint16_t* blk = reinterpret_cast<const uint16_t*>(staged + size_t(j) * rb + b * 34);
          acc[j] += f16_bits(blk[0]) * sum[j];
        }
      }
    }
  } else {
    const float* h = a.h + size_t(s) * a.d_expert;
#pragma unroll 2
    for (int c = lane * 8; c < a.d_expert; c += 256) {
      const float4* xv = reinterpret_cast<const float4*>(h + c);
      const float4 x0 = xv[0], x1 = xv[1];
      const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
      for (int j = 0; j < kRankRows; ++j) {
        if (j >= rows) break;
        const uint16_t* w = reinterpret_cast<const uint16_t*>(staged + size_t(j) * rb);
        float wf[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(w + c), wf);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[j] += wf[2 * i] * xs[2 * i] + wf[2 * i + 1] * xs[2 * i + 1];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kRankRows; ++j) {
    const float v = warp_sum(acc[j]);
    if (lane == 0) sums[j][k] = v;
  }
  __syncthreads();
  if (int(threadIdx.x) < rows) {
    const int j = threadIdx.x;
    float total = 0;
    for (int q = 0; q < a.top_k; ++q) total += a.weights[t * a.top_k + q] * sums[j][q];
    float* o = a.out + size_t(t) * a.d_model + r0 + j;
    *o = a.accumulate ? *o + total : total;
  }
}

size_t moe_down_rank_smem(const MoeArgs& a) {
  return size_t(a.top_k) * kRankRows * dtype_row_bytes(a.down_dtype, a.d_expert);
}

// Whether moe_down_rank_kernel takes phase 2 (else moe_down_sum_kernel).
bool moe_down_by_rank(const MoeArgs& a) {
  if (a.top_k < 1 || a.top_k > kMaxRankWarps || moe_down_rank_smem(a) > kRankMaxSmem) return false;
  if (a.down_dtype == DType::kBF16 || a.down_dtype == DType::kF16) return a.d_expert % 8 == 0;
  if (a.down_dtype == DType::kQ4_K) return a.hq && a.d_expert % 256 == 0;
  return a.down_dtype == DType::kQ8_0 && (a.hq || a.h) && a.d_expert % 256 == 0 &&
         dtype_row_bytes(DType::kQ8_0, a.d_expert) <= size_t(kRankRowBytes);
}

}  // namespace

bool moe_down_f32_h(const MoeArgs& a) {
  MoeArgs f = a;
  f.hq = nullptr;
  f.hd = nullptr;
  return f.down_dtype == DType::kQ8_0 && f.h && moe_down_by_rank(f);
}

bool down_q8_h() {
  static const bool on = [] {
    const char* e = std::getenv("TURBOSPARK_CUDA_DOWN_Q8H");
    return e && std::string_view(e) == "1";
  }();
  return on;
}

namespace {

// One dtype's GEMV: gemv_staged_kernel where it applies (gemv_staged), else gemv_kernel.
template <DType T, int NT>
void launch_gemv_as(const GemvParams& p, dim3 grid, cudaStream_t s) {
  if constexpr (T == DType::kF16 || T == DType::kBF16 || T == DType::kQ8_0 || T == DType::kQ4_K) {
    if (gemv_staged(T, p)) {
      launch_kernel(gemv_staged_kernel<T>, grid, 32 * kWarps, size_t(kWarps) * p.row_bytes, s, p);
      return;
    }
  }
  launch_kernel(gemv_kernel<T, NT>, grid, 32 * kWarps, 0, s, p);
}

template <int NT>
void launch_gemv(const DevMatrix& w, const GemvParams& p, cudaStream_t s) {
  const dim3 grid(unsigned((p.total_rows + kWarps - 1) / kWarps), unsigned((p.n + NT - 1) / NT));
  switch (w.dtype) {
    case DType::kF32:
      launch_gemv_as<DType::kF32, NT>(p, grid, s);
      break;
    case DType::kF16:
      launch_gemv_as<DType::kF16, NT>(p, grid, s);
      break;
    case DType::kBF16:
      launch_gemv_as<DType::kBF16, NT>(p, grid, s);
      break;
    case DType::kQ8_0:
      launch_gemv_as<DType::kQ8_0, NT>(p, grid, s);
      break;
    case DType::kQ4_K:
      launch_gemv_as<DType::kQ4_K, NT>(p, grid, s);
      break;
  }
}

}  // namespace

// ---------------------------------------------------------------- host launchers

void gemv(const DevMatrix& w, const float* x, int n, float* y, bool accumulate, cudaStream_t s) {
  gemv_parts(&w, &y, 1, {x}, n, accumulate, s);
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

void route_spec(const RouteArgs& a, cudaStream_t s);  // kernels.cu

void route(const RouteArgs& a, cudaStream_t s) {
  if (!a.plain()) return route_spec(a, s);
  launch_kernel(route_kernel, unsigned((a.n + 3) / 4), 128, 0, s, a);
}

namespace {
// Opt-in shared memory per block on sm_90 (227 KiB) less the kernel's static arrays.
constexpr size_t kNormRouteMaxSmem = 218 * 1024;
}  // namespace

bool norm_route_applies(DType router_dtype, int d) {
  const bool float_type =
      router_dtype == DType::kF32 || router_dtype == DType::kBF16 || router_dtype == DType::kF16;
  // d % 32: the Q8 copy's blocks are whole warps (as rmsnorm()); x, the norm weights and one
  // router row in shared memory.
  return float_type && d % 32 == 0 &&
         norm_route_smem(d, 1, size_t(dtype_row_bytes(router_dtype, d))) <= kNormRouteMaxSmem;
}

void norm_route(const NormRouteArgs& args, cudaStream_t s) {
  NormRouteArgs a = args;
  a.route.logits = a.logits;
  const int block = a.block > 0 ? a.block : rmsnorm_block(a.d);
  const size_t rb = size_t(dtype_row_bytes(a.router_dtype, a.d));
  a.row_bytes = rb;
  a.rows = int(std::min<size_t>(std::min(kNormRouteRows, block / 32),
                                (kNormRouteMaxSmem - size_t(a.d) * 8) / rb));
  const unsigned grid = unsigned((a.route.n_experts + a.rows - 1) / a.rows);
  const size_t smem = norm_route_smem(a.d, a.rows, rb);
  const auto pick = [&]<bool kHere>() {
    return a.router_dtype == DType::kF32   ? norm_route_kernel<DType::kF32, kHere>
           : a.router_dtype == DType::kF16 ? norm_route_kernel<DType::kF16, kHere>
                                           : norm_route_kernel<DType::kBF16, kHere>;
  };
  const auto kernel =
      a.route_here ? pick.template operator()<true>() : pick.template operator()<false>();
  // Per device, so set at every launch (a host-side call); a failure shows at the launch.
  // (The static shared memory counts against the 48 KiB default too.)
  if (smem > 32 * 1024)
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  launch_kernel(kernel, grid, unsigned(block), smem, s, a);
}

namespace {
// BF16 / F16 phase 1 takes the 40-register kernel when that turns a grid of more than one
// wave into one (qwen3-30b-a3b: 1,536 blocks, 10 -> 12 blocks per SM on 132 SMs); grids of
// several waves either way keep the default kernel, which measured faster on them (Mixtral,
// docs/PERF.md). Same arithmetic in both. (Q4_K's phase 1, 54 registers, measured slower
// held to 40: it spills; docs/PERF.md.)
template <DType T>
bool gate_up_wide(const MoeArgs& a, unsigned blocks) {
  if (a.force_wide >= 0) return a.force_wide == 1;
  static const std::pair<unsigned, unsigned> wave = [] {
    int dev = 0, sms = 0, narrow = 0, wide = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&narrow, moe_gate_up_kernel<T, false>,
                                                  32 * kWarps, 0);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&wide, moe_gate_up_wide_kernel<T, false>,
                                                  32 * kWarps, 0);
    return std::pair{unsigned(narrow * sms), unsigned(wide * sms)};
  }();
  return blocks > wave.first && blocks <= wave.second;
}

template <DType T, bool kRoute>
void launch_gate_up_16(const MoeArgs& a, dim3 grid, cudaStream_t s) {
  const auto kernel = gate_up_wide<T>(a, grid.x * grid.y) ? moe_gate_up_wide_kernel<T, kRoute>
                                                          : moe_gate_up_kernel<T, kRoute>;
  launch_kernel(kernel, grid, 32 * kWarps, kRoute ? kRouteSmem : 0, s, a);
}

// Grid (ranks, 2: gate and up), each thread asking chunks of kPrefetchChunk bytes of its
// expert's matrix into L2. The matrix is widened to 16-byte bounds (the bulk prefetch's unit;
// an expert's matrix lies inside one allocation, whose bounds are 256-byte aligned).
constexpr uintptr_t kPrefetchChunk = 16 * 1024;

__global__ void prefetch_experts_kernel(PrefetchArgs a) {
  pdl_wait();
  const int e = a.ids[blockIdx.x];
  if (e < 0) return;
  const void* const* tab = blockIdx.y == 0 ? a.gate : a.up;
  const uintptr_t base = reinterpret_cast<uintptr_t>(tab[e]);
  const uintptr_t lo = base & ~uintptr_t(15), hi = (base + a.bytes + 15) & ~uintptr_t(15);
  for (uintptr_t p = lo + threadIdx.x * kPrefetchChunk; p < hi; p += blockDim.x * kPrefetchChunk) {
    const unsigned n = unsigned(hi - p < kPrefetchChunk ? hi - p : kPrefetchChunk);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(n) : "memory");
#endif
  }
}

__global__ void count_predicted_kernel(const int* pred, const int* real, int layers, int top_k,
                                       unsigned long long* hits) {
  pdl_wait();
  unsigned long long h = 0, n = 0;
  for (int i = threadIdx.x; i < layers * top_k; i += blockDim.x) {
    const int l = i / top_k;
    if (real[l * top_k] < 0 || pred[l * top_k] < 0) continue;
    ++n;
    for (int j = 0; j < top_k; ++j) h += pred[l * top_k + j] == real[i];
  }
  atomicAdd(hits, h);
  atomicAdd(hits + 1, n);
}

}  // namespace

void prefetch_experts(const PrefetchArgs& a, cudaStream_t s) {
  launch_kernel(prefetch_experts_kernel, dim3(unsigned(a.ranks), 2u), 128, 0, s, a);
}

void count_predicted(const int* pred, const int* real, int layers, int top_k,
                     unsigned long long* hits, cudaStream_t s) {
  launch_kernel(count_predicted_kernel, 1, 256, 0, s, pred, real, layers, top_k, hits);
}

namespace {
template <bool kRoute>
void launch_gate_up(const MoeArgs& a, cudaStream_t s) {
  const dim3 grid(unsigned((a.d_expert + kWarps - 1) / kWarps), unsigned(a.n * a.top_k));
  const size_t route = kRoute ? kRouteSmem : 0;
  switch (a.gate_dtype) {
    case DType::kF32:
      launch_kernel(moe_gate_up_kernel<DType::kF32, kRoute>, grid, 32 * kWarps, route, s, a);
      break;
    case DType::kF16:
      launch_gate_up_16<DType::kF16, kRoute>(a, grid, s);
      break;
    case DType::kBF16:
      launch_gate_up_16<DType::kBF16, kRoute>(a, grid, s);
      break;
    case DType::kQ8_0:
      if (moe_gate_up_staged(a))
        launch_kernel(moe_gate_up_q8_kernel<kRoute>, grid, 32 * kWarps,
                      size_t(kWarps) * 2 * dtype_row_bytes(DType::kQ8_0, a.d_model) + route, s, a);
      else
        launch_kernel(moe_gate_up_kernel<DType::kQ8_0, kRoute>, grid, 32 * kWarps, route, s, a);
      break;
    case DType::kQ4_K:
      launch_kernel(moe_gate_up_kernel<DType::kQ4_K, kRoute>, grid, 32 * kWarps, route, s, a);
      break;
  }
}

template <bool kRoute>
void launch_down_rank(const MoeArgs& a, cudaStream_t s) {
  const dim3 grid(unsigned((a.d_model + kRankRows - 1) / kRankRows), unsigned(a.n));
  const unsigned block = unsigned(32 * a.top_k);
  const size_t smem = moe_down_rank_smem(a);
  const auto kernel = a.down_dtype == DType::kBF16   ? moe_down_rank_kernel<DType::kBF16, kRoute>
                      : a.down_dtype == DType::kF16  ? moe_down_rank_kernel<DType::kF16, kRoute>
                      : a.down_dtype == DType::kQ4_K ? moe_down_rank_kernel<DType::kQ4_K, kRoute>
                                                     : moe_down_rank_kernel<DType::kQ8_0, kRoute>;
  // Per device, so set at every launch (a host-side call); a failure shows at the launch.
  if (smem > 32 * 1024)
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  launch_kernel(kernel, grid, block, smem, s, a);
}
}  // namespace

void moe_gate_up(const MoeArgs& a, cudaStream_t s) {
  a.route.logits ? launch_gate_up<true>(a, s) : launch_gate_up<false>(a, s);
}

void moe_down_sum(const MoeArgs& a, cudaStream_t s) {
  if (moe_down_by_rank(a)) {
    a.route.logits ? launch_down_rank<true>(a, s) : launch_down_rank<false>(a, s);
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

}  // namespace ts::cuda
