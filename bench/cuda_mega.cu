// The floor of a decode step built as one persistent kernel (issue 4; docs/PERF.md "A decode
// layer as one persistent kernel: its floor, measured"). The engine's decode step is a chain
// of ~8 kernels per layer, each reading its weights in a burst that starts only when the
// kernel before has finished (docs/PERF.md "What a burst of weights costs": the chain's floor
// is the BF16 goal itself). This lab tool times the other design: one block per SM, the
// stages of every layer separated by grid-wide barriers, and the weights that depend on no
// result (the next layer's q|k|v, wo and router rows) copied into each block's shared memory
// by the bulk-copy engine while the current layer's experts stream, so only the experts'
// bytes (known after the router) start after a dependency.
//
// It moves the bytes and keeps the dependencies of qwen3-30b-a3b's decode layer (d_model
// 2,048; q|k|v 5,120 x 2,048; wo 2,048 x 4,096; router 128 x 2,048 in BF16; 128 experts of
// 768, top 8, chosen per layer and token from logits the router stage writes; attention at
// context 128 as 32 blocks reading 8 KB of keys and values each), Q8_0 (34 bytes per 32
// weights) or BF16; the arithmetic is a fold of the loaded words, not the GEMVs. So its
// times are what the bytes, the barriers and the serial top-k cost: a floor for the design,
// not an engine.
//
// Build by hand (a lab tool, no CMake target):
//   nvcc -O3 -std=c++20 -arch=sm_90a -cudart static bench/cuda_mega.cu -o build-gpu/cuda_mega
// Run (GPU machine): build-gpu/cuda_mega
// Per dtype and variant, us per layer (48 layers a launch, 12 distinct layers' weights, so
// every layer's bytes are cold: 720+ MB between two reads of one layer; median of 9 launches):
//   skeleton       no bytes: the barriers, the top-k and the launch alone (no-topk: the experts
//                  fixed, no top-k either)
//   global         every stage reads its weights when it runs (the chain's order, barriers
//                  instead of kernel boundaries)
//   preload        the next layer's dense rows (as many of q|k|v, router, wo as fit in
//                  shared memory, in that order) copied during this layer's experts
//   +down          each block's share of the down rows also asked into L2 with the gate|up rows
//                  (one burst for both expert phases)
//   /b1            barriers on a counter that only grows (a release add, acquire loads), not a
//                  count reset by the last block and a generation
//   /predN         at the layer's start the N best experts' gate|up rows asked into L2 (a
//                  prediction that is always right: the logits are a hash known ahead), while
//                  the attention half runs
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cuda_check.h"

constexpr int kThreads = 1024, kExperts = 128, kTopK = 8, kLayers = 48, kDistinct = 12;
constexpr int kAttnBlocks = 32;
constexpr size_t kAttnBytes = 8192;  // per attention block (context 128)

struct Sizes {
  size_t qkv, wo, router, gate_up, down;  // bytes; gate_up and down per expert
};

Sizes sizes_for(bool q8) {
  const auto m = [&](size_t rows, size_t cols) {
    return q8 ? rows * cols / 32 * 34 : rows * cols * 2;
  };
  return {m(5120, 2048), m(2048, 4096), size_t(128) * 2048 * 2, 2 * m(768, 2048), m(2048, 768)};
}

struct MegaArgs {
  const uint8_t* dense;    // [kDistinct][qkv | wo | router]
  const uint8_t* experts;  // [kDistinct][kExperts][gate_up | down]
  const uint8_t* kv;       // [kDistinct][kAttnBlocks * kAttnBytes]
  Sizes s;
  size_t dense_stride, expert_stride;
  size_t share[3];    // per block: qkv, wo, router (16-byte multiples)
  int preload[3];     // which of them come from shared memory
  int down_prefetch;  // ask the down rows into L2 with the gate|up rows
  int skeleton;       // read nothing
  int no_topk;        // the experts are 0..7 (no top-k)
  int predict;        // ranks whose gate|up rows are asked into L2 at the layer's start
  int token;
  float* logits;  // [kExperts]
  unsigned* bar;  // [2]: count, generation
  unsigned* sink;
};

__host__ __device__ constexpr size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// Folds bytes [0, n) of p (16-byte aligned, n a multiple of 16): four loads in flight a thread.
__device__ __forceinline__ uint32_t fold_global(const uint8_t* p, size_t n) {
  return fold_nc(reinterpret_cast<const uint4*>(p), n / 16, threadIdx.x, kThreads);
}

__device__ __forceinline__ uint32_t fold_shared(const uint4* p, size_t n) {
  uint32_t acc = 0;
  for (size_t i = threadIdx.x; i < n / 16; i += kThreads) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return acc;
}

