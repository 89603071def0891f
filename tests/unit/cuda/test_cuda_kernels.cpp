// Every CUDA kernel against a simple CPU reference on random inputs, outputs poisoned with
// NaN first so an unwritten element shows. Skipped where no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/quant.h"
#include "backend/cuda/kernels.cuh"
#include "core/thread_pool.h"
#include "cuda_test_util.h"
#include "model/router.h"
#include "runtime/sampler.h"

namespace {

using ts_test::have_gpu;

using ts::DType;

#define SKIP_WITHOUT_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

// A device buffer holding a copy of `host` (or `bytes` of NaN poison).
struct Dev {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Dev(size_t n) : bytes(n) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 4)), cudaSuccess);
    cudaMemset(p, 0xff, n);  // NaN for floats
  }
  template <class T>
  explicit Dev(const std::vector<T>& host) : Dev(host.size() * sizeof(T)) {
    cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice);
  }
  ~Dev() { cudaFree(p); }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
  template <class T>
  std::vector<T> get() const {
    std::vector<T> out(bytes / sizeof(T));
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaMemcpy(out.data(), p, bytes, cudaMemcpyDeviceToHost);
    return out;
  }
};

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// A random [rows, cols] matrix in `type` (quantized with the CPU's quantizer).
std::vector<uint8_t> make_matrix(DType type, int64_t rows, int64_t cols, uint32_t seed) {
  const std::vector<float> f = randn(size_t(rows * cols), seed, 0.5f);
  const size_t rb = ts::dtype_row_bytes(type, cols);
  std::vector<uint8_t> out(size_t(rows) * rb);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = &f[size_t(r * cols)];
    uint8_t* dst = &out[size_t(r) * rb];
    switch (type) {
      case DType::kF32: std::memcpy(dst, src, rb); break;
      case DType::kF16:
        for (int64_t c = 0; c < cols; ++c) {
          const uint16_t h = ts::f32_to_f16(src[c]);
          std::memcpy(dst + 2 * c, &h, 2);
        }
        break;
      case DType::kBF16:
        for (int64_t c = 0; c < cols; ++c) {
          const uint16_t h = ts::f32_to_bf16(src[c]);
          std::memcpy(dst + 2 * c, &h, 2);
        }
        break;
      default: ts::cpu::quantize_row(type, src, dst, cols);
    }
  }
  return out;
}

// make_matrix for the Q8-activation tests: Q4_K matrices as random super-blocks (d and dmin
// in [0.002, 0.02), random 6-bit scales and mins and 4-bit quants) instead of the CPU's
// quantizer, which takes minutes for the largest shapes; other types as make_matrix.
std::vector<uint8_t> make_q8act_matrix(DType type, int64_t rows, int64_t cols, uint32_t seed) {
  if (type != DType::kQ4_K) return make_matrix(type, rows, cols, seed);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> scale(0.002f, 0.02f);
  std::vector<uint8_t> out(size_t(rows) * ts::dtype_row_bytes(type, cols));
  for (size_t b = 0; b < out.size() / 144; ++b) {
    uint8_t* blk = &out[b * 144];
    const uint16_t d = ts::f32_to_f16(scale(rng)), dmin = ts::f32_to_f16(scale(rng));
    std::memcpy(blk, &d, 2);
    std::memcpy(blk + 2, &dmin, 2);
    for (int i = 4; i < 144; ++i) blk[i] = uint8_t(rng());
  }
  return out;
}

// y = W x on the CPU with F32 activations, the reference for the CUDA kernels that take F32
// x: the CPU's own Q8_0 / Q4_K kernels quantize x to int8 blocks (backend/cpu/quant.h), so
// quantized rows are dequantized (the reference conversion) and multiplied in F32.
void cpu_matvec_f32_x(const void* w, DType t, const float* x, float* y, int64_t cols,
                      int64_t rows) {
  if (!ts::dtype_is_quantized(t)) return ts::cpu::matvec_rows(w, t, x, y, cols, 0, rows);
  std::vector<float> f(size_t(rows * cols));
  const size_t rb = ts::dtype_row_bytes(t, cols);
  for (int64_t r = 0; r < rows; ++r)
    ts::cpu::dequantize_row(t, static_cast<const uint8_t*>(w) + size_t(r) * rb,
                            &f[size_t(r * cols)], cols);
  ts::cpu::matvec_rows(f.data(), DType::kF32, x, y, cols, 0, rows);
}

// x as Q8 blocks, as quantize_act: d = max|x| / 127 per 32 values, round to nearest.
void quantize_q8_ref(const float* x, int64_t n, std::vector<int8_t>& q, std::vector<float>& d) {
  q.resize(size_t(n));
  d.resize(size_t(n / 32));
  for (int64_t b = 0; b < n / 32; ++b) {
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    d[size_t(b)] = amax / 127.0f;
    const float id = d[size_t(b)] != 0 ? 1.0f / d[size_t(b)] : 0.0f;
    for (int i = 0; i < 32; ++i) q[size_t(b * 32 + i)] = int8_t(std::nearbyint(x[b * 32 + i] * id));
  }
}

// One Q8_0 or Q4_K weight row . Q8 activations, 32 values at a time in double from integer
// sums: Q8_0 d * d_x * sum(q * q_x); Q4_K d_x * (d * sc * sum(q * q_x) - dmin * m * sum(q_x)).
double q8act_row_dot(DType type, const uint8_t* row, const int8_t* q, const float* d,
                     int64_t cols) {
  double acc = 0;
  for (int64_t b = 0; b < cols / 32; ++b) {
    const int8_t* qx = q + b * 32;
    if (type == DType::kQ8_0) {
      uint16_t dh;
      std::memcpy(&dh, row + b * 34, 2);
      int s = 0;
      for (int i = 0; i < 32; ++i) s += int(int8_t(row[b * 34 + 2 + i])) * qx[i];
      acc += double(ts::f16_to_f32(dh)) * d[b] * s;
      continue;
    }
    const uint8_t* blk = row + (b / 8) * 144;
    const int j = int(b % 8);
    uint16_t dh, mh;
    std::memcpy(&dh, blk, 2);
    std::memcpy(&mh, blk + 2, 2);
    const uint8_t* sc = blk + 4;
    const int s6 = j < 4 ? sc[j] & 63 : (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
    const int m6 = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    int s = 0, sx = 0;
    for (int i = 0; i < 32; ++i) {
      const uint8_t byte = blk[16 + 32 * (j / 2) + i];
      s += ((j & 1) ? byte >> 4 : byte & 15) * qx[i];
      sx += qx[i];
    }
    acc +=
        double(d[b]) * (double(ts::f16_to_f32(dh)) * s6 * s - double(ts::f16_to_f32(mh)) * m6 * sx);
  }
  return acc;
}

double max_rel(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num = std::max(num, double(std::fabs(got[i] - want[i])));
    den = std::max(den, double(std::fabs(want[i])));
  }
  return num / den;
}

TEST(CudaKernels, GemvMatchesCpuForEveryDtype) {
  SKIP_WITHOUT_GPU();
  ts::ThreadPool pool(1);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_K}) {
    // 288: Q8_0 rows off the 16-byte tile path; 2560: more than one tile per row.
    for (int64_t cols : {256, 288, 512, 1024, 2560}) {
      if (!ts::dtype_row_ok(t, cols)) continue;
      const int64_t rows = 37;
      const std::vector<uint8_t> w = make_matrix(t, rows, cols, 11);
      // One token runs the kernel that stages rows in shared memory (BF16 / F16 rows of a
      // multiple of 8 columns): token 0 (the same x for every n) must get the same bits.
      std::vector<float> one_token;
      for (int n : {1, 3, 6}) {
        const std::vector<float> x = randn(size_t(n * cols), 5);
        std::vector<float> want(size_t(n * rows));
        for (int i = 0; i < n; ++i)
          cpu_matvec_f32_x(w.data(), t, &x[size_t(i * cols)], &want[size_t(i * rows)], cols, rows);
        Dev dw(w), dx(x), dy(want.size() * 4);
        ts::cuda::gemv({dw.p, t, rows, cols}, dx.as<float>(), n, dy.as<float>(), false, nullptr);
        EXPECT_LE(max_rel(dy.get<float>(), want), 1e-4)
            << ts::dtype_name(t) << " cols " << cols << " n " << n;
        const std::vector<float> got = dy.get<float>();
        if (n == 1)
          one_token = got;
        else
          EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + rows), one_token)
              << ts::dtype_name(t) << " cols " << cols << " n " << n;
        // accumulate: y += W x
        ts::cuda::gemv({dw.p, t, rows, cols}, dx.as<float>(), n, dy.as<float>(), true, nullptr);
        std::vector<float> twice = want;
        for (float& v : twice) v *= 2;
        EXPECT_LE(max_rel(dy.get<float>(), twice), 1e-4) << ts::dtype_name(t) << " accumulate";
      }
    }
  }
}

// Q8_0 and Q4_K weights with Q8 activations (dp4a): against an integer reference that
// quantizes x the same way (d = max|x| / 127, round to nearest), so only the float scaling
// can differ.
TEST(CudaKernels, GemvQ8ActivationsMatchIntegerReference) {
  SKIP_WITHOUT_GPU();
  // One token with rows of up to 8,192 columns takes the kernel that stages whole rows;
  // 8,448 and every n = 4 the tile-by-tile kernel (Q8_0; Q4_K's rows of 8,448 still stage).
  // Token 0's x is the same for n = 1 and 4 (one random sequence), and both kernels must give
  // it the same bits.
  for (const DType type : {DType::kQ8_0, DType::kQ4_K})
    for (int64_t cols : {256, 2048, 4096, 8448}) {
      SCOPED_TRACE(ts::dtype_name(type));
      const int64_t rows = 21;
      const std::vector<uint8_t> w = make_q8act_matrix(type, rows, cols, 17);
      const size_t rb = ts::dtype_row_bytes(type, cols);
      std::vector<float> one_token;
      for (int n : {1, 4}) {
        const std::vector<float> x = randn(size_t(n * cols), 23);
        std::vector<float> want(size_t(n * rows), 0.0f);
        const int64_t nb = cols / 32;
        std::vector<int8_t> qx;
        std::vector<float> dx_ref;
        for (int t = 0; t < n; ++t) {
          quantize_q8_ref(&x[size_t(t * cols)], cols, qx, dx_ref);
          for (int64_t r = 0; r < rows; ++r)
            want[size_t(t * rows + r)] =
                float(q8act_row_dot(type, &w[size_t(r) * rb], qx.data(), dx_ref.data(), cols));
        }
        Dev dw(w), dx(x), dy(want.size() * 4), dq(size_t(n * cols)), dd(size_t(n * nb) * 4);
        const ts::cuda::QAct q{dq.as<int8_t>(), dd.as<float>()};
        ts::cuda::quantize_act(dx.as<float>(), n * cols, q, nullptr);
        const ts::cuda::DevMatrix m{dw.p, type, rows, cols};
        float* y = dy.as<float>();
        ts::cuda::gemv_parts(&m, &y, 1, {dx.as<float>(), q}, n, false, nullptr);
        // Q4_K: each sub-block's two float terms (d * sc * sum, dmin * m * sum) partly cancel.
        const double tol = type == DType::kQ4_K ? 5e-5 : 1e-5;
        EXPECT_LE(max_rel(dy.get<float>(), want), tol) << "cols " << cols << " n " << n;
        const std::vector<float> got = dy.get<float>();
        if (n == 1)
          one_token = got;
        else
          EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + rows), one_token) << cols;
        // and within Q8 activation error of the exact F32-activation product
        std::vector<float> exact(want.size());
        for (int t = 0; t < n; ++t)
          cpu_matvec_f32_x(w.data(), type, &x[size_t(t * cols)], &exact[size_t(t * rows)], cols,
                           rows);
        EXPECT_LE(max_rel(dy.get<float>(), exact), 2e-2);
      }
    }
}

TEST(CudaKernels, GemvHandlesColumnsOffTheVectorWidth) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kF32, DType::kBF16}) {
    const int64_t rows = 5, cols = 70;  // not a multiple of 4 / 8: the scalar path
    const std::vector<uint8_t> w = make_matrix(t, rows, cols, 3);
    const std::vector<float> x = randn(size_t(cols), 4);
    std::vector<float> want(rows);
    ts::cpu::matvec_rows(w.data(), t, x.data(), want.data(), cols, 0, rows);
    Dev dw(w), dx(x), dy(want.size() * 4);
    ts::cuda::gemv({dw.p, t, rows, cols}, dx.as<float>(), 1, dy.as<float>(), false, nullptr);
    EXPECT_LE(max_rel(dy.get<float>(), want), 1e-5) << ts::dtype_name(t);
  }
}

TEST(CudaKernels, RmsnormMatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (int cols : {32, 200, 2048}) {
    const int rows = 7;
    const std::vector<float> x = randn(size_t(rows * cols), 1), w = randn(size_t(cols), 2);
    std::vector<float> want(x.size());
    ts::cpu::rmsnorm_rows(x.data(), w.data(), want.data(), rows, cols, 1e-6f);
    Dev dx(x), dw(w), dy(x.size() * 4);
    ts::cuda::rmsnorm(dx.as<float>(), dw.as<float>(), dy.as<float>(), rows, cols, 1e-6f, nullptr);
    EXPECT_LE(max_rel(dy.get<float>(), want), 1e-5) << cols;
    if (cols % 32 != 0) continue;
    // With a Q8 output: the same y, and the bytes quantize_act makes of that y.
    const size_t n = x.size();
    Dev dy2(n * 4), dq(n), dd(n / 32 * 4), dq_ref(n), dd_ref(n / 32 * 4);
    ts::cuda::rmsnorm(dx.as<float>(), dw.as<float>(), dy2.as<float>(), rows, cols, 1e-6f, nullptr,
                      {dq.as<int8_t>(), dd.as<float>()});
    ts::cuda::quantize_act(dy2.as<float>(), int64_t(n), {dq_ref.as<int8_t>(), dd_ref.as<float>()},
                           nullptr);
    EXPECT_EQ(dy2.get<float>(), dy.get<float>()) << cols;
    EXPECT_EQ(dq.get<int8_t>(), dq_ref.get<int8_t>()) << cols;
    EXPECT_EQ(dd.get<float>(), dd_ref.get<float>()) << cols;
  }
}

