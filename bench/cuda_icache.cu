// Whether a decode step's serial tails wait on their own instructions (issue 4; docs/PERF.md
// "Cold instructions in the serial tails"). A decode layer streams 20-60 MB of weights
// through the 50-60 MB L2, so code that runs once a layer on one SM — the router's last
// block (softmax of 128 logits, ranks, top-k), a one-block RMSNorm — may find its
// instructions neither in that SM's instruction caches nor in L2, and fetch each line from
// DRAM. This times such a tail after a cold burst of weights, with and without the tail's
// code run once before the PDL wait (on throwaway data, while the burst still streams), which
// pulls its lines into the SM's caches.
//
// Build by hand (a lab tool, no CMake target):
//   nvcc -O3 -std=c++20 -arch=sm_90a -cudart static bench/cuda_icache.cu -o build-gpu/cuda_icache
// Run (GPU machine): build-gpu/cuda_icache
// Each step of a CUDA graph (48 steps, median of 5 replays) is a burst of MB megabytes that no
// step read in the 400 MB before (cold), then a 16-block x 1,024-thread kernel whose blocks
// each write 8 logits and count themselves; with `tail` the last block routes them (warp 0's
// softmax, every expert's rank by 8 threads, the top 8's ids and renormalized weights, as the
// engine's block_route_one); with `warm` every block first runs the same routing function on a
// throwaway copy before its wait. Prints us per step; a tail's cost is its row less the
// no-tail row of the same burst.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_check.h"

// The burst: every thread reads 16-byte words i, i + stride, ... four at a time.
__global__ void __launch_bounds__(512) read_kernel(const uint4* p, size_t words, unsigned* sink) {
  grid_wait();
  grid_trigger();
  const uint32_t acc = fold_nc(p, words, size_t(blockIdx.x) * blockDim.x + threadIdx.x,
                               size_t(gridDim.x) * blockDim.x);
  if (acc == 0x12345679u) *sink = acc;
}

constexpr int kExperts = 128, kTopK = 8, kRows = 8;

// Routing of 128 logits by a whole block, shaped as the engine's block_route_one.
__device__ __noinline__ void route_block(const float* logits, int* ids, float* weights) {
  __shared__ float4 probs4[kExperts / 4];
  __shared__ int sel_e[kTopK];
  __shared__ float sel_p[kTopK];
  float* probs = reinterpret_cast<float*>(probs4);
  const int lane = threadIdx.x % 32;
  if (threadIdx.x < 32) {
    float p[kExperts / 32];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kExperts / 32; ++i) {
      p[i] = __ldcg(logits + lane + 32 * i);
      mx = fmaxf(mx, p[i]);
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kExperts / 32; ++i) {
      p[i] = expf(p[i] - mx);
      sum += p[i];
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
    for (int i = 0; i < kExperts / 32; ++i) probs[lane + 32 * i] = p[i] / sum;
  }
  __syncthreads();
  constexpr int g = 8;
  if (int(threadIdx.x) < g * kExperts) {
    const int e = int(threadIdx.x) / g, part = int(threadIdx.x) % g;
    const float pe = probs[e];
    int rank = 0;
#pragma unroll 4
    for (int c = part; c < kExperts / 4; c += g) {
      const float4 v = probs4[c];
      const float vs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) rank += int(vs[j] > pe) | (int(vs[j] == pe) & int(4 * c + j < e));
    }
    for (int o = g / 2; o > 0; o >>= 1) rank += __shfl_xor_sync(0xffffffffu, rank, o);
    if (part == 0 && rank < kTopK) {
      sel_e[rank] = e;
      sel_p[rank] = pe;
    }
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  float picked = 0.0f;
  for (int r = 0; r < kTopK; ++r) picked += sel_p[r];
  if (lane < kTopK) {
    ids[lane] = sel_e[lane];
    weights[lane] = sel_p[lane] / picked;
  }
}

struct TailArgs {
  unsigned* counter;  // 0 between launches
  float* logits;      // [128]
  int* ids;
  float* weights;
  const float* scratch_logits;  // the warm-up's throwaway data
  int* scratch_ids;
  float* scratch_weights;
  int tail, warm;
};

__global__ void __launch_bounds__(1024) tail_kernel(TailArgs a) {
  if (a.warm) route_block(a.scratch_logits, a.scratch_ids + blockIdx.x * kTopK,
                          a.scratch_weights + blockIdx.x * kTopK);
  grid_wait();
  grid_trigger();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < kRows && lane == 0) a.logits[blockIdx.x * kRows + warp] = float(warp * 37 % 11) * 0.1f;
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(a.counter, 1u) == gridDim.x - 1;
    if (last) *a.counter = 0;
    __threadfence();
  }
  __syncthreads();
  if (!last || !a.tail) return;
  route_block(a.logits, a.ids, a.weights);
}

int main() {
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_kernel, 512, 0));
  const int blocks = prop.multiProcessorCount * per_sm;
  const size_t pool = size_t(2) << 30;
  std::printf("%s, %d SMs, L2 %.0f MB, pool %.1f GB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize / 1e6, double(pool) / 1e9);
  uint8_t* base = nullptr;
  CHECK(cudaMalloc(&base, pool));
  CHECK(cudaMemset(base, 0x5a, pool));
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&sink, 4));
  TailArgs a{};
  CHECK(cudaMalloc(&a.counter, 4));
  CHECK(cudaMemset(a.counter, 0, 4));
  CHECK(cudaMalloc(&a.logits, kExperts * 4));
  CHECK(cudaMalloc(&a.ids, kTopK * 4));
  CHECK(cudaMalloc(&a.weights, kTopK * 4));
  float* scratch = nullptr;
  CHECK(cudaMalloc(&scratch, kExperts * 4));
  CHECK(cudaMemset(scratch, 0, kExperts * 4));
  a.scratch_logits = scratch;
  CHECK(cudaMalloc(&a.scratch_ids, 16 * kTopK * 4));
  CHECK(cudaMalloc(&a.scratch_weights, 16 * kTopK * 4));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("%6s %4s %4s %9s\n", "MB", "tail", "warm", "us/step");
  for (const double mb : {0.0, 13.4, 26.7, 50.0}) {
    const size_t bytes = size_t(mb * 1e6) / 16 * 16;
    const size_t span = std::max<size_t>(bytes, 4096), regions = pool / span;
    for (int tail = 0; tail <= 1; ++tail)
      for (int warm = 0; warm <= 1; ++warm) {
        TailArgs t = a;
        t.tail = tail;
        t.warm = warm;
        const int steps = 48;
        const double us = graph_us_per_step(s, steps, [&] {
          for (int i = 0; i < steps; ++i) {
            if (bytes)
              launch_ex(true, unsigned(blocks), 512, 0, s, read_kernel,
                        reinterpret_cast<const uint4*>(base + size_t(i) % regions * span),
                        bytes / 16, sink);
            launch_ex(true, 16, 1024, 0, s, tail_kernel, t);
          }
        });
        std::printf("%6.1f %4d %4d %9.2f\n", mb, tail, warm, us);
      }
  }
  std::vector<int> ids(kTopK);
  CHECK(cudaMemcpy(ids.data(), a.ids, kTopK * 4, cudaMemcpyDeviceToHost));
  std::printf("ids:");
  for (int e : ids) std::printf(" %d", e);
  std::printf("\n");
  CHECK(cudaGetLastError());
  return 0;
}