// All blocks meet (every block is resident: a cooperative launch). Kind 0: thread 0 counts
// the block in, the last one resets the count and advances the generation, the others spin
// on it. Kind 1: a counter that only grows (bar[2]): thread 0 adds 1 with release semantics
// (no value returned) and spins until it reaches the barrier's target, gen counting the
// barriers passed (no reset, no last block).
__device__ int g_barrier_kind;

__device__ __forceinline__ void grid_sync(unsigned* bar, unsigned& gen) {
  __syncthreads();
  if (g_barrier_kind == 1) {
    if (threadIdx.x == 0) {
      ++gen;
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar + 2) : "memory");
      const unsigned target = gen * gridDim.x;
      unsigned g;
      do {
        asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(g) : "l"(bar + 2) : "memory");
      } while (int(g - target) < 0);
    }
    __syncthreads();
    return;
  }
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      bar[0] = 0;
      __threadfence();
      atomicExch(bar + 1, gen + 1);
    } else {
      unsigned g;
      do {
        asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(g) : "l"(bar + 1) : "memory");
      } while (g == gen);
    }
    ++gen;
  }
  __syncthreads();
}

// The block's share [b * share, ...) of an array of n bytes, clamped.
__device__ __forceinline__ void share_of(size_t n, size_t share, size_t* off, size_t* len) {
  const size_t o = min_sz(n, size_t(blockIdx.x) * share);
  *off = o;
  *len = min_sz(n, o + share) - o;
}

// Queues the bulk copies of layer u's dense shares into shared memory (thread 0).
__device__ void preload(const MegaArgs& a, int u, uint8_t* buf, uint64_t* mbar) {
  const uint8_t* layer = a.dense + size_t(u) * a.dense_stride;
  const size_t starts[3] = {0, a.s.qkv, a.s.qkv + a.s.wo};
  const size_t totals[3] = {a.s.qkv, a.s.wo, a.s.router};
  uint32_t bytes = 0;
  size_t off[3], len[3];
  for (int m = 0; m < 3; ++m) {
    share_of(totals[m], a.share[m], &off[m], &len[m]);
    if (a.preload[m]) bytes += uint32_t(len[m]);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(mbar)),
               "r"(bytes)
               : "memory");
  size_t at = 0;
  for (int m = 0; m < 3; ++m) {
    if (!a.preload[m]) continue;
    for (size_t c = 0; c < len[m]; c += 65536) {
      const uint32_t n = uint32_t(min_sz(65536, len[m] - c));
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
          "[%3];" ::"r"(smem_addr(buf + at + c)),
          "l"(layer + starts[m] + off[m] + c), "r"(n), "r"(smem_addr(mbar))
          : "memory");
    }
    at += a.share[m];
  }
}

// The router's logit of expert e at layer l for this token (a hash: the tool's routing
// depends on the token and the layer only).
__device__ __forceinline__ float logit_of(int token, int l, int e) {
  uint32_t h = uint32_t(token) * 2654435761u ^ uint32_t(l) * 40503u ^ uint32_t(e) * 97u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return float(h & 0xffffff) / 16777216.0f;
}

// Top 8 of 128 values (lane holds lane, lane + 32, ...) by one warp: 8 rounds of a warp-wide
// argmax; lane 0 writes the ids best first.
__device__ __forceinline__ void warp_top8(float (&p)[kExperts / 32], int* out, int lane) {
  for (int r = 0; r < kTopK; ++r) {
    float best;
    const int be = warp_argmax_take(p, lane, &best);
    if (lane == 0) out[r] = be;
  }
}