// greedy_pick: runtime::argmax's id (the first of the largest, NaN skipped, 0 where logits[0]
// is NaN) on random logits with ties across and within the blocks' ranges, NaNs, -inf only;
// each pick is the next token, advances the position, and goes into the ring in order; the
// block count is left 0 for the next launch.
TEST(CudaKernels, GreedyPickIsTheHostArgmaxAndFillsTheRing) {
  SKIP_WITHOUT_GPU();
  const float nan = std::nanf(""), inf = INFINITY;
  std::vector<std::vector<float>> cases;
  for (int vocab : {1, 31, 1000, 151936}) cases.push_back(randn(size_t(vocab), uint32_t(vocab)));
  {
    std::vector<float> v = randn(151936, 5);
    const float top = *std::max_element(v.begin(), v.end()) + 1.0f;
    v[150000] = top, v[77777] = top, v[77778] = top;  // the first of three ties wins
    cases.push_back(v);
    v[0] = nan;  // NaN first: 0, as the host's loop
    cases.push_back(v);
    v[0] = 0.0f, v[77777] = nan, v[77778] = nan;  // NaN skipped: 150000
    cases.push_back(v);
  }
  cases.push_back(std::vector<float>(5000, -inf));
  cases.push_back(std::vector<float>(5000, nan));
  const int ring_size = 4;
  int* ring_host = nullptr;
  ASSERT_EQ(
      cudaHostAlloc(reinterpret_cast<void**>(&ring_host), (1 + ring_size) * 4, cudaHostAllocMapped),
      cudaSuccess);
  int* ring_dev = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ring_dev), ring_host, 0),
            cudaSuccess);
  std::fill_n(ring_host, 1 + ring_size, -7);
  ring_host[0] = 0;
  Dev tokens(4), pos(std::vector<int>{41}), part_v(ts::cuda::kGreedyBlocks * 4),
      part_i(ts::cuda::kGreedyBlocks * 4), count(std::vector<unsigned>{0, 0});
  for (size_t c = 0; c < cases.size(); ++c) {
    const std::vector<float>& v = cases[c];
    Dev logits(v);
    ts::cuda::greedy_pick({.logits = logits.as<float>(),
                           .vocab = int(v.size()),
                           .tokens = tokens.as<int>(),
                           .pos = pos.as<int>(),
                           .part_v = part_v.as<float>(),
                           .part_i = part_i.as<int>(),
                           .count = count.as<unsigned>(),
                           .seq = count.as<unsigned>() + 1,
                           .ring = ring_dev,
                           .ring_size = ring_size},
                          nullptr);
    const int want = ts::runtime::argmax(v);
    EXPECT_EQ(tokens.get<int>()[0], want) << "case " << c;
    EXPECT_EQ(pos.get<int>()[0], 42 + int(c)) << "case " << c;
    EXPECT_EQ(count.get<unsigned>(), (std::vector<unsigned>{0, unsigned(c + 1)})) << "case " << c;
    EXPECT_EQ(ring_host[0], int(c + 1)) << "case " << c;
    EXPECT_EQ(ring_host[1 + c % ring_size], want) << "case " << c;
  }
  cudaFreeHost(ring_host);
}

// count_predicted: per compared layer, how many of the router's picks the prediction held
// (layers with -1 on either side skipped); prefetch_experts reads nothing back and writes
// nothing (the tables, ids and weights unchanged), also with ids of -1.
TEST(CudaKernels, PredictedExpertsCountedAndPrefetchWritesNothing) {
  SKIP_WITHOUT_GPU();
  const int k = 4;
  const std::vector<int> pred = {3, 1, 7, 0, /**/ 5, 6, 2, 9, /**/ -1, -1, -1, -1, /**/ 1, 2, 3, 4};
  const std::vector<int> real = {0,      1, 2, 3, /**/ 8,  9,  10, 11,
                                 /**/ 1, 2, 3, 4, /**/ -1, -1, -1, -1};
  Dev dp(pred), dr(real);
  const std::vector<unsigned long long> zero = {40, 100};
  Dev dh(zero);
  ts::cuda::count_predicted(dp.as<int>(), dr.as<int>(), 4, k, dh.as<unsigned long long>(), nullptr);
  ts::cuda::count_predicted(dp.as<int>(), dr.as<int>(), 4, k, dh.as<unsigned long long>(), nullptr);
  // Layer 0: 0, 1, 3 predicted (3 right); layer 1: 9 (1 right); 8 picks compared per call.
  EXPECT_EQ(dh.get<unsigned long long>(), (std::vector<unsigned long long>{48, 116}));

  const int n_experts = 8;
  const size_t bytes = 3 * 1088 + 16;
  std::vector<std::vector<uint8_t>> host;
  std::vector<std::unique_ptr<Dev>> mats;
  std::vector<const void*> tab_g, tab_u;
  for (int e = 0; e < n_experts; ++e)
    for (int m = 0; m < 2; ++m) {
      host.push_back(std::vector<uint8_t>(bytes, uint8_t(e * 2 + m)));
      mats.push_back(std::make_unique<Dev>(host.back()));
      (m == 0 ? tab_g : tab_u).push_back(mats.back()->p);
    }
  Dev dg(tab_g), du(tab_u);
  const std::vector<int> ids = {6, -1, 0, 3};
  Dev di(ids);
  for (int ranks : {1, 4})
    ts::cuda::prefetch_experts({.gate = dg.as<const void*>(),
                                .up = du.as<const void*>(),
                                .ids = di.as<int>(),
                                .ranks = ranks,
                                .bytes = bytes},
                               nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  for (size_t i = 0; i < mats.size(); ++i) EXPECT_EQ(mats[i]->get<uint8_t>(), host[i]) << i;
  EXPECT_EQ(dg.get<const void*>(), tab_g);
  EXPECT_EQ(du.get<const void*>(), tab_u);
  EXPECT_EQ(di.get<int>(), ids);
}

// RoPE + KV append's arguments on these device buffers (no norms, no BF16 copies).
ts::cuda::RopeKvArgs rope_args(const Dev& q, const Dev& k, const Dev& v, const Dev& k_cache,
                               const Dev& v_cache, const Dev& inv_freq, const Dev& pos, int n,
                               int n_heads, int n_kv, int hd) {
  return {.q = q.as<float>(),
          .k = k.as<float>(),
          .v = v.as<float>(),
          .k_cache = k_cache.as<float>(),
          .v_cache = v_cache.as<float>(),
          .inv_freq = inv_freq.as<float>(),
          .pos = pos.as<int>(),
          .n = n,
          .n_heads = n_heads,
          .n_kv_heads = n_kv,
          .head_dim = hd};
}

// n = 1: the split (flash-decoding) kernel; n > 1: the tiled prefill kernel (40 queries:
// more than one query tile, keys over several key tiles).
class CudaAttention : public ::testing::TestWithParam<int> {};

TEST_P(CudaAttention, RopeAndAttentionMatchCpu) {
  SKIP_WITHOUT_GPU();
  ts::ThreadPool pool(1);
  const int n = GetParam();
  const int n_heads = 8, n_kv = 2, hd = 64, pos0 = 150, n_ctx = 200;
  const int qd = n_heads * hd, kvd = n_kv * hd;
  std::vector<float> inv;
  for (int i = 0; i < hd / 2; ++i) inv.push_back(1.0f / std::pow(10000.0f, float(2 * i) / hd));
  const std::vector<float> q = randn(size_t(n * qd), 1), k = randn(size_t(n * kvd), 2),
                           v = randn(size_t(n * kvd), 3);
  std::vector<float> kc = randn(size_t(n_ctx * kvd), 4), vc = randn(size_t(n_ctx * kvd), 5);
  // CPU reference: rope, append, attention.
  std::vector<float> qr = q, kr = k, kc_ref = kc, vc_ref = vc, want(size_t(n * qd));
  const ts::cpu::RopeTable rope{.head_stride = hd, .dim = hd, .inv_freq = inv};
  for (int t = 0; t < n; ++t) {
    ts::cpu::rope_apply(&qr[size_t(t * qd)], n_heads, rope, pos0 + t);
    ts::cpu::rope_apply(&kr[size_t(t * kvd)], n_kv, rope, pos0 + t);
    std::copy_n(&kr[size_t(t * kvd)], kvd, &kc_ref[size_t((pos0 + t) * kvd)]);
    std::copy_n(&v[size_t(t * kvd)], kvd, &vc_ref[size_t((pos0 + t) * kvd)]);
  }
  ts::cpu::attention(pool, {.q = qr.data(), .k_cache = kc_ref.data(), .v_cache = vc_ref.data(),
                            .out = want.data(), .n_tokens = n, .pos0 = pos0, .n_heads = n_heads,
                            .n_kv_heads = n_kv, .head_dim = hd});
  for (int splits : {1, 4, 16}) {
    Dev dq(q), dk(k), dv(v), dkc(kc), dvc(vc), dinv(inv), dpos(std::vector<int>{pos0});
    Dev dout(want.size() * 4), dpart(size_t(n * n_heads * splits * (hd + 2)) * 4);
    // BF16 copies of the appended rows (poisoned: the other rows must stay untouched).
    Dev dkb(kc.size() * 2), dvb(vc.size() * 2);
    ts::cuda::RopeKvArgs ra = rope_args(dq, dk, dv, dkc, dvc, dinv, dpos, n, n_heads, n_kv, hd);
    ra.k_bf16 = dkb.p;
    ra.v_bf16 = dvb.p;
    ts::cuda::rope_kv_append(ra, nullptr);
    EXPECT_LE(max_rel(dq.get<float>(), qr), 1e-6);
    EXPECT_LE(max_rel(dkc.get<float>(), kc_ref), 1e-6);
    EXPECT_EQ(dvc.get<float>(), vc_ref);
    const std::vector<float> kc_got = dkc.get<float>(), vc_got = dvc.get<float>();
    const std::vector<uint16_t> kb = dkb.get<uint16_t>(), vb = dvb.get<uint16_t>();
    for (size_t i = 0; i < kb.size(); ++i) {
      const bool appended = i >= size_t(pos0 * kvd) && i < size_t((pos0 + n) * kvd);
      ASSERT_EQ(kb[i], appended ? ts::f32_to_bf16(kc_got[i]) : uint16_t(0xffff)) << "k " << i;
      ASSERT_EQ(vb[i], appended ? ts::f32_to_bf16(vc_got[i]) : uint16_t(0xffff)) << "v " << i;
    }
    // BF16 rows alone (the cache of a model whose weights are not F32): the same rows.
    {
      Dev dq2(q), dkb2(kc.size() * 2), dvb2(vc.size() * 2);
      ts::cuda::RopeKvArgs rb = ra;
      rb.q = dq2.as<float>();
      rb.k_cache = rb.v_cache = nullptr;
      rb.k_bf16 = dkb2.p;
      rb.v_bf16 = dvb2.p;
      ts::cuda::rope_kv_append(rb, nullptr);
      EXPECT_EQ(dkb2.get<uint16_t>(), kb);
      EXPECT_EQ(dvb2.get<uint16_t>(), vb);
      EXPECT_EQ(dq2.get<float>(), dq.get<float>());
    }
    ts::cuda::attention({.q = dq.as<float>(), .k_cache = dkc.as<float>(),
                         .v_cache = dvc.as<float>(), .out = dout.as<float>(),
                         .partial = dpart.as<float>(), .pos = dpos.as<int>(), .n = n,
                         .n_heads = n_heads, .n_kv_heads = n_kv, .head_dim = hd,
                         .n_splits = splits},
                        nullptr);
    EXPECT_LE(max_rel(dout.get<float>(), want), 1e-5) << "splits " << splits;
  }
}
INSTANTIATE_TEST_SUITE_P(Tokens, CudaAttention, ::testing::Values(1, 5, 40));

// RoPE + KV append with qwen3_moe's per-head RMSNorm of q and k first (weights loaded before
// the kernel's wait, q, k and v after it): against the CPU's rmsnorm and rope per head.
TEST(CudaKernels, RopeWithPerHeadNormMatchesCpu) {
  SKIP_WITHOUT_GPU();
  for (const int hd : {64, 128}) {
    for (const int n : {1, 5}) {
      const int n_heads = 8, n_kv = 2, pos0 = 37, n_ctx = 64;
      const int qd = n_heads * hd, kvd = n_kv * hd;
      const float eps = 1e-6f;
      std::vector<float> inv;
      for (int i = 0; i < hd / 2; ++i) inv.push_back(1.0f / std::pow(1e6f, float(2 * i) / hd));
      const std::vector<float> q = randn(size_t(n * qd), 31), k = randn(size_t(n * kvd), 32),
                               v = randn(size_t(n * kvd), 33), qn = randn(size_t(hd), 34, 0.5f),
                               kn = randn(size_t(hd), 35, 0.5f);
      std::vector<float> qr = q, kr = k, kc_ref(size_t(n_ctx * kvd), 0.0f),
                         vc_ref(size_t(n_ctx * kvd), 0.0f);
      const ts::cpu::RopeTable rope{.head_stride = hd, .dim = hd, .inv_freq = inv};
      for (int t = 0; t < n; ++t) {
        for (int h = 0; h < n_heads; ++h) {
          float* x = &qr[size_t(t * qd + h * hd)];
          ts::cpu::rmsnorm_rows(x, qn.data(), x, 1, hd, eps);
        }
        for (int h = 0; h < n_kv; ++h) {
          float* x = &kr[size_t(t * kvd + h * hd)];
          ts::cpu::rmsnorm_rows(x, kn.data(), x, 1, hd, eps);
        }
        ts::cpu::rope_apply(&qr[size_t(t * qd)], n_heads, rope, pos0 + t);
        ts::cpu::rope_apply(&kr[size_t(t * kvd)], n_kv, rope, pos0 + t);
        std::copy_n(&kr[size_t(t * kvd)], kvd, &kc_ref[size_t((pos0 + t) * kvd)]);
        std::copy_n(&v[size_t(t * kvd)], kvd, &vc_ref[size_t((pos0 + t) * kvd)]);
      }
      Dev dq(q), dk(k), dv(v), dinv(inv), dqn(qn), dkn(kn), dpos(std::vector<int>{pos0}),
          dkc(std::vector<float>(kc_ref.size(), 0.0f)),
          dvc(std::vector<float>(vc_ref.size(), 0.0f));
      ts::cuda::RopeKvArgs ra = rope_args(dq, dk, dv, dkc, dvc, dinv, dpos, n, n_heads, n_kv, hd);
      ra.q_norm = dqn.as<float>();
      ra.k_norm = dkn.as<float>();
      ra.eps = eps;
      ts::cuda::rope_kv_append(ra, nullptr);
      const std::string what = "hd " + std::to_string(hd) + " n " + std::to_string(n);
      EXPECT_LE(max_rel(dq.get<float>(), qr), 1e-5) << what;
      EXPECT_LE(max_rel(dkc.get<float>(), kc_ref), 1e-5) << what;
      EXPECT_EQ(dvc.get<float>(), vc_ref) << what;
    }
  }
}

// Decode attention shapes: one block per KV head for groups of 1 to 32 query heads (head dims
// 64 and 128; groups of 16 and 32 give a warp 2 and 4 heads), one block per
// query head where the head dim is too wide; short and long contexts, split counts from 1 to
// more splits than 32-key tiles (empty splits). Against the CPU's attention.
TEST(CudaKernels, DecodeAttentionByKvHeadMatchesCpu) {
  SKIP_WITHOUT_GPU();
  ts::ThreadPool pool(1);
  struct Case {
    int n_heads, n_kv, hd, pos0;
  };
  for (const Case c : {Case{8, 8, 64, 37}, Case{32, 4, 128, 127}, Case{32, 4, 128, 1500},
                       Case{16, 4, 64, 300}, Case{16, 1, 128, 70}, Case{64, 2, 64, 45},
                       Case{8, 2, 256, 90}, Case{6, 2, 96, 31}}) {
    const int qd = c.n_heads * c.hd, kvd = c.n_kv * c.hd, n_ctx = c.pos0 + 1;
    EXPECT_EQ(ts::cuda::gqa_attention_applies(c.n_heads, c.n_kv, c.hd), c.hd <= 128);
    const std::vector<float> q = randn(size_t(qd), 11), kc = randn(size_t(n_ctx * kvd), 12),
                             vc = randn(size_t(n_ctx * kvd), 13);
    std::vector<float> want(static_cast<size_t>(qd));
    ts::cpu::attention(pool, {.q = q.data(), .k_cache = kc.data(), .v_cache = vc.data(),
                              .out = want.data(), .n_tokens = 1, .pos0 = c.pos0,
                              .n_heads = c.n_heads, .n_kv_heads = c.n_kv, .head_dim = c.hd});
    for (int splits : {1, 3, 64}) {
      Dev dq(q), dkc(kc), dvc(vc), dpos(std::vector<int>{c.pos0});
      Dev dout(want.size() * 4), dpart(size_t(c.n_heads * splits * (c.hd + 2)) * 4);
      ts::cuda::attention({.q = dq.as<float>(), .k_cache = dkc.as<float>(),
                           .v_cache = dvc.as<float>(), .out = dout.as<float>(),
                           .partial = dpart.as<float>(), .pos = dpos.as<int>(), .n = 1,
                           .n_heads = c.n_heads, .n_kv_heads = c.n_kv, .head_dim = c.hd,
                           .n_splits = splits},
                          nullptr);
      EXPECT_LE(max_rel(dout.get<float>(), want), 1e-5)
          << "heads " << c.n_heads << "/" << c.n_kv << " hd " << c.hd << " keys " << n_ctx
          << " splits " << splits;
      // With a Q8 copy of the output (by the merge, or after it for head dims off 32): the
      // same output, and the bytes quantize_act makes of it.
      Dev dout2(want.size() * 4), dqo(want.size()), ddo(want.size() / 32 * 4), dq_ref(want.size()),
          dd_ref(want.size() / 32 * 4);
      ts::cuda::attention({.q = dq.as<float>(), .k_cache = dkc.as<float>(),
                           .v_cache = dvc.as<float>(), .out = dout2.as<float>(),
                           .partial = dpart.as<float>(), .pos = dpos.as<int>(), .n = 1,
                           .n_heads = c.n_heads, .n_kv_heads = c.n_kv, .head_dim = c.hd,
                           .n_splits = splits, .out_q = {dqo.as<int8_t>(), ddo.as<float>()}},
                          nullptr);
      ts::cuda::quantize_act(dout2.as<float>(), int64_t(want.size()),
                             {dq_ref.as<int8_t>(), dd_ref.as<float>()}, nullptr);
      EXPECT_EQ(dout2.get<float>(), dout.get<float>());
      EXPECT_EQ(dqo.get<int8_t>(), dq_ref.get<int8_t>()) << "hd " << c.hd;
      EXPECT_EQ(ddo.get<float>(), dd_ref.get<float>()) << "hd " << c.hd;
    }
  }
}

// Decode attention as one thread block cluster per KV head (the merge in distributed shared
// memory, no merge launch): up to kClusterAttentionKeys keys the same bytes as the split path
// with 32-key splits (output and its Q8 copy), for groups that leave cluster blocks without a
// head to merge (4), one each (8) and two (16, also at head dim 128: past the 48 KiB default
// of shared memory); past that bound still the CPU's attention.
TEST(CudaKernels, DecodeAttentionInOneClusterMatchesSplitsAndMerge) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int n_heads, n_kv, hd;
  };
  int ran = 0;
  ts::ThreadPool pool(1);
  for (const Case c :
       {Case{32, 4, 128}, Case{32, 8, 128}, Case{16, 1, 64}, Case{6, 2, 96}, Case{64, 4, 128}}) {
    if (!ts::cuda::cluster_attention_applies(c.n_heads, c.n_kv, c.hd)) continue;
    for (const int pos0 : {0, 1, 31, 32, 100, ts::cuda::kClusterAttentionKeys - 1,
                           ts::cuda::kClusterAttentionKeys, 700}) {
      const int qd = c.n_heads * c.hd, kvd = c.n_kv * c.hd, n_ctx = pos0 + 1;
      const std::vector<float> q = randn(size_t(qd), 21), kc = randn(size_t(n_ctx * kvd), 22, 2.0f),
                               vc = randn(size_t(n_ctx * kvd), 23);
      const bool q8 = c.hd % 32 == 0;
      const std::string what = "heads " + std::to_string(c.n_heads) + "/" + std::to_string(c.n_kv) +
                               " hd " + std::to_string(c.hd) + " keys " + std::to_string(n_ctx);
      Dev dq(q), dkc(kc), dvc(vc), dpos(std::vector<int>{pos0});
      const int splits = 64;
      Dev dpart(size_t(c.n_heads * splits * (c.hd + 2)) * 4);
      Dev split_out(size_t(qd) * 4), split_qo{size_t(qd)}, split_do(size_t(qd) / 32 * 4);
      Dev out(size_t(qd) * 4), qo{size_t(qd)}, d_o(size_t(qd) / 32 * 4);
      ts::cuda::AttentionArgs a{.q = dq.as<float>(),
                                .k_cache = dkc.as<float>(),
                                .v_cache = dvc.as<float>(),
                                .out = split_out.as<float>(),
                                .partial = dpart.as<float>(),
                                .pos = dpos.as<int>(),
                                .n = 1,
                                .n_heads = c.n_heads,
                                .n_kv_heads = c.n_kv,
                                .head_dim = c.hd,
                                .n_splits = splits};
      if (q8) a.out_q = {split_qo.as<int8_t>(), split_do.as<float>()};
      ts::cuda::attention(a, nullptr);
      a.out = out.as<float>();
      a.partial = nullptr;  // the cluster path writes no partial rows
      if (q8) a.out_q = {qo.as<int8_t>(), d_o.as<float>()};
      a.cluster = true;
      ts::cuda::attention(a, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
      const std::vector<float> got = out.get<float>();
      if (n_ctx <= ts::cuda::kClusterAttentionKeys) {
        EXPECT_EQ(got, split_out.get<float>()) << what;
        if (q8) {
          EXPECT_EQ(qo.get<int8_t>(), split_qo.get<int8_t>()) << what;
          EXPECT_EQ(d_o.get<float>(), split_do.get<float>()) << what;
        }
      }
      std::vector<float> want(static_cast<size_t>(qd));
      ts::cpu::attention(pool, {.q = q.data(),
                                .k_cache = kc.data(),
                                .v_cache = vc.data(),
                                .out = want.data(),
                                .n_tokens = 1,
                                .pos0 = pos0,
                                .n_heads = c.n_heads,
                                .n_kv_heads = c.n_kv,
                                .head_dim = c.hd});
      EXPECT_LE(max_rel(got, want), 1e-5) << what;
      if (q8) {
        Dev dq_ref{size_t(qd)}, dd_ref(size_t(qd) / 32 * 4);
        ts::cuda::quantize_act(out.as<float>(), qd, {dq_ref.as<int8_t>(), dd_ref.as<float>()},
                               nullptr);
        EXPECT_EQ(qo.get<int8_t>(), dq_ref.get<int8_t>()) << what;
        EXPECT_EQ(d_o.get<float>(), dd_ref.get<float>()) << what;
      }
      ++ran;
    }
  }
  // On a GPU that launches clusters (sm_90), every case ran.
  if (ts::cuda::cluster_attention_available()) {
    EXPECT_EQ(ran, 40);
  }
}

