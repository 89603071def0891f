// CudaSession's declaration and the device-memory types it is built from, shared by the files
// that implement it (internal to src/backend/cuda): cuda_session.cu (weights, scratch, the
// forward pass, attention, GEMMs), cuda_session_cache.cu (the GPU expert cache),
// cuda_session_moe.cu (the routed-expert pass: decode steps and the expert-grouped prefill).
#pragma once

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

#include "backend/cuda/blas.h"
#include "backend/cuda/cuda_session.h"
#include "backend/cuda/kernels.cuh"
#include "experts/expert_store.h"
#include "runtime/interventions.h"
#include "runtime/model.h"

namespace ts::cuda::detail {

inline Error cuda_error(const char* what, cudaError_t e, const char* file, int line) {
  return make_error(std::string("CUDA error: ") + cudaGetErrorString(e) + " in " + what + " (" +
                    file + ":" + std::to_string(line) + ")");
}

#define CUDA_TRY(expr)                                                                \
  do {                                                                                \
    const cudaError_t ts_cuda_err_ = (expr);                                          \
    if (ts_cuda_err_ != cudaSuccess)                                                  \
      return ::ts::cuda::detail::cuda_error(#expr, ts_cuda_err_, __FILE__, __LINE__); \
  } while (0)

#define CUBLAS_TRY(expr)                                                                   \
  do {                                                                                     \
    const cublasStatus_t ts_blas_st_ = (expr);                                             \
    if (ts_blas_st_ != CUBLAS_STATUS_SUCCESS)                                              \
      return make_error(std::string("cuBLAS error ") + std::to_string(int(ts_blas_st_)) + \
                        " in " #expr " (" __FILE__ ":" + std::to_string(__LINE__) + ")"); \
  } while (0)

inline double gib(uint64_t b) { return double(b) / double(1ull << 30); }

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
  float* corr_bias = nullptr;    // [n_experts] RouterSpec's selection-only correction bias
  // The experts' input (ffn_norm's output) fits F16 (cpu::rmsnorm_fits_f16): Q8_0 / Q4_K
  // experts read in place then run phase 1 on F16.
  bool experts_f16_input = false;
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
inline uint64_t mlp_bytes(const DevMlp& m) {
  return m.gate.n_bytes() + m.up.n_bytes() + m.down.n_bytes();
}

// Up to this many tokens the GEMV kernels run (weights read once per 4 tokens); beyond, cuBLAS
// and the expert-grouped MoE.
constexpr int kGemvMaxTokens = 8;
// Rows of the logits buffer: callers that want every row's logits get them in blocks of
// this many (vocab 151,936: 156 MB), not a chunk's worth (4,096 rows: 2.5 GB).
constexpr size_t kLogitRows = 256;

// Q8_0 and Q4_K weights in GEMVs take Q8 activations (dp4a) when rows are whole 256-column
// tiles / super-blocks.
inline bool q8_activations(DType w, int64_t cols) {
  return (w == DType::kQ8_0 || w == DType::kQ4_K) && cols % 256 == 0;
}

inline size_t align256(size_t b) { return (b + 255) / 256 * 256; }

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
  // With the decode graphs (resident experts, no profiling or interventions): every step a
  // graph replay that feeds itself (greedy_graphs_), up to kGreedyAhead of them queued ahead of
  // on_token; else Engine's loop.
  Status decode_greedy(int token, int n, const std::function<bool(int)>& on_token) override;
  // The pinned buffer the step's last copy wrote (no host copy of it per step).
  std::span<const float> last_logits() const override { return {h_logits_, size_t(hp_.vocab)}; }
  const runtime::PhaseTimes& phases() const override {
    read_prediction_counts();
    return phases_;
  }
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
  Result<double> replay_step_ms(int n);
  void sample_routing(uint64_t seed) {
    sampled_routing_ = true;
    route_seed_ = seed;
  }

 private:
  Status forward_chunk(const int* tokens, int n, float* logits_out, bool last_chunk);
  // logits_out: every row's logits to host memory, else only the last row's (logits_).
  Status run_layers(int n, float* logits_out, bool last_chunk);
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
  // Decode graphs with resident experts: after layer l (after the embedding, for layer 0),
  // layer l + 1's router is run on side_ on x as it stands (norm_route with l + 1's norm and
  // router: the experts the layer would pick if its attention changed nothing), and the gate
  // and up matrices of its predict_ranks_ best predictions asked into L2 (prefetch_experts)
  // while the attention runs on stream_ (docs/PERF.md, fifteenth session). The phases still
  // read the router's experts: the output is the same bytes.
  Status predict_layer(int layer);
  void read_prediction_counts() const;

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
  const Blas* bl_ = nullptr;  // cuBLAS, loaded by begin()
  cublasHandle_t blas_ = nullptr;
  // The decode graphs: [0] attention split over the context, [1] steps over at most
  // kClusterAttentionKeys keys (attention in one cluster per KV head).
  cudaGraphExec_t graphs_[2] = {};
  int graph_splits_ = 0;
  // The attention of one-token steps runs as clusters (cluster_attention_applies) ...
  bool cluster_attention_ok_ = false;
  // ... and the launches being issued (or captured) cover at most kClusterAttentionKeys keys.
  bool attn_cluster_ = false;
  bool cluster_step(int n) const {
    return n == 1 && cluster_attention_ok_ && pos_ + n <= kClusterAttentionKeys;
  }

  int n_ctx_ = 0, chunk_ = 0, pos_ = 0;
  // The KV cache, [n_layers, n_ctx, kv_dim]: F32 rows where a layer's weights are F32 (the
  // fixtures' exact path), else BF16 rows (a third of the bytes; the tensor-core attention
  // reads BF16 anyway). One of the two pairs is allocated, the other null.
  float *k_cache_ = nullptr, *v_cache_ = nullptr;
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
  int* plan_ = nullptr;  // group_plan's summary (device); h_plan_ its copy (pinned)
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
  int logit_rows_ = 1;      // rows the logits buffer holds (kLogitRows, or the chunk if less)
  unsigned long long* hist_ = nullptr;  // [n_layers, n_experts]
  unsigned* route_counter_ = nullptr;   // norm_route()'s, 0 between launches
  // Predictions made (TURBOSPARK_CUDA_PREDICT=0: none), and how many of the best are
  // prefetched: at most half of top_k and of the L2 (TURBOSPARK_CUDA_PREDICT_RANKS=N to
  // measure; 0: predicted, nothing prefetched).
  bool predict_ = true;
  // Decode's top-k in phase 1's blocks (MoeArgs::route): -1 where measured faster (Q8_0
  // experts: docs/PERF.md), else in the router's last block; TURBOSPARK_CUDA_ROUTE_IN_P1=0
  // never, =1 for every expert type (to measure, and to test the path on every kernel).
  int route_in_p1_ = -1;
  int predict_ranks_ = 0;
  bool predicting_ = false;      // capturing a decode graph with predict_
  cudaStream_t side_ = nullptr;  // the predictions and prefetches
  cudaEvent_t side_fork_ = nullptr, side_join_ = nullptr;
  int* pred_ids_ = nullptr;  // [n_layers, top_k], -1 where none was predicted
  int* real_ids_ = nullptr;  // [n_layers, top_k] the router's picks while predicting_
  float* pred_xn_ = nullptr;
  float* pred_logits_ = nullptr;
  float* pred_w_ = nullptr;
  unsigned* pred_counter_ = nullptr;
  unsigned long long* pred_hits_ = nullptr;  // right, compared
  // Pinned host mirrors.
  int* h_tokens_ = nullptr;
  int* h_pos_ = nullptr;
  int* h_ids_ = nullptr;
  int* h_plan_ = nullptr;
  // With the GPU expert cache, decode segments end with the router writing the ids into
  // mapped host memory [flag, ids...] (ids_flag_dev_ as the device sees it): the host reads
  // them without a device-to-host copy and a stream synchronization.
  int* ids_flag_host_ = nullptr;
  int* ids_flag_dev_ = nullptr;
  Status wait_ids_flag(int k);
  Status wait_mapped(const int* word, int at_least, const char* what);
  // Greedy decoding on the device (decode_greedy): graphs of a decode step whose input token
  // and position are the device's own (no host copies) and whose last launch, greedy_pick,
  // writes the argmax as the next step's token and into the mapped ring [count, ids...]
  // (greedy_ring_dev_ as the device sees it); [0] split attention, [1] in clusters, as graphs_.
  static constexpr int kGreedyAhead = 2, kGreedyRing = 8;
  cudaGraphExec_t greedy_graphs_[2] = {};
  int* greedy_ring_host_ = nullptr;
  int* greedy_ring_dev_ = nullptr;
  float* pick_v_ = nullptr;
  int* pick_i_ = nullptr;
  unsigned* pick_count_ = nullptr;  // [0] the blocks done, [1] the picks since the start
  Status capture_greedy(bool cluster);
  // phases_.expert_requests for `tokens` tokens through every MoE layer.
  void count_expert_requests(int tokens);
  // Captures what body launches on stream_ as `graph` (instantiated); the capture is closed
  // whatever body returns.
  Status capture_graph(cudaGraphExec_t& graph, const std::function<Status()>& body);
  float* h_logits_ = nullptr;
  mutable runtime::PhaseTimes phases_;  // (the prediction counts are read when asked)
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
  // Decode segments, as graphs_: [0] split attention, [1] attention in clusters.
  std::vector<cudaGraphExec_t> segment_sets_[2];
  std::vector<int> segment_layers_;
  bool capturing_segments_ = false;
  bool sampled_routing_ = false;  // bench --routing uniform|zipf:S
  uint64_t route_seed_ = 0;
};

}  // namespace ts::cuda::detail
