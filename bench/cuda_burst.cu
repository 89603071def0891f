// How long one read of S bytes takes on the GPU from a standing start, in a chain of kernels
// as a decode step runs them (issue 4; docs/PERF.md "What a burst of weights costs"). A
// decode step reads each layer's weights in a few dependent bursts (qwen3-30b-a3b, Q8_0:
// 11.1 MB q|k|v, 8.9 MB wo, 26.7 MB gate|up, 13.4 MB down) between latency-bound kernels,
// not as one long stream; this measures the floor of such a burst with a kernel that does
// nothing but read, so the engine's kernels can be compared with it rather than with the
// 4.1 TB/s of a 2 GiB copy.
//
// Build by hand (a lab tool, no CMake target):
//   nvcc -O3 -std=c++20 -arch=sm_90a -cudart static bench/cuda_burst.cu -o build-gpu/cuda_burst
// Run (GPU machine): build-gpu/cuda_burst [POOL_GB]   (default 8)
// Per size, us per step and GB/s, each a CUDA graph of back-to-back launches (so no host
// launch gaps), every launch reading a region no launch read in the last >= 400 MB (cold in
// the 50-60 MB L2), median of 5 replays:
//   plain   read kernels serialized the ordinary way (each starts after the one before ends);
//   wait    programmatic dependent launch (PDL), a one-block kernel then the read kernel per
//           step, every block waiting (griddepcontrol.wait) before it reads: the read's blocks
//           are resident early, but its reads start only once the kernel before has completed
//           — the decode's expert phases after the router;
//   early   the same, but each kernel lets the next launch at once and reads before its
//           wait — as the staged GEMVs (q|k|v, wo) stage weights that depend on nothing; the
//           next kernel's blocks still need room on the SMs, so this overlaps only tails.
// Size 0 is one block that reads nothing: the chain's cost per launch. Then the same 26.7 MB
// in the shape of the engine's phase 1 (rows_kernel below).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"

enum Mode { kPlain, kWait, kEarly };

// Each thread reads 16-byte words i, i + stride, ... four at a time (fold_nc: four loads in
// flight per thread, ~17 MB over the GPU at full occupancy) and folds them into one word,
// stored only if it matches a value it never does (so the loads are not dead).