// One token's attention on tensor cores from the BF16 copies of the cache (a decode step of a
// model whose weights are not F32, past the cluster path's keys): against a double-precision
// softmax of the F32 inputs (BF16 queries, keys, values and probabilities: about 2^-8
// relative, the prefill kernel's bound), with the F32 cache poisoned (NaN) so that reading it
// would show, and BF16 rows past the last key poisoned too; groups of 1 to 16 query heads,
// head dims 64 and 128, splits of one and of several 64-key tiles and empty splits, and more
// used splits (79 of 100 at 5,001 keys) than the merge loads at once; the Q8 copy written by the
// merge the bytes quantize_act makes of the output.
TEST(CudaKernels, DecodeAttentionOnTensorCoresMatchesReference) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int n_heads, n_kv, hd, pos0;
  };
  for (const Case c : {Case{32, 4, 128, 4100}, Case{32, 4, 128, 5000}, Case{32, 4, 128, 300},
                       Case{16, 4, 64, 1000},
                       Case{16, 1, 128, 70}, Case{8, 8, 64, 37}, Case{32, 2, 128, 700}}) {
    ASSERT_TRUE(ts::cuda::tc_decode_attention_applies(c.n_heads, c.n_kv, c.hd));
    const int qd = c.n_heads * c.hd, kvd = c.n_kv * c.hd, n_ctx = c.pos0 + 1;
    const int group = c.n_heads / c.n_kv;
    const std::vector<float> q = randn(size_t(qd), 61), k = randn(size_t(n_ctx * kvd), 62, 2.0f),
                             v = randn(size_t(n_ctx * kvd), 63);
    std::vector<float> want(static_cast<size_t>(qd));
    for (int h = 0; h < c.n_heads; ++h) {
      const int g = h / group;
      std::vector<double> sc(static_cast<size_t>(n_ctx));
      double mx = -1e300, sum = 0;
      for (int j = 0; j < n_ctx; ++j) {
        double dot = 0;
        for (int i = 0; i < c.hd; ++i)
          dot += double(q[size_t(h * c.hd + i)]) * k[size_t(j * kvd + g * c.hd + i)];
        sc[size_t(j)] = dot / std::sqrt(double(c.hd));
        mx = std::max(mx, sc[size_t(j)]);
      }
      for (double& x : sc) sum += (x = std::exp(x - mx));
      for (int i = 0; i < c.hd; ++i) {
        double o = 0;
        for (int j = 0; j < n_ctx; ++j) o += sc[size_t(j)] * v[size_t(j * kvd + g * c.hd + i)];
        want[size_t(h * c.hd + i)] = float(o / sum);
      }
    }
    // BF16 copies with 64 rows of poison (NaN) past the last key.
    std::vector<uint16_t> kb(size_t(n_ctx + 64) * kvd, 0xffff), vb(kb.size(), 0xffff);
    for (size_t i = 0; i < k.size(); ++i) {
      kb[i] = ts::f32_to_bf16(k[i]);
      vb[i] = ts::f32_to_bf16(v[i]);
    }
    const std::string what = "heads " + std::to_string(c.n_heads) + "/" + std::to_string(c.n_kv) +
                             " hd " + std::to_string(c.hd) + " keys " + std::to_string(n_ctx);
    Dev dq(q), dkb(kb), dvb(vb), dpos(std::vector<int>{c.pos0});
    Dev poison_k(k.size() * 4), poison_v(v.size() * 4);  // NaN: the F32 cache is not read
    for (const int splits : {1, 3, 66, 100}) {
      Dev dout(size_t(qd) * 4), dpart(size_t(c.n_heads * splits * (c.hd + 2)) * 4);
      ts::cuda::AttentionArgs a{.q = dq.as<float>(),
                                .k_cache = poison_k.as<float>(),
                                .v_cache = poison_v.as<float>(),
                                .out = dout.as<float>(),
                                .partial = dpart.as<float>(),
                                .pos = dpos.as<int>(),
                                .n = 1,
                                .n_heads = c.n_heads,
                                .n_kv_heads = c.n_kv,
                                .head_dim = c.hd,
                                .n_splits = splits,
                                .k_bf16 = dkb.p,
                                .v_bf16 = dvb.p};
      ts::cuda::attention(a, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
      const std::vector<float> got = dout.get<float>();
      EXPECT_LE(max_rel(got, want), 2e-2) << what << " splits " << splits;
      // With the Q8 copy by the merge: the same output, and quantize_act's bytes of it.
      Dev dout2(size_t(qd) * 4), qo{size_t(qd)}, d_o(size_t(qd) / 32 * 4), q_ref{size_t(qd)},
          d_ref(size_t(qd) / 32 * 4);
      a.out = dout2.as<float>();
      a.out_q = {qo.as<int8_t>(), d_o.as<float>()};
      ts::cuda::attention(a, nullptr);
      ts::cuda::quantize_act(dout2.as<float>(), qd, {q_ref.as<int8_t>(), d_ref.as<float>()},
                             nullptr);
      EXPECT_EQ(dout2.get<float>(), got) << what;
      EXPECT_EQ(qo.get<int8_t>(), q_ref.get<int8_t>()) << what;
      EXPECT_EQ(d_o.get<float>(), d_ref.get<float>()) << what;
    }
  }
}

// Tensor-core prefill attention against a double-precision causal softmax: head dims 64 and
// 128, GQA, query counts off the 64-query tile, a chunk that starts after earlier positions.
TEST(CudaKernels, TensorCoreAttentionMatchesReference) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int n, pos0, n_heads, n_kv, hd;
  };
  for (const Case c : {Case{100, 0, 4, 2, 128}, Case{70, 37, 2, 1, 64}, Case{16, 200, 4, 4, 128},
                       Case{130, 5, 8, 2, 64}, Case{300, 0, 4, 1, 128}, Case{200, 150, 8, 8, 64}}) {
    const int qd = c.n_heads * c.hd, kvd = c.n_kv * c.hd, n_ctx = c.pos0 + c.n;
    const std::vector<float> q = randn(size_t(c.n * qd), 51), kc = randn(size_t(n_ctx * kvd), 52),
                             vc = randn(size_t(n_ctx * kvd), 53);
    std::vector<float> want(size_t(c.n * qd));
    for (int t = 0; t < c.n; ++t)
      for (int h = 0; h < c.n_heads; ++h) {
        const int g = h / (c.n_heads / c.n_kv), last = c.pos0 + t;
        std::vector<double> sc(size_t(last + 1));
        double mx = -1e300, sum = 0;
        for (int j = 0; j <= last; ++j) {
          double dot = 0;
          for (int i = 0; i < c.hd; ++i)
            dot += double(q[size_t(t * qd + h * c.hd + i)]) * kc[size_t(j * kvd + g * c.hd + i)];
          sc[size_t(j)] = dot / std::sqrt(double(c.hd));
          mx = std::max(mx, sc[size_t(j)]);
        }
        for (double& v : sc) sum += (v = std::exp(v - mx));
        for (int i = 0; i < c.hd; ++i) {
          double o = 0;
          for (int j = 0; j <= last; ++j) o += sc[size_t(j)] * vc[size_t(j * kvd + g * c.hd + i)];
          want[size_t(t * qd + h * c.hd + i)] = float(o / sum);
        }
      }
    // The BF16 cache rows; rows past the last query's position hold poison (NaN), which the
    // kernel must not read.
    std::vector<uint16_t> kb(size_t(n_ctx + 64) * kvd, 0xffff), vb(kb.size(), 0xffff);
    for (size_t i = 0; i < kc.size(); ++i) {
      kb[i] = ts::f32_to_bf16(kc[i]);
      vb[i] = ts::f32_to_bf16(vc[i]);
    }
    Dev dq(q), dkb(kb), dvb(vb), dpos(std::vector<int>{c.pos0}), dout(want.size() * 4);
    ts::cuda::attention({.q = dq.as<float>(),
                         .k_cache = nullptr,
                         .v_cache = nullptr,
                         .out = dout.as<float>(),
                         .partial = nullptr,
                         .pos = dpos.as<int>(),
                         .n = c.n,
                         .n_heads = c.n_heads,
                         .n_kv_heads = c.n_kv,
                         .head_dim = c.hd,
                         .n_splits = 1,
                         .k_bf16 = dkb.p,
                         .v_bf16 = dvb.p},
                        nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    // BF16 inputs and probabilities: about 2^-8 relative.
    EXPECT_LE(max_rel(dout.get<float>(), want), 2e-2)
        << "n " << c.n << " pos0 " << c.pos0 << " hd " << c.hd;
  }
}

