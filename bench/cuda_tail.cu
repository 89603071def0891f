// What a grid's "last block" costs in a chain of decode kernels (issue 4; docs/PERF.md "The
// router folded into wo"). Several decode kernels end with a count that elects the grid's
// last block, which then does a short serial tail (norm_route routes there); folding more
// work into bigger grids this way (the router into wo's 320 blocks, the next RMSNorm into
// phase 2's 512) measured far slower than the work moved. This times the pattern alone:
// every block writes one float and counts itself, the last one (optionally) sums the
// floats, reads and writes 2,048 floats as a norm would, and ranks 128 values as the
// router's top-k does, in a chain of launches as a CUDA graph with programmatic dependent
// launch (each kernel waits for the one before, as the engine's).
//
// Build by hand (a lab tool, no CMake target):
//   nvcc -O3 -std=c++20 -arch=sm_90a -cudart static bench/cuda_tail.cu -o build-gpu/cuda_tail
// Run (GPU machine): build-gpu/cuda_tail
// Prints us per launch (median of 5 graph replays of 48 launches) for each configuration.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_check.h"

struct TailArgs {
  unsigned* counter;  // 0 between launches
  float* part;        // [grid]
  const float* x;     // [2048]
  float* out;         // [2048]
  float* vals;        // [128]
  int* ids;           // [8]
  int tail;           // 0: no count; 1: count only; 2: + sum and 2,048 floats; 3: + rank 128
  int fence_all;      // every thread fences before the count (else thread 0 only)
  float pad[64];      // a parameter block the size of the engine's (WoRouteArgs + shape)
};

__global__ void tail_kernel(TailArgs a) {
  extern __shared__ float smem_unused[];
  grid_wait();
  grid_trigger();
  if (threadIdx.x == 0) a.part[blockIdx.x] = float(blockIdx.x);
  if (a.tail == 0) return;
  __shared__ bool last;
  if (a.fence_all) __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    if (!a.fence_all) __threadfence();
    last = atomicAdd(a.counter, 1u) == gridDim.x - 1;
    if (last) *a.counter = 0;
    __threadfence();
  }
  __syncthreads();
  if (!last || a.tail == 1) return;
  __shared__ float red[32];
  float s = 0.0f;
  for (int b = threadIdx.x; b < int(gridDim.x); b += blockDim.x) s += __ldcg(a.part + b);
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) s += __ldcg(a.x + i) * __ldcg(a.x + i);
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = s;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < int(blockDim.x / 32); ++w) t += red[w];
  const float inv = rsqrtf(t / 2048.0f + 1e-6f);
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) a.out[i] = __ldcg(a.x + i) * inv;
  if (a.tail == 2) return;
  __shared__ float v[128];
  if (threadIdx.x < 128) v[threadIdx.x] = __ldcg(a.vals + threadIdx.x) * inv;
  __syncthreads();
  if (threadIdx.x < 128) {
    const float me = v[threadIdx.x];
    int rank = 0;
    for (int j = 0; j < 128; ++j) rank += v[j] > me || (v[j] == me && j < int(threadIdx.x));
    if (rank < 8) a.ids[rank] = int(threadIdx.x);
  }
}

int main() {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  TailArgs a{};
  CHECK(cudaMalloc(&a.counter, 4));
  CHECK(cudaMemset(a.counter, 0, 4));
  CHECK(cudaMalloc(&a.part, 4096 * 4));
  float* x;
  CHECK(cudaMalloc(&x, 2048 * 4));
  CHECK(cudaMemset(x, 0, 2048 * 4));
  a.x = x;
  CHECK(cudaMalloc(&a.out, 2048 * 4));
  CHECK(cudaMalloc(&a.vals, 128 * 4));
  CHECK(cudaMemset(a.vals, 0, 128 * 4));
  CHECK(cudaMalloc(&a.ids, 8 * 4));
  CHECK(cudaFuncSetAttribute(tail_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
  struct Conf {
    int grid, block, smem, tail, fence_all;
  };
  const std::vector<Conf> confs = {
      {1, 32, 0, 0, 0},          {16, 1024, 0, 3, 0},    {16, 1024, 0, 3, 1},
      {16, 256, 0, 3, 0},        {64, 256, 0, 3, 0},     {320, 256, 0, 0, 0},
      {320, 256, 0, 1, 0},       {320, 256, 0, 2, 0},    {320, 256, 0, 3, 0},
      {320, 256, 0, 3, 1},       {320, 256, 34816, 3, 0}, {640, 128, 0, 3, 0},
      {640, 128, 17408, 3, 0},   {512, 256, 0, 3, 0},    {1536, 128, 0, 3, 0},
  };
  printf("grid block smem_bytes tail fence_all us_per_launch\n");
  for (const Conf& c : confs) {
    TailArgs t = a;
    t.tail = c.tail;
    t.fence_all = c.fence_all;
    const int steps = 48;
    const double us = graph_us_per_step(s, steps, [&] {
      for (int i = 0; i < steps; ++i)
        launch_ex(true, dim3(unsigned(c.grid)), dim3(unsigned(c.block)), size_t(c.smem), s,
                  tail_kernel, t);
    });
    printf("%5d %5d %6d %d %d %8.2f\n", c.grid, c.block, c.smem, c.tail, c.fence_all, us);
  }
  return 0;
}
