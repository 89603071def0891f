// Expert-grouped GEMMs on Hopper's warpgroup MMA (wgmma, sm_90a) for BF16 weights: the
// prefill path's largest cost (docs/PERF.md). A block is two warpgroups (256 threads) and
// computes a [kWgTile = 128 rows, 256 weight rows] tile of one expert, each warpgroup 64 of
// the rows against the same weight tile (a warpgroup whose rows are all past the tile's end
// only helps copy): in phase 1 the 256 weight rows are 128 gate rows then the same 128 up
// rows (so a thread holds gate and up of the same outputs and applies SiLU * up in
// registers), in phase 2 256 down rows. Steps of 64 columns: the x tile and the weight tile
// of a step are copied by cp.async into shared memory in the 128-byte swizzled K-major layout
// wgmma reads (16-byte chunk c of row r at chunk c ^ (r % 8) of the row, 8-row atoms of
// 1,024 bytes), kWgStages buffers; per step 4 wgmma m64n256k16 per warpgroup (one per
// 16 columns), waited before the step's buffer is refilled. Each output is a sum over
// columns in one fixed order, whatever the residency. Compiled only for sm_90a
// (CMAKE_CUDA_ARCHITECTURES 90a); grouped_wgmma_available() says whether this build and
// device run it.
#include "backend/cuda/kernels.cuh"

#include "backend/cuda/device_util.cuh"