// The CUDA-core attention kernels over a BF16 cache (the cache of a model whose weights are
// not F32, where tensor cores do not apply: the cluster path, chunks under kTcAttentionMin
// tokens, head dims other than 64 / 128, groups over 16): the bytes the same kernels give over
// F32 rows holding the same rounded values (a BF16 value widens exactly), output and Q8 copy;
// BF16 rows past the last key poisoned. Cases: by KV head (groups of 32, head dim 96), by
// query head (head dim 256, one and three tokens), as clusters, the tiled prefill kernel.
TEST(CudaKernels, AttentionOverBf16CacheMatchesF32KernelsOnTheSameValues) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int n_heads, n_kv, hd, pos0, n;
    bool cluster;
  };
  int ran = 0;
  for (const Case c : {Case{32, 1, 128, 300, 1, false}, Case{6, 2, 96, 200, 1, false},
                       Case{8, 2, 256, 90, 1, false}, Case{8, 2, 256, 90, 3, false},
                       Case{32, 4, 128, 200, 1, true}, Case{16, 1, 64, 100, 1, true},
                       Case{64, 4, 128, 130, 1, true}, Case{8, 2, 64, 150, 5, false},
                       Case{6, 2, 96, 37, 40, false}}) {
    if (c.cluster && !ts::cuda::cluster_attention_applies(c.n_heads, c.n_kv, c.hd)) continue;
    if (c.n == 1 && !c.cluster) {  // not the tensor-core decode kernel
      ASSERT_FALSE(ts::cuda::tc_decode_attention_applies(c.n_heads, c.n_kv, c.hd));
    }
    const int qd = c.n_heads * c.hd, kvd = c.n_kv * c.hd, n_ctx = c.pos0 + c.n;
    const std::vector<float> q = randn(size_t(c.n * qd), 71),
                             k = randn(size_t(n_ctx * kvd), 72, 2.0f),
                             v = randn(size_t(n_ctx * kvd), 73);
    std::vector<uint16_t> kb(size_t(n_ctx + 64) * kvd, 0xffff), vb(kb.size(), 0xffff);
    std::vector<float> kr(k.size()), vr(v.size());
    for (size_t i = 0; i < k.size(); ++i) {
      kb[i] = ts::f32_to_bf16(k[i]);
      vb[i] = ts::f32_to_bf16(v[i]);
      kr[i] = ts::bf16_to_f32(kb[i]);
      vr[i] = ts::bf16_to_f32(vb[i]);
    }
    const std::string what = "heads " + std::to_string(c.n_heads) + "/" + std::to_string(c.n_kv) +
                             " hd " + std::to_string(c.hd) + " keys " + std::to_string(n_ctx) +
                             " n " + std::to_string(c.n) + (c.cluster ? " cluster" : "");
    const bool q8 = c.hd % 32 == 0;
    const int splits = 3;
    Dev dq(q), dkr(kr), dvr(vr), dkb(kb), dvb(vb), dpos(std::vector<int>{c.pos0});
    const auto run = [&](bool bf16) {
      Dev out(size_t(c.n * qd) * 4), qo{size_t(c.n * qd)}, d_o(size_t(c.n * qd) / 32 * 4),
          part(size_t(c.n * c.n_heads * splits * (c.hd + 2)) * 4);
      ts::cuda::AttentionArgs a{.q = dq.as<float>(),
                                .k_cache = bf16 ? nullptr : dkr.as<float>(),
                                .v_cache = bf16 ? nullptr : dvr.as<float>(),
                                .out = out.as<float>(),
                                .partial = part.as<float>(),
                                .pos = dpos.as<int>(),
                                .n = c.n,
                                .n_heads = c.n_heads,
                                .n_kv_heads = c.n_kv,
                                .head_dim = c.hd,
                                .n_splits = splits,
                                .k_bf16 = bf16 ? dkb.p : nullptr,
                                .v_bf16 = bf16 ? dvb.p : nullptr,
                                .cluster = c.cluster};
      if (q8 && c.n == 1) a.out_q = {qo.as<int8_t>(), d_o.as<float>()};
      ts::cuda::attention(a, nullptr);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
      std::vector<float> got = out.get<float>();
      if (q8 && c.n == 1) {
        const std::vector<int8_t> qs = qo.get<int8_t>();
        for (const int8_t x : qs) got.push_back(float(x));
        for (const float x : d_o.get<float>()) got.push_back(x);
      }
      return got;
    };
    const std::vector<float> f32 = run(false), bf16 = run(true);
    for (const float x : f32) ASSERT_TRUE(std::isfinite(x)) << what;
    EXPECT_EQ(bf16, f32) << what;
    ++ran;
  }
  EXPECT_EQ(ran, ts::cuda::cluster_attention_available() ? 9 : 6);
}

TEST(CudaKernels, RouteMatchesSelectExperts) {
  SKIP_WITHOUT_GPU();
  for (int n_experts : {8, 60, 128, 300}) {
    for (bool renorm : {false, true}) {
      // 300 experts: top 40 (ranks held by lanes in two groups of 32).
      const int n = 9, k = n_experts == 300 ? 40 : std::min(8, n_experts / 2);
      std::vector<float> logits = randn(size_t(n * n_experts), uint32_t(n_experts), 2.0f);
      logits[3] = logits[5];  // a tie: the lower id must rank first
      std::vector<int> want_ids(size_t(n * k));
      std::vector<float> want_w(size_t(n * k));
      for (int t = 0; t < n; ++t)
        ts::model::select_experts(
            std::span<const float>(&logits[size_t(t * n_experts)], size_t(n_experts)), {},
            {.renormalize = renorm},
            {.ids = std::span<int>(&want_ids[size_t(t * k)], size_t(k)),
             .weights = std::span<float>(&want_w[size_t(t * k)], size_t(k))});
      Dev dl(logits), di(want_ids.size() * 4), dw(want_w.size() * 4),
          dh(std::vector<unsigned long long>(size_t(n_experts), 0));
      ts::cuda::route({.logits = dl.as<float>(), .ids = di.as<int>(), .weights = dw.as<float>(),
                       .hist = dh.as<unsigned long long>(), .n = n, .n_experts = n_experts,
                       .top_k = k, .renormalize = renorm},
                      nullptr);
      EXPECT_EQ(di.get<int>(), want_ids) << n_experts;
      EXPECT_LE(max_rel(dw.get<float>(), want_w), 1e-6);
      std::vector<unsigned long long> hist = dh.get<unsigned long long>();
      std::vector<unsigned long long> want_h(static_cast<size_t>(n_experts));
      for (int id : want_ids) ++want_h[size_t(id)];
      EXPECT_EQ(hist, want_h);
    }
  }
}

// One token's routing into these buffers (weights renormalized).
ts::cuda::RouteArgs one_token_route(const Dev& logits, const Dev& ids, const Dev& w,
                                    const Dev& hist, int n_experts, int k) {
  return {.logits = logits.as<float>(),
          .ids = ids.as<int>(),
          .weights = w.as<float>(),
          .hist = hist.as<unsigned long long>(),
          .n = 1,
          .n_experts = n_experts,
          .top_k = k,
          .renormalize = true};
}

// The fused decode launch against the three it replaces (rmsnorm with its Q8 copy, the
// router GEMV, route): the same bytes of xn, its Q8 blocks, the logits, ids and weights, and
// the same histogram counts. Outputs are poisoned (NaN / 0xff) before each run; the second
// run checks that the kernel left its counter ready for the next launch.
TEST(CudaKernels, NormRouteMatchesNormRouterAndTopK) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    // 96: a 64-thread block; 288: 256 threads; 2048: 1,024 threads.
    for (int d : {96, 288, 2048}) {
      for (int n_experts : {8, 60, 128, 300}) {
        const int k = n_experts == 300 ? 40 : std::min(8, n_experts / 2);
        ASSERT_TRUE(ts::cuda::norm_route_applies(t, d));
        const std::vector<uint8_t> router = make_matrix(t, n_experts, d, uint32_t(d + n_experts));
        const std::vector<float> x = randn(size_t(d), uint32_t(3 + d), 3.0f);
        const std::vector<float> nw = randn(size_t(d), uint32_t(4 + d));
        Dev dr(router), dx(x), dnw(nw), counter(std::vector<unsigned>{0});
        struct Out {
          Dev xn, q, qd, logits, ids, w, hist;
        };
        const auto make_out = [&] {
          return new Out{Dev(size_t(d) * 4),
                         Dev(size_t(d)),
                         Dev(size_t(d) / 32 * 4),
                         Dev(size_t(n_experts) * 4),
                         Dev(size_t(k) * 4),
                         Dev(size_t(k) * 4),
                         Dev(std::vector<unsigned long long>(size_t(n_experts), 0))};
        };
        const std::unique_ptr<Out> ref(make_out()), got(make_out());
        const auto route_args = [&](Out& o) {
          return one_token_route(o.logits, o.ids, o.w, o.hist, n_experts, k);
        };
        const auto reference = [&] {
          ts::cuda::rmsnorm(dx.as<float>(), dnw.as<float>(), ref->xn.as<float>(), 1, d, 1e-6f,
                            nullptr, {ref->q.as<int8_t>(), ref->qd.as<float>()});
          ts::cuda::gemv({dr.p, t, n_experts, d}, ref->xn.as<float>(), 1, ref->logits.as<float>(),
                         false, nullptr);
        };
        reference();
        // A tie at the top: the best expert's row copied over another's (same row, same
        // logit), so both are picked and the lower id must rank first.
        {
          const std::vector<float> lg = ref->logits.get<float>();
          const int best = int(std::max_element(lg.begin(), lg.end()) - lg.begin());
          const int other = best == 0 ? n_experts - 1 : 0;
          const size_t rb = router.size() / size_t(n_experts);
          cudaMemcpy(dr.as<uint8_t>() + size_t(other) * rb, dr.as<uint8_t>() + size_t(best) * rb,
                     rb, cudaMemcpyDeviceToDevice);
          reference();
        }
        ts::cuda::route(route_args(*ref), nullptr);
        for (int run = 0; run < 2; ++run) {
          if (run == 1) {  // poison again
            for (Dev* o : {&got->xn, &got->q, &got->qd, &got->logits, &got->ids, &got->w})
              cudaMemset(o->p, 0xff, o->bytes);
          }
          ts::cuda::norm_route({.x = dx.as<float>(),
                                .norm_w = dnw.as<float>(),
                                .eps = 1e-6f,
                                .d = d,
                                .xn = got->xn.as<float>(),
                                .xq = {got->q.as<int8_t>(), got->qd.as<float>()},
                                .router = dr.p,
                                .router_dtype = t,
                                .logits = got->logits.as<float>(),
                                .counter = counter.as<unsigned>(),
                                .route = route_args(*got)},
                               nullptr);
          const std::string what = std::string(ts::dtype_name(t)) + " d " + std::to_string(d) +
                                   " experts " + std::to_string(n_experts) + " run " +
                                   std::to_string(run);
          EXPECT_EQ(got->xn.get<uint32_t>(), ref->xn.get<uint32_t>()) << what;
          EXPECT_EQ(got->q.get<int8_t>(), ref->q.get<int8_t>()) << what;
          EXPECT_EQ(got->qd.get<uint32_t>(), ref->qd.get<uint32_t>()) << what;
          EXPECT_EQ(got->logits.get<uint32_t>(), ref->logits.get<uint32_t>()) << what;
          EXPECT_EQ(got->ids.get<int>(), ref->ids.get<int>()) << what;
          EXPECT_EQ(got->w.get<uint32_t>(), ref->w.get<uint32_t>()) << what;
          std::vector<unsigned long long> want_h = ref->hist.get<unsigned long long>();
          for (auto& c : want_h) c *= unsigned(run + 1);
          EXPECT_EQ(got->hist.get<unsigned long long>(), want_h) << what;
          EXPECT_EQ(counter.get<unsigned>()[0], 0u) << what;
        }
      }
    }
  }
}

// A NaN in the residual stream makes every router logit NaN: norm_route's last block (the
// ranks counted at once) must then name what route_token names — expert 0 with weight 0 at
// every rank — not whichever expert wrote rank 0 last.
TEST(CudaKernels, NormRouteOnNaNLogitsPicksAsRouteDoes) {
  SKIP_WITHOUT_GPU();
  const int d = 2048, n_experts = 128, k = 8;
  const DType t = DType::kBF16;
  const std::vector<uint8_t> router = make_matrix(t, n_experts, d, 17);
  std::vector<float> x = randn(size_t(d), 19);
  x[5] = std::nanf("");
  const std::vector<float> nw = randn(size_t(d), 23);
  Dev dr(router), dx(x), dnw(nw), counter(std::vector<unsigned>{0}), xn(size_t(d) * 4),
      logits(size_t(n_experts) * 4);
  struct Out {
    Dev ids, w, hist;
  };
  const std::unique_ptr<Out> ref(
      new Out{Dev(std::vector<int>(size_t(k), 3)), Dev(size_t(k) * 4),
              Dev(std::vector<unsigned long long>(size_t(n_experts), 0))}),
      got(new Out{Dev(std::vector<int>(size_t(k), 3)), Dev(size_t(k) * 4),
                  Dev(std::vector<unsigned long long>(size_t(n_experts), 0))});
  const auto route_args = [&](Out& o) {
    return one_token_route(logits, o.ids, o.w, o.hist, n_experts, k);
  };
  ts::cuda::norm_route({.x = dx.as<float>(),
                        .norm_w = dnw.as<float>(),
                        .eps = 1e-6f,
                        .d = d,
                        .xn = xn.as<float>(),
                        .router = dr.p,
                        .router_dtype = t,
                        .logits = logits.as<float>(),
                        .counter = counter.as<unsigned>(),
                        .route = route_args(*got)},
                       nullptr);
  for (float v : logits.get<float>()) ASSERT_TRUE(std::isnan(v));
  ts::cuda::route(route_args(*ref), nullptr);
  EXPECT_EQ(ref->ids.get<int>(), std::vector<int>(size_t(k), 0));
  EXPECT_EQ(got->ids.get<int>(), ref->ids.get<int>());
  EXPECT_EQ(got->w.get<uint32_t>(), ref->w.get<uint32_t>());
  EXPECT_EQ(got->hist.get<unsigned long long>(), ref->hist.get<unsigned long long>());
  EXPECT_EQ(counter.get<unsigned>()[0], 0u);
}

