#include "backend/cuda/cuda_session.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/kernels.cuh"
#include "experts/expert_store.h"
#include "runtime/interventions.h"
#include "runtime/model.h"

namespace ts::cuda {
namespace {

Error cuda_error(const char* what, cudaError_t e, const char* file, int line) {
  return make_error(std::string("CUDA error: ") + cudaGetErrorString(e) + " in " + what + " (" +
                    file + ":" + std::to_string(line) + ")");
}

#define CUDA_TRY(expr)                                                 \
  do {                                                                 \
    const cudaError_t ts_cuda_err_ = (expr);                           \
    if (ts_cuda_err_ != cudaSuccess)                                   \
      return cuda_error(#expr, ts_cuda_err_, __FILE__, __LINE__);      \
  } while (0)

#define CUBLAS_TRY(expr)                                                                   \
  do {                                                                                     \
    const cublasStatus_t ts_blas_st_ = (expr);                                             \
    if (ts_blas_st_ != CUBLAS_STATUS_SUCCESS)                                              \
      return make_error(std::string("cuBLAS error ") + std::to_string(int(ts_blas_st_)) + \
                        " in " #expr " (" __FILE__ ":" + std::to_string(__LINE__) + ")"); \
  } while (0)

double gib(uint64_t b) { return double(b) / double(1ull << 30); }

// Device allocations owned by a session, freed together.
class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() {
    for (void* p : ptrs_) cudaFree(p);
  }
  Result<void*> alloc(size_t bytes) {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 256));
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      return make_error("out of GPU memory: allocating " + std::to_string(gib(bytes)) +
                        " GiB with " + std::to_string(gib(free_b)) + " GiB free of " +
                        std::to_string(gib(total_b)) + " GiB (" + cudaGetErrorString(e) + ")");
    }
    ptrs_.push_back(p);
    bytes_ += bytes;
    return p;
  }
  template <class T>
  Result<T*> alloc_n(size_t n) {
    TS_ASSIGN(void* p, alloc(n * sizeof(T)));
    return static_cast<T*>(p);
  }
  uint64_t bytes() const { return bytes_; }

 private:
  std::vector<void*> ptrs_;
  uint64_t bytes_ = 0;
};

struct DevMlp {
  DevMatrix gate, up, down;
};

struct DevLayer {
  float* attn_norm = nullptr;  // [d_model]
  float* ffn_norm = nullptr;   // [d_model]
  float *bq = nullptr, *bk = nullptr, *bv = nullptr;  // qkv biases or null
  float *q_norm = nullptr, *k_norm = nullptr;         // [head_dim] or [q_dim]/[kv_dim] or null
  DevMatrix wq, wk, wv, wo;
  bool is_moe = false;
  DevMatrix router;       // [n_experts, d_model]
  DevMatrix shared_gate;  // [1, d_model]
  DevMlp shared;          // shared expert (d_shared)
  DevMlp dense;           // dense MLP (d_ff) on layers without experts
  // Routed experts: views (for the grouped prefill) and the same addresses as device tables
  // [n_experts] (for the decode kernels).
  std::vector<DevMlp> experts;
  // One expert's bytes: gate at 0, up at up_off, down at down_off (256-byte aligned).
  size_t expert_bytes = 0, up_off = 0, down_off = 0;
  float* router_bias = nullptr;  // bench --routing zipf:S: log-popularity per expert
  const void** gate_tab = nullptr;
  const void** up_tab = nullptr;
  const void** down_tab = nullptr;
};

struct DevWeights {
  DevMatrix embed;     // [vocab, d_model]
  DevMatrix lm_head;   // [vocab, d_model]
  float* final_norm = nullptr;
  std::vector<DevLayer> layers;
};

// Shapes only: a cached expert's views have no address until bound.
uint64_t mlp_bytes(const DevMlp& m) {
  return m.gate.n_bytes() + m.up.n_bytes() + m.down.n_bytes();
}

// Builds DevWeights: from host memory (a loaded model) or from random numbers on the device.
class Uploader {
 public:
  Uploader(Arena& arena, cudaStream_t s, bool quantize) : arena_(arena), s_(s), quantize_(quantize) {}

  Result<float*> vec(const std::vector<float>& v) {
    if (v.empty()) return static_cast<float*>(nullptr);
    TS_ASSIGN(float* p, arena_.alloc_n<float>(v.size()));
    CUDA_TRY(cudaMemcpyAsync(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice, s_));
    return p;
  }

  // Type the matrix will have on the device.
  DType device_type(DType t, int64_t cols) const {
    return quantize_ && !dtype_is_quantized(t) && cols % 32 == 0 ? DType::kQ8_0 : t;
  }

  // Copies (or quantizes) host matrix m into dst (device_type(m) bytes reserved there).
  Status copy(const model::Matrix& m, void* dst) {
    const DevMatrix src_shape{nullptr, m.dtype, m.rows, m.cols};
    if (device_type(m.dtype, m.cols) == m.dtype) {
      CUDA_TRY(cudaMemcpyAsync(dst, m.data, src_shape.n_bytes(), cudaMemcpyHostToDevice, s_));
      return {};
    }
    TS_TRY(ensure_staging(src_shape.n_bytes(), size_t(m.rows * m.cols) * 4));
    CUDA_TRY(cudaMemcpyAsync(raw_, m.data, src_shape.n_bytes(), cudaMemcpyHostToDevice, s_));
    to_f32({raw_, m.dtype, m.rows, m.cols}, f32_, s_);
    quantize_q8_0(f32_, dst, m.rows * m.cols, s_);
    // The staging buffers are reused by the next call: wait for this one.
    CUDA_TRY(cudaStreamSynchronize(s_));
    return {};
  }

  Result<DevMatrix> matrix(const model::Matrix& m) {
    if (!m.present()) return DevMatrix{};
    const DevMatrix out_shape{nullptr, device_type(m.dtype, m.cols), m.rows, m.cols};
    TS_ASSIGN(void* p, arena_.alloc(out_shape.n_bytes()));
    TS_TRY(copy(m, p));
    return DevMatrix{p, out_shape.dtype, m.rows, m.cols};
  }

  // A random matrix of `type` on the device.
  Result<DevMatrix> random(DType type, int64_t rows, int64_t cols, uint64_t seed) {
    const DevMatrix shape{nullptr, type, rows, cols};
    TS_ASSIGN(void* p, arena_.alloc(shape.n_bytes()));
    TS_TRY(fill_random(type, rows, cols, seed, p));
    return DevMatrix{p, type, rows, cols};
  }

  Status fill_random(DType type, int64_t rows, int64_t cols, uint64_t seed, void* dst) {
    const float scale = 1.0f / std::sqrt(float(cols));
    if (!dtype_is_quantized(type)) {
      fill_uniform(dst, type, rows * cols, scale, seed, s_);
      return {};
    }
    if (type == DType::kQ4_K) {
      if (cols % 256) return make_error("synthetic Q4_K weights need rows of 256-multiples");
      fill_q4_k_random(dst, rows * cols, scale, seed, s_);
      return {};
    }
    if (type != DType::kQ8_0)
      return make_error("synthetic weights: only F32, F16, BF16, Q8_0, Q4_K");
    TS_TRY(ensure_staging(0, size_t(rows * cols) * 4));
    fill_uniform(f32_, DType::kF32, rows * cols, scale, seed, s_);
    quantize_q8_0(f32_, dst, rows * cols, s_);
    CUDA_TRY(cudaStreamSynchronize(s_));
    return {};
  }

  Result<float*> ones(int64_t n) {
    TS_ASSIGN(float* p, arena_.alloc_n<float>(size_t(n)));
    fill_value(p, n, 1.0f, s_);
    return p;
  }

 private:
  Status ensure_staging(size_t raw_bytes, size_t f32_bytes) {
    if (raw_bytes > raw_cap_) {
      if (raw_) cudaFree(raw_);
      raw_ = nullptr;
      CUDA_TRY(cudaMalloc(&raw_, raw_bytes));
      raw_cap_ = raw_bytes;
    }
    if (f32_bytes > f32_cap_) {
      if (f32_) cudaFree(f32_);
      f32_ = nullptr;
      CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&f32_), f32_bytes));
      f32_cap_ = f32_bytes;
    }
    return {};
  }

 public:
  ~Uploader() {
    if (raw_) cudaFree(raw_);
    if (f32_) cudaFree(f32_);
  }

 private:
  Arena& arena_;
  cudaStream_t s_;
  bool quantize_;
  void* raw_ = nullptr;
  float* f32_ = nullptr;
  size_t raw_cap_ = 0, f32_cap_ = 0;
};

// Up to this many tokens the GEMV kernels run (weights read once per 4 tokens); beyond, cuBLAS
// and the expert-grouped MoE.
constexpr int kGemvMaxTokens = 8;

// Q8_0 weights in GEMVs take Q8 activations (dp4a) when rows fit the tile path.
bool q8_activations(DType w, int64_t cols) { return w == DType::kQ8_0 && cols % 256 == 0; }

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

using Clock = std::chrono::steady_clock;

// Times launches between CUDA events (off unless enabled); results are read after the
// stream synchronizes.
class KernelProfiler {
 public:
  ~KernelProfiler() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  bool on() const { return on_; }
  void enable(bool on) {
    on_ = on;
    table_.clear();
    pending_.clear();
  }
  template <class F>
  auto time(const char* name, double bytes, cudaStream_t s, F&& launch) {
    if (!on_) return launch();
    cudaEvent_t a = event(), b = event();
    cudaEventRecord(a, s);
    auto result = launch();
    cudaEventRecord(b, s);
    pending_.push_back({name, bytes, a, b});
    return result;
  }
  // After a synchronize: adds the pending launches to the table.
  void collect() {
    for (const Pending& p : pending_) {
      float ms = 0;
      cudaEventElapsedTime(&ms, p.a, p.b);
      auto it = std::find_if(table_.begin(), table_.end(),
                             [&](const KernelStat& k) { return k.name == p.name; });
      if (it == table_.end()) it = table_.insert(table_.end(), KernelStat{p.name});
      it->ms += ms;
      it->calls += 1;
      it->bytes += p.bytes;
    }
    pending_.clear();
    next_ = 0;
  }
  const std::vector<KernelStat>& table() const { return table_; }

 private:
  struct Pending {
    const char* name;
    double bytes;
    cudaEvent_t a, b;
  };
  cudaEvent_t event() {
    if (next_ == events_.size()) {
      cudaEvent_t e;
      cudaEventCreate(&e);
      events_.push_back(e);
    }
    return events_[next_++];
  }
  bool on_ = false;
  std::vector<cudaEvent_t> events_;
  size_t next_ = 0;
  std::vector<Pending> pending_;
  std::vector<KernelStat> table_;
};

// A launcher returning nothing, for KernelProfiler::time.
template <class F>
Status launch(F&& f) {
  f();
  return {};
}

class CudaSession final : public runtime::Engine {
 public:
  CudaSession(const model::HParams& hp, runtime::SessionOptions options, int device)
      : hp_(hp), device_(device), opt_(std::move(options)) {}
  ~CudaSession() override;

  // Allocates the KV cache and scratch after the weights are in place.
  Status init(const std::string& device_name);
  Status upload(const runtime::LoadedModel& model);
  Status synthesize(const SyntheticOptions& syn);
  Status begin(int device);  // stream, cuBLAS

  int position() const override { return pos_; }
  int n_ctx() const override { return n_ctx_; }
  void reset() override { pos_ = 0; }
  void truncate(int n) override { pos_ = std::min(pos_, std::max(0, n)); }
  Status forward(std::span<const int> tokens, std::vector<float>* all_logits) override;
  std::span<const float> last_logits() const override { return last_logits_; }
  const runtime::PhaseTimes& phases() const override { return phases_; }
  std::vector<uint64_t> router_hist() const override;
  const std::vector<std::vector<float>>& captures() const override { return captures_; }
  int64_t captured_positions() const override {
    return captures_.empty() ? 0 : int64_t(captures_[0].size()) / hp_.d_model;
  }
  const std::vector<runtime::RouterTraceEntry>& router_trace() const override { return trace_; }
  std::string device_name() const override { return device_name_; }
  std::optional<runtime::ExpertCacheReport> expert_cache() const override;

  CudaBenchInfo info() const;
  KernelProfiler& profiler() { return prof_; }
  void sample_routing(uint64_t seed) {
    sampled_routing_ = true;
    route_seed_ = seed;
  }

 private:
  Status forward_chunk(const int* tokens, int n, float* logits_out, bool last_chunk);
  Status run_layers(int n, bool all_rows, bool last_chunk);
  Status layer_boundary(int layer, int n, bool last_chunk);
  Status attention_block(int layer, int n);
  Status moe_block(int layer, int n);
  Status grouped_experts(int layer, int n);
  Status init_dequant_scratch();
  Status dense_mlp(const DevMlp& mlp, int n, int d_hidden, float* out);
  // y[n, rows] (+)= x[n, cols] . W^T: the GEMV kernel for few tokens, cuBLAS beyond.
  // x_q8: x's Q8 blocks, already written (GEMV-sized n with Q8_0 weights only).
  Status linear(const DevMatrix& w, const float* x, int n, float* y, bool accumulate = false,
                const QAct* x_q8 = nullptr);
  // cuBLAS: y[n, rows] (+)= x . W^T where x is already in the GEMM input type of w.
  Status gemm(const DevMatrix& w, const void* x, int n, float* y, bool accumulate);
  DType gemm_input_type(DType w) const {
    return w == DType::kF32 ? DType::kF32 : w == DType::kF16 ? DType::kF16 : DType::kBF16;
  }
  int attention_splits(int n, int max_keys) const;
  bool graph_eligible() const;
  bool segments_eligible() const;