__global__ void __launch_bounds__(kThreads, 1) mega_kernel(MegaArgs a) {
  extern __shared__ uint4 mega_smem[];
  uint8_t* buf = reinterpret_cast<uint8_t*>(mega_smem);
  __shared__ __align__(8) uint64_t mbar;
  __shared__ int sel[kTopK], pred[kTopK];
  __shared__ uint32_t red[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool any_preload = !a.skeleton && (a.preload[0] || a.preload[1] || a.preload[2]);
  unsigned gen = 0;
  if (threadIdx.x == 0) {
    gen = g_barrier_kind == 1 ? *reinterpret_cast<volatile unsigned*>(a.bar + 2) / gridDim.x
                              : *reinterpret_cast<volatile unsigned*>(a.bar + 1);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&mbar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0 && any_preload) preload(a, 0, buf, &mbar);
  uint32_t acc = 0, parity = 0;
  size_t smem_at[3] = {0, 0, 0};
  for (int m = 0, at = 0; m < 3; ++m)
    if (a.preload[m]) {
      smem_at[m] = size_t(at);
      at += int(a.share[m]);
    }
  const size_t totals[3] = {a.s.qkv, a.s.wo, a.s.router};
  // Stage m of the dense weights: this block's share, from shared memory or global.
  const auto dense = [&](int m, int u) {
    if (a.skeleton) return;
    size_t off, len;
    share_of(totals[m], a.share[m], &off, &len);
    if (a.preload[m])
      acc ^= fold_shared(reinterpret_cast<const uint4*>(buf + smem_at[m]), len);
    else
      acc ^= fold_global(a.dense + size_t(u) * a.dense_stride +
                             (m == 0   ? 0
                              : m == 1 ? a.s.qkv
                                       : a.s.qkv + a.s.wo) +
                             off,
                         len);
  };
  for (int l = 0; l < kLayers; ++l) {
    const int u = l % kDistinct;
    if (any_preload) {
      // The dense shares of this layer, queued during the layer before.
      while (true) {
        uint32_t ok;
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, "
            "0, p; }"
            : "=r"(ok)
            : "r"(smem_addr(&mbar)), "r"(parity)
            : "memory");
        if (ok) break;
      }
      parity ^= 1;
    }
    const uint8_t* ex = a.experts + size_t(u) * kExperts * a.expert_stride;
    // Block b's share of `ranks` experts' rows (gate|up or down), of those named in ids: read,
    // or asked into L2 by thread 0.
    const auto span = [&](const int* ids, int ranks, size_t per, size_t base, bool prefetch) {
      const size_t share = (ranks * per / gridDim.x + 15) / 16 * 16;
      size_t off, len;
      share_of(ranks * per, share, &off, &len);
      while (len) {
        const int r = int(off / per);
        const size_t in = off % per, n = min_sz(len, per - in);
        const uint8_t* p = ex + size_t(ids[r]) * a.expert_stride + base + in;
        if (prefetch) {
          if (threadIdx.x == 0)
            for (size_t c = 0; c < n; c += 65536)
              asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + c),
                           "r"(uint32_t(min_sz(65536, n - c)))
                           : "memory");
        } else {
          acc ^= fold_global(p, n);
        }
        off += n;
        len -= n;
      }
    };
    // The prediction (here always right: the logits are known ahead): the best ranks' gate|up
    // rows asked into L2 while the attention half runs (its weights come from shared memory).
    if (a.predict && !a.skeleton) {
      if (warp == 0) {
        float p[kExperts / 32];
#pragma unroll
        for (int i = 0; i < kExperts / 32; ++i) p[i] = logit_of(a.token, l, lane + 32 * i);
        warp_top8(p, pred, lane);
      }
      __syncthreads();
      span(pred, a.predict, a.s.gate_up, 0, true);
    }
    // RMSNorm of x and q|k|v.
    dense(0, u);
    grid_sync(a.bar, gen);
    // Attention: 32 blocks read their keys and values.
    if (!a.skeleton && blockIdx.x < kAttnBlocks)
      acc ^= fold_global(a.kv + size_t(u) * kAttnBlocks * kAttnBytes + blockIdx.x * kAttnBytes,
                         kAttnBytes);
    grid_sync(a.bar, gen);
    dense(1, u);  // wo
    grid_sync(a.bar, gen);
    // Norm and router: the logits depend on the token and the layer (and nothing else).
    dense(2, u);
    if (threadIdx.x == 0 && blockIdx.x < kExperts)
      a.logits[blockIdx.x] = logit_of(a.token, l, int(blockIdx.x)) + float(acc == 0x9e3779b9u);
    grid_sync(a.bar, gen);
    // Top-k by every block (warp 0) from the logits.
    if (a.no_topk && threadIdx.x < kTopK) sel[threadIdx.x] = int(threadIdx.x);
    if (warp == 0 && !a.no_topk) {
      float p[kExperts / 32];
#pragma unroll
      for (int i = 0; i < kExperts / 32; ++i) p[i] = __ldcg(a.logits + lane + 32 * i);
      warp_top8(p, sel, lane);
    }
    __syncthreads();
    // The next layer's dense shares into shared memory while the experts stream.
    if (threadIdx.x == 0 && any_preload && l + 1 < kLayers)
      preload(a, (l + 1) % kDistinct, buf, &mbar);
    // This block's share of the 8 experts' gate|up rows, then of their down rows.
    if (!a.skeleton) {
      if (a.down_prefetch) span(sel, kTopK, a.s.down, a.s.gate_up, true);
      span(sel, kTopK, a.s.gate_up, 0, false);
    }
    grid_sync(a.bar, gen);
    if (!a.skeleton) span(sel, kTopK, a.s.down, a.s.gate_up, false);
    grid_sync(a.bar, gen);
  }
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) red[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t t = 0;
    for (int w = 0; w < kThreads / 32; ++w) t ^= red[w];
    if (t == 0x12345679u) *a.sink = t;
  }
}