// Decode's top-k inside phase 1 (MoeArgs::route): every block ranks the logits up to its own
// slot, block (0, 0) writes ids / weights / hist; phase 2 by rank, which stages its rows before
// its wait, ranks them again per warp (the ids are phase 1's, not yet written then). The same
// ids, weights, histogram, h and output, to the bit, as route() followed by the phases reading
// the ids — for every phase 1 kernel (Q8_0 staged with Q8 activations, Q8_0 / Q4_K / F32 rows,
// BF16 both widths), phase 2 by rank and by row (top 40: ranks written in two groups), expert
// counts off 32 (60, 8), ties at the top and at the last rank taken, and logits
// with NaN (ids must still index the tables). The ids start as a valid wrong pick, so a phase
// that read them too early would give other bytes.
TEST(CudaKernels, Phase1RanksTheLogitsAsRouteDoes) {
  SKIP_WITHOUT_GPU();
  struct Case {
    DType type;
    int n_experts, k, force_wide;
    bool q8act, nan;
  };
  const Case cases[] = {
      {DType::kQ8_0, 128, 8, -1, true, false},  {DType::kQ8_0, 60, 4, -1, true, false},
      {DType::kQ8_0, 128, 40, -1, true, false}, {DType::kQ8_0, 128, 8, -1, false, false},
      {DType::kQ4_K, 128, 8, -1, true, false},  {DType::kBF16, 128, 8, 1, false, false},
      {DType::kBF16, 128, 8, 0, false, false},  {DType::kF32, 8, 2, -1, false, false},
      {DType::kQ8_0, 128, 8, -1, true, true},   {DType::kBF16, 60, 4, 1, false, true}};
  const int d = 256, de = 256;
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(ts::dtype_name(c.type)) + " experts " + std::to_string(c.n_experts) +
                 " top " + std::to_string(c.k) + " wide " + std::to_string(c.force_wide) +
                 (c.q8act ? " q8 x" : "") + (c.nan ? " NaN" : ""));
    std::vector<std::vector<uint8_t>> G, U, D;
    std::vector<Dev*> owned;
    std::vector<const void*> gp, up, dp;
    for (int e = 0; e < c.n_experts; ++e) {
      G.push_back(make_matrix(c.type, de, d, uint32_t(700 + e)));
      U.push_back(make_matrix(c.type, de, d, uint32_t(900 + e)));
      D.push_back(make_matrix(c.type, d, de, uint32_t(1100 + e)));
      for (auto [v, tab] :
           {std::pair{&G.back(), &gp}, std::pair{&U.back(), &up}, std::pair{&D.back(), &dp}}) {
        owned.push_back(new Dev(*v));
        tab->push_back(owned.back()->p);
      }
    }
    std::vector<float> logits = randn(size_t(c.n_experts), uint32_t(31 + c.n_experts), 2.0f);
    // Ties: the best logit copied onto another expert (a tie at the top), and rank k - 1's onto
    // rank k's (a tie for the last place taken).
    std::vector<int> order(static_cast<size_t>(c.n_experts));
    for (int e = 0; e < c.n_experts; ++e) order[size_t(e)] = e;
    std::sort(order.begin(), order.end(),
              [&](int i, int j) { return logits[size_t(i)] > logits[size_t(j)]; });
    logits[size_t(order[5 % c.n_experts])] = logits[size_t(order[0])];
    logits[size_t(order[size_t(c.k)])] = logits[size_t(order[size_t(c.k - 1)])];
    if (c.nan) logits[size_t(order[1])] = std::nanf("");
    const std::vector<float> x = randn(size_t(d), 37);
    Dev dg(gp), du(up), dd(dp), dl(logits), dx(x), dxq(static_cast<size_t>(d)),
        dxd(size_t(d / 32) * 4);
    ts::cuda::quantize_act(dx.as<float>(), d, {dxq.as<int8_t>(), dxd.as<float>()}, nullptr);
    struct Out {
      Dev ids, w, hist, h, hq, hd, out;
    };
    const auto make_out = [&] {
      std::vector<int> wrong(static_cast<size_t>(c.k));
      for (int r = 0; r < c.k; ++r) wrong[size_t(r)] = (r * 7 + 1) % c.n_experts;
      return new Out{Dev(wrong),
                     Dev(std::vector<float>(size_t(c.k), -7.0f)),
                     Dev(std::vector<unsigned long long>(size_t(c.n_experts), 0)),
                     Dev(std::vector<float>(size_t(c.k * de), -7.0f)),
                     Dev(size_t(c.k * de)),
                     Dev(size_t(c.k * de / 32) * 4),
                     Dev(std::vector<float>(size_t(d), -7.0f))};
    };
    const std::unique_ptr<Out> ref(make_out()), got(make_out());
    const auto route_args = [&](Out& o) {
      return one_token_route(dl, o.ids, o.w, o.hist, c.n_experts, c.k);
    };
    const auto moe_args = [&](Out& o) {
      ts::cuda::MoeArgs a{.gate = dg.as<const void*>(),
                          .up = du.as<const void*>(),
                          .down = dd.as<const void*>(),
                          .gate_dtype = c.type,
                          .down_dtype = c.type,
                          .ids = o.ids.as<int>(),
                          .weights = o.w.as<float>(),
                          .xn = dx.as<float>(),
                          .h = o.h.as<float>(),
                          .out = o.out.as<float>(),
                          .n = 1,
                          .d_model = d,
                          .d_expert = de,
                          .top_k = c.k};
      if (c.q8act) {
        a.xq = dxq.as<int8_t>();
        a.xd = dxd.as<float>();
      }
      a.force_wide = c.force_wide;
      return a;
    };
    // Both phases, h quantized between them for Q4_K (as the session does).
    const auto phases = [&](ts::cuda::MoeArgs a, Out& o) {
      ts::cuda::moe_gate_up(a, nullptr);
      if (c.type == DType::kQ4_K) {
        ts::cuda::quantize_act(o.h.as<float>(), int64_t(c.k) * de,
                               {o.hq.as<int8_t>(), o.hd.as<float>()}, nullptr);
        a.hq = o.hq.as<int8_t>();
        a.hd = o.hd.as<float>();
      }
      ts::cuda::moe_down_sum(a, nullptr);
    };
    ts::cuda::route(route_args(*ref), nullptr);
    phases(moe_args(*ref), *ref);
    ts::cuda::MoeArgs a = moe_args(*got);
    a.route = route_args(*got);
    phases(a, *got);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int> ids = got->ids.get<int>();
    EXPECT_EQ(ids, ref->ids.get<int>());
    for (int e : ids) EXPECT_TRUE(e >= 0 && e < c.n_experts) << e;
    EXPECT_EQ(got->w.get<uint32_t>(), ref->w.get<uint32_t>());
    EXPECT_EQ(got->hist.get<unsigned long long>(), ref->hist.get<unsigned long long>());
    EXPECT_EQ(got->h.get<uint32_t>(), ref->h.get<uint32_t>());
    EXPECT_EQ(got->out.get<uint32_t>(), ref->out.get<uint32_t>());
    if (!c.nan) {
      // And the CPU's selection (select_experts): the same ids.
      std::vector<int> want_ids(static_cast<size_t>(c.k));
      std::vector<float> want_w(static_cast<size_t>(c.k));
      ts::model::select_experts(logits, {}, {.renormalize = true},
                                {.ids = want_ids, .weights = want_w});
      EXPECT_EQ(ids, want_ids);
      EXPECT_LE(max_rel(got->w.get<float>(), want_w), 1e-6);
    }
    for (Dev* p : owned) delete p;
  }
}

// The expert cache's decode path: one token's ids also land in mapped host memory, and the
// flag is raised only after them.
TEST(CudaKernels, RouteWritesIdsAndFlagToMappedHostMemory) {
  SKIP_WITHOUT_GPU();
  for (int n_experts : {8, 128, 300}) {
    const int k = n_experts == 300 ? 40 : std::min(8, n_experts / 2);
    std::vector<float> logits = randn(size_t(n_experts), uint32_t(7 + n_experts), 2.0f);
    std::vector<int> want_ids(static_cast<size_t>(k));
    std::vector<float> want_w(static_cast<size_t>(k));
    ts::model::select_experts(logits, {}, {.renormalize = true}, {.ids = want_ids, .weights = want_w});
    int* host = nullptr;
    ASSERT_EQ(
        cudaHostAlloc(reinterpret_cast<void**>(&host), size_t(k + 1) * 4, cudaHostAllocMapped),
        cudaSuccess);
    for (int i = 0; i <= k; ++i) host[i] = i == 0 ? 0 : -7;  // flag down, ids poisoned
    int* dev = nullptr;
    ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0), cudaSuccess);
    Dev dl(logits), di(std::vector<int>(size_t(k), -7)), dw(want_w.size() * 4);
    ts::cuda::route({.logits = dl.as<float>(),
                     .ids = di.as<int>(),
                     .weights = dw.as<float>(),
                     .hist = nullptr,
                     .n = 1,
                     .n_experts = n_experts,
                     .top_k = k,
                     .renormalize = true,
                     .host_ids = dev + 1,
                     .host_flag = dev},
                    nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(host[0], 1) << n_experts;
    EXPECT_EQ(std::vector<int>(host + 1, host + 1 + k), want_ids) << n_experts;
    EXPECT_EQ(di.get<int>(), want_ids) << n_experts;
    EXPECT_LE(max_rel(dw.get<float>(), want_w), 1e-6);
    cudaFreeHost(host);
  }
}

// Both MoE phases against the CPU composition: per slot h = silu(G x) * (U x), then
// out = sum_r w_r D_r h_r in rank order.
TEST(CudaKernels, MoePhasesMatchCpu) {
  SKIP_WITHOUT_GPU();
  // d 262: phase 2 by rank (BF16) with a last block of 2 rows, not 4 (F32 and BF16 only).
  const std::pair<DType, int> cases[] = {{DType::kF32, 256},  {DType::kBF16, 256},
                                         {DType::kQ8_0, 256}, {DType::kQ4_K, 256},
                                         {DType::kF32, 262},  {DType::kBF16, 262}};
  for (const auto& [t, d] : cases) {
    const int de = 256, n_experts = 6, k = 3, n = 2;
    std::vector<std::vector<uint8_t>> G, U, D;
    std::vector<Dev*> owned;
    std::vector<const void*> gp, up, dp;
    for (int e = 0; e < n_experts; ++e) {
      G.push_back(make_matrix(t, de, d, uint32_t(100 + e)));
      U.push_back(make_matrix(t, de, d, uint32_t(200 + e)));
      D.push_back(make_matrix(t, d, de, uint32_t(300 + e)));
      for (auto [v, tab] : {std::pair{&G.back(), &gp}, std::pair{&U.back(), &up},
                             std::pair{&D.back(), &dp}}) {
        owned.push_back(new Dev(*v));
        tab->push_back(owned.back()->p);
      }
    }
    const std::vector<int> ids = {4, 0, 2, 1, 5, 4};
    const std::vector<float> w = {0.5f, 0.3f, 0.2f, 0.6f, 0.25f, 0.15f};
    const std::vector<float> x = randn(size_t(n * d), 9);
    std::vector<float> want(static_cast<size_t>(n * d), 0.0f);
    std::vector<float> h(static_cast<size_t>(de)), g(static_cast<size_t>(de)),
        u(static_cast<size_t>(de)), o(static_cast<size_t>(d));
    for (int tok = 0; tok < n; ++tok)
      for (int r = 0; r < k; ++r) {
        const int e = ids[size_t(tok * k + r)];
        cpu_matvec_f32_x(G[size_t(e)].data(), t, &x[size_t(tok * d)], g.data(), d, de);
        cpu_matvec_f32_x(U[size_t(e)].data(), t, &x[size_t(tok * d)], u.data(), d, de);
        ts::cpu::silu_mul(g.data(), u.data(), h.data(), de);
        cpu_matvec_f32_x(D[size_t(e)].data(), t, h.data(), o.data(), de, d);
        for (int i = 0; i < d; ++i) want[size_t(tok * d + i)] += w[size_t(tok * k + r)] * o[size_t(i)];
      }
    Dev dg(gp), du(up), dd(dp), di(ids), dw(w), dx(x), dh(size_t(n * k * de) * 4),
        dout(want.size() * 4);
    const ts::cuda::MoeArgs a{.gate = dg.as<const void*>(), .up = du.as<const void*>(),
                              .down = dd.as<const void*>(), .gate_dtype = t, .down_dtype = t,
                              .ids = di.as<int>(), .weights = dw.as<float>(),
                              .xn = dx.as<float>(), .h = dh.as<float>(), .out = dout.as<float>(),
                              .n = n, .d_model = d, .d_expert = de, .top_k = k};
    ts::cuda::moe_gate_up(a, nullptr);
    ts::cuda::moe_down_sum(a, nullptr);
    EXPECT_LE(max_rel(dout.get<float>(), want), 1e-4) << ts::dtype_name(t) << " d " << d;
    // BF16 phase 1 has a second kernel (fewer registers, for one-wave grids): the same h.
    if (t == DType::kBF16) {
      const std::vector<float> h_auto = dh.get<float>();
      for (int wide : {0, 1}) {
        Dev dh2(size_t(n * k * de) * 4);
        ts::cuda::MoeArgs b = a;
        b.h = dh2.as<float>();
        b.force_wide = wide;
        ts::cuda::moe_gate_up(b, nullptr);
        EXPECT_EQ(dh2.get<float>(), h_auto) << "force_wide " << wide;
      }
    }
    for (Dev* p : owned) delete p;
  }
}