  // The GPU expert cache (--residency host|streamed); see "GPU expert cache" below.
  bool cached() const { return opt_.gpu_experts.residency != runtime::GpuResidency::kResident; }
  bool streamed() const { return opt_.gpu_experts.residency == runtime::GpuResidency::kStreamed; }
  void set_expert_layout(DevLayer& D, DType gate_t, DType down_t, int64_t d_expert,
                         int64_t d_model);
  Result<uint8_t*> expert_layer_memory(DevLayer& D);
  Status finish_expert_layer(int layer, const uint8_t* built);
  void free_layer_memory();
  Status init_expert_cache();
  Status warm_expert_cache();
  void point_expert(int layer, int e, uint8_t* at);
  Status copy_experts(int layer, std::span<const int> ids, std::span<uint8_t* const> dst);
  Status copy_misses(int layer, std::span<const int> ids, std::span<uint8_t* const> dst);
  Status upload_table(int layer);
  Status bind_step(int layer, int n, const MoeArgs* hits);
  Status bind_ids(int layer, int n, const MoeArgs* hits);
  bool prefetch_applies(int n) const;
  Status prefetch_layer(int layer);
  Status begin_segment();
  Status end_segment();
  Status decode_segments();
  Status sync_expert_table(int layer, bool wait = true);
  void collect_copy_times();

  model::HParams hp_;
  int device_;
  runtime::SessionOptions opt_;
  std::string device_name_;
  Arena arena_;
  DevWeights w_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  cudaGraphExec_t graph_ = nullptr;
  int graph_splits_ = 0;

  int n_ctx_ = 0, chunk_ = 0, pos_ = 0;
  float *k_cache_ = nullptr, *v_cache_ = nullptr;  // [n_layers, n_ctx, kv_dim]
  // BF16 copies of the cache for the tensor-core prefill attention (null for F32 models).
  void *k_bf16_ = nullptr, *v_bf16_ = nullptr;
  float* inv_freq_ = nullptr;
  // Scratch for one chunk (device).
  float *x_ = nullptr, *xn_ = nullptr, *tmp_ = nullptr, *q_ = nullptr, *k_ = nullptr,
        *v_ = nullptr, *att_ = nullptr, *partial_ = nullptr, *router_ = nullptr,
        *sel_w_ = nullptr, *h1_ = nullptr, *h2_ = nullptr, *moe_out_ = nullptr,
        *shared_out_ = nullptr, *shared_z_ = nullptr, *logits_ = nullptr, *slot_rows_ = nullptr;
  GroupTile* group_tiles_ = nullptr;
  // Per slot of a GEMV-sized step: 1 where phase 1 ran early (its expert hit), pinned mirror.
  int* slot_hit_ = nullptr;
  int* h_slot_hit_ = nullptr;
  bool slot_hit_set_ = true;  // slot_hit_ may hold ones (it starts uninitialized)
  std::vector<MoeArgs> segment_hits_;  // per layer: phase 1 of the captured decode step
  int *sel_ids_ = nullptr, *tokens_ = nullptr, *pos_dev_ = nullptr, *group_src_ = nullptr,
      *group_row_of_ = nullptr;
  // Q8 activations for Q8_0 GEMVs: qx_ holds a GEMV input (xn, attention output), qh_ the
  // experts' hidden rows.
  QAct qx_, qh_;
  void* act_ = nullptr;     // GEMM inputs in F16/BF16 (gathered rows, activations)
  void* wtmp_ = nullptr;    // a quantized matrix dequantized to BF16 for cuBLAS
  size_t act_bytes_ = 0, wtmp_bytes_ = 0;
  // Long prefill chunks with Q8_0 experts: the experts a layer uses, dequantized to BF16
  // dq_group_ at a time (dq_expert_bytes_ each: gate, up, down at dq_off_), run through the
  // BF16 grouped kernel; dq_tab_ [gate | up | down][n_experts] addresses the copies.
  uint8_t* dq_ = nullptr;
  int dq_group_ = 0;
  size_t dq_expert_bytes_ = 0, dq_off_[3] = {};
  const void** dq_tab_ = nullptr;
  int* dq_ids_ = nullptr;
  int partial_rows_ = 0;    // n * n_splits the partial buffer holds
  unsigned long long* hist_ = nullptr;  // [n_layers, n_experts]
  // Pinned host mirrors.
  int* h_tokens_ = nullptr;
  int* h_pos_ = nullptr;
  int* h_ids_ = nullptr;
  // With the GPU expert cache, decode segments end with the router writing the ids into
  // mapped host memory [flag, ids...] (ids_flag_dev_ as the device sees it): the host reads
  // them without a device-to-host copy and a stream synchronization.
  int* ids_flag_host_ = nullptr;
  int* ids_flag_dev_ = nullptr;
  Status wait_ids_flag(int k);
  float* h_logits_ = nullptr;
  std::vector<float> last_logits_;
  runtime::PhaseTimes phases_;
  runtime::Interventions iv_;
  std::vector<int> capture_index_;
  std::vector<std::vector<float>> captures_;
  std::vector<runtime::RouterTraceEntry> trace_;
  std::vector<float> host_rows_;
  bool use_graphs_ = true;
  KernelProfiler prof_;

  // GPU expert cache. Per MoE layer: its slots, the replacement policy and protect set, the
  // pinned host copy of every expert (host mode), and a pinned mirror of the device address
  // tables [gate | up | down][n_experts].
  struct CachedLayer {
    std::unique_ptr<experts::SlotCache> cache;
    uint8_t* slots = nullptr;
    uint8_t* host = nullptr;
    const void** tab_host = nullptr;
    const void** tab_dev = nullptr;
    cudaEvent_t copy_begin = nullptr, copy_end = nullptr;  // this chunk's copies, timed
    bool copies_timed = false;
    bool table_stale = false;  // tab_host changed since tab_dev was written
  };
  Status start_copy_timer(CachedLayer& C);
  experts::ExpertStore* store_ = nullptr;  // streamed: where misses are read from
  std::vector<void*> pinned_store_;         // its slot memory, registered by this session
  double used_fraction_ = 1.0;              // of the experts, by the last grouped MoE layer
  std::vector<CachedLayer> cached_;
  int slots_per_layer_ = 0;
  // Device expert buffers outside the cache: experts a step needs beyond its layer's free
  // slots, and the ring the expert-grouped prefill streams misses through (staging_free_[i]
  // is recorded when the GEMMs reading buffer i are done).
  std::vector<uint8_t*> staging_;
  std::vector<cudaEvent_t> staging_free_;
  // A binding's copies (bind_ids, copy_misses): gate_up_loaded_ once the table and all of the
  // misses but the last one's down part have landed (phase 1 may run), loaded_ after that
  // down part too (phase 2 may run).
  cudaEvent_t loaded_ = nullptr, gate_up_loaded_ = nullptr;
  std::vector<void*> batch_dst_;  // copy_misses' cudaMemcpyBatchAsync arguments
  std::vector<const void*> batch_src_;
  std::vector<size_t> batch_bytes_;
  cudaStream_t copy_stream_ = nullptr;
  uint8_t* layer_tmp_ = nullptr;  // a layer's experts while they are built at load
  size_t layer_tmp_bytes_ = 0;
  runtime::ExpertCacheReport cache_report_;
  // Decode with the cache: the step as CUDA graph segments split where the host binds a MoE
  // layer's experts (segment i ends with MoE layer i's ids copied to the host).
  // Prefill with the cache, chunks that use most experts: each MoE layer's uncached experts
  // copied whole into one of two layer buffers while the layer before computes.
  uint8_t* pf_buf_[2] = {nullptr, nullptr};
  int pf_layer_[2] = {-1, -1};
  int pf_turn_ = 0;
  cudaEvent_t pf_ready_[2] = {nullptr, nullptr}, pf_free_[2] = {nullptr, nullptr};
  std::vector<cudaGraphExec_t> segments_;
  std::vector<int> segment_layers_;
  bool capturing_segments_ = false;
  bool sampled_routing_ = false;  // bench --routing uniform|zipf:S
  uint64_t route_seed_ = 0;
};

CudaSession::~CudaSession() {
  if (stream_) cudaStreamSynchronize(stream_);
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  for (void* p : pinned_store_) cudaHostUnregister(p);
  free_layer_memory();
  for (CachedLayer& C : cached_) {
    if (C.host) cudaFreeHost(C.host);
    if (C.tab_host) cudaFreeHost(static_cast<void*>(C.tab_host));
    for (cudaEvent_t e : {C.copy_begin, C.copy_end})
      if (e) cudaEventDestroy(e);
  }
  for (cudaEvent_t e : staging_free_) cudaEventDestroy(e);
  for (cudaEvent_t e : {pf_ready_[0], pf_ready_[1], pf_free_[0], pf_free_[1]})
    if (e) cudaEventDestroy(e);
  if (loaded_) cudaEventDestroy(loaded_);
  if (gate_up_loaded_) cudaEventDestroy(gate_up_loaded_);
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
  if (graph_) cudaGraphExecDestroy(graph_);
  for (cudaGraphExec_t g : segments_) cudaGraphExecDestroy(g);
  if (blas_) cublasDestroy(blas_);
  if (stream_) cudaStreamDestroy(stream_);
  for (void* p : {static_cast<void*>(h_tokens_), static_cast<void*>(h_pos_),
                  static_cast<void*>(h_ids_), static_cast<void*>(h_slot_hit_),
                  static_cast<void*>(h_logits_), static_cast<void*>(ids_flag_host_)})
    if (p) cudaFreeHost(p);
}

Status CudaSession::begin(int device) {
  CUDA_TRY(cudaSetDevice(device));
  CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUBLAS_TRY(cublasCreate(&blas_));
  CUBLAS_TRY(cublasSetStream(blas_, stream_));
  // F32 GEMMs stay F32 (no TF32): the fixtures are checked against transformers in F32.
  CUBLAS_TRY(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH));
  const char* env = std::getenv("TURBOSPARK_CUDA_GRAPHS");
  use_graphs_ = !(env && std::string(env) == "0");
  cached_.resize(size_t(hp_.n_layers));
  return {};
}

Status CudaSession::upload(const runtime::LoadedModel& model) {
  const model::DenseWeights& d = model.dense();
  Uploader up(arena_, stream_, opt_.quantize_q8_0);
  // The embedding is only gathered row by row: it stays in its float type.
  Uploader keep(arena_, stream_, false);
  TS_ASSIGN(w_.embed, keep.matrix(d.embed));
  if (d.lm_head.data == d.embed.data && !opt_.quantize_q8_0) {
    w_.lm_head = w_.embed;
  } else {
    TS_ASSIGN(w_.lm_head, up.matrix(d.lm_head));
  }
  TS_ASSIGN(w_.final_norm, up.vec(d.final_norm));
  experts::ExpertStore& store = model.experts();
  store_ = &store;
  w_.layers.resize(size_t(hp_.n_layers));
  for (int l = 0; l < hp_.n_layers; ++l) {
    const model::LayerWeights& L = d.layers[size_t(l)];
    DevLayer& D = w_.layers[size_t(l)];
    TS_ASSIGN(D.attn_norm, up.vec(L.attn_norm));
    TS_ASSIGN(D.ffn_norm, up.vec(L.ffn_norm));
    TS_ASSIGN(D.bq, up.vec(L.bq));
    TS_ASSIGN(D.bk, up.vec(L.bk));
    TS_ASSIGN(D.bv, up.vec(L.bv));
    TS_ASSIGN(D.q_norm, up.vec(L.q_norm));
    TS_ASSIGN(D.k_norm, up.vec(L.k_norm));
    TS_ASSIGN(D.wq, up.matrix(L.wq));
    TS_ASSIGN(D.wk, up.matrix(L.wk));
    TS_ASSIGN(D.wv, up.matrix(L.wv));
    TS_ASSIGN(D.wo, up.matrix(L.wo));
    D.is_moe = L.is_moe;
    TS_ASSIGN(D.dense.gate, up.matrix(L.dense.gate));
    TS_ASSIGN(D.dense.up, up.matrix(L.dense.up));
    TS_ASSIGN(D.dense.down, up.matrix(L.dense.down));
    if (!L.is_moe) continue;
    // The router stays in its float type: selection must match the CPU's.
    TS_ASSIGN(D.router, keep.matrix(L.router));
    TS_ASSIGN(D.shared_gate, keep.matrix(L.shared_gate));
    TS_ASSIGN(D.shared.gate, up.matrix(L.shared.gate));
    TS_ASSIGN(D.shared.up, up.matrix(L.shared.up));
    TS_ASSIGN(D.shared.down, up.matrix(L.shared.down));
    // Routed experts: one block per layer, each expert's gate|up|down 256-byte aligned, in
    // GPU memory (resident) or built on the device and moved to pinned host memory (host).
    // Streamed: only the first expert is read, for the layout; the rest stay in the files.
    std::vector<model::ExpertWeights> views(size_t(hp_.n_experts));
    const int batch = std::max(1, store.max_batch(l));
    const int n_load = streamed() ? 1 : hp_.n_experts;
    std::vector<int> ids;
    uint8_t* base = nullptr;
    for (int e0 = 0; e0 < n_load; e0 += batch) {
      const int nb = std::min(batch, n_load - e0);
      ids.resize(size_t(nb));
      for (int i = 0; i < nb; ++i) ids[size_t(i)] = e0 + i;
      TS_TRY(store.acquire(l, ids, std::span<model::ExpertWeights>(views.data() + e0, size_t(nb))));
      for (int i = 0; i < nb; ++i) {
        const model::ExpertWeights& v = views[size_t(e0 + i)];
        const DType g = up.device_type(v.gate.dtype, v.gate.cols);
        const DType dn = up.device_type(v.down.dtype, v.down.cols);
        if (D.experts.empty()) {
          set_expert_layout(D, g, dn, v.gate.rows, v.gate.cols);
          if (streamed() && (g != v.gate.dtype || dn != v.down.dtype))
            return make_error("--residency streamed on CUDA copies expert bytes as stored: "
                              "--quant q8_0 cannot convert them; make a Q8_0 pack instead "
                              "(turbospark pack --experts-quant q8_0)");
          TS_ASSIGN(base, expert_layer_memory(D));
        }
        const DevMlp& shape = D.experts[size_t(e0 + i)];
        if (g != shape.gate.dtype || dn != shape.down.dtype ||
            up.device_type(v.up.dtype, v.up.cols) != g || v.gate.rows != shape.gate.rows ||
            v.gate.cols != shape.gate.cols || v.down.rows != shape.down.rows ||
            v.down.cols != shape.down.cols)
          return make_error("layer " + std::to_string(l) + " expert " + std::to_string(e0 + i) +
                            ": expert weights of one layer must share their dtypes and shapes "
                            "on CUDA");
        if (!base) continue;
        uint8_t* at = base + size_t(e0 + i) * D.expert_bytes;
        TS_TRY(up.copy(v.gate, at));
        TS_TRY(up.copy(v.up, at + D.up_off));
        TS_TRY(up.copy(v.down, at + D.down_off));
      }
      // Copies from mapped or slot memory must finish before the slots are reused.
      CUDA_TRY(cudaStreamSynchronize(stream_));
      store.release(l);
    }
    TS_TRY(finish_expert_layer(l, base));
  }
  CUDA_TRY(cudaStreamSynchronize(stream_));
  free_layer_memory();
  return {};
}