__global__ void __launch_bounds__(512)
    read_kernel(const uint4* p, size_t words, unsigned* sink, int mode) {
  // wait: as the engine's pdl_wait(); early: the next kernel may launch at once, and this
  // one completes only after the one before (so the chain stays ordered).
  if (mode == kWait) grid_wait();
  if (mode != kPlain) grid_trigger();
  const uint32_t acc = fold_nc(p, words, size_t(blockIdx.x) * blockDim.x + threadIdx.x,
                               size_t(gridDim.x) * blockDim.x);
  if (mode == kEarly) grid_wait();
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

__global__ void tiny_kernel(int mode) {
  if (mode != kPlain) {
    grid_wait();
    grid_trigger();
  }
}

void launch(size_t words, const uint4* p, unsigned* sink, int mode, int blocks, cudaStream_t s) {
  if (words == 0)
    launch_ex(mode != kPlain, 1, 32, 0, s, tiny_kernel, mode);
  else
    launch_ex(mode != kPlain, unsigned(blocks), 512, 0, s, read_kernel, p, words, sink, mode);
}

// Phase 1's shape (moe_gate_up_q8_kernel at qwen3-30b-a3b's Q8_0 shape): grid (192, 8) of
// 4 warps, each warp copying one gate and one up row of 2,176 bytes into shared memory
// (cp.async) and folding them; 8 of 128 experts of 768 rows per launch: 26.7 MB. Each step's
// one-block kernel before it writes the step's 8 expert ids (as the router's last block
// does); with `lookup` every warp reads its slot's id after its wait, then the expert's rows
// from a table (as the engine's phase 1), else the addresses are arguments.
constexpr int kRowBytes = 2176, kExpertRows = 768, kSlots = 8, kExperts = 128;
constexpr size_t kMatrixBytes = size_t(kRowBytes) * kExpertRows;

struct Rows {
  const int* ids;
  const uint8_t* const* gate;  // [kExperts]
  const uint8_t* const* up;
  const uint8_t* gate_d[kSlots];  // without lookup
  const uint8_t* up_d[kSlots];
  int lookup;
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

__global__ void ids_kernel(int* ids, int step) {
  grid_wait();
  grid_trigger();
  if (threadIdx.x < kSlots) ids[threadIdx.x] = (step * kSlots + int(threadIdx.x)) % kExperts;
}

__global__ void __launch_bounds__(128, 12) rows_kernel(Rows a, unsigned* sink) {
  extern __shared__ uint4 rows_smem[];
  grid_wait();
  grid_trigger();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = blockIdx.x * 4 + warp, s = blockIdx.y;
  const uint8_t* g;
  const uint8_t* u;
  if (a.lookup) {
    const int e = a.ids[s];
    g = a.gate[e];
    u = a.up[e];
  } else {
    g = a.gate_d[s];
    u = a.up_d[s];
  }
  g += size_t(r) * kRowBytes;
  u += size_t(r) * kRowBytes;
  uint8_t* tile = reinterpret_cast<uint8_t*>(rows_smem) + size_t(warp) * 2 * kRowBytes;
  for (int c = lane; c < kRowBytes / 16; c += 32) {
    cp_async16(tile + 16 * c, g + 16 * c);
    cp_async16(tile + kRowBytes + 16 * c, u + 16 * c);
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  uint32_t acc = 0;
  for (int c = lane; c < 2 * kRowBytes / 4; c += 32)
    acc ^= reinterpret_cast<const uint32_t*>(tile)[c];
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

int main(int argc, char** argv) {
  const double pool_gb = argc > 1 ? std::atof(argv[1]) : 8.0;
  const size_t pool = size_t(pool_gb * 1e9) / 4096 * 4096;
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_kernel, 512, 0));
  const int blocks = prop.multiProcessorCount * per_sm;
  std::printf("%s, %d SMs, L2 %.0f MB, read_kernel %d blocks of 512 (%d per SM), pool %.1f GB\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, blocks, per_sm,
              double(pool) / 1e9);
  uint8_t* base = nullptr;
  CHECK(cudaMalloc(&base, pool));
  CHECK(cudaMemset(base, 0x5a, pool));
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&sink, 4));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double sizes_mb[] = {0, 0.5, 2, 4, 8.9, 11.1, 13.4, 26.7, 50, 100, 400, 2000};
  const char* names[] = {"plain", "wait", "early"};
  std::printf("%9s %8s %10s %9s\n", "MB", "mode", "us/step", "GB/s");
  for (const double mb : sizes_mb) {
    const size_t bytes = size_t(mb * 1e6) / 16 * 16;
    if (bytes > pool / 2) continue;
    // Enough launches that a replay reads >= 400 MB between two reads of one region.
    const int n = bytes == 0 ? 400 : int(std::clamp<size_t>(400000000 / bytes + 1, 20, 2000));
    const size_t span = std::max<size_t>(bytes, 4096);
    const size_t regions = std::max<size_t>(1, pool / span);
    for (int mode = kPlain; mode <= kEarly; ++mode) {
      const double med = graph_us_per_step(s, n, [&] {
        for (int i = 0; i < n; ++i) {
          const uint4* p = reinterpret_cast<const uint4*>(base + (size_t(i) % regions) * span);
          // With PDL, a one-block kernel before each read, as a latency-bound kernel
          // (RMSNorm, the router) comes before each burst in a decode step: the read's blocks
          // can be resident before it completes.
          if (mode != kPlain && bytes) launch(0, nullptr, sink, mode, blocks, s);
          launch(bytes / 16, p, sink, mode, blocks, s);
        }
      });
      std::printf("%9.1f %8s %10.2f %9.0f\n", mb, names[mode], med,
                  bytes ? double(bytes) / (med * 1e-6) / 1e9 : 0.0);
    }
  }
  // Phase 1's shape, 64 steps per graph (a step's 8 experts are reused 16 steps later, after
  // 427 MB of others: cold).
  {
    const uint8_t* tab_h[2][kExperts];
    for (int e = 0; e < kExperts; ++e)
      for (int m = 0; m < 2; ++m) tab_h[m][e] = base + (size_t(2 * e + m)) * kMatrixBytes;
    const uint8_t** tab = nullptr;
    int* ids = nullptr;
    CHECK(cudaMalloc(&tab, sizeof tab_h));
    CHECK(cudaMemcpy(tab, tab_h, sizeof tab_h, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&ids, kSlots * sizeof(int)));
    const size_t smem = 4 * 2 * kRowBytes;
    const int steps = 64;
    for (int lookup = 1; lookup >= 0; --lookup) {
      const double med = graph_us_per_step(s, steps, [&] {
        for (int i = 0; i < steps; ++i) {
          launch_ex(true, 1, 32, 0, s, ids_kernel, ids, i);
          Rows a{.ids = ids, .gate = tab, .up = tab + kExperts, .lookup = lookup};
          for (int k = 0; k < kSlots; ++k) {
            const int e = (i * kSlots + k) % kExperts;
            a.gate_d[k] = tab_h[0][e];
            a.up_d[k] = tab_h[1][e];
          }
          launch_ex(true, dim3(kExpertRows / 4, kSlots), 128, smem, s, rows_kernel, a, sink);
        }
      });
      std::printf(
          "phase 1's shape (26.7 MB, 1,536 blocks of 4 warps, cp.async rows), %s: %.2f us/step, "
          "%.0f GB/s\n",
          lookup ? "ids + table after the wait" : "addresses as arguments", med,
          2.0 * kSlots * kMatrixBytes / (med * 1e-6) / 1e9);
    }
  }
  CHECK(cudaGetLastError());
  return 0;
}