// The MoE phases on Q8_0 and Q4_K weights with Q8 activations (dp4a), against per-block
// integer dot products: qwen3's shape (d_expert 768, top 8: every row of a slot staged whole
// in shared memory), a 4,096-wide model (gate|up's larger staging) and rows too wide to stage
// (the tiled path). h is checked against the reference's, and the down sum against the
// reference computed from the kernel's own h, quantized the same way, so it must agree to
// float rounding of the rank-ordered sum.
TEST(CudaKernels, MoePhasesQ8ActivationsMatchIntegerReference) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int d, de, k;
  };
  for (const DType type : {DType::kQ8_0, DType::kQ4_K})
    for (const Case c : {Case{512, 768, 8}, Case{4096, 256, 2}, Case{4608, 2048, 3}}) {
      SCOPED_TRACE(std::string(ts::dtype_name(type)) + " d " + std::to_string(c.d) + " d_expert " +
                   std::to_string(c.de));
      const int n_experts = 10, n = 2, ns = n * c.k;
      std::vector<std::vector<uint8_t>> G, U, D;
      std::vector<Dev*> owned;
      std::vector<const void*> gp, up, dp;
      for (int e = 0; e < n_experts; ++e) {
        G.push_back(make_q8act_matrix(type, c.de, c.d, uint32_t(400 + e)));
        U.push_back(make_q8act_matrix(type, c.de, c.d, uint32_t(500 + e)));
        D.push_back(make_q8act_matrix(type, c.d, c.de, uint32_t(600 + e)));
        for (auto [v, tab] :
             {std::pair{&G.back(), &gp}, std::pair{&U.back(), &up}, std::pair{&D.back(), &dp}}) {
          owned.push_back(new Dev(*v));
          tab->push_back(owned.back()->p);
        }
      }
      std::vector<int> ids;
      std::vector<float> w;
      for (int s = 0; s < ns; ++s) {
        ids.push_back((s * 7 + 3) % n_experts);
        w.push_back(0.05f + 0.1f * float((s * 5) % c.k) / float(c.k));
      }
      const std::vector<float> x = randn(size_t(n * c.d), 19);
      Dev dg(gp), du(up), dd(dp), di(ids), dw(w), dx(x), dh(size_t(ns * c.de) * 4),
          dout(size_t(n * c.d) * 4), dxq(size_t(n * c.d)), dxd(size_t(n * c.d / 32) * 4),
          dhq(size_t(ns * c.de)), dhd(size_t(ns * c.de / 32) * 4);
      ts::cuda::quantize_act(dx.as<float>(), int64_t(n) * c.d, {dxq.as<int8_t>(), dxd.as<float>()},
                             nullptr);
      ts::cuda::MoeArgs a{.gate = dg.as<const void*>(),
                          .up = du.as<const void*>(),
                          .down = dd.as<const void*>(),
                          .gate_dtype = type,
                          .down_dtype = type,
                          .ids = di.as<int>(),
                          .weights = dw.as<float>(),
                          .xn = dx.as<float>(),
                          .h = dh.as<float>(),
                          .out = dout.as<float>(),
                          .n = n,
                          .d_model = c.d,
                          .d_expert = c.de,
                          .top_k = c.k};
      a.xq = dxq.as<int8_t>();
      a.xd = dxd.as<float>();
      ts::cuda::moe_gate_up(a, nullptr);
      ts::cuda::quantize_act(dh.as<float>(), int64_t(ns) * c.de,
                             {dhq.as<int8_t>(), dhd.as<float>()}, nullptr);
      a.hq = dhq.as<int8_t>();
      a.hd = dhd.as<float>();
      ts::cuda::moe_down_sum(a, nullptr);
      const std::vector<float> h = dh.get<float>(), out = dout.get<float>();
      std::vector<int8_t> q;
      std::vector<float> qd;
      std::vector<float> want_h(h.size()), want(out.size(), 0.0f);
      const size_t rb = ts::dtype_row_bytes(type, c.d), rbd = ts::dtype_row_bytes(type, c.de);
      for (int s = 0; s < ns; ++s) {
        const int e = ids[size_t(s)], t = s / c.k;
        quantize_q8_ref(&x[size_t(t * c.d)], c.d, q, qd);
        for (int r = 0; r < c.de; ++r) {
          const double g = q8act_row_dot(type, &G[size_t(e)][r * rb], q.data(), qd.data(), c.d);
          const double u = q8act_row_dot(type, &U[size_t(e)][r * rb], q.data(), qd.data(), c.d);
          want_h[size_t(s * c.de + r)] = float(g / (1 + std::exp(-g)) * u);
        }
        quantize_q8_ref(&h[size_t(s * c.de)], c.de, q, qd);  // the kernel's own h
        for (int r = 0; r < c.d; ++r)
          want[size_t(t * c.d + r)] +=
              w[size_t(s)] *
              float(q8act_row_dot(type, &D[size_t(e)][r * rbd], q.data(), qd.data(), c.de));
      }
      // Q4_K: each sub-block's two float terms (d * sc * sum, dmin * m * sum) partly cancel.
      const double tol = type == DType::kQ4_K ? 5e-5 : 1e-5;
      EXPECT_LE(max_rel(h, want_h), tol);
      EXPECT_LE(max_rel(out, want), tol);
      if (type == DType::kQ8_0) {
        // Phase 2 on the F32 h itself (no hq; what decode runs where moe_down_f32_h holds: rows
        // of up to 1,024 columns, else the row kernel), into a poisoned output, against the same
        // sum in double.
        ts::cuda::MoeArgs f = a;
        f.hq = nullptr;
        f.hd = nullptr;
        EXPECT_EQ(ts::cuda::moe_down_f32_h(f), c.de <= 1024);
        Dev dout_f(size_t(n * c.d) * 4);  // NaN until written
        f.out = dout_f.as<float>();
        ts::cuda::moe_down_sum(f, nullptr);
        std::vector<double> want_f(out.size(), 0.0);
        for (int s = 0; s < ns; ++s) {
          const int e = ids[size_t(s)], t = s / c.k;
          for (int r = 0; r < c.d; ++r) {
            const uint8_t* row = &D[size_t(e)][r * rbd];
            double acc = 0;
            for (int b = 0; b < c.de / 32; ++b) {
              uint16_t dh16;
              std::memcpy(&dh16, row + b * 34, 2);
              double sb = 0;
              for (int i = 0; i < 32; ++i)
                sb += double(int8_t(row[b * 34 + 2 + i])) * h[size_t(s * c.de + b * 32 + i)];
              acc += double(ts::f16_to_f32(dh16)) * sb;
            }
            want_f[size_t(t * c.d + r)] += double(w[size_t(s)]) * acc;
          }
        }
        EXPECT_LE(max_rel(dout_f.get<float>(), std::vector<float>(want_f.begin(), want_f.end())),
                  1e-5)
            << "F32 h";
      }
      for (Dev* p : owned) delete p;
    }
}

TEST(CudaKernels, QuantizeQ8_0MatchesCpuBytes) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 32 * 100;
  std::vector<float> x = randn(size_t(n), 12);
  for (int i = 0; i < 32; ++i) x[size_t(32 + i)] = 0.0f;  // an all-zero block
  std::vector<uint8_t> want(size_t(ts::dtype_row_bytes(DType::kQ8_0, n)));
  ts::cpu::quantize_row(DType::kQ8_0, x.data(), want.data(), n);
  Dev dx(x), dq(want.size());
  ts::cuda::quantize_q8_0(dx.as<float>(), dq.p, n, nullptr);
  const std::vector<uint8_t> got = dq.get<uint8_t>();
  for (size_t b = 0; b < want.size() / 34; ++b)
    for (size_t i = 0; i < 34; ++i)
      ASSERT_EQ(int(got[b * 34 + i]), int(want[b * 34 + i]))
          << "block " << b << " byte " << i << "; d got " << std::hex
          << (got[b * 34] | got[b * 34 + 1] << 8) << " want " << (want[b * 34] | want[b * 34 + 1] << 8);
}

TEST(CudaKernels, DequantizeMatchesCpuReference) {
  SKIP_WITHOUT_GPU();
  for (DType t : {DType::kQ8_0, DType::kQ4_K, DType::kF16}) {
    const int64_t rows = 3, cols = 512;
    const std::vector<uint8_t> w = make_matrix(t, rows, cols, 21);
    std::vector<float> want(size_t(rows * cols));
    const size_t rb = ts::dtype_row_bytes(t, cols);
    for (int64_t r = 0; r < rows; ++r) {
      if (t == DType::kF16) {
        for (int64_t c = 0; c < cols; ++c) {
          uint16_t h;
          std::memcpy(&h, &w[size_t(r) * rb + size_t(2 * c)], 2);
          want[size_t(r * cols + c)] = ts::f16_to_f32(h);
        }
      } else {
        ts::cpu::dequantize_row(t, &w[size_t(r) * rb], &want[size_t(r * cols)], cols);
      }
    }
    Dev dw(w), df(want.size() * 4), db(want.size() * 2);
    ts::cuda::to_f32({dw.p, t, rows, cols}, df.as<float>(), nullptr);
    // (d * sc) * q - dmin * m may be contracted to one FMA on the GPU: a rounding apart.
    EXPECT_LE(max_rel(df.get<float>(), want), 1e-6) << ts::dtype_name(t);
    ts::cuda::dequantize_bf16({dw.p, t, rows, cols}, db.p, nullptr);
    const std::vector<uint16_t> b = db.get<uint16_t>();
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_LE(std::abs(int(b[i]) - int(ts::f32_to_bf16(want[i]))), 1)
          << ts::dtype_name(t) << " element " << i;
  }
}

// DequantizeExpertsToBf16MatchesDequantizeBf16 for one type per matrix (gate, up, down).
void check_expert_dequant(const DType (&types)[3]) {
  // Q8_0: gate / up [42, 256]: 336 blocks (a warp's 32 and a tail of 16); down [256, 64]: 512.
  // Q4_K: gate / up [42, 256]: 42 super-blocks (a warp's 4 and a tail of 2); down [256, 256].
  const int n_experts = 3;
  const int64_t down_cols = types[2] == DType::kQ4_K ? 256 : 64;
  const int64_t shape[3][2] = {{42, 256}, {42, 256}, {256, down_cols}};
  std::vector<std::vector<uint8_t>> w[3];
  std::vector<Dev*> owned;
  std::vector<const void*> tab[3];
  for (int m = 0; m < 3; ++m)
    for (int e = 0; e < n_experts; ++e) {
      w[m].push_back(make_matrix(types[m], shape[m][0], shape[m][1], uint32_t(70 + 10 * m + e)));
      owned.push_back(new Dev(w[m].back()));
      tab[m].push_back(owned.back()->p);
    }
  const auto want_of = [&](int m, int e) {
    Dev dw(w[m][size_t(e)]), db(size_t(shape[m][0] * shape[m][1]) * 2);
    ts::cuda::dequantize_bf16({dw.p, types[m], shape[m][0], shape[m][1]}, db.p, nullptr);
    return db.get<uint16_t>();
  };
  // Each matrix followed by a 256-byte gap; experts 512 bytes apart beyond that.
  size_t off[3], stride = 0;
  for (int m = 0; m < 3; ++m) {
    off[m] = stride;
    stride += size_t(shape[m][0] * shape[m][1]) * 2 + 256;
  }
  stride += 512;
  const std::vector<int> ids = {2, 0};
  Dev dids(ids), dtab0(tab[0]), dtab1(tab[1]), dtab2(tab[2]);
  Dev dst(stride * 3), out_tab(size_t(3 * n_experts) * sizeof(void*));
  ts::cuda::ExpertDequant q;
  for (int m = 0; m < 3; ++m) q.type[m] = types[m];
  q.experts = dids.as<int>();
  q.src_tab[0] = dtab0.as<const void*>();
  q.src_tab[1] = dtab1.as<const void*>();
  q.src_tab[2] = dtab2.as<const void*>();
  for (int m = 0; m < 3; ++m) {
    q.blocks[m] = shape[m][0] * shape[m][1] / 32;
    q.dst_off[m] = off[m];
    q.dst_tab[m] = out_tab.as<const void*>() + m * n_experts;
  }
  q.dst = dst.p;
  q.dst_stride = stride;
  q.count = int(ids.size());
  ts::cuda::dequantize_experts_bf16(q, nullptr);
  const std::vector<uint8_t> got = dst.get<uint8_t>();
  std::vector<bool> written(got.size(), false);
  for (size_t j = 0; j < ids.size(); ++j)
    for (int m = 0; m < 3; ++m) {
      const std::vector<uint16_t> want = want_of(m, ids[j]);
      const size_t at = j * stride + off[m];
      ASSERT_EQ(0, std::memcmp(got.data() + at, want.data(), want.size() * 2))
          << "expert " << ids[j] << " matrix " << m;
      for (size_t i = 0; i < want.size() * 2; ++i) written[at + i] = true;
    }
  for (size_t i = 0; i < got.size(); ++i)
    if (!written[i]) {
      ASSERT_EQ(got[i], 0xff) << "byte " << i << " written outside the copies";
    }
  const std::vector<const void*> tabs = out_tab.get<const void*>();
  for (int m = 0; m < 3; ++m)
    for (int e = 0; e < n_experts; ++e) {
      const auto it = std::find(ids.begin(), ids.end(), e);
      if (it == ids.end()) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(tabs[size_t(m * n_experts + e)]), ~uintptr_t(0))
            << "table entry of an unlisted expert written";
      } else {
        EXPECT_EQ(tabs[size_t(m * n_experts + e)],
                  static_cast<const uint8_t*>(dst.p) + size_t(it - ids.begin()) * stride + off[m]);
      }
    }
  // One matrix by address, 2 bytes past a 16-byte boundary.
  std::vector<uint8_t> shifted(2, 0);
  shifted.insert(shifted.end(), w[2][1].begin(), w[2][1].end());
  Dev dshift(shifted), one(size_t(shape[2][0] * shape[2][1]) * 2);
  ts::cuda::ExpertDequant q1;
  q1.type[0] = types[2];
  q1.direct[0] = dshift.as<uint8_t>() + 2;
  q1.blocks[0] = shape[2][0] * shape[2][1] / 32;
  q1.dst = one.p;
  ts::cuda::dequantize_experts_bf16(q1, nullptr);
  EXPECT_EQ(one.get<uint16_t>(), want_of(2, 1));
  for (Dev* p : owned) delete p;
}

// dequantize_experts_bf16: per-expert Q8_0 and Q4_K matrices (and a mix of the two, as in
// Q4_K_M files) through address tables into one scratch (expert j of the list at j * stride +
// offset, dst_tab[m][e] set), and one direct matrix 2 bytes off 16-byte alignment (the unstaged /
// byte-load path): byte for byte what dequantize_bf16 gives, with the scratch's gaps and the
// tables' other entries untouched (poisoned).
TEST(CudaKernels, DequantizeExpertsToBf16MatchesDequantizeBf16) {
  SKIP_WITHOUT_GPU();
  using enum DType;
  const DType cases[][3] = {{kQ8_0, kQ8_0, kQ8_0}, {kQ4_K, kQ4_K, kQ4_K}, {kQ4_K, kQ4_K, kQ8_0}};
  for (const auto& types : cases) {
    SCOPED_TRACE(std::string(ts::dtype_name(types[0])) + " gate/up, " +
                 std::string(ts::dtype_name(types[2])) + " down");
    check_expert_dequant(types);
  }
}