Status CudaSession::synthesize(const SyntheticOptions& syn) {
  sampled_routing_ = syn.sampled_routing;
  route_seed_ = syn.seed * 7919;
  Uploader up(arena_, stream_, false);
  uint64_t seed = syn.seed * 1000003ull;
  const DType float_t = dtype_is_quantized(syn.dtype) ? DType::kBF16 : syn.dtype;
  const int d = hp_.d_model;
  TS_ASSIGN(w_.embed, up.random(float_t, hp_.vocab, d, ++seed));
  if (hp_.tie_word_embeddings && !dtype_is_quantized(syn.dtype)) {
    w_.lm_head = w_.embed;
  } else {
    TS_ASSIGN(w_.lm_head, up.random(syn.dtype, hp_.vocab, d, ++seed));
  }
  TS_ASSIGN(w_.final_norm, up.ones(d));
  w_.layers.resize(size_t(hp_.n_layers));
  for (int l = 0; l < hp_.n_layers; ++l) {
    DevLayer& D = w_.layers[size_t(l)];
    TS_ASSIGN(D.attn_norm, up.ones(d));
    TS_ASSIGN(D.ffn_norm, up.ones(d));
    TS_ASSIGN(D.wq, up.random(syn.dtype, hp_.q_dim(), d, ++seed));
    TS_ASSIGN(D.wk, up.random(syn.dtype, hp_.kv_dim(), d, ++seed));
    TS_ASSIGN(D.wv, up.random(syn.dtype, hp_.kv_dim(), d, ++seed));
    TS_ASSIGN(D.wo, up.random(syn.dtype, d, hp_.q_dim(), ++seed));
    if (hp_.qk_norm == model::QkNorm::kPerHead) {
      TS_ASSIGN(D.q_norm, up.ones(hp_.head_dim));
      TS_ASSIGN(D.k_norm, up.ones(hp_.head_dim));
    } else if (hp_.qk_norm == model::QkNorm::kFullProjection) {
      TS_ASSIGN(D.q_norm, up.ones(hp_.q_dim()));
      TS_ASSIGN(D.k_norm, up.ones(hp_.kv_dim()));
    }
    D.is_moe = hp_.layer_is_moe[size_t(l)];
    if (!D.is_moe) {
      TS_ASSIGN(D.dense.gate, up.random(syn.dtype, hp_.d_ff, d, ++seed));
      TS_ASSIGN(D.dense.up, up.random(syn.dtype, hp_.d_ff, d, ++seed));
      TS_ASSIGN(D.dense.down, up.random(syn.dtype, d, hp_.d_ff, ++seed));
      continue;
    }
    TS_ASSIGN(D.router, up.random(float_t, hp_.n_experts, d, ++seed));
    if (hp_.d_shared > 0) {
      TS_ASSIGN(D.shared.gate, up.random(syn.dtype, hp_.d_shared, d, ++seed));
      TS_ASSIGN(D.shared.up, up.random(syn.dtype, hp_.d_shared, d, ++seed));
      TS_ASSIGN(D.shared.down, up.random(syn.dtype, d, hp_.d_shared, ++seed));
      if (hp_.shared_expert_gate) {
        TS_ASSIGN(D.shared_gate, up.random(float_t, 1, d, ++seed));
      }
    }
    if (syn.zipf > 0) {
      // Popularity rank r (a random order per layer) gets -s * ln(r + 1): weight (r+1)^-s.
      std::vector<int> order(size_t(hp_.n_experts));
      for (int e = 0; e < hp_.n_experts; ++e) order[size_t(e)] = e;
      std::mt19937_64 rng(seed + uint64_t(l));
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<float> bias(order.size());
      for (size_t r = 0; r < order.size(); ++r)
        bias[size_t(order[r])] = -float(syn.zipf * std::log(double(r) + 1.0));
      TS_ASSIGN(D.router_bias, up.vec(bias));
    }
    if (streamed()) return make_error("synthetic weights have no files to stream from: use "
                                      "--residency host or resident");
    set_expert_layout(D, syn.dtype, syn.dtype, hp_.d_expert, d);
    TS_ASSIGN(uint8_t* base, expert_layer_memory(D));
    for (int e = 0; e < hp_.n_experts; ++e) {
      uint8_t* at = base + size_t(e) * D.expert_bytes;
      TS_TRY(up.fill_random(syn.dtype, hp_.d_expert, d, ++seed, at));
      TS_TRY(up.fill_random(syn.dtype, hp_.d_expert, d, ++seed, at + D.up_off));
      TS_TRY(up.fill_random(syn.dtype, d, hp_.d_expert, ++seed, at + D.down_off));
    }
    TS_TRY(finish_expert_layer(l, base));
  }
  CUDA_TRY(cudaStreamSynchronize(stream_));
  free_layer_memory();
  return {};
}

Status CudaSession::init(const std::string& device_name) {
  device_name_ = device_name;
  const model::HParams& hp = hp_;
  n_ctx_ = opt_.n_ctx > 0 ? opt_.n_ctx : std::min(hp.max_positions, 4096);
  chunk_ = opt_.prefill_chunk > 0 ? opt_.prefill_chunk : 2048;
  chunk_ = std::min(chunk_, n_ctx_);
  for (const DevLayer& L : w_.layers)
    if (L.is_moe && (L.experts.empty() || L.experts[0].gate.rows == 0))
      return make_error("internal: a MoE layer without experts on the device");
  if (hp.head_dim > kMaxHeadDim || hp.head_dim % 2)
    return make_error("CUDA attention supports an even head_dim up to " +
                      std::to_string(kMaxHeadDim) + ", the model has " +
                      std::to_string(hp.head_dim));
  if (hp.n_experts > kMaxExperts)
    return make_error("CUDA router supports up to " + std::to_string(kMaxExperts) +
                      " experts, the model has " + std::to_string(hp.n_experts));
  // The KV cache and scratch: check the free memory first for a clear message.
  const size_t c = size_t(chunk_), d = size_t(hp.d_model), k = size_t(std::max(1, hp.top_k));
  const size_t kv = size_t(hp.n_layers) * size_t(n_ctx_) * size_t(hp.kv_dim());
  const size_t hidden = size_t(std::max({hp.d_expert, hp.d_ff, hp.d_shared, 1}));
  const size_t widest = std::max({d, size_t(hp.q_dim()), hidden});
  partial_rows_ = int(std::max<size_t>(c, 64));
  size_t need = 2 * kv * 4 + c * d * 4 * 6 + c * size_t(hp.q_dim()) * 8 +
                c * size_t(hp.kv_dim()) * 8 + size_t(partial_rows_) * size_t(hp.n_heads) *
                size_t(hp.head_dim + 2) * 4 + c * size_t(hp.n_experts) * 4 +
                c * k * (8 + d * 4) + 2 * c * k * hidden * 4 + c * size_t(hp.vocab) * 4;
  act_bytes_ = c * k * widest * 2;
  need += act_bytes_;
  bool tc_attention = hp.head_dim == 64 || hp.head_dim == 128;
  if (tc_attention) {
    tc_attention = false;
    for (const DevLayer& L : w_.layers) tc_attention |= L.wq.dtype != DType::kF32;
  }
  if (tc_attention) need += 2 * kv * 2;
  size_t free_b = 0, total_b = 0;
  CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  if (need + (64u << 20) > free_b)
    return make_error("the KV cache (n_ctx " + std::to_string(n_ctx_) + ") and scratch need " +
                      std::to_string(gib(need)) + " GiB on " + device_name_ + " after the weights (" +
                      std::to_string(gib(arena_.bytes())) + " GiB); " +
                      std::to_string(gib(free_b)) + " GiB are free: use a smaller --n-ctx");
  TS_ASSIGN(k_cache_, arena_.alloc_n<float>(kv));
  TS_ASSIGN(v_cache_, arena_.alloc_n<float>(kv));
  if (tc_attention) {
    TS_ASSIGN(k_bf16_, arena_.alloc(kv * 2));
    TS_ASSIGN(v_bf16_, arena_.alloc(kv * 2));
  }
  std::vector<float> inv;
  for (int i = 0; i < hp.head_dim / 2; ++i)
    inv.push_back(1.0f / std::pow(hp.rope_theta, float(2 * i) / float(hp.head_dim)));
  TS_ASSIGN(inv_freq_, arena_.alloc_n<float>(inv.size()));
  CUDA_TRY(cudaMemcpy(inv_freq_, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
  TS_ASSIGN(x_, arena_.alloc_n<float>(c * d));
  TS_ASSIGN(xn_, arena_.alloc_n<float>(c * d));
  TS_ASSIGN(tmp_, arena_.alloc_n<float>(c * d));
  TS_ASSIGN(moe_out_, arena_.alloc_n<float>(c * d));
  TS_ASSIGN(shared_out_, arena_.alloc_n<float>(c * d));
  TS_ASSIGN(shared_z_, arena_.alloc_n<float>(c));
  TS_ASSIGN(q_, arena_.alloc_n<float>(c * size_t(hp.q_dim())));
  TS_ASSIGN(att_, arena_.alloc_n<float>(c * size_t(hp.q_dim())));
  TS_ASSIGN(k_, arena_.alloc_n<float>(c * size_t(hp.kv_dim())));
  TS_ASSIGN(v_, arena_.alloc_n<float>(c * size_t(hp.kv_dim())));
  TS_ASSIGN(partial_, arena_.alloc_n<float>(size_t(partial_rows_) * size_t(hp.n_heads) *
                                             size_t(hp.head_dim + 2)));
  TS_ASSIGN(router_, arena_.alloc_n<float>(c * size_t(std::max(1, hp.n_experts))));
  TS_ASSIGN(sel_ids_, arena_.alloc_n<int>(c * k));
  TS_ASSIGN(sel_w_, arena_.alloc_n<float>(c * k));
  TS_ASSIGN(group_src_, arena_.alloc_n<int>(c * k));
  TS_ASSIGN(group_row_of_, arena_.alloc_n<int>(c * k));
  TS_ASSIGN(group_tiles_, arena_.alloc_n<GroupTile>(c * k / size_t(kGroupTile) +
                                                     size_t(std::max(1, hp.n_experts)) + 1));
  TS_ASSIGN(slot_rows_, arena_.alloc_n<float>(c * k * d));
  TS_ASSIGN(h1_, arena_.alloc_n<float>(c * k * hidden));
  TS_ASSIGN(h2_, arena_.alloc_n<float>(c * k * hidden));
  TS_ASSIGN(logits_, arena_.alloc_n<float>(c * size_t(hp.vocab)));
  TS_ASSIGN(tokens_, arena_.alloc_n<int>(c));
  TS_ASSIGN(pos_dev_, arena_.alloc_n<int>(1));
  TS_ASSIGN(act_, arena_.alloc(act_bytes_));
  TS_ASSIGN(qx_.q, arena_.alloc_n<int8_t>(size_t(kGemvMaxTokens) * widest));
  TS_ASSIGN(qx_.d, arena_.alloc_n<float>(size_t(kGemvMaxTokens) * widest / 32 + 1));
  TS_ASSIGN(qh_.q, arena_.alloc_n<int8_t>(size_t(kGemvMaxTokens) * k * hidden));
  TS_ASSIGN(qh_.d, arena_.alloc_n<float>(size_t(kGemvMaxTokens) * k * hidden / 32 + 1));
  TS_ASSIGN(hist_, arena_.alloc_n<unsigned long long>(size_t(hp.n_layers) *
                                                      size_t(std::max(1, hp.n_experts))));
  CUDA_TRY(cudaMemset(hist_, 0, size_t(hp.n_layers) * size_t(std::max(1, hp.n_experts)) * 8));
  // Dequantization buffer for cuBLAS on quantized matrices (prefill only).
  size_t wtmp = 0;
  auto note = [&](const DevMatrix& m) {
    if (m.rows > 0 && dtype_is_quantized(m.dtype)) wtmp = std::max(wtmp, size_t(m.rows * m.cols) * 2);
  };
  note(w_.lm_head);
  for (const DevLayer& L : w_.layers) {
    for (const DevMatrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.shared.gate, &L.shared.up,
                               &L.shared.down, &L.dense.gate, &L.dense.up, &L.dense.down})
      note(*m);
    if (!L.experts.empty()) {
      note(L.experts[0].gate);
      note(L.experts[0].down);
    }
  }
  if (wtmp) {
    TS_ASSIGN(wtmp_, arena_.alloc(wtmp));
    wtmp_bytes_ = wtmp;
  }
  TS_TRY(init_dequant_scratch());
  // Device address tables of the experts, [gate | up | down][n_experts] per layer (null
  // entries for cached experts until they are bound).
  const size_t ne = size_t(std::max(1, hp.n_experts));
  for (size_t l = 0; l < w_.layers.size(); ++l) {
    DevLayer& L = w_.layers[l];
    if (!L.is_moe) continue;
    std::vector<const void*> tab(3 * ne);
    for (size_t e = 0; e < L.experts.size(); ++e) {
      tab[e] = L.experts[e].gate.data;
      tab[ne + e] = L.experts[e].up.data;
      tab[2 * ne + e] = L.experts[e].down.data;
    }
    TS_ASSIGN(const void** dev, arena_.alloc_n<const void*>(tab.size()));
    CUDA_TRY(cudaMemcpy(dev, tab.data(), tab.size() * sizeof(void*), cudaMemcpyHostToDevice));
    L.gate_tab = dev;
    L.up_tab = dev + ne;
    L.down_tab = dev + 2 * ne;
    cached_[l].tab_dev = dev;
  }
  if (cached()) TS_TRY(init_expert_cache());
  CUDA_TRY(cudaMallocHost(&h_tokens_, c * 4));
  CUDA_TRY(cudaMallocHost(&h_pos_, 4));
  CUDA_TRY(cudaMallocHost(&h_ids_, c * k * 4));
  if (cached()) {
    CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&ids_flag_host_), size_t(k + 1) * 4,
                           cudaHostAllocMapped));
    CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ids_flag_dev_), ids_flag_host_, 0));
  }
  CUDA_TRY(cudaMallocHost(&h_slot_hit_, size_t(kGemvMaxTokens) * k * 4));
  TS_ASSIGN(slot_hit_, arena_.alloc_n<int>(size_t(kGemvMaxTokens) * k));
  segment_hits_.resize(size_t(hp.n_layers));
  CUDA_TRY(cudaMallocHost(&h_logits_, size_t(hp.vocab) * 4));
  last_logits_.assign(size_t(hp.vocab), 0.0f);
  iv_ = std::move(opt_.interventions);
  iv_.steer.resize(size_t(hp.n_layers));
  capture_index_.assign(size_t(hp.n_layers) + 1, -1);
  for (int l : iv_.capture_layers) {
    if (l < -1 || l >= hp.n_layers) return make_error("capture layer out of range");
    capture_index_[size_t(l + 1)] = int(captures_.size());
    captures_.emplace_back();
  }
  return {};
}