int main() {
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int blocks = prop.multiProcessorCount;
  const size_t max_smem = prop.sharedMemPerBlockOptin - 1024;
  std::printf("%s, %d SMs, L2 %.0f MB, shared memory per block up to %zu bytes\n", prop.name,
              blocks, prop.l2CacheSize / 1e6, max_smem);
  CHECK(cudaFuncSetAttribute(mega_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(max_smem)));
  float* logits;
  unsigned *bar, *sink;
  CHECK(cudaMalloc(&logits, kExperts * 4));
  CHECK(cudaMalloc(&bar, 16));
  CHECK(cudaMemset(bar, 0, 16));
  CHECK(cudaMalloc(&sink, 4));
  uint8_t* kv;
  CHECK(cudaMalloc(&kv, size_t(kDistinct) * kAttnBlocks * kAttnBytes));
  std::printf("%-5s %-16s %8s %10s %9s %s\n", "dtype", "variant", "us/layer", "MB/layer", "GB/s",
              "in shared memory");
  for (const bool q8 : {true, false}) {
    const Sizes s = sizes_for(q8);
    MegaArgs a{};
    a.s = s;
    a.dense_stride = (s.qkv + s.wo + s.router + 4095) / 4096 * 4096;
    a.expert_stride = s.gate_up + s.down;
    uint8_t *dense, *experts;
    CHECK(cudaMalloc(&dense, kDistinct * a.dense_stride));
    CHECK(cudaMalloc(&experts, size_t(kDistinct) * kExperts * a.expert_stride));
    a.dense = dense;
    a.experts = experts;
    a.kv = kv;
    a.logits = logits;
    a.bar = bar;
    a.sink = sink;
    const size_t totals[3] = {s.qkv, s.wo, s.router};
    for (int m = 0; m < 3; ++m) a.share[m] = (totals[m] / blocks + 15) / 16 * 16;
    const double mb =
        double(s.qkv + s.wo + s.router + kTopK * (s.gate_up + s.down) + kAttnBlocks * kAttnBytes) /
        1e6;
    struct Variant {
      const char* name;
      int skeleton, preload, down_prefetch, barrier, no_topk, predict;
    };
    for (const Variant v :
         {Variant{"skeleton", 1, 0, 0, 0, 0, 0}, Variant{"skeleton/b1", 1, 0, 0, 1, 0, 0},
          Variant{"skel/b1/no-topk", 1, 0, 0, 1, 1, 0}, Variant{"global", 0, 0, 0, 0, 0, 0},
          Variant{"global/b1", 0, 0, 0, 1, 0, 0}, Variant{"preload", 0, 1, 0, 0, 0, 0},
          Variant{"preload/b1", 0, 1, 0, 1, 0, 0}, Variant{"preload+down/b1", 0, 1, 1, 1, 0, 0},
          Variant{"preload/b1/pred2", 0, 1, 0, 1, 0, 2},
          Variant{"preload/b1/pred4", 0, 1, 0, 1, 0, 4},
          Variant{"preload/b1/pred8", 0, 1, 0, 1, 0, 8},
          Variant{"global/b1/pred4", 0, 0, 0, 1, 0, 4}}) {
      MegaArgs b = a;
      b.skeleton = v.skeleton;
      b.down_prefetch = v.down_prefetch;
      b.no_topk = v.no_topk;
      b.predict = v.predict;
      CHECK(cudaMemcpyToSymbol(g_barrier_kind, &v.barrier, sizeof(int)));
      size_t smem = 0;
      std::string what;
      const char* names[3] = {"q|k|v", "wo", "router"};
      for (const int m : {0, 2, 1}) {
        b.preload[m] = v.preload && smem + b.share[m] <= max_smem;
        if (b.preload[m]) {
          smem += b.share[m];
          what += std::string(what.empty() ? "" : ", ") + names[m];
        }
      }
      const std::vector<float> ms = sorted_launch_ms(
          10, [&](int rep) { b.token = rep; },
          [&](int) {
            void* params[] = {&b};
            CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(mega_kernel), blocks,
                                              kThreads, params, smem, nullptr));
          });
      const double t = 1e3 * ms[ms.size() / 2] / kLayers;
      std::printf("%-5s %-16s %8.2f %10.1f %9.0f %s\n", q8 ? "q8_0" : "bf16", v.name, t,
                  v.skeleton ? 0.0 : mb, v.skeleton ? 0.0 : mb * 1e3 / t,
                  what.empty() ? "-" : what.c_str());
    }
    CHECK(cudaFree(dense));
    CHECK(cudaFree(experts));
  }
  CHECK(cudaGetLastError());
  return 0;
}