// The grouped tensor-core GEMMs against a double-precision reference on the same BF16 inputs
// (x rounded to BF16, weights as dequantize_bf16 gives them): experts of 1, 64, 70 and 130
// rows (tile edges), output widths off the kernels' output blocks, tables vs direct addresses.
// Q8_0 weights take grouped_quant_mma_kernel where k is a multiple of 128 and the WMMA kernel
// otherwise: the shapes give each phase both. Q4_K weights (k a multiple of 256) take
// grouped_quant_mma_kernel's Q4_K form, on the shapes that have such widths.
TEST(CudaKernels, GroupedGemmsMatchReference) {
  SKIP_WITHOUT_GPU();
  // Five shapes: outputs within one block and across two or more (BF16 blocks are 128
  // outputs wide, or 128 / 256 on the warpgroup-MMA kernels; Q8_0 ones 128, or 64 on the WMMA
  // kernel), 1 to 12 column steps of 32, 64 or 128, some ending past k.
  struct Shape {
    int d, de;
  };
  // On a compute 9.0 device the BF16 phases run the warpgroup-MMA kernels (blocks of 128
  // gate|up outputs or 256 down outputs, 64-column steps): a build without sm_90a would
  // quietly take the slower kernels.
  int dev = 0, major = 0, minor = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (major == 9 && minor == 0) {
    EXPECT_TRUE(ts::cuda::grouped_wgmma_available());
  }
  // Kernels: 0 = what grouped_gate_up / grouped_down choose; 1 = the mma.sync BF16 kernels
  // called directly, which devices without warpgroup MMA choose (run here too when the
  // device has it, so every kernel is checked on the GPU machine); 2 = Q8_0 on tiles of
  // kQuantSmallTile rows.
  for (const Shape sh : {Shape{160, 96}, Shape{256, 160}, Shape{384, 224}, Shape{384, 256},
                         Shape{224, 128}, Shape{512, 256}, Shape{768, 512}})
    for (const auto& [t, kernel] :
         {std::pair{DType::kBF16, 0}, std::pair{DType::kBF16, 1}, std::pair{DType::kQ8_0, 0},
          std::pair{DType::kQ8_0, 2}, std::pair{DType::kQ8_0, 3}, std::pair{DType::kQ8_0, 4},
          std::pair{DType::kQ4_K, 0}, std::pair{DType::kQ4_K, 2}, std::pair{DType::kQ4_K, 3},
          std::pair{DType::kQ4_K, 4}}) {
      if (kernel == 1 && ts::cuda::grouped_tile_rows(t) == ts::cuda::kGroupTile) continue;
      if (!ts::cuda::grouped_supports(t, sh.d) || !ts::cuda::grouped_supports(t, sh.de)) continue;
      const int d = sh.d, de = sh.de;
      // 3, 4: Q8_0 / Q4_K phase 1 on F16 x (tiles of 64, 32 rows), where k is a multiple of
      // 128 (Q8_0; Q4_K's are of 256).
      const bool f16 = kernel >= 3;
      if (f16 && d % 128 != 0) continue;
      const std::string what = std::string(ts::dtype_name(t)) + " d " + std::to_string(d) +
                               (kernel == 1   ? " (mma.sync kernels)"
                                : kernel == 2 ? " (tiles of 32 rows)"
                                : kernel == 3 ? " (F16 x)"
                                : kernel == 4 ? " (F16 x, tiles of 32 rows)"
                                              : "");
      const std::vector<int> rows_of = {1, 64, 70, 130};  // rows per expert, sorted by expert
      // Tiles of 64 rows, or 128 on the warpgroup-MMA kernels (where 1, 64 and the 2 rows
      // past 128 leave the second warpgroup idle; 70 and 128 use both).
      const int tile_rows = kernel == 1 || kernel == 3   ? ts::cuda::kGroupTile
                            : kernel == 2 || kernel == 4 ? ts::cuda::kQuantSmallTile
                                                         : ts::cuda::grouped_tile_rows(t);
      const int n_experts = int(rows_of.size());
      std::vector<ts::cuda::GroupTile> tiles;
      std::vector<int> first;
      int ns = 0;
      for (int e = 0; e < n_experts; ++e) {
        first.push_back(int(tiles.size()));
        for (int off = 0; off < rows_of[size_t(e)]; off += tile_rows)
          tiles.push_back({e, ns + off, std::min(tile_rows, rows_of[size_t(e)] - off)});
        ns += rows_of[size_t(e)];
      }
      first.push_back(int(tiles.size()));
      // Weights and their BF16 values; x as BF16.
      std::vector<std::vector<uint8_t>> G, U, D;
      std::vector<std::vector<float>> Gf, Uf, Df;
      std::vector<Dev*> owned;
      std::vector<const void*> gp, up, dp;
      const auto as_bf16_values = [&](const std::vector<uint8_t>& w, int64_t r, int64_t c) {
        Dev dw(w), db(size_t(r * c) * 2);
        ts::cuda::dequantize_bf16({dw.p, t, r, c}, db.p, nullptr);
        std::vector<float> f;
        for (uint16_t h : db.get<uint16_t>()) f.push_back(ts::bf16_to_f32(h));
        return f;
      };
      for (int e = 0; e < n_experts; ++e) {
        G.push_back(make_matrix(t, de, d, uint32_t(400 + e)));
        U.push_back(make_matrix(t, de, d, uint32_t(500 + e)));
        D.push_back(make_matrix(t, d, de, uint32_t(600 + e)));
        Gf.push_back(as_bf16_values(G.back(), de, d));
        Uf.push_back(as_bf16_values(U.back(), de, d));
        Df.push_back(as_bf16_values(D.back(), d, de));
        for (auto [v, tab] :
             {std::pair{&G.back(), &gp}, std::pair{&U.back(), &up}, std::pair{&D.back(), &dp}}) {
          owned.push_back(new Dev(*v));
          tab->push_back(owned.back()->p);
        }
      }
      const std::vector<float> xf = randn(size_t(ns * d), 41);
      std::vector<uint16_t> xb;
      for (float v : xf) xb.push_back(f16 ? ts::f32_to_f16(v) : ts::f32_to_bf16(v));
      const auto x_value = [&](size_t i) {
        return f16 ? ts::f16_to_f32(xb[i]) : ts::bf16_to_f32(xb[i]);
      };
      std::vector<int> expert_of;
      for (int e = 0; e < n_experts; ++e)
        expert_of.insert(expert_of.end(), size_t(rows_of[size_t(e)]), e);
      // The tiles, then 7 that no kernel may read (a plan's unused room): an expert past the
      // tables and rows past x.
      std::vector<ts::cuda::GroupTile> room = tiles;
      for (int i = 0; i < 7; ++i) room.push_back({1 << 24, 1 << 28, tile_rows});
      Dev dtiles(room), dx(xb), dg(gp), du(up), dd(dp);
      // The plan as the device holds it (GroupedArgs::plan: tile count, tile rows), and one
      // whose tiles are of another height.
      const int other_rows =
          tile_rows == ts::cuda::kQuantSmallTile ? ts::cuda::kGroupTile : ts::cuda::kQuantSmallTile;
      Dev dplan(std::vector<int>{int(tiles.size()), tile_rows});
      Dev dother(std::vector<int>{int(tiles.size()), other_rows});
      // Every way of addressing the weights must give the same bytes: 0 = the tables; 1 = one
      // expert's tiles at a time at its addresses; 2 = the tables on a plan the host has not
      // read (a grid of 7 tiles more than the plan's count); 3 = the same plan launched for
      // tiles of another height, which writes nothing.
      std::vector<uint16_t> h_by[4];
      std::vector<float> y_by[4];
      for (int mode : {0, 1, 2, 3}) {
        const bool direct = mode == 1;
        const int* plan = mode == 2 ? dplan.as<int>() : mode == 3 ? dother.as<int>() : nullptr;
        Dev dh(size_t(ns * de) * 2), dy(size_t(ns * d) * 4);
        for (int e = 0; e < (direct ? n_experts : 1); ++e) {
          const int t0 = direct ? first[size_t(e)] : 0;
          const int nt = direct ? first[size_t(e) + 1] - t0 : int(tiles.size()) + (plan ? 7 : 0);
          ts::cuda::GroupedArgs a{.tiles = dtiles.as<ts::cuda::GroupTile>() + t0,
                                  .n_tiles = nt,
                                  .w0 = dg.as<const void*>(),
                                  .w1 = du.as<const void*>(),
                                  .direct0 = direct ? gp[size_t(e)] : nullptr,
                                  .direct1 = direct ? up[size_t(e)] : nullptr,
                                  .dtype = t,
                                  .x = dx.p,
                                  .n = de,
                                  .k = d,
                                  .out = dh.p,
                                  .tile_rows = tile_rows,
                                  .x_f16 = f16,
                                  .plan = plan};
          kernel == 1 ? ts::cuda::grouped_mma(true, a, nullptr)
                      : ts::cuda::grouped_gate_up(a, nullptr);
          // Mode 3's phase 1 wrote nothing: phase 2 reads the real h (mode 0's).
          const void* h_in = dh.p;
          Dev dh0(mode == 3 ? h_by[0] : std::vector<uint16_t>{});
          if (mode == 3) h_in = dh0.p;
          a = ts::cuda::GroupedArgs{.tiles = dtiles.as<ts::cuda::GroupTile>() + t0,
                                    .n_tiles = nt,
                                    .w0 = dd.as<const void*>(),
                                    .direct0 = direct ? dp[size_t(e)] : nullptr,
                                    .dtype = t,
                                    .x = h_in,
                                    .n = d,
                                    .k = de,
                                    .out = dy.p,
                                    .tile_rows = tile_rows,
                                    .plan = plan};
          kernel == 1 ? ts::cuda::grouped_mma(false, a, nullptr)
                      : ts::cuda::grouped_down(a, nullptr);
        }
        h_by[mode] = dh.get<uint16_t>();
        y_by[mode] = dy.get<float>();
        ASSERT_EQ(cudaGetLastError(), cudaSuccess) << what << " mode " << mode;
      }
      const std::vector<uint16_t>& h_tab = h_by[0];
      const std::vector<float>& y_tab = y_by[0];
      for (int mode : {1, 2}) {
        ASSERT_EQ(h_tab, h_by[mode]) << what << " mode " << mode;
        ASSERT_EQ(0, std::memcmp(y_tab.data(), y_by[mode].data(), y_tab.size() * 4))
            << what << " mode " << mode;
      }
      // Poison (all bits set) left everywhere by the launch for another height.
      for (uint16_t v : h_by[3]) ASSERT_EQ(v, 0xffff) << what << " (plan of another height)";
      for (float v : y_by[3]) ASSERT_TRUE(std::isnan(v)) << what << " (plan of another height)";
      // Reference: phase 1 from the BF16 inputs; phase 2 from the kernel's own BF16 h, so each
      // phase is checked alone.
      std::vector<float> h_want(size_t(ns * de)), h_got(size_t(ns * de)), y_want(size_t(ns * d));
      for (int r = 0; r < ns; ++r) {
        const int e = expert_of[size_t(r)];
        for (int j = 0; j < de; ++j) {
          double g = 0, u = 0;
          for (int c = 0; c < d; ++c) {
            const double xv = x_value(size_t(r * d + c));
            g += xv * Gf[size_t(e)][size_t(j * d + c)];
            u += xv * Uf[size_t(e)][size_t(j * d + c)];
          }
          h_want[size_t(r * de + j)] = float(g / (1.0 + std::exp(-g)) * u);
          h_got[size_t(r * de + j)] = ts::bf16_to_f32(h_tab[size_t(r * de + j)]);
        }
        for (int j = 0; j < d; ++j) {
          double y = 0;
          for (int c = 0; c < de; ++c)
            y += double(h_got[size_t(r * de + c)]) * Df[size_t(e)][size_t(j * de + c)];
          y_want[size_t(r * d + j)] = float(y);
        }
      }
      // h is rounded to BF16 (relative 2^-9); y accumulates in F32. (On F16 x the weights
      // are the F16 nearest d q, the reference's their BF16 values: within 2^-9 too.)
      EXPECT_LE(max_rel(h_got, h_want), 8e-3) << what;
      EXPECT_LE(max_rel(y_tab, y_want), 1e-5) << what;
      for (Dev* p : owned) delete p;
    }
}

TEST(CudaKernels, GatherAndSlotSumMatchReference) {
  SKIP_WITHOUT_GPU();
  // d = 300 and 2,048 take the four-a-thread kernels, 302 the one-a-thread ones.
  for (const int d : {300, 302, 2048})
    for (const DType type : {DType::kF32, DType::kBF16, DType::kF16}) {
      const int n = 4, k = 2;
      const std::string what = "d " + std::to_string(d) + " " + std::string(ts::dtype_name(type));
      const std::vector<float> src = randn(size_t(n * d), 31);
      const std::vector<int> rows = {3, 0, 2, 2, 1, 0, 3, 1};
      const size_t es = type == DType::kF32 ? 4 : 2;
      Dev ds(src), dr(rows), dg(rows.size() * size_t(d) * es);
      ts::cuda::gather_rows(ds.as<float>(), dr.as<int>(), int(rows.size()), d, dg.p, type, nullptr);
      const std::vector<uint8_t> g = dg.get<uint8_t>();
      for (size_t i = 0; i < rows.size(); ++i)
        for (int c = 0; c < d; ++c) {
          const float want = src[size_t(rows[i] * d + c)];
          const size_t at = i * size_t(d) + size_t(c);
          if (type == DType::kF32) {
            float f;
            std::memcpy(&f, &g[at * 4], 4);
            ASSERT_EQ(f, want) << what;
            continue;
          }
          uint16_t h;
          std::memcpy(&h, &g[at * 2], 2);
          ASSERT_EQ(h, type == DType::kBF16 ? ts::f32_to_bf16(want) : ts::f32_to_f16(want)) << what;
        }
      if (type != DType::kF32) continue;
      // The slot sum, over the F32 rows: in rank order, each step one fused multiply-add.
      std::vector<float> gf(rows.size() * size_t(d));
      std::memcpy(gf.data(), g.data(), gf.size() * 4);
      const std::vector<float> w = {0.7f, 0.3f, 0.6f, 0.4f, 0.5f, 0.5f, 0.9f, 0.1f};
      Dev dw(w), dout(size_t(n * d) * 4);
      ts::cuda::slot_sum(dg.as<float>(), dr.as<int>(), dw.as<float>(), n, k, d, dout.as<float>(),
                         nullptr);
      const std::vector<float> out = dout.get<float>();
      for (int t = 0; t < n; ++t)
        for (int c = 0; c < d; ++c) {
          float want = 0;
          for (int r = 0; r < k; ++r)
            want =
                std::fma(w[size_t(t * k + r)], gf[size_t(rows[size_t(t * k + r)] * d + c)], want);
          ASSERT_EQ(out[size_t(t * d + c)], want) << what << " t " << t << " c " << c;
        }
    }
}

