// What the hand-built CUDA lab tools in bench/ (cuda_h2d.cu, cuda_burst.cu, cuda_icache.cu)
// share: CHECK(call) (a failed CUDA runtime call
// prints where and why, and exits 1), one launch with or without PDL, and the time per step of a
// captured chain of launches.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                               \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// Device side: wait for the kernel before in the stream (programmatic dependent launch), let
// the next one launch, a 16-byte load that leaves L1 alone, and a strided read of many.
__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_trigger() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ uint4 load_nc(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// Words first, first + stride, ... below `words` of w read four at a time (four loads in
// flight a thread) and folded into one (xor), for a caller that only needs the loads done.
__device__ __forceinline__ uint32_t fold_nc(const uint4* w, size_t words, size_t first,
                                            size_t stride) {
  uint32_t acc = 0;
  size_t i = first;
  for (; i + 3 * stride < words; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = load_nc(w + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < words; i += stride) {
    const uint4 v = load_nc(w + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return acc;
}

// reps launches timed one by one with events (before(rep), untimed, ahead of each): the times
// in ms of all but the first (a warm-up), sorted.
template <class Before, class Launch>
std::vector<float> sorted_launch_ms(int reps, Before before, Launch launch) {
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int rep = 0; rep < reps; ++rep) {
    before(rep);
    CHECK(cudaEventRecord(e0));
    launch(rep);
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (rep) ms.push_back(t);
  }
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms;
}

// One launch, with programmatic dependent launch (PDL) or without.
template <class... P, class... A>
void launch_ex(bool pdl, dim3 grid, dim3 block, size_t smem, cudaStream_t s, void (*kernel)(P...),
               A... args) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = pdl;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// Captures issue(s) (steps launches' worth) as one CUDA graph, replays it once to warm up and
// 5 times timed; the median replay's time per step, in us.
template <class F>
double graph_us_per_step(cudaStream_t s, int steps, F issue) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  issue();
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  CHECK(cudaGraphLaunch(ge, s));  // warm-up
  std::vector<double> us;
  for (int r = 0; r < 5; ++r) {
    CHECK(cudaEventRecord(e0, s));
    CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(1e3 * double(ms) / steps);
  }
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaGraphDestroy(g));
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}