std::vector<uint64_t> CudaSession::router_hist() const {
  std::vector<uint64_t> out(size_t(hp_.n_layers) * size_t(std::max(1, hp_.n_experts)));
  if (cudaMemcpy(out.data(), hist_, out.size() * 8, cudaMemcpyDeviceToHost) != cudaSuccess)
    std::fill(out.begin(), out.end(), 0);
  if (hp_.n_experts == 0) out.clear();
  return out;
}

CudaBenchInfo CudaSession::info() const {
  CudaBenchInfo b;
  uint64_t bytes = w_.lm_head.n_bytes() + w_.embed.row_bytes();
  for (const DevLayer& L : w_.layers) {
    bytes += L.wq.n_bytes() + L.wk.n_bytes() + L.wv.n_bytes() + L.wo.n_bytes();
    bytes += mlp_bytes(L.dense) + mlp_bytes(L.shared) + L.shared_gate.n_bytes() + L.router.n_bytes();
    if (L.is_moe) bytes += uint64_t(hp_.top_k) * mlp_bytes(L.experts[0]);
  }
  b.decode_weight_bytes = bytes;
  b.kv_bytes_per_position = 2ull * uint64_t(hp_.n_layers) * uint64_t(hp_.kv_dim()) * 4;
  b.device_bytes = arena_.bytes();
  for (const DevLayer& L : w_.layers)
    if (L.is_moe) {
      ++b.moe_layers;
      b.expert_bytes = mlp_bytes(L.experts[0]);
    }
  b.graphs = use_graphs_ && !cached() && iv_.capture_layers.empty() && !iv_.trace_router;
  return b;
}

// ---------------------------------------------------------------- GPU expert cache
//
// --residency host|streamed on CUDA. The dense weights are resident; every MoE layer has a
// fixed number of device slots for its experts, managed by experts::SlotCache (LRU or LFU,
// and a protect set: the experts the current step reads are never evicted). After the router
// kernel the host reads back only the selected ids, binds every selected expert to a device
// address — its slot on a hit; on a miss a slot by policy, or a staging buffer when every slot
// is protected — and copies the misses on the copy stream; the compute stream waits on an
// event. The kernels are the resident ones reading the same bytes at other addresses, so the
// logits are byte-identical to resident mode for any cache size.

void CudaSession::set_expert_layout(DevLayer& D, DType gate_t, DType down_t, int64_t d_expert,
                                    int64_t d_model) {
  const DevMatrix g{nullptr, gate_t, d_expert, d_model}, dn{nullptr, down_t, d_model, d_expert};
  D.up_off = align256(g.n_bytes());
  D.down_off = 2 * D.up_off;
  D.expert_bytes = D.down_off + align256(dn.n_bytes());
  D.experts.assign(size_t(hp_.n_experts), DevMlp{g, g, dn});
}

// Where a layer's experts are built at load: in GPU memory for good (resident; the views
// point there), in a reused device buffer that finish_expert_layer moves to pinned host
// memory (host), or nowhere (streamed: they stay in the files).
Result<uint8_t*> CudaSession::expert_layer_memory(DevLayer& D) {
  const size_t bytes = D.expert_bytes * size_t(hp_.n_experts);
  if (streamed()) return static_cast<uint8_t*>(nullptr);
  if (cached()) {
    if (bytes > layer_tmp_bytes_) {
      free_layer_memory();
      CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&layer_tmp_), bytes));
      layer_tmp_bytes_ = bytes;
    }
    return layer_tmp_;
  }
  TS_ASSIGN(void* p, arena_.alloc(bytes));
  uint8_t* base = static_cast<uint8_t*>(p);
  for (size_t e = 0; e < D.experts.size(); ++e) {
    DevMlp& m = D.experts[e];
    m.gate.data = base + e * D.expert_bytes;
    m.up.data = base + e * D.expert_bytes + D.up_off;
    m.down.data = base + e * D.expert_bytes + D.down_off;
  }
  return base;
}

Status CudaSession::finish_expert_layer(int layer, const uint8_t* built) {
  if (!cached() || streamed()) return {};
  const size_t bytes = w_.layers[size_t(layer)].expert_bytes * size_t(hp_.n_experts);
  CachedLayer& C = cached_[size_t(layer)];
  const cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(&C.host), bytes, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    cudaGetLastError();
    C.host = nullptr;
    return make_error("--residency host: cannot pin " + std::to_string(gib(bytes)) +
                      " GiB of host memory for layer " + std::to_string(layer) + "'s experts (" +
                      cudaGetErrorString(e) + ")");
  }
  CUDA_TRY(cudaStreamSynchronize(stream_));
  CUDA_TRY(cudaMemcpy(C.host, built, bytes, cudaMemcpyDeviceToHost));
  return {};
}

void CudaSession::free_layer_memory() {
  if (layer_tmp_) cudaFree(layer_tmp_);
  layer_tmp_ = nullptr;
  layer_tmp_bytes_ = 0;
}