namespace ts::cuda {
namespace {

constexpr int kWgK = 64;      // columns per step: one 128-byte row
constexpr int kWgRows = 256;  // weight rows per block
constexpr int kWgRowBytes = kWgK * 2;
constexpr int kWgThreads = 256;                              // two warpgroups
constexpr int kWgStage = (kWgTile + kWgRows) * kWgRowBytes;  // 48 KB
// cp.async buffers (one block of 8 warps per SM either way: 195 registers): 3, 4, and 4 with
// one step of wgmma kept in flight measured within 3% of each other (docs/PERF.md).
constexpr int kWgStages = 3;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TS_WGMMA 1
#else
#define TS_WGMMA 0
#endif

#if TS_WGMMA
// Shared-memory matrix descriptor: K-major, 128-byte swizzle; start address and the
// stride between 8-row atoms (1,024 bytes) in 16-byte units; the leading offset is unused
// by swizzled K-major layouts (1 by convention).
__device__ __forceinline__ uint64_t wg_desc(unsigned smem_addr) {
  return uint64_t((smem_addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

// d (64 x 256 over the warpgroup) += A (64 x 16) B^T (256 x 16), both from shared memory.
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, "
      "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, "
      "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
      "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, "
      "%123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "n"(1));
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N of the warpgroup's committed wgmma groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes the generic proxy's shared-memory writes (cp.async) visible to wgmma's reads.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Rows [0, rows) of a [*, k] BF16 matrix, columns k0..k0+63, into the swizzled tile at s:
// ROWS x 8 16-byte chunks, zero past rows / k (k a multiple of 8).
template <int ROWS>
__device__ __forceinline__ void wg_copy(const uint8_t* base, int rows, int k, int k0, uint8_t* s) {
#pragma unroll
  for (int i = 0; i < ROWS * 8 / kWgThreads; ++i) {
    const int c = threadIdx.x + kWgThreads * i, row = c / 8, chunk = c % 8, col = k0 + chunk * 8;
    const bool ok = row < rows && col < k;
    const uint8_t* src = ok ? base + (size_t(row) * k + col) * 2 : base;
    cp_async16_zfill(s + row * kWgRowBytes + ((chunk ^ (row % 8)) * 16), src, ok);
  }
}
#endif

template <bool kGateUp>
__global__ void __launch_bounds__(kWgThreads) grouped_wgmma_kernel(GroupedArgs a) {
  pdl_wait();
  if (past_plan(a)) return;
#if TS_WGMMA
  extern __shared__ __align__(1024) unsigned char wg_smem[];
  // The swizzle is on address bits: tiles start at a 1,024-byte boundary.
  uint8_t* const stage0 = wg_smem + ((1024 - (smem_u32(wg_smem) & 1023)) & 1023);
  const GroupTile tile = a.tiles[blockIdx.y];
  constexpr int kOut = kGateUp ? kWgRows / 2 : kWgRows;  // outputs per block
  const int n0 = blockIdx.x * kOut;
  const int n_rows = min(kOut, a.n - n0);
  const uint8_t* w0 = static_cast<const uint8_t*>(a.direct0 ? a.direct0 : a.w0[tile.expert]);
  const uint8_t* w1 =
      kGateUp ? static_cast<const uint8_t*>(a.direct1 ? a.direct1 : a.w1[tile.expert]) : nullptr;
  const size_t w_row = size_t(a.k) * 2;
  w0 += size_t(n0) * w_row;
  if (kGateUp) w1 += size_t(n0) * w_row;
  const uint8_t* x = static_cast<const uint8_t*>(a.x) + size_t(tile.row0) * size_t(a.k) * 2;
  const int steps = (a.k + kWgK - 1) / kWgK;
  const int wg = threadIdx.x / 128;  // this warpgroup's rows: 64 wg .. 64 wg + 63
  const bool active = 64 * wg < tile.m;

  float d[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) d[i] = 0.0f;
  // Stage layout: x [128 rows], then the 256 weight rows, 128 bytes each.
  const auto xs_of = [&](int b) { return stage0 + b * kWgStage; };
  const auto ws_of = [&](int b) { return stage0 + b * kWgStage + kWgTile * kWgRowBytes; };
  const auto issue = [&](int step, int b) {
    wg_copy<kWgTile>(x, tile.m, a.k, step * kWgK, xs_of(b));
    if (kGateUp) {
      wg_copy<kOut>(w0, n_rows, a.k, step * kWgK, ws_of(b));
      wg_copy<kOut>(w1, n_rows, a.k, step * kWgK, ws_of(b) + kOut * kWgRowBytes);
    } else {
      wg_copy<kOut>(w0, n_rows, a.k, step * kWgK, ws_of(b));
    }
  };
  // kWgStages - 1 steps of copies in flight beyond the one computing; one commit group per
  // step (empty past the last step, so the count of pending groups is always the same).
  for (int st = 0; st < kWgStages - 1; ++st) {
    if (st < steps) issue(st, st);
    cp_async_commit();
  }
  for (int step = 0; step < steps; ++step) {
    const int b = step % kWgStages;
    cp_async_wait_group<kWgStages - 2>();  // this step's copies landed
    fence_proxy_async();
    __syncthreads();
    // The previous step's buffer: its wgmma completed before every thread reached the barrier.
    const int next = step + kWgStages - 1;
    if (next < steps) issue(next, next % kWgStages);
    cp_async_commit();
    if (active) {  // uniform over the warpgroup, as wgmma requires
      const unsigned xa = smem_u32(xs_of(b)) + wg * 64 * kWgRowBytes, wa = smem_u32(ws_of(b));
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kWgK / 16; ++kk)  // 16 columns = 32 bytes along the swizzled row
        wgmma_m64n256k16(d, wg_desc(xa + 32 * kk), wg_desc(wa + 32 * kk));
      wgmma_commit();
      wgmma_wait<0>();
    }
  }
  // Thread holds, for each 8-column group j and h = 0, 1: row 64 wg + 16 warp + lane / 4 + 8 h,
  // columns 8 j + 2 (lane % 4) + 0, 1 in d[4 j + 2 h + 0, 1]. Phase 1: gate column c is group
  // c / 8, up column c group 16 + c / 8 (d[i + 64]).
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const bool pairs = a.n % 2 == 0;
  constexpr int kGroups = kOut / 8;
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 64 * wg + 16 * warp + lane / 4 + 8 * h;
      const int col = n0 + 8 * j + 2 * (lane % 4);
      if (r >= tile.m || col >= a.n) continue;
      const size_t o = size_t(tile.row0 + r) * size_t(a.n) + size_t(col);
      const int i = 4 * j + 2 * h;  // gate (or down) in d[i], d[i + 1]; up in d[i + 64], ...
      store_grouped_pair<kGateUp>(a.out, o, d[i], d[i + 1], kGateUp ? d[64 + i] : 0.0f,
                                  kGateUp ? d[64 + i + 1] : 0.0f, col + 1 < a.n, pairs);
    }
#endif
}

__global__ void wgmma_probe_kernel(int* out) { *out = TS_WGMMA; }

}  // namespace

bool grouped_wgmma_available() {
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (major != 9 || minor != 0) return false;
    int* flag = nullptr;
    int got = 0;
    if (cudaMalloc(&flag, sizeof(int)) != cudaSuccess) return false;
    wgmma_probe_kernel<<<1, 1>>>(flag);
    const bool copied = cudaMemcpy(&got, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
    cudaFree(flag);
    return copied && got == 1;
  }();
  return ok;
}

void grouped_wgmma(bool gate_up, const GroupedArgs& a, cudaStream_t s) {
  if (a.n_tiles == 0) return;
  constexpr size_t smem = size_t(kWgStages) * kWgStage + 1024;  // + alignment slack
  const auto kernel = gate_up ? grouped_wgmma_kernel<true> : grouped_wgmma_kernel<false>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  const int out = gate_up ? kWgRows / 2 : kWgRows;
  const dim3 grid(unsigned((a.n + out - 1) / out), unsigned(a.n_tiles));
  launch_kernel(kernel, grid, kWgThreads, smem, s, a);
}

}  // namespace ts::cuda
