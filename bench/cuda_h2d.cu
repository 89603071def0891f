// Host -> device expert copies, three ways, for the GPU expert cache (issue 5; docs/PERF.md
// "the order of a binding's copies"): cudaMemcpyAsync per expert on one or two streams, one
// cudaMemcpyBatchAsync per layer, and one gather kernel whose threads read the experts from
// mapped pinned memory (16-byte loads) and write them into device slots. It answers whether a kernel can beat the per-transfer
// ramp of the copy engine at one layer's worth of misses (4 x 5.01 MB of Q8_0 experts at
// qwen3-30b-a3b's shape), before that is tried inside the engine.
//
// Build by hand (a lab tool, no CMake target):
//   nvcc -O3 -std=c++20 -arch=sm_90 -cudart static bench/cuda_h2d.cu -o build-gpu/cuda_h2d
// Run (GPU machine): build-gpu/cuda_h2d [EXPERT_BYTES [MISSES]]
// Prints, per method: GB/s over many back-to-back layers, and us per single layer (copies
// issued, then synchronized: what one binding waits for).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"

struct Gather {
  const uint4* src[8];
  uint4* dst[8];
};

// Block b copies 16-byte words b, b + gridDim.x, ... of every expert, in expert order.
__global__ void gather_kernel(Gather g, int n, size_t words) {
  for (int e = 0; e < n; ++e) {
    const uint4* s = g.src[e];
    uint4* d = g.dst[e];
    for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
         i += size_t(gridDim.x) * blockDim.x) {
      // Four loads in flight per thread before the stores: PCIe latency is ~1-2 us.
      uint4 v[4];
      int k = 0;
      for (; k < 4 && i + size_t(k) * gridDim.x * blockDim.x < words; ++k)
        v[k] = __ldcs(s + i + size_t(k) * gridDim.x * blockDim.x);
      for (int j = 0; j < k; ++j) d[i + size_t(j) * gridDim.x * blockDim.x] = v[j];
      i += size_t(k - 1) * gridDim.x * blockDim.x;
    }
  }
}

int main(int argc, char** argv) {
  const size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 5013504;  // one expert
  const int misses = argc > 2 ? std::clamp(std::atoi(argv[2]), 1, 8) : 4;
  if (bytes % 16 != 0) {
    std::fprintf(stderr, "EXPERT_BYTES must be a multiple of 16\n");
    return 2;
  }
  const int n_host = 128, n_slots = 64, layers = 48;
  uint8_t* host = nullptr;
  CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), size_t(n_host) * bytes,
                      cudaHostAllocMapped));
  for (size_t i = 0; i < size_t(n_host) * bytes; ++i) host[i] = uint8_t(i * 2654435761u >> 13);
  uint8_t* host_dev = nullptr;
  CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host, 0));
  uint8_t* slots = nullptr;
  CHECK(cudaMalloc(&slots, size_t(n_slots) * bytes));
  cudaStream_t s[2];
  for (auto& x : s) CHECK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, expert %zu bytes, %d misses per layer, %d layers per timed run\n", prop.name,
              bytes, misses, layers);

  // Layer l's misses: experts spread over the host arena, slots spread over the cache.
  auto src_of = [&](int l, int m) { return size_t((l * 37 + m * 29) % n_host) * bytes; };
  auto dst_of = [&](int l, int m) { return size_t((l * 11 + m * 7) % n_slots) * bytes; };

  auto memcpy_layer = [&](int l, int streams) {
    for (int m = 0; m < misses; ++m)
      CHECK(cudaMemcpyAsync(slots + dst_of(l, m), host + src_of(l, m), bytes,
                            cudaMemcpyHostToDevice, s[m % streams]));
  };
  auto batch_layer = [&](int l) {
    void* dsts[8];
    const void* srcs[8];
    size_t sizes[8];
    for (int m = 0; m < misses; ++m) {
      dsts[m] = slots + dst_of(l, m);
      srcs[m] = host + src_of(l, m);
      sizes[m] = bytes;
    }
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t first = 0;
    CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, size_t(misses), &attr, &first, 1, s[0]));
  };
  auto kernel_layer = [&](int l, int blocks) {
    Gather g{};
    for (int m = 0; m < misses; ++m) {
      g.src[m] = reinterpret_cast<const uint4*>(host_dev + src_of(l, m));
      g.dst[m] = reinterpret_cast<uint4*>(slots + dst_of(l, m));
    }
    gather_kernel<<<blocks, 256, 0, s[0]>>>(g, misses, bytes / 16);
    CHECK(cudaGetLastError());
  };
  auto sync = [&] {
    for (auto& x : s) CHECK(cudaStreamSynchronize(x));
  };
  // Many layers back to back (rate), then one layer at a time with a host wait (latency).
  auto measure = [&](const char* name, auto&& issue) {
    issue(0);
    sync();
    auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < layers; ++l) issue(l);
    sync();
    const double rate_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double one_us = 1e30;
    for (int l = 0; l < layers; ++l) {
      auto t1 = std::chrono::steady_clock::now();
      issue(l);
      sync();
      one_us = std::min(one_us, std::chrono::duration<double, std::micro>(
                                    std::chrono::steady_clock::now() - t1).count());
    }
    const double gb = double(layers) * misses * double(bytes) / 1e9;
    std::printf("%-28s %6.1f GB/s back to back; one layer (%.1f MB) best %6.1f us = %5.1f GB/s\n",
                name, gb / rate_s, misses * double(bytes) / 1e6, one_us,
                misses * double(bytes) / one_us / 1e3);
  };
  measure("cudaMemcpyAsync, 1 stream", [&](int l) { memcpy_layer(l, 1); });
  measure("cudaMemcpyAsync, 2 streams", [&](int l) { memcpy_layer(l, 2); });
  measure("cudaMemcpyBatchAsync", [&](int l) { batch_layer(l); });
  // The ceiling: the same bytes as one transfer (contiguous experts into contiguous slots).
  measure("one contiguous transfer", [&](int l) {
    CHECK(cudaMemcpyAsync(slots, host + size_t(l % (n_host - misses)) * bytes,
                          size_t(misses) * bytes, cudaMemcpyHostToDevice, s[0]));
  });
  for (int blocks : {16, 32, 66, 132, 264, 528}) {
    char name[64];
    std::snprintf(name, sizeof name, "gather kernel, %d blocks", blocks);
    measure(name, [&](int l) { kernel_layer(l, blocks); });
  }
  // The kernel's copy must equal the bytes (the last layer's last miss).
  std::vector<uint8_t> back(bytes);
  CHECK(cudaMemcpy(back.data(), slots + dst_of(layers - 1, misses - 1), bytes,
                   cudaMemcpyDeviceToHost));
  const uint8_t* want = host + src_of(layers - 1, misses - 1);
  const bool same = std::equal(back.begin(), back.end(), want);
  std::printf("gather kernel copy %s\n", same ? "matches the host bytes" : "DIFFERS from the host bytes");
  return same ? 0 : 1;
}