Status CudaSession::init_expert_cache() {
  const runtime::GpuExpertOptions& go = opt_.gpu_experts;
  size_t expert_bytes = 0;
  int moe_layers = 0;
  for (const DevLayer& L : w_.layers)
    if (L.is_moe) {
      ++moe_layers;
      expert_bytes = std::max(expert_bytes, L.expert_bytes);
    }
  if (moe_layers == 0) return {};
  CUDA_TRY(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  CUDA_TRY(cudaEventCreateWithFlags(&loaded_, cudaEventDisableTiming));
  CUDA_TRY(cudaEventCreateWithFlags(&gate_up_loaded_, cudaEventDisableTiming));
  // Staging: every distinct expert of a GEMV-sized chunk (up to kGemvMaxTokens tokens), at
  // least two for the prefill ring.
  const int n_staging =
      std::max(2, std::min(hp_.n_experts, kGemvMaxTokens * std::max(1, hp_.top_k)));
  for (int i = 0; i < n_staging; ++i) {
    TS_ASSIGN(void* p, arena_.alloc(expert_bytes));
    staging_.push_back(static_cast<uint8_t*>(p));
    cudaEvent_t ev = nullptr;
    CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    staging_free_.push_back(ev);
  }
  if (go.layer_prefetch && !streamed() &&
      int64_t(chunk_) * hp_.top_k >= 2 * int64_t(hp_.n_experts)) {
    for (int b = 0; b < 2; ++b) {
      TS_ASSIGN(void* p, arena_.alloc(expert_bytes * size_t(hp_.n_experts)));
      pf_buf_[b] = static_cast<uint8_t*>(p);
      CUDA_TRY(cudaEventCreateWithFlags(&pf_ready_[b], cudaEventDisableTiming));
      CUDA_TRY(cudaEventCreateWithFlags(&pf_free_[b], cudaEventDisableTiming));
    }
  }
  const double per_slot_row = double(expert_bytes) * moe_layers;  // one slot in every layer
  int slots = go.slots_per_layer;
  if (slots == 0 && go.cache_gb > 0) {
    slots = int(go.cache_gb * 1e9 / per_slot_row);
    if (slots < 1)
      return make_error("--gpu-expert-cache-gb " + std::to_string(go.cache_gb) +
                        " holds less than one expert per MoE layer (one slot in each of the " +
                        std::to_string(moe_layers) + " layers takes " +
                        std::to_string(per_slot_row / 1e9) + " GB)");
  }
  if (slots == 0) {
    // All that fits, keeping 1 GiB free.
    size_t free_b = 0, total_b = 0;
    CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
    const double room = double(free_b) - double(1ull << 30);
    slots = room > per_slot_row ? int(room / per_slot_row) : 1;
  }
  slots_per_layer_ = std::min(slots, hp_.n_experts);
  const size_t ne = size_t(hp_.n_experts);
  for (size_t l = 0; l < w_.layers.size(); ++l) {
    if (!w_.layers[l].is_moe) continue;
    CachedLayer& C = cached_[l];
    C.cache = std::make_unique<experts::SlotCache>(slots_per_layer_, hp_.n_experts, go.policy);
    TS_ASSIGN(void* p, arena_.alloc(size_t(slots_per_layer_) * w_.layers[l].expert_bytes));
    C.slots = static_cast<uint8_t*>(p);
    CUDA_TRY(cudaMallocHost(reinterpret_cast<void**>(&C.tab_host), 3 * ne * sizeof(void*)));
    std::fill_n(C.tab_host, 3 * ne, nullptr);
    CUDA_TRY(cudaEventCreate(&C.copy_begin));
    CUDA_TRY(cudaEventCreate(&C.copy_end));
  }
  if (streamed()) {
    // The store's reader threads read into its slots; pinned, the copies from them are true
    // async DMA at the link's rate. Another session may have pinned them already (then they
    // stay as they are); without pinning the copies still work, staged by the driver.
    for (std::span<uint8_t> m : store_->slot_memory()) {
      if (cudaHostRegister(m.data(), m.size(), cudaHostRegisterDefault) == cudaSuccess)
        pinned_store_.push_back(m.data());
      else
        cudaGetLastError();
    }
  }
  cache_report_.residency = streamed() ? "streamed" : "host";
  cache_report_.slots_per_layer = slots_per_layer_;
  return warm_expert_cache();
}

// --cache-warm: each layer's slots filled with its most selected experts (ties: lower id).
// Not counted in the cache's statistics.
Status CudaSession::warm_expert_cache() {
  const auto& warm = opt_.gpu_experts.warm;
  if (warm.empty()) return {};
  const runtime::ExpertCacheReport before = cache_report_;
  for (size_t l = 0; l < w_.layers.size() && l < warm.size(); ++l) {
    CachedLayer& C = cached_[l];
    if (!C.cache || warm[l].empty()) continue;
    const std::vector<int> order = experts::most_selected(warm[l], slots_per_layer_);
    experts::SlotCache::Plan plan;
    if (!C.cache->plan(order, &plan)) return make_error("internal: warm plan");
    std::vector<int> ids;
    std::vector<uint8_t*> dst;
    for (int i : plan.miss) {
      ids.push_back(order[size_t(i)]);
      dst.push_back(C.slots + size_t(plan.slot[size_t(i)]) * w_.layers[l].expert_bytes);
      point_expert(int(l), ids.back(), dst.back());
    }
    TS_TRY(copy_experts(int(l), ids, dst));
    TS_TRY(sync_expert_table(int(l)));
    C.cache->unprotect_all();
  }
  CUDA_TRY(cudaStreamSynchronize(copy_stream_));
  CUDA_TRY(cudaStreamSynchronize(stream_));
  for (CachedLayer& C : cached_) C.copies_timed = false;
  cache_report_ = before;
  return {};
}

void CudaSession::point_expert(int layer, int e, uint8_t* at) {
  DevLayer& D = w_.layers[size_t(layer)];
  DevMlp& m = D.experts[size_t(e)];
  m.gate.data = at;
  m.up.data = at + D.up_off;
  m.down.data = at + D.down_off;
  const size_t ne = size_t(hp_.n_experts);
  const void** tab = cached_[size_t(layer)].tab_host;
  tab[size_t(e)] = m.gate.data;
  tab[ne + size_t(e)] = m.up.data;
  tab[2 * ne + size_t(e)] = m.down.data;
  cached_[size_t(layer)].table_stale = true;
}

// Expert ids[i] of `layer` copied to dst[i] on the copy stream: from pinned host memory, or
// read by the ExpertStore's reader threads (pread, O_DIRECT with --direct-io) and copied
// from its slots.
Status CudaSession::copy_experts(int layer, std::span<const int> ids,
                                 std::span<uint8_t* const> dst) {
  if (ids.empty()) return {};
  CachedLayer& C = cached_[size_t(layer)];
  const DevLayer& D = w_.layers[size_t(layer)];
  TS_TRY(start_copy_timer(C));
  if (C.host) {
    for (size_t i = 0; i < ids.size(); ++i)
      CUDA_TRY(cudaMemcpyAsync(dst[i], C.host + size_t(ids[i]) * D.expert_bytes,
                               D.expert_bytes, cudaMemcpyHostToDevice, copy_stream_));
    cache_report_.copied_bytes += uint64_t(ids.size()) * D.expert_bytes;
  } else {
    const size_t batch = size_t(std::max(1, store_->max_batch(layer)));
    std::vector<model::ExpertWeights> views;
    for (size_t i0 = 0; i0 < ids.size(); i0 += batch) {
      const size_t nb = std::min(batch, ids.size() - i0);
      views.resize(nb);
      TS_TRY(store_->acquire(layer, ids.subspan(i0, nb), views));
      for (size_t j = 0; j < nb; ++j) {
        const DevMlp& shape = D.experts[size_t(ids[i0 + j])];
        const std::pair<const model::Matrix*, std::pair<size_t, size_t>> parts[3] = {
            {&views[j].gate, {0, shape.gate.n_bytes()}},
            {&views[j].up, {D.up_off, shape.up.n_bytes()}},
            {&views[j].down, {D.down_off, shape.down.n_bytes()}}};
        for (const auto& [m, at] : parts) {
          CUDA_TRY(cudaMemcpyAsync(dst[i0 + j] + at.first, m->data, at.second,
                                   cudaMemcpyHostToDevice, copy_stream_));
          cache_report_.copied_bytes += at.second;
        }
      }
      // The store's slots are reused by its next acquire.
      CUDA_TRY(cudaStreamSynchronize(copy_stream_));
      store_->release(layer);
    }
  }
  CUDA_TRY(cudaEventRecord(C.copy_end, copy_stream_));
  return {};
}

// The first copy of a layer in this forward records when the copy stream starts on it.
Status CudaSession::start_copy_timer(CachedLayer& C) {
  if (C.copies_timed) return {};
  CUDA_TRY(cudaEventRecord(C.copy_begin, copy_stream_));
  C.copies_timed = true;
  return {};
}

// A binding's copies, in the order its kernels need them: every miss but the last whole,
// the last one's gate|up part, gate_up_loaded_ (phase 1 may run), the last one's down part,
// loaded_ (phase 2 may run). Phase 1 of the misses so runs under that last down part; one
// split copy only, since each extra transfer cost ~3 us of copy rate, as much as splitting
// every expert gained (docs/PERF.md). From the files (reader threads fill whole experts)
// both events follow all the copies.
Status CudaSession::copy_misses(int layer, std::span<const int> ids,
                                std::span<uint8_t* const> dst) {
  CachedLayer& C = cached_[size_t(layer)];
  const DevLayer& D = w_.layers[size_t(layer)];
  if (!C.host || ids.empty()) {
    TS_TRY(copy_experts(layer, ids, dst));
    CUDA_TRY(cudaEventRecord(gate_up_loaded_, copy_stream_));
    CUDA_TRY(cudaEventRecord(loaded_, copy_stream_));
    return {};
  }
  TS_TRY(start_copy_timer(C));
  // One batch: every miss but the last whole, and the last one's gate|up part ([0, down_off)
  // of an expert's bytes). One call costs the copy engine less than a transfer per expert
  // (docs/PERF.md: 53.6 vs 52.6 GB/s while copying).
  const size_t last = ids.size() - 1;
  batch_dst_.resize(ids.size());
  batch_src_.resize(ids.size());
  batch_bytes_.resize(ids.size());
  for (size_t i = 0; i <= last; ++i) {
    batch_dst_[i] = dst[i];
    batch_src_[i] = C.host + size_t(ids[i]) * D.expert_bytes;
    batch_bytes_[i] = i < last ? D.expert_bytes : D.down_off;
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t attr_first = 0;
  CUDA_TRY(cudaMemcpyBatchAsync(batch_dst_.data(), batch_src_.data(), batch_bytes_.data(),
                                ids.size(), &attr, &attr_first, 1, copy_stream_));
  CUDA_TRY(cudaEventRecord(gate_up_loaded_, copy_stream_));
  const uint8_t* src = C.host + size_t(ids[last]) * D.expert_bytes;
  CUDA_TRY(cudaMemcpyAsync(dst[last] + D.down_off, src + D.down_off, D.expert_bytes - D.down_off,
                           cudaMemcpyHostToDevice, copy_stream_));
  cache_report_.copied_bytes += uint64_t(ids.size()) * D.expert_bytes;
  CUDA_TRY(cudaEventRecord(C.copy_end, copy_stream_));
  CUDA_TRY(cudaEventRecord(loaded_, copy_stream_));
  return {};
}

// The device table of `layer` from its host mirror, on the copy stream.
Status CudaSession::upload_table(int layer) {
  CachedLayer& C = cached_[size_t(layer)];
  CUDA_TRY(cudaMemcpyAsync(C.tab_dev, C.tab_host, 3 * size_t(hp_.n_experts) * sizeof(void*),
                           cudaMemcpyHostToDevice, copy_stream_));
  C.table_stale = false;
  return {};
}

// The device table of `layer` from its host mirror, on the copy stream after the copies; the
// compute stream waits for both.
Status CudaSession::sync_expert_table(int layer, bool wait) {
  TS_TRY(upload_table(layer));
  CUDA_TRY(cudaEventRecord(loaded_, copy_stream_));
  if (wait) CUDA_TRY(cudaStreamWaitEvent(stream_, loaded_, 0));
  return {};
}

// A GEMV-sized step (n <= kGemvMaxTokens): binds every distinct selected expert of `layer`.
Status CudaSession::bind_step(int layer, int n, const MoeArgs* hits) {
  const int k = hp_.top_k;
  if (capturing_segments_) {
    // Decode graph segments (one token): what was captured since the last break runs now; it
    // ends with the router kernel writing the ids to the host and raising the flag. Capture
    // resumes after the binding, for the MoE kernels on.
    *reinterpret_cast<volatile int*>(ids_flag_host_) = 0;
    TS_TRY(end_segment());
    TS_TRY(wait_ids_flag(k));
    if (hits) segment_hits_[size_t(layer)] = *hits;
    TS_TRY(bind_ids(layer, n, hits));
    return begin_segment();
  }
  CUDA_TRY(cudaMemcpyAsync(h_ids_, sel_ids_, size_t(n) * size_t(k) * 4, cudaMemcpyDeviceToHost,
                           stream_));
  CUDA_TRY(cudaStreamSynchronize(stream_));
  return bind_ids(layer, n, hits);
}

Status CudaSession::begin_segment() {
  CUDA_TRY(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  return {};
}

// Ends the capture, keeps the graph and launches it.
Status CudaSession::end_segment() {
  cudaGraph_t g = nullptr;
  CUDA_TRY(cudaStreamEndCapture(stream_, &g));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  if (inst != cudaSuccess) return cuda_error("cudaGraphInstantiate", inst, __FILE__, __LINE__);
  segments_.push_back(exec);
  CUDA_TRY(cudaGraphLaunch(exec, stream_));
  return {};
}

// Binds the ids in h_ids_ (n tokens' top-k, copied from the device and synchronized).
// With `hits` (phase 1's arguments for this step), slot_mask_ marks the slots whose expert
// hit and phase 1 runs for them now, on the compute stream, while the misses are copied; the
// caller's phase 1 then runs the other slots (mask value 0) after the copies.
Status CudaSession::bind_ids(int layer, int n, const MoeArgs* hits) {
  struct Timer {  // host time spent binding, on every return path
    double& ms;
    Clock::time_point t0 = Clock::now();
    ~Timer() { ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }
  } timer{cache_report_.bind_ms};
  const int k = hp_.top_k;
  std::vector<int> ids;  // distinct, in rank order of first use
  for (int i = 0; i < n * k; ++i)
    if (std::find(ids.begin(), ids.end(), h_ids_[i]) == ids.end()) ids.push_back(h_ids_[i]);
  CachedLayer& C = cached_[size_t(layer)];
  const DevLayer& D = w_.layers[size_t(layer)];
  const bool fresh_table = !C.table_stale;
  // The previous step of this layer is finished: the stream was just synchronized, or (decode
  // segments) this step's router kernel has raised its flag, and it runs after everything
  // before it on the stream has completed (griddepcontrol.wait).
  C.cache->unprotect_all();
  std::vector<bool> hit(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) hit[i] = C.cache->slot_of(ids[i]) >= 0;
  cache_report_.requests += ids.size();
  cache_report_.hits += uint64_t(std::count(hit.begin(), hit.end(), true));
  std::vector<int> miss;
  std::vector<uint8_t*> dst;
  experts::SlotCache::Plan plan;
  if (C.cache->plan(ids, &plan)) {
    for (int i : plan.miss) {
      miss.push_back(ids[size_t(i)]);
      dst.push_back(C.slots + size_t(plan.slot[size_t(i)]) * D.expert_bytes);
    }
  } else {
    // More distinct experts than free slots: hits keep theirs, misses take slots while any
    // are unprotected, then staging buffers.
    for (size_t i = 0; i < ids.size(); ++i)
      if (hit[i]) C.cache->plan(std::span<const int>(&ids[i], 1), &plan);
    size_t staged = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (hit[i]) continue;
      miss.push_back(ids[i]);
      if (C.cache->plan(std::span<const int>(&ids[i], 1), &plan)) {
        dst.push_back(C.slots + size_t(plan.slot[0]) * D.expert_bytes);
      } else {
        if (staged == staging_.size()) return make_error("internal: expert staging exhausted");
        dst.push_back(staging_[staged++]);
      }
    }
  }
  for (size_t i = 0; i < miss.size(); ++i) point_expert(layer, miss[i], dst[i]);
  // Misses make the table stale; so may the expert-grouped prefill, which binds through the
  // host views only. The table goes first, on the copy stream: a few KB ahead of the experts'
  // bytes (after the last gate|up part it cost copy rate; on the compute stream it queued
  // behind the copies on the same copy engine: docs/PERF.md). Nothing stale, nothing copied
  // or recorded: the compute stream's waits on these events (phase 2's is in the decode
  // graph) then find an earlier, finished record.
  const bool stale = C.table_stale;
  if (stale) {
    TS_TRY(upload_table(layer));
    TS_TRY(copy_misses(layer, miss, dst));
  }
  // Early phase 1 needs the hits' device table entries to be current: not after a grouped
  // prefill left the table stale.
  const bool early = hits && fresh_table && !miss.empty() && miss.size() < ids.size();
  if (early || (hits && slot_hit_set_)) {
    // The mask: this step's hits, or all zero again (copied only when it changes; the
    // previous copy from this buffer, in an earlier layer's binding, is done: see above).
    const int rows = early ? n * k : kGemvMaxTokens * k;
    for (int s = 0; s < rows; ++s)
      h_slot_hit_[s] = early && hit[size_t(std::find(ids.begin(), ids.end(), h_ids_[s]) - ids.begin())];
    CUDA_TRY(cudaMemcpyAsync(slot_hit_, h_slot_hit_, size_t(rows) * 4, cudaMemcpyHostToDevice,
                             stream_));
    slot_hit_set_ = early;
  }
  if (!stale) return {};
  if (early) {
    // The hits' table entries and slots are not touched by the copies (the table copy
    // rewrites their entries with the same addresses, possibly while this runs).
    MoeArgs a = *hits;
    a.mask_value = 1;
    moe_gate_up(a, stream_);
  }
  CUDA_TRY(cudaStreamWaitEvent(stream_, gate_up_loaded_, 0));
  return {};
}

// Whole-layer prefetch pays when a chunk is expected to use most experts: n * top_k
// selections of n_experts reach ~86% of them at twice as many selections as experts.
bool CudaSession::prefetch_applies(int n) const {
  return cached() && pf_buf_[0] && n > kGemvMaxTokens &&
         int64_t(n) * hp_.top_k >= 2 * int64_t(hp_.n_experts);
}

// Copies every expert of `layer` that its cache does not hold into the next layer buffer,
// once the layer that used that buffer last is done with it. Consecutive experts go as one
// copy (the host image and the buffer share the layout).
Status CudaSession::prefetch_layer(int layer) {
  if (layer < 0 || pf_layer_[0] == layer || pf_layer_[1] == layer) return {};
  const int b = pf_turn_;
  pf_turn_ ^= 1;
  if (pf_layer_[b] >= 0) return make_error("internal: prefetch buffer still bound");
  CachedLayer& C = cached_[size_t(layer)];
  const size_t eb = w_.layers[size_t(layer)].expert_bytes;
  CUDA_TRY(cudaStreamWaitEvent(copy_stream_, pf_free_[b], 0));
  TS_TRY(start_copy_timer(C));
  for (int e = 0; e < hp_.n_experts;) {
    if (C.cache->slot_of(e) >= 0) {
      ++e;
      continue;
    }
    int end = e + 1;
    while (end < hp_.n_experts && C.cache->slot_of(end) < 0) ++end;
    CUDA_TRY(cudaMemcpyAsync(pf_buf_[b] + size_t(e) * eb, C.host + size_t(e) * eb,
                             size_t(end - e) * eb, cudaMemcpyHostToDevice, copy_stream_));
    cache_report_.copied_bytes += uint64_t(end - e) * eb;
    e = end;
  }
  CUDA_TRY(cudaEventRecord(C.copy_end, copy_stream_));
  CUDA_TRY(cudaEventRecord(pf_ready_[b], copy_stream_));
  pf_layer_[b] = layer;
  return {};
}

void CudaSession::collect_copy_times() {
  for (CachedLayer& C : cached_) {
    if (!C.copies_timed) continue;
    float ms = 0;
    if (cudaEventElapsedTime(&ms, C.copy_begin, C.copy_end) == cudaSuccess)
      cache_report_.copy_ms += ms;
    C.copies_timed = false;
  }
}

std::optional<runtime::ExpertCacheReport> CudaSession::expert_cache() const {
  if (!cached()) return std::nullopt;
  return cache_report_;
}

// ---------------------------------------------------------------- forward

Status CudaSession::forward(std::span<const int> tokens, std::vector<float>* all_logits) {
  CUDA_TRY(cudaSetDevice(device_));  // the calling thread may not be the one that built us
  if (tokens.empty()) return make_error("the token list is empty");
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= hp_.vocab)
      return make_error("token id " + std::to_string(tokens[i]) + " at index " +
                        std::to_string(i) + " is outside the vocabulary [0, " +
                        std::to_string(hp_.vocab) + ")");
  if (pos_ + int64_t(tokens.size()) > n_ctx_)
    return make_error("context overflow: " + std::to_string(pos_) + " + " +
                      std::to_string(tokens.size()) + " tokens exceed n_ctx = " +
                      std::to_string(n_ctx_));
  if (all_logits) all_logits->assign(tokens.size() * size_t(hp_.vocab), 0.0f);
  const auto t0 = Clock::now();
  for (size_t b = 0; b < tokens.size(); b += size_t(chunk_)) {
    const int pos0 = pos_;
    const bool last_chunk = b + size_t(chunk_) >= tokens.size();
    const int n = int(std::min(tokens.size() - b, size_t(chunk_)));
    Status st = forward_chunk(tokens.data() + b, n,
                              all_logits ? all_logits->data() + b * size_t(hp_.vocab) : nullptr,
                              last_chunk);
    if (!st.ok()) {
      pos_ = pos0;
      return st;
    }
  }
  phases_.total_us += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  return {};
}

bool CudaSession::segments_eligible() const {
  if (!use_graphs_ || prof_.on() || iv_.trace_router || !iv_.capture_layers.empty()) return false;
  for (const auto& ops : iv_.steer)
    if (!ops.empty()) return false;
  return true;
}

// A decode step with the GPU expert cache. The first one runs under capture, broken into
// segments at each MoE layer's binding (bind_step); later ones replay the segments, binding
// between them. Capture needs the same launches every step: the attention split count is
// fixed for the whole context, as for the single decode graph.
Status CudaSession::decode_segments() {
  if (segments_.empty()) {
    graph_splits_ = attention_splits(1, n_ctx_);
    capturing_segments_ = true;
    Status st = [&]() -> Status {
      TS_TRY(begin_segment());
      CUDA_TRY(cudaMemcpyAsync(tokens_, h_tokens_, 4, cudaMemcpyHostToDevice, stream_));
      CUDA_TRY(cudaMemcpyAsync(pos_dev_, h_pos_, 4, cudaMemcpyHostToDevice, stream_));
      TS_TRY(run_layers(1, false, true));
      CUDA_TRY(cudaMemcpyAsync(h_logits_, logits_, size_t(hp_.vocab) * 4, cudaMemcpyDeviceToHost,
                               stream_));
      return end_segment();
    }();
    capturing_segments_ = false;
    if (!st.ok()) {
      // Leave no capture open and no partial set of segments.
      cudaGraph_t g = nullptr;
      if (cudaStreamEndCapture(stream_, &g) == cudaSuccess && g) cudaGraphDestroy(g);
      cudaGetLastError();
      for (cudaGraphExec_t e : segments_) cudaGraphExecDestroy(e);
      segments_.clear();
      return st;
    }
    segment_layers_.clear();
    for (int l = 0; l < hp_.n_layers; ++l)
      if (w_.layers[size_t(l)].is_moe) segment_layers_.push_back(l);
    return {};
  }
  for (size_t i = 0; i < segments_.size(); ++i) {
    const bool binds = i < segment_layers_.size();
    if (binds) *reinterpret_cast<volatile int*>(ids_flag_host_) = 0;
    CUDA_TRY(cudaGraphLaunch(segments_[i], stream_));
    if (!binds) break;
    TS_TRY(wait_ids_flag(hp_.top_k));
    TS_TRY(bind_ids(segment_layers_[i], 1, &segment_hits_[size_t(segment_layers_[i])]));
  }
  return {};
}

// Spins until the segment's router kernel has raised the flag, then copies its k ids to
// h_ids_. Never hangs: the stream is polled, and an idle or failed stream without the flag is
// an error.
Status CudaSession::wait_ids_flag(int k) {
  volatile int* flag = ids_flag_host_;
  for (uint64_t spin = 1; *flag == 0; ++spin) {
    if (spin % 1024 != 0) continue;
    const cudaError_t q = cudaStreamQuery(stream_);
    if (q == cudaErrorNotReady) continue;
    if (q != cudaSuccess) return cuda_error("cudaStreamQuery", q, __FILE__, __LINE__);
    if (*flag == 0) return make_error("internal: the router's ids never reached the host");
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  for (int i = 0; i < k; ++i) h_ids_[i] = reinterpret_cast<volatile int*>(ids_flag_host_)[1 + i];
  return {};
}

bool CudaSession::graph_eligible() const {
  // The cache plans on the host between layers: no graph.
  if (!use_graphs_ || cached() || prof_.on() || iv_.trace_router || !iv_.capture_layers.empty()) return false;
  for (const auto& ops : iv_.steer)
    if (!ops.empty()) return false;
  return true;
}

Status CudaSession::forward_chunk(const int* tokens, int n, float* logits_out, bool last_chunk) {
  std::copy_n(tokens, n, h_tokens_);
  *h_pos_ = pos_;
  const bool all_rows = logits_out != nullptr;
  if (n == 1 && !all_rows && cached() && segments_eligible()) {
    TS_TRY(decode_segments());
  } else if (n == 1 && !all_rows && graph_eligible()) {
    // A decode step is the same launches every time (the position is read on the device):
    // capture it once, replay it after.
    if (!graph_) {
      graph_splits_ = attention_splits(1, n_ctx_);
      cudaGraph_t g = nullptr;
      CUDA_TRY(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      Status st = [&]() -> Status {
        CUDA_TRY(cudaMemcpyAsync(tokens_, h_tokens_, 4, cudaMemcpyHostToDevice, stream_));
        CUDA_TRY(cudaMemcpyAsync(pos_dev_, h_pos_, 4, cudaMemcpyHostToDevice, stream_));
        TS_TRY(run_layers(1, false, true));
        CUDA_TRY(cudaMemcpyAsync(h_logits_, logits_, size_t(hp_.vocab) * 4,
                                 cudaMemcpyDeviceToHost, stream_));
        return {};
      }();
      const cudaError_t end = cudaStreamEndCapture(stream_, &g);
      TS_TRY(st);
      if (end != cudaSuccess) return cuda_error("cudaStreamEndCapture", end, __FILE__, __LINE__);
      const cudaError_t inst = cudaGraphInstantiate(&graph_, g, 0);
      cudaGraphDestroy(g);
      if (inst != cudaSuccess) return cuda_error("cudaGraphInstantiate", inst, __FILE__, __LINE__);
    }
    CUDA_TRY(cudaGraphLaunch(graph_, stream_));
  } else {
    CUDA_TRY(cudaMemcpyAsync(tokens_, h_tokens_, size_t(n) * 4, cudaMemcpyHostToDevice, stream_));
    CUDA_TRY(cudaMemcpyAsync(pos_dev_, h_pos_, 4, cudaMemcpyHostToDevice, stream_));
    TS_TRY(run_layers(n, all_rows, last_chunk));
    const float* last = logits_ + (all_rows ? size_t(n - 1) * size_t(hp_.vocab) : 0);
    CUDA_TRY(cudaMemcpyAsync(h_logits_, last, size_t(hp_.vocab) * 4, cudaMemcpyDeviceToHost,
                             stream_));
    if (all_rows)
      CUDA_TRY(cudaMemcpyAsync(logits_out, logits_, size_t(n) * size_t(hp_.vocab) * 4,
                               cudaMemcpyDeviceToHost, stream_));
  }
  CUDA_TRY(cudaStreamSynchronize(stream_));
  CUDA_TRY(cudaGetLastError());
  prof_.collect();
  if (cached()) collect_copy_times();
  std::copy_n(h_logits_, hp_.vocab, last_logits_.data());
  pos_ += n;
  int moe_layers = 0;
  for (const DevLayer& L : w_.layers) moe_layers += L.is_moe;
  phases_.expert_requests += uint64_t(n) * uint64_t(hp_.top_k) * uint64_t(moe_layers);
  return {};
}

Status CudaSession::run_layers(int n, bool all_rows, bool last_chunk) {
  const size_t d = size_t(hp_.d_model);
  TS_TRY(prof_.time("embed", double(n) * double(w_.embed.row_bytes()), stream_,
                    [&] { return launch([&] { embed_rows(w_.embed, tokens_, n, x_, stream_); }); }));
  TS_TRY(layer_boundary(-1, n, last_chunk));
  const bool prefetch = prefetch_applies(n);
  pf_layer_[0] = pf_layer_[1] = -1;  // nothing survives a chunk that failed part way
  auto next_moe = [&](int l) {
    for (int j = l + 1; j < hp_.n_layers; ++j)
      if (w_.layers[size_t(j)].is_moe) return j;
    return -1;
  };
  // The next MoE layer's experts load while this layer computes. Routing that concentrates
  // on few experts makes a whole-layer copy mostly waste: the next layer is prefetched only
  // while the last grouped layer used half its experts.
  auto prefetch_after = [&](int l) {
    return prefetch && used_fraction_ >= 0.5 ? prefetch_layer(next_moe(l)) : Status{};
  };
  TS_TRY(prefetch_after(-1));
  for (int l = 0; l < hp_.n_layers; ++l) {
    TS_TRY(prefetch_after(l));
    TS_TRY(attention_block(l, n));
    const DevLayer& L = w_.layers[size_t(l)];
    if (L.is_moe) {
      TS_TRY(moe_block(l, n));
    } else {
      rmsnorm(x_, L.ffn_norm, xn_, n, int(d), hp_.rms_eps, stream_);
      TS_TRY(prof_.time("dense mlp", double(mlp_bytes(L.dense)), stream_,
                        [&] { return dense_mlp(L.dense, n, hp_.d_ff, tmp_); }));
      add_inplace(x_, tmp_, int64_t(n) * int64_t(d), stream_);
    }
    TS_TRY(layer_boundary(l, n, last_chunk));
  }
  rmsnorm(x_, w_.final_norm, xn_, n, int(d), hp_.rms_eps, stream_);
  return prof_.time("lm head", double(w_.lm_head.n_bytes()), stream_, [&] {
    if (all_rows) return linear(w_.lm_head, xn_, n, logits_);
    return linear(w_.lm_head, xn_ + size_t(n - 1) * d, 1, logits_);
  });
}

Status CudaSession::layer_boundary(int layer, int n, bool last_chunk) {
  const size_t d = size_t(hp_.d_model);
  const bool steer = layer >= 0 && !iv_.steer[size_t(layer)].empty();
  const int c = capture_index_[size_t(layer + 1)];
  if (!steer && c < 0) return {};
  // Steering and capture run the CPU's definitions on the downloaded rows (apply_steer), so
  // both backends intervene at the same point with the same arithmetic.
  host_rows_.resize(size_t(n) * d);
  CUDA_TRY(cudaMemcpyAsync(host_rows_.data(), x_, host_rows_.size() * 4, cudaMemcpyDeviceToHost,
                           stream_));
  CUDA_TRY(cudaStreamSynchronize(stream_));
  if (steer) {
    for (const runtime::SteerOp& op : iv_.steer[size_t(layer)])
      for (int t = 0; t < n; ++t) runtime::apply_steer(op, host_rows_.data() + size_t(t) * d, int64_t(d));
    CUDA_TRY(cudaMemcpyAsync(x_, host_rows_.data(), host_rows_.size() * 4, cudaMemcpyHostToDevice,
                             stream_));
    CUDA_TRY(cudaStreamSynchronize(stream_));
  }
  if (c >= 0) {
    std::vector<float>& cap = captures_[size_t(c)];
    if (!iv_.capture_last) cap.insert(cap.end(), host_rows_.begin(), host_rows_.end());
    else if (last_chunk) cap.insert(cap.end(), host_rows_.end() - long(d), host_rows_.end());
  }
  return {};
}

int CudaSession::attention_splits(int n, int max_keys) const {
  // Enough blocks to fill the GPU without splits of under 32 keys: ~4 per SM on 132 SMs
  // for a block per query head, ~2 for a block per KV head (it scores its whole group).
  const bool gqa = gqa_attention_applies(hp_.n_heads, hp_.n_kv_heads, hp_.head_dim);
  const int per_split = (gqa ? hp_.n_kv_heads : hp_.n_heads) * n, target = gqa ? 264 : 528;
  const int want = (target + per_split - 1) / per_split;
  int splits = std::clamp(want, 1, std::max(1, (max_keys + 31) / 32));
  splits = std::min(splits, std::max(1, partial_rows_ / n));
  return splits;
}

Status CudaSession::attention_block(int layer, int n) {
  const DevLayer& L = w_.layers[size_t(layer)];
  const int d = hp_.d_model, qd = hp_.q_dim(), kvd = hp_.kv_dim();
  const bool qkv_gemv =
      n <= kGemvMaxTokens && L.wk.dtype == L.wq.dtype && L.wv.dtype == L.wq.dtype;
  // The norm also writes the Q8 copy the q|k|v GEMV reads.
  const bool qkv_q8 = qkv_gemv && q8_activations(L.wq.dtype, L.wq.cols);
  TS_TRY(prof_.time("rmsnorm", double(n) * d * 8, stream_, [&] {
    return launch([&] {
      rmsnorm(x_, L.attn_norm, xn_, n, d, hp_.rms_eps, stream_, qkv_q8 ? qx_ : QAct{});
    });
  }));
  TS_TRY(prof_.time("qkv", double(L.wq.n_bytes() + L.wk.n_bytes() + L.wv.n_bytes()), stream_,
                    [&]() -> Status {
                      if (qkv_gemv) {
                        const DevMatrix w[3] = {L.wq, L.wk, L.wv};
                        float* const y[3] = {q_, k_, v_};
                        GemvInput in{xn_};
                        if (qkv_q8) in.q = qx_;
                        gemv_parts(w, y, 3, in, n, false, stream_);
                        return {};
                      }
                      TS_TRY(linear(L.wq, xn_, n, q_));
                      TS_TRY(linear(L.wk, xn_, n, k_));
                      return linear(L.wv, xn_, n, v_);
                    }));
  if (L.bq) add_bias(q_, L.bq, n, qd, stream_);
  if (L.bk) add_bias(k_, L.bk, n, kvd, stream_);
  if (L.bv) add_bias(v_, L.bv, n, kvd, stream_);
  switch (hp_.qk_norm) {
    case model::QkNorm::kNone: break;
    case model::QkNorm::kPerHead: break;  // fused into rope_kv_append
    case model::QkNorm::kFullProjection:
      rmsnorm(q_, L.q_norm, q_, n, qd, hp_.rms_eps, stream_);
      rmsnorm(k_, L.k_norm, k_, n, kvd, hp_.rms_eps, stream_);
      break;
  }
  const size_t layer_off = size_t(layer) * size_t(n_ctx_) * size_t(kvd);
  const bool per_head = hp_.qk_norm == model::QkNorm::kPerHead;
  TS_TRY(prof_.time("rope + kv append", double(n) * (qd + 3 * kvd) * 8, stream_, [&] {
    return launch([&] {
      rope_kv_append({.q = q_,
                      .k = k_,
                      .v = v_,
                      .k_cache = k_cache_ + layer_off,
                      .v_cache = v_cache_ + layer_off,
                      .inv_freq = inv_freq_,
                      .pos = pos_dev_,
                      .n = n,
                      .n_heads = hp_.n_heads,
                      .n_kv_heads = hp_.n_kv_heads,
                      .head_dim = hp_.head_dim,
                      .q_norm = per_head ? L.q_norm : nullptr,
                      .k_norm = per_head ? L.k_norm : nullptr,
                      .eps = hp_.rms_eps,
                      .k_bf16 = k_bf16_ ? static_cast<uint16_t*>(k_bf16_) + layer_off : nullptr,
                      .v_bf16 = v_bf16_ ? static_cast<uint16_t*>(v_bf16_) + layer_off : nullptr},
                     stream_);
    });
  }));
  const int splits = n == 1 && graph_splits_ > 0 ? graph_splits_ : attention_splits(n, pos_ + n);
  // A Q8_0 wo reads the attention output as Q8 blocks, written by the attention's merge.
  const bool wo_q8 = n <= kGemvMaxTokens && q8_activations(L.wo.dtype, L.wo.cols);
  const double kv_bytes = 2.0 * double(pos_ + n) * kvd * 4;
  const bool bf16_attention = k_bf16_ && L.wq.dtype != DType::kF32;
  TS_TRY(prof_.time("attention", kv_bytes, stream_, [&] {
    return launch([&] {
      attention(
          {.q = q_,
           .k_cache = k_cache_ + layer_off,
           .v_cache = v_cache_ + layer_off,
           .out = att_,
           .partial = partial_,
           .pos = pos_dev_,
           .n = n,
           .n_heads = hp_.n_heads,
           .n_kv_heads = hp_.n_kv_heads,
           .head_dim = hp_.head_dim,
           .n_splits = splits,
           .tensor_cores = L.wq.dtype != DType::kF32,
           .k_bf16 = bf16_attention ? static_cast<const uint16_t*>(k_bf16_) + layer_off : nullptr,
           .v_bf16 = bf16_attention ? static_cast<const uint16_t*>(v_bf16_) + layer_off : nullptr,
           .out_q = wo_q8 ? qx_ : QAct{}},
          stream_);
    });
  }));
  return prof_.time("wo", double(L.wo.n_bytes()), stream_, [&] {
    return linear(L.wo, att_, n, x_, /*accumulate=*/true, wo_q8 ? &qx_ : nullptr);
  });
}

Status CudaSession::dense_mlp(const DevMlp& mlp, int n, int d_hidden, float* out) {
  TS_TRY(linear(mlp.gate, xn_, n, h1_));
  TS_TRY(linear(mlp.up, xn_, n, h2_));
  silu_mul(h1_, h2_, h1_, int64_t(n) * d_hidden, stream_);
  return linear(mlp.down, h1_, n, out);
}

Status CudaSession::moe_block(int layer, int n) {
  const DevLayer& L = w_.layers[size_t(layer)];
  const int d = hp_.d_model, k = hp_.top_k;
  // The norm also writes the Q8 copy the experts' gate|up GEMVs read (a Q8_0 router's
  // GEMV re-quantizes the same rows to the same bytes).
  const bool experts_q8 = n <= kGemvMaxTokens && q8_activations(L.experts[0].gate.dtype, d);
  TS_TRY(prof_.time("rmsnorm", double(n) * d * 8, stream_, [&] {
    return launch([&] {
      rmsnorm(x_, L.ffn_norm, xn_, n, d, hp_.rms_eps, stream_, experts_q8 ? qx_ : QAct{});
    });
  }));
  TS_TRY(prof_.time("router", double(L.router.n_bytes()), stream_,
                    [&] { return linear(L.router, xn_, n, router_); }));
  if (sampled_routing_)
    synthetic_route(router_, L.router_bias, pos_dev_, n, hp_.n_experts,
                    route_seed_ + uint64_t(layer), stream_);
  TS_TRY(prof_.time("top-k", double(n) * hp_.n_experts * 4, stream_, [&] {
    return launch([&] {
      const bool to_host = capturing_segments_;  // decode segments: one token
      route({.logits = router_,
             .ids = sel_ids_,
             .weights = sel_w_,
             .hist = hist_ + size_t(layer) * size_t(hp_.n_experts),
             .n = n,
             .n_experts = hp_.n_experts,
             .top_k = k,
             .renormalize = hp_.moe.renormalize,
             .host_ids = to_host ? ids_flag_dev_ + 1 : nullptr,
             .host_flag = to_host ? ids_flag_dev_ : nullptr},
            stream_);
    });
  }));
  if (iv_.trace_router) {
    std::vector<int> ids(size_t(n) * size_t(k));
    std::vector<float> wts(ids.size());
    CUDA_TRY(cudaMemcpyAsync(ids.data(), sel_ids_, ids.size() * 4, cudaMemcpyDeviceToHost, stream_));
    CUDA_TRY(cudaMemcpyAsync(wts.data(), sel_w_, wts.size() * 4, cudaMemcpyDeviceToHost, stream_));
    CUDA_TRY(cudaStreamSynchronize(stream_));
    for (int t = 0; t < n; ++t)
      trace_.push_back({pos_ + t, layer,
                        std::vector<int>(ids.begin() + long(t) * k, ids.begin() + long(t + 1) * k),
                        std::vector<float>(wts.begin() + long(t) * k, wts.begin() + long(t + 1) * k)});
  }
  if (n <= kGemvMaxTokens) {
    MoeArgs a{.gate = L.gate_tab, .up = L.up_tab, .down = L.down_tab,
                    .gate_dtype = L.experts[0].gate.dtype, .down_dtype = L.experts[0].down.dtype,
                    .ids = sel_ids_, .weights = sel_w_, .xn = xn_, .h = h1_, .out = moe_out_,
                    .n = n, .d_model = d, .d_expert = hp_.d_expert, .top_k = k,
                    // Without a shared expert the sum goes straight onto the residual.
                    .accumulate = !L.shared.gate.present()};
    if (a.accumulate) a.out = x_;
    if (experts_q8) {
      a.xq = qx_.q;
      a.xd = qx_.d;
    }
    if (cached()) {
      // Phase 1 of the slots that hit runs during the binding (bind_ids); below, the rest.
      a.slot_mask = slot_hit_;
      a.mask_value = 0;
      TS_TRY(bind_step(layer, n, &a));
    }
    const double up_bytes = double(n) * k * double(L.experts[0].gate.n_bytes()) * 2;
    const double down_bytes = double(n) * k * double(L.experts[0].down.n_bytes());
    TS_TRY(prof_.time("experts gate|up", up_bytes, stream_,
                      [&] { return launch([&] { moe_gate_up(a, stream_); }); }));
    if (q8_activations(a.down_dtype, hp_.d_expert)) {
      quantize_act(h1_, int64_t(n) * k * hp_.d_expert, qh_, stream_);
      a.hq = qh_.q;
      a.hd = qh_.d;
    }
    if (cached()) {
      // The misses' down parts (bind_ids). Inside a decode graph segment this is an external
      // event wait node: each replay waits for the record its binding made just before.
      CUDA_TRY(cudaStreamWaitEvent(stream_, loaded_,
                                   capturing_segments_ ? cudaEventWaitExternal : 0));
    }
    TS_TRY(prof_.time("experts down+sum", down_bytes, stream_,
                      [&] { return launch([&] { moe_down_sum(a, stream_); }); }));
    if (a.accumulate) return {};
  } else {
    TS_TRY(prof_.time("experts grouped", 0, stream_, [&] { return grouped_experts(layer, n); }));
  }
  const bool shared = L.shared.gate.present();
  if (shared) {
    TS_TRY(prof_.time("shared expert", double(mlp_bytes(L.shared)), stream_,
                      [&] { return dense_mlp(L.shared, n, hp_.d_shared, shared_out_); }));
    if (L.shared_gate.present()) TS_TRY(linear(L.shared_gate, xn_, n, shared_z_));
  }
  TS_TRY(prof_.time("moe residual", double(n) * d * 12, stream_, [&] {
    return launch([&] {
      moe_residual(x_, moe_out_, shared ? shared_out_ : nullptr,
                   shared && L.shared_gate.present() ? shared_z_ : nullptr, n, d, stream_);
    });
  }));
  return {};
}

// Rows per used expert (one 64-row tile) from which a chunk's Q8_0 experts are dequantized
// to BF16 and run through the BF16 grouped kernel: docs/PERF.md measured it faster than the
// Q8_0 kernel from 512-token prompts up (prefill 1.2x at 512 tokens, 1.46x at 4096).
constexpr int kDequantQ8MinRows = 64;

// Prefill: the chunk's (token, rank) slots sorted by expert; each expert used runs its
// three projections as GEMMs over its rows; the slots are then summed in rank order.

Status CudaSession::grouped_experts(int layer, int n) {
  const DevLayer& L = w_.layers[size_t(layer)];
  const int d = hp_.d_model, k = hp_.top_k, de = hp_.d_expert, ns = n * k;
  CUDA_TRY(cudaMemcpyAsync(h_ids_, sel_ids_, size_t(ns) * 4, cudaMemcpyDeviceToHost, stream_));
  CUDA_TRY(cudaStreamSynchronize(stream_));
  std::vector<int> count(size_t(hp_.n_experts) + 1, 0);
  std::vector<int> src(static_cast<size_t>(ns)), row_of(static_cast<size_t>(ns));
  for (int s = 0; s < ns; ++s) ++count[size_t(h_ids_[s]) + 1];
  int used = 0;
  for (int e = 0; e < hp_.n_experts; ++e) used += count[size_t(e) + 1] > 0;
  used_fraction_ = double(used) / double(hp_.n_experts);
  for (int e = 0; e < hp_.n_experts; ++e) count[size_t(e) + 1] += count[size_t(e)];
  std::vector<int> fill(count.begin(), count.end() - 1);
  for (int s = 0; s < ns; ++s) {
    const int at = fill[size_t(h_ids_[s])]++;
    src[size_t(at)] = s / k;
    row_of[size_t(s)] = at;
  }
  CUDA_TRY(cudaMemcpyAsync(group_src_, src.data(), size_t(ns) * 4, cudaMemcpyHostToDevice, stream_));
  CUDA_TRY(cudaMemcpyAsync(group_row_of_, row_of.data(), size_t(ns) * 4, cudaMemcpyHostToDevice,
                           stream_));
  const DType gate_in = gemm_input_type(L.experts[0].gate.dtype);
  const DType down_in = gemm_input_type(L.experts[0].down.dtype);
  const size_t gate_es = gate_in == DType::kF32 ? 4 : 2;
  // Gathered rows: F16/BF16 in act_; F32 in slot_rows_, where each expert's down projection
  // then overwrites its own rows after its gate/up GEMMs have read them (one stream, in
  // order). The down outputs [ns, d_model] always land in slot_rows_.
  //
  // With the GPU expert cache, each used expert is bound before its GEMMs: hits stay in
  // their slots (protected for the whole layer), misses are copied once into a free slot or,
  // when none is left, into the staging ring; the copy stream runs ahead of the GEMMs by up
  // to the ring's length, so loading the next experts overlaps computing this one.
  void* xg = gate_in == DType::kF32 ? static_cast<void*>(slot_rows_) : act_;
  gather_rows(xn_, group_src_, ns, d, xg, gate_in, stream_);
  // BF16 and Q8_0 experts run as two grouped tensor-core launches over tiles of each
  // expert's rows (all experts at once when all are bound together, else expert by expert);
  // other types run three cuBLAS GEMMs per expert.
  const bool tiled = grouped_supports(L.experts[0].gate.dtype, d) &&
                     grouped_supports(L.experts[0].up.dtype, d) &&
                     grouped_supports(L.experts[0].down.dtype, de);
  std::vector<GroupTile> tiles;
  std::vector<int> first_tile(size_t(hp_.n_experts) + 1, 0);
  if (tiled) {
    for (int e = 0; e < hp_.n_experts; ++e) {
      first_tile[size_t(e)] = int(tiles.size());
      for (int off = count[size_t(e)]; off < count[size_t(e) + 1]; off += kGroupTile)
        tiles.push_back({e, off, std::min(kGroupTile, count[size_t(e) + 1] - off)});
    }
    first_tile[size_t(hp_.n_experts)] = int(tiles.size());
    CUDA_TRY(cudaMemcpyAsync(group_tiles_, tiles.data(), tiles.size() * sizeof(GroupTile),
                             cudaMemcpyHostToDevice, stream_));
  }
  // Long chunks with Q8_0 experts run on BF16 copies of them (kDequantQ8MinRows).
  const bool dq = tiled && dq_ && L.experts[0].gate.dtype == DType::kQ8_0 &&
                  L.experts[0].up.dtype == DType::kQ8_0 &&
                  L.experts[0].down.dtype == DType::kQ8_0 &&
                  int64_t(ns) >= int64_t(kDequantQ8MinRows) * used;
  // Phase 1 into h2_ (BF16 [ns, de]), phase 2 into slot_rows_, for tiles [t0, t0 + nt):
  // weights through the tables tab (gate, up, down) or, for one expert's tiles, at direct.
  const auto run_tiles = [&](int t0, int nt, const void** const* tab, const void* const* direct,
                             DType dtype) {
    GroupedArgs a{.tiles = group_tiles_ + t0,
                  .n_tiles = nt,
                  .w0 = tab ? tab[0] : nullptr,
                  .w1 = tab ? tab[1] : nullptr,
                  .direct0 = direct ? direct[0] : nullptr,
                  .direct1 = direct ? direct[1] : nullptr,
                  .dtype = dtype,
                  .x = xg,
                  .n = de,
                  .k = d,
                  .out = h2_};
    grouped_gate_up(a, stream_);
    a = GroupedArgs{.tiles = group_tiles_ + t0,
                    .n_tiles = nt,
                    .w0 = tab ? tab[2] : nullptr,
                    .direct0 = direct ? direct[2] : nullptr,
                    .dtype = dtype,
                    .x = h2_,
                    .n = d,
                    .k = de,
                    .out = slot_rows_};
    grouped_down(a, stream_);
  };
  const void** layer_tab[3] = {L.gate_tab, L.up_tab, L.down_tab};
  const size_t ne = size_t(hp_.n_experts);
  const void** dq_tab[3] = {dq_tab_, dq_tab_ + ne, dq_tab_ + 2 * ne};
  const auto dq_args = [&] {
    Q8Dequant q;
    q.blocks[0] = L.experts[0].gate.rows * L.experts[0].gate.cols / 32;
    q.blocks[1] = L.experts[0].up.rows * L.experts[0].up.cols / 32;
    q.blocks[2] = L.experts[0].down.rows * L.experts[0].down.cols / 32;
    q.dst = dq_;
    for (int m = 0; m < 3; ++m) q.dst_off[m] = dq_off_[m];
    q.dst_stride = dq_expert_bytes_;
    return q;
  };
  float* yg = slot_rows_;
  CachedLayer& C = cached_[size_t(layer)];
  std::vector<bool> hit;
  if (cached()) {
    C.cache->unprotect_all();
    hit.assign(size_t(hp_.n_experts), false);
    experts::SlotCache::Plan plan;
    for (int e = 0; e < hp_.n_experts; ++e) {
      if (count[size_t(e) + 1] == count[size_t(e)]) continue;
      ++cache_report_.requests;
      if (C.cache->slot_of(e) < 0) continue;
      hit[size_t(e)] = true;
      ++cache_report_.hits;
      C.cache->plan(std::span<const int>(&e, 1), &plan);
    }
  }
  size_t ring = 0;
  // A prefetched layer: the misses are already on their way into the layer buffer.
  int pf = -1;
  for (int b = 0; b < 2; ++b)
    if (cached() && pf_layer_[b] == layer) pf = b;
  if (pf >= 0) {
    // Used misses enter the cache as they would without the prefetch (a device-to-device
    // copy into a slot by policy); the rest are read where they landed.
    CUDA_TRY(cudaStreamWaitEvent(stream_, pf_ready_[pf], 0));
    experts::SlotCache::Plan plan;
    for (int e = 0; e < hp_.n_experts; ++e) {
      if (count[size_t(e) + 1] == count[size_t(e)] || hit[size_t(e)]) continue;
      uint8_t* at = pf_buf_[pf] + size_t(e) * L.expert_bytes;
      if (C.cache->plan(std::span<const int>(&e, 1), &plan)) {
        uint8_t* slot = C.slots + size_t(plan.slot[0]) * L.expert_bytes;
        CUDA_TRY(cudaMemcpyAsync(slot, at, L.expert_bytes, cudaMemcpyDeviceToDevice, stream_));
        at = slot;
      }
      point_expert(layer, e, at);
    }
  }
  // Every used expert bound at once (resident, cached, or in the prefetched layer buffer):
  // one pair of launches for all; otherwise expert by expert as each is bound.
  const bool all_at_once = tiled && (!cached() || pf >= 0);
  if (all_at_once) {
    if (cached() && C.table_stale) TS_TRY(sync_expert_table(layer));
    if (!dq) {
      run_tiles(0, int(tiles.size()), layer_tab, nullptr, L.experts[0].gate.dtype);
    } else {
      // Groups of dq_group_ used experts: dequantize, then their tiles (contiguous, since
      // tiles are in expert order); the next group's copies wait for these GEMMs (one stream).
      std::vector<int> ids;
      for (int e = 0; e < hp_.n_experts; ++e)
        if (count[size_t(e) + 1] > count[size_t(e)]) ids.push_back(e);
      CUDA_TRY(
          cudaMemcpyAsync(dq_ids_, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, stream_));
      for (size_t g0 = 0; g0 < ids.size(); g0 += size_t(dq_group_)) {
        const size_t g1 = std::min(ids.size(), g0 + size_t(dq_group_));
        Q8Dequant q = dq_args();
        q.experts = dq_ids_ + g0;
        for (int m = 0; m < 3; ++m) {
          q.src_tab[m] = layer_tab[m];
          q.dst_tab[m] = dq_tab[m];
        }
        q.count = int(g1 - g0);
        dequantize_q8_bf16(q, stream_);
        const int t0 = first_tile[size_t(ids[g0])], t1 = first_tile[size_t(ids[g1 - 1]) + 1];
        run_tiles(t0, t1 - t0, dq_tab, nullptr, DType::kBF16);
      }
    }
  }
  for (int e = 0; e < hp_.n_experts; ++e) {
    const int m = count[size_t(e) + 1] - count[size_t(e)];
    if (m == 0 || all_at_once) continue;
    const int off = count[size_t(e)];
    int staged = -1;
    if (cached() && !hit[size_t(e)] && pf < 0) {
      experts::SlotCache::Plan plan;
      uint8_t* dst = nullptr;
      if (C.cache->plan(std::span<const int>(&e, 1), &plan)) {
        dst = C.slots + size_t(plan.slot[0]) * L.expert_bytes;
      } else {
        staged = int(ring++ % staging_.size());
        dst = staging_[size_t(staged)];
        CUDA_TRY(cudaStreamWaitEvent(copy_stream_, staging_free_[size_t(staged)], 0));
      }
      point_expert(layer, e, dst);
      TS_TRY(copy_experts(layer, std::span<const int>(&e, 1), std::span<uint8_t* const>(&dst, 1)));
      CUDA_TRY(cudaEventRecord(loaded_, copy_stream_));
      CUDA_TRY(cudaStreamWaitEvent(stream_, loaded_, 0));
    }
    const DevMlp& x = L.experts[size_t(e)];
    if (tiled) {
      const int t0 = first_tile[size_t(e)], nt = first_tile[size_t(e) + 1] - t0;
      if (dq) {
        Q8Dequant q = dq_args();
        q.direct[0] = x.gate.data;
        q.direct[1] = x.up.data;
        q.direct[2] = x.down.data;
        dequantize_q8_bf16(q, stream_);
        const void* copy[3];
        for (int m = 0; m < 3; ++m) copy[m] = dq_ + dq_off_[m];
        run_tiles(t0, nt, nullptr, copy, DType::kBF16);
      } else {
        const void* at[3] = {x.gate.data, x.up.data, x.down.data};
        run_tiles(t0, nt, nullptr, at, L.experts[0].gate.dtype);
      }
      if (staged >= 0) CUDA_TRY(cudaEventRecord(staging_free_[size_t(staged)], stream_));
      continue;
    }
    const void* xe = static_cast<const uint8_t*>(xg) + size_t(off) * size_t(d) * gate_es;
    TS_TRY(gemm(x.gate, xe, m, h1_, false));
    TS_TRY(gemm(x.up, xe, m, h2_, false));
    silu_mul(h1_, h2_, h1_, int64_t(m) * de, stream_);
    const void* he = h1_;
    if (down_in != DType::kF32) {
      // h2_ is free again: the activations in the down GEMM's input type.
      convert_f32(h1_, h2_, down_in, int64_t(m) * de, stream_);
      he = h2_;
    }
    TS_TRY(gemm(x.down, he, m, yg + size_t(off) * size_t(d), false));
    if (staged >= 0) CUDA_TRY(cudaEventRecord(staging_free_[size_t(staged)], stream_));
  }
  if (pf >= 0) {
    CUDA_TRY(cudaEventRecord(pf_free_[pf], stream_));
    pf_layer_[pf] = -1;
  }
  slot_sum(yg, group_row_of_, sel_w_, n, k, d, moe_out_, stream_);
  return {};
}

Status CudaSession::init_dequant_scratch() {
  const DevLayer* q8 = nullptr;
  for (const DevLayer& L : w_.layers)
    if (L.is_moe && L.experts[0].gate.dtype == DType::kQ8_0 &&
        L.experts[0].up.dtype == DType::kQ8_0 && L.experts[0].down.dtype == DType::kQ8_0 &&
        grouped_supports(DType::kQ8_0, hp_.d_model) && grouped_supports(DType::kQ8_0, hp_.d_expert))
      q8 = &L;
  if (!q8) return {};
  const DevMlp& x = q8->experts[0];
  size_t at = 0;
  for (int m = 0; m < 3; ++m) {
    const DevMatrix& w = m == 0 ? x.gate : m == 1 ? x.up : x.down;
    dq_off_[m] = at;
    at += (size_t(w.rows * w.cols) * 2 + 255) / 256 * 256;
  }
  dq_expert_bytes_ = at;
  // Up to 1 GiB (and an eighth of what is free), at least one expert.
  size_t free_b = 0, total_b = 0;
  CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  const size_t budget = std::min<size_t>(size_t(1) << 30, free_b / 8);
  dq_group_ = int(std::clamp<size_t>(budget / at, 1, size_t(hp_.n_experts)));
  TS_ASSIGN(void* dq, arena_.alloc(size_t(dq_group_) * at));
  dq_ = static_cast<uint8_t*>(dq);
  TS_ASSIGN(dq_tab_, arena_.alloc_n<const void*>(3 * size_t(hp_.n_experts)));
  TS_ASSIGN(dq_ids_, arena_.alloc_n<int>(size_t(hp_.n_experts)));
  return {};
}

Status CudaSession::linear(const DevMatrix& w, const float* x, int n, float* y, bool accumulate,
                           const QAct* x_q8) {
  if (n <= kGemvMaxTokens) {
    GemvInput in{x};
    if (x_q8) {
      in.q = *x_q8;  // x already quantized by the kernel that wrote it
    } else if (q8_activations(w.dtype, w.cols)) {
      quantize_act(x, int64_t(n) * w.cols, qx_, stream_);
      in.q = qx_;
    }
    gemv_parts(&w, &y, 1, in, n, accumulate, stream_);
    return {};
  }
  const DType in = gemm_input_type(w.dtype);
  if (in == DType::kF32) return gemm(w, x, n, y, accumulate);
  if (size_t(n) * size_t(w.cols) * 2 > act_bytes_)
    return make_error("internal: GEMM input scratch too small");
  convert_f32(x, act_, in, int64_t(n) * w.cols, stream_);
  return gemm(w, act_, n, y, accumulate);
}

Status CudaSession::gemm(const DevMatrix& w, const void* x, int n, float* y, bool accumulate) {
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const int rows = int(w.rows), cols = int(w.cols);
  if (w.dtype == DType::kF32) {
    CUBLAS_TRY(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &one,
                           static_cast<const float*>(w.data), cols, static_cast<const float*>(x),
                           cols, &beta, y, rows));
    return {};
  }
  const void* wd = w.data;
  cudaDataType_t t = w.dtype == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
  if (dtype_is_quantized(w.dtype)) {
    if (size_t(w.rows * w.cols) * 2 > wtmp_bytes_) return make_error("internal: dequant scratch");
    if (w.dtype == DType::kQ8_0) {
      Q8Dequant q;
      q.direct[0] = w.data;
      q.blocks[0] = w.rows * w.cols / 32;
      q.dst = wtmp_;
      dequantize_q8_bf16(q, stream_);
    } else {
      dequantize_bf16(w, wtmp_, stream_);
    }
    wd = wtmp_;
    t = CUDA_R_16BF;
  }
  CUBLAS_TRY(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &one, wd, t, cols, x, t,
                          cols, &beta, y, CUDA_R_32F, rows, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT));
  return {};
}

Result<std::string> open_device(int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0)
    return make_error(std::string("--device cuda: no CUDA device found (") +
                      (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices") + ")");
  if (device < 0 || device >= count)
    return make_error("--device cuda:" + std::to_string(device) + ": there are " +
                      std::to_string(count) + " CUDA device(s), numbered from 0");
  cudaDeviceProp prop{};
  CUDA_TRY(cudaGetDeviceProperties(&prop, device));
  return "cuda:" + std::to_string(device) + " (" + prop.name + ")";
}

}  // namespace