// group_plan against the host's counting sort (what grouped_experts ran before the plan
// moved to the device) and the tile rule, on routings that take each branch of the rule.
TEST(CudaKernels, GroupPlanSortsSlotsStablyAndCutsTilesByTheRule) {
  SKIP_WITHOUT_GPU();
  struct Case {
    const char* what;
    int tokens, k, ne;
    int hot;  // 0: every expert alike; else the ids fall on the first `hot` experts
    bool in_place;
    int dq_min_rows, small_tile;
  };
  const Case cases[] = {
      {"517 tokens, 128 experts, spread: 64-row tiles", 517, 8, 128, 0, true, 256, 32},
      {"20 tokens, 8 experts: 32-row tiles", 20, 2, 8, 0, true, 256, 32},
      {"100 tokens on 9 experts: most rows > 32", 100, 8, 128, 9, true, 256, 32},
      {"4,096 tokens on 40 experts: BF16 copies", 4096, 8, 128, 40, true, 256, 32},
      {"not in place, no copies: no tiles", 300, 4, 64, 0, false, 0, 0},
      {"not in place, copies", 300, 4, 64, 0, false, 64, 32},
      {"1,100 tokens, 512 experts, top-40", 1100, 40, 512, 0, true, 256, 32},
      {"one token", 1, 8, 128, 0, true, 256, 32},
  };
  uint32_t seed = 7;
  auto next = [&] {
    seed = seed * 1664525u + 1013904223u;
    return seed >> 8;
  };
  for (const Case& c : cases) {
    const int ns = c.tokens * c.k, ne = c.ne, span = c.hot > 0 ? c.hot : ne;
    std::vector<int> ids(static_cast<size_t>(ns));
    for (int t = 0; t < c.tokens; ++t)
      for (int r = 0; r < c.k; ++r) {
        // Distinct experts within a token, as top-k gives (where the span allows).
        int e;
        bool dup;
        do {
          e = int(next() % uint32_t(span));
          dup = false;
          for (int j = 0; j < r && c.k <= span; ++j) dup |= ids[size_t(t * c.k + j)] == e;
        } while (dup);
        ids[size_t(t * c.k + r)] = e;
      }
    // The host's plan.
    std::vector<int> first(size_t(ne) + 1, 0), src(static_cast<size_t>(ns)),
        row_of(static_cast<size_t>(ns));
    for (int e : ids) ++first[size_t(e) + 1];
    int used = 0, most = 0;
    for (int e = 0; e < ne; ++e) {
      used += first[size_t(e) + 1] > 0;
      most = std::max(most, first[size_t(e) + 1]);
    }
    for (int e = 0; e < ne; ++e) first[size_t(e) + 1] += first[size_t(e)];
    std::vector<int> fill(first.begin(), first.end() - 1);
    for (int s = 0; s < ns; ++s) {
      const int at = fill[size_t(ids[size_t(s)])]++;
      src[size_t(at)] = s / c.k;
      row_of[size_t(s)] = at;
    }
    const int tile = 64, dq_tile = 128;
    const bool dq = c.dq_min_rows > 0 && (!c.in_place || ns >= c.dq_min_rows * used);
    const int tr = dq ? dq_tile : c.small_tile > 0 && most <= c.small_tile ? c.small_tile : tile;
    std::vector<int> tiles;  // (expert, row0, m) triples
    if (c.in_place || dq)
      for (int e = 0; e < ne; ++e)
        for (int off = first[size_t(e)]; off < first[size_t(e) + 1]; off += tr)
          tiles.insert(tiles.end(), {e, off, std::min(tr, first[size_t(e) + 1] - off)});
    // The device's.
    Dev di(ids), dsrc(size_t(ns) * 4), drow(size_t(ns) * 4),
        dtiles((size_t(ns) / 32 + size_t(ne) + 1) * sizeof(ts::cuda::GroupTile)),
        dsum((size_t(ne) + 1 + ts::cuda::kPlanFields) * 4);
    ts::cuda::group_plan({.ids = di.as<int>(),
                          .ns = ns,
                          .k = c.k,
                          .n_experts = ne,
                          .in_place = c.in_place,
                          .dq_min_rows = c.dq_min_rows,
                          .dq_tile = dq_tile,
                          .small_tile = c.small_tile,
                          .tile = tile,
                          .src = dsrc.as<int>(),
                          .row_of = drow.as<int>(),
                          .tiles = dtiles.as<ts::cuda::GroupTile>(),
                          .summary = dsum.as<int>()},
                         nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << c.what;
    EXPECT_EQ(dsrc.get<int>(), src) << c.what;
    EXPECT_EQ(drow.get<int>(), row_of) << c.what;
    const std::vector<int> sum = dsum.get<int>();
    EXPECT_EQ(std::vector<int>(sum.begin(), sum.begin() + ne + 1), first) << c.what;
    const int* got = sum.data() + ne + 1;
    EXPECT_EQ(got[0], used) << c.what;
    EXPECT_EQ(got[1], most) << c.what;
    ASSERT_EQ(got[2], int(tiles.size() / 3)) << c.what;
    EXPECT_EQ(got[3], tr) << c.what;
    EXPECT_EQ(got[4], int(dq)) << c.what;
    const std::vector<int> t = dtiles.get<int>();
    EXPECT_EQ(std::vector<int>(t.begin(), t.begin() + long(tiles.size())), tiles) << c.what;
  }
}

// ---- Elementwise kernels and the synthetic-weight generators (bench --synthetic, --routing):
// each against a CPU reference; the generators' hash is replicated here bit for bit.

// One element of a float matrix of `type`, as the CPU reads it.
float elem_of(const std::vector<uint8_t>& m, DType type, size_t i) {
  uint16_t h;
  switch (type) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, &m[4 * i], 4);
      return f;
    }
    case DType::kBF16: std::memcpy(&h, &m[2 * i], 2); return ts::bf16_to_f32(h);
    default: std::memcpy(&h, &m[2 * i], 2); return ts::f16_to_f32(h);
  }
}

TEST(CudaKernels, EmbedRowsCopiesTheSelectedRowsAsF32) {
  SKIP_WITHOUT_GPU();
  const int vocab = 37, d = 300;  // d not a multiple of the block size
  const std::vector<int> ids = {5, 0, 36, 5, 17};
  for (const DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    const std::vector<uint8_t> table = make_matrix(t, vocab, d, 3);
    Dev dt(table), di(ids), dx(ids.size() * size_t(d) * 4);
    const ts::cuda::DevMatrix m{dt.p, t, vocab, d};
    ts::cuda::embed_rows(m, di.as<int>(), int(ids.size()), dx.as<float>(), nullptr);
    const std::vector<float> x = dx.get<float>();
    for (size_t i = 0; i < ids.size(); ++i)
      for (int c = 0; c < d; ++c)
        ASSERT_EQ(x[i * d + size_t(c)], elem_of(table, t, size_t(ids[i]) * d + size_t(c)))
            << ts::dtype_name(t) << " row " << i << " col " << c;
  }
}

TEST(CudaKernels, AddBiasAndAddInplaceMatchReference) {
  SKIP_WITHOUT_GPU();
  const int n = 3, dim = 1000;
  const std::vector<float> y = randn(size_t(n * dim), 41), b = randn(size_t(dim), 42),
                           z = randn(size_t(n * dim), 43);
  Dev dy(y), db(b), dz(z);
  ts::cuda::add_bias(dy.as<float>(), db.as<float>(), n, dim, nullptr);
  const std::vector<float> got = dy.get<float>();
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < dim; ++i)
      ASSERT_EQ(got[size_t(t * dim + i)], y[size_t(t * dim + i)] + b[size_t(i)]);
  ts::cuda::add_inplace(dy.as<float>(), dz.as<float>(), int64_t(n) * dim, nullptr);
  const std::vector<float> got2 = dy.get<float>();
  for (size_t i = 0; i < got2.size(); ++i) ASSERT_EQ(got2[i], got[i] + z[i]);
}

TEST(CudaKernels, MoeResidualAddsExpertsAndGatedSharedExpert) {
  SKIP_WITHOUT_GPU();
  const int n = 3, d = 700;
  const std::vector<float> x = randn(size_t(n * d), 51), moe = randn(size_t(n * d), 52),
                           shared = randn(size_t(n * d), 53), z = {-2.0f, 0.3f, 4.0f};
  Dev dm(moe), ds(shared), dz(z);
  for (int mode = 0; mode < 3; ++mode) {  // no shared expert; ungated; gated by sigmoid(z)
    Dev dx(x);
    ts::cuda::moe_residual(dx.as<float>(), dm.as<float>(), mode > 0 ? ds.as<float>() : nullptr,
                           mode == 2 ? dz.as<float>() : nullptr, n, d, nullptr);
    const std::vector<float> got = dx.get<float>();
    for (int t = 0; t < n; ++t) {
      const float g = mode == 2 ? 1.0f / (1.0f + std::exp(-z[size_t(t)])) : 1.0f;
      for (int i = 0; i < d; ++i) {
        const size_t at = size_t(t * d + i);
        const float want = x[at] + moe[at] + (mode > 0 ? g * shared[at] : 0.0f);
        ASSERT_NEAR(got[at], want, 1e-5f * (1.0f + std::fabs(want))) << "mode " << mode;
      }
    }
  }
}

TEST(CudaKernels, ConvertF32RoundsToNearestEven) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 5000;
  std::vector<float> x = randn(size_t(n), 61, 3.0f);
  x[0] = 0.0f;
  x[1] = -0.0f;
  x[2] = 1.0f + 1.0f / 256.0f;  // a BF16 tie: rounds to even (1.0)
  x[3] = 70000.0f;              // F16 overflow: inf
  Dev dx(x);
  for (const DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    Dev out(size_t(n) * ts::dtype_row_bytes(t, 1));
    ts::cuda::convert_f32(dx.as<float>(), out.p, t, n, nullptr);
    const std::vector<uint8_t> got = out.get<uint8_t>();
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[size_t(i)];
      if (t == DType::kF32) {
        ASSERT_EQ(0, std::memcmp(&got[size_t(4 * i)], &v, 4)) << i;
      } else {
        uint16_t h;
        std::memcpy(&h, &got[size_t(2 * i)], 2);
        ASSERT_EQ(h, t == DType::kBF16 ? ts::f32_to_bf16(v) : ts::f32_to_f16(v))
            << ts::dtype_name(t) << " element " << i << " = " << v;
      }
    }
  }
}

uint64_t mix64_ref(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

TEST(CudaKernels, FillUniformAndFillValueMatchTheirDefinitions) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 10000;
  const float scale = 0.25f;
  const uint64_t seed = 1234;
  std::vector<float> want(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t z = mix64_ref(seed * 0x9e3779b97f4a7c15ull + uint64_t(i));
    const float u = float(z >> 40) * (1.0f / 16777216.0f);
    want[size_t(i)] = (2.0f * u - 1.0f) * scale;
  }
  for (const DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    Dev out(size_t(n) * ts::dtype_row_bytes(t, 1));
    ts::cuda::fill_uniform(out.p, t, n, scale, seed, nullptr);
    const std::vector<uint8_t> got = out.get<uint8_t>();
    double mean = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float v = elem_of(got, t, size_t(i));
      const float w = t == DType::kF32    ? want[size_t(i)]
                      : t == DType::kBF16 ? ts::bf16_to_f32(ts::f32_to_bf16(want[size_t(i)]))
                                          : ts::f16_to_f32(ts::f32_to_f16(want[size_t(i)]));
      ASSERT_EQ(v, w) << ts::dtype_name(t) << " element " << i;
      ASSERT_LE(std::fabs(v), scale);
      mean += v;
    }
    EXPECT_LT(std::fabs(mean / double(n)), 0.01) << "not centred";
  }
  // Another seed, other values.
  Dev a(size_t(n) * 4);
  ts::cuda::fill_uniform(a.p, DType::kF32, n, scale, seed + 1, nullptr);
  const std::vector<float> other = a.get<float>();
  int same = 0;
  for (int64_t i = 0; i < n; ++i) same += other[size_t(i)] == want[size_t(i)];
  EXPECT_LT(same, 10);
  ts::cuda::fill_value(a.as<float>(), n - 1, -3.5f, nullptr);
  const std::vector<float> filled = a.get<float>();
  for (int64_t i = 0; i < n - 1; ++i) ASSERT_EQ(filled[size_t(i)], -3.5f) << i;
  EXPECT_EQ(filled[size_t(n - 1)], other[size_t(n - 1)]) << "wrote past n";
}

TEST(CudaKernels, FillQ4KRandomWritesItsBlocksAndStaysInRange) {
  SKIP_WITHOUT_GPU();
  const int64_t n = 256 * 40;
  const float scale = 0.5f;
  const uint64_t seed = 99;
  const size_t bytes = size_t(n / 256) * 144;
  Dev out(bytes + 144);  // one poisoned block after the last
  ts::cuda::fill_q4_k_random(out.p, n, scale, seed, nullptr);
  const std::vector<uint8_t> got = out.get<uint8_t>();
  for (int64_t b = 0; b < n / 256; ++b) {
    const uint8_t* blk = &got[size_t(b) * 144];
    uint16_t d, dmin;
    std::memcpy(&d, blk, 2);
    std::memcpy(&dmin, blk + 2, 2);
    ASSERT_EQ(d, ts::f32_to_f16(2.0f * scale / (15.0f * 63.0f))) << "block " << b;
    ASSERT_EQ(dmin, ts::f32_to_f16(scale / 63.0f)) << "block " << b;
    for (int i = 0; i < 140; i += 4) {
      const uint32_t z = uint32_t(mix64_ref(seed * 0x9e3779b97f4a7c15ull + uint64_t(b) * 64 + uint64_t(i)));
      ASSERT_EQ(0, std::memcmp(blk + 4 + i, &z, 4)) << "block " << b << " byte " << i;
    }
  }
  for (size_t i = bytes; i < got.size(); ++i) ASSERT_EQ(got[i], 0xff) << "wrote past n";
  std::vector<float> vals(static_cast<size_t>(n));
  ts::cpu::dequantize_row(DType::kQ4_K, got.data(), vals.data(), n);
  for (const float v : vals) {
    ASSERT_GE(v, -scale * 1.01f);
    ASSERT_LE(v, 2.0f * scale * 1.01f);
  }
}

TEST(CudaKernels, SyntheticRouteIsBiasPlusGumbelNoisePerPosition) {
  SKIP_WITHOUT_GPU();
  const int n = 3, ne = 128, pos0 = 17;
  const uint64_t seed = 5;
  std::vector<float> bias(static_cast<size_t>(ne));
  for (int e = 0; e < ne; ++e) bias[size_t(e)] = 0.01f * float(e);
  Dev db(bias), dpos(std::vector<int>{pos0});
  for (const bool with_bias : {false, true}) {
    Dev dl(size_t(n * ne) * 4);
    ts::cuda::synthetic_route(dl.as<float>(), with_bias ? db.as<float>() : nullptr,
                              dpos.as<int>(), n, ne, seed, nullptr);
    const std::vector<float> got = dl.get<float>();
    for (int t = 0; t < n; ++t)
      for (int e = 0; e < ne; ++e) {
        const uint64_t z = mix64_ref(seed * 0x9e3779b97f4a7c15ull +
                                     (uint64_t(uint32_t(pos0 + t)) << 20) + uint64_t(e));
        const float u = (float(z >> 40) + 0.5f) * (1.0f / 16777216.0f);
        const float want = (with_bias ? bias[size_t(e)] : 0.0f) - std::log(-std::log(u));
        ASSERT_NEAR(got[size_t(t * ne + e)], want, 1e-5f * (1.0f + std::fabs(want)))
            << "t " << t << " e " << e;
      }
    // Consecutive positions draw differently.
    int same = 0;
    for (int e = 0; e < ne; ++e) same += got[size_t(e)] == got[size_t(ne + e)];
    EXPECT_LT(same, 4);
  }
}

}  // namespace