Result<std::unique_ptr<runtime::Engine>> make_cuda_session(const runtime::LoadedModel& model,
                                                           runtime::SessionOptions options,
                                                           int device) {
  TS_ASSIGN(std::string name, open_device(device));
  const bool all_experts = options.gpu_experts.residency == runtime::GpuResidency::kResident;
  auto s = std::make_unique<CudaSession>(model.hp(), std::move(options), device);
  TS_TRY(s->begin(device));
  // Weights first: a model too big for the card fails here with the sizes.
  size_t free_b = 0, total_b = 0;
  CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  // With the GPU expert cache only the dense weights must fit; the cache takes what is left.
  const uint64_t weights = model.counts().dense_bytes +
                           (all_experts ? model.counts().routed_bytes : 0);
  if (weights > free_b)
    return make_error("the model's weights need " + std::to_string(gib(weights)) + " GiB on " +
                      name + ", which has " + std::to_string(gib(free_b)) + " GiB free of " +
                      std::to_string(gib(total_b)) + " GiB");
  TS_TRY(s->upload(model));
  TS_TRY(s->init(name));
  return std::unique_ptr<runtime::Engine>(std::move(s));
}

Result<std::unique_ptr<runtime::Engine>> make_synthetic_cuda_session(
    const model::HParams& hp, runtime::SessionOptions options, int device,
    SyntheticOptions synthetic) {
  TS_ASSIGN(std::string name, open_device(device));
  auto s = std::make_unique<CudaSession>(hp, std::move(options), device);
  TS_TRY(s->begin(device));
  TS_TRY(s->synthesize(synthetic));
  TS_TRY(s->init(name));
  return std::unique_ptr<runtime::Engine>(std::move(s));
}

void set_sampled_routing(runtime::Engine& engine, uint64_t seed) {
  if (auto* s = dynamic_cast<CudaSession*>(&engine)) s->sample_routing(seed);
}

void set_profiling(runtime::Engine& engine, bool on) {
  if (auto* s = dynamic_cast<CudaSession*>(&engine)) s->profiler().enable(on);
}

std::vector<KernelStat> profile_table(const runtime::Engine& engine) {
  auto* s = dynamic_cast<const CudaSession*>(&engine);
  return s ? const_cast<CudaSession*>(s)->profiler().table() : std::vector<KernelStat>{};
}

CudaBenchInfo bench_info(const runtime::Engine& engine) {
  const auto* s = dynamic_cast<const CudaSession*>(&engine);
  return s ? s->info() : CudaBenchInfo{};
}

}  // namespace ts::cuda
