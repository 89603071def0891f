#include "backend/cpu/ops.h"
#include "backend/cpu/quant.h"
#include "backend/cuda/cuda_session_impl.cuh"
#include "model/weights.h"

namespace ts::cuda {
namespace detail {
namespace {

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
  const std::string name = "cuda:" + std::to_string(device) + " (" + prop.name + ")";
  // A card this build has no kernels for (an sm_80 / sm_89 card under the default sm_90
  // build) would load every weight and then fail at the first launch: refuse it here.
  CUDA_TRY(cudaSetDevice(device));
  const cudaError_t image = kernel_image_status();
  if (image != cudaSuccess) {
    const std::string cc = std::to_string(prop.major) + "." + std::to_string(prop.minor);
    const std::string arch = std::to_string(prop.major) + std::to_string(prop.minor);
    return make_error(
        "--device " + name + ": this build has no CUDA kernels for its compute capability " + cc +
        " (built for CMAKE_CUDA_ARCHITECTURES " TS_CUDA_ARCHITECTURES "; " +
        cudaGetErrorString(image) + "): rebuild with -DCMAKE_CUDA_ARCHITECTURES=" + arch);
  }
  return name;
}

}  // namespace

CudaSession::~CudaSession() {
  if (stream_) cudaStreamSynchronize(stream_);
  if (side_) cudaStreamSynchronize(side_);
  for (cudaEvent_t e : {side_fork_, side_join_})
    if (e) cudaEventDestroy(e);
  if (side_) cudaStreamDestroy(side_);
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
  for (cudaGraphExec_t g : graphs_)
    if (g) cudaGraphExecDestroy(g);
  for (cudaGraphExec_t g : greedy_graphs_)
    if (g) cudaGraphExecDestroy(g);
  for (const auto& set : segment_sets_)
    for (cudaGraphExec_t g : set) cudaGraphExecDestroy(g);
  if (blas_) bl_->destroy(blas_);
  if (stream_) cudaStreamDestroy(stream_);
  for (void* p :
       {static_cast<void*>(h_tokens_), static_cast<void*>(h_pos_), static_cast<void*>(h_ids_),
        static_cast<void*>(h_plan_), static_cast<void*>(h_slot_hit_), static_cast<void*>(h_logits_),
        static_cast<void*>(ids_flag_host_), static_cast<void*>(greedy_ring_host_)})
    if (p) cudaFreeHost(p);
}

Status CudaSession::begin(int device) {
  CUDA_TRY(cudaSetDevice(device));
  CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  TS_ASSIGN(bl_, load_blas());
  CUBLAS_TRY(bl_->create(&blas_));
  CUBLAS_TRY(bl_->set_stream(blas_, stream_));
  // F32 GEMMs stay F32 (no TF32): the fixtures are checked against transformers in F32.
  CUBLAS_TRY(bl_->set_math_mode(blas_, CUBLAS_DEFAULT_MATH));
  const char* env = std::getenv("TURBOSPARK_CUDA_GRAPHS");
  use_graphs_ = !(env && std::string(env) == "0");
  const char* pe = std::getenv("TURBOSPARK_CUDA_PREDICT");
  // The prediction runs the fused norm + router + top-k: plain softmax routing only.
  const model::RouterSpec& rs = hp_.router;
  const bool plain_router = rs.scoring == model::ScoreFn::kSoftmax && !rs.correction_bias &&
                            rs.n_group == 1 && rs.scale == 1.0f;
  predict_ = !(pe && std::string(pe) == "0") && plain_router;
  const char* re = std::getenv("TURBOSPARK_CUDA_ROUTE_IN_P1");
  route_in_p1_ = !re ? -1 : std::string(re) == "0" ? 0 : 1;
  // (Probes the device once, here: never during a graph capture.)
  const bool clusters = cluster_launch_available();
  cluster_attention_ok_ =
      clusters && cluster_attention_applies(hp_.n_heads, hp_.n_kv_heads, hp_.head_dim);
  cached_.resize(size_t(hp_.n_layers));
  return {};
}

Status CudaSession::upload(const runtime::LoadedModel& model) {
  const model::DenseWeights& d = model.dense();
  Uploader up(arena_, stream_, opt_.quantize_q8_0);
  // The embedding is only gathered row by row: it stays in its float type. A quantized one
  // (GGUF files) is dequantized to F32 here, as the CPU dequantizes the rows it gathers.
  Uploader keep(arena_, stream_, false);
  if (dtype_is_quantized(d.embed.dtype)) {
    std::vector<float> table(size_t(d.embed.rows * d.embed.cols));
    const size_t row_bytes = dtype_row_bytes(d.embed.dtype, d.embed.cols);
    for (int64_t r = 0; r < d.embed.rows; ++r)
      cpu::dequantize_row(d.embed.dtype, static_cast<const uint8_t*>(d.embed.data) + r * row_bytes,
                          table.data() + r * d.embed.cols, d.embed.cols);
    TS_ASSIGN(w_.embed,
              keep.matrix(model::Matrix{table.data(), DType::kF32, d.embed.rows, d.embed.cols}));
    CUDA_TRY(cudaStreamSynchronize(stream_));  // the copy has read `table`
  } else {
    TS_ASSIGN(w_.embed, keep.matrix(d.embed));
  }
  if (d.lm_head.data == d.embed.data && !opt_.quantize_q8_0 && !dtype_is_quantized(d.embed.dtype)) {
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
    D.experts_f16_input = cpu::rmsnorm_fits_f16(L.ffn_norm);
    TS_ASSIGN(D.bq, up.vec(L.bq));
    TS_ASSIGN(D.bk, up.vec(L.bk));
    TS_ASSIGN(D.bv, up.vec(L.bv));
    TS_ASSIGN(D.q_norm, up.vec(L.q_norm));
    TS_ASSIGN(D.k_norm, up.vec(L.k_norm));
    TS_ASSIGN(D.corr_bias, up.vec(L.router_bias));
    TS_ASSIGN(D.wq, up.matrix(L.wq));
    TS_ASSIGN(D.wk, up.matrix(L.wk));
    TS_ASSIGN(D.wv, up.matrix(L.wv));
    TS_ASSIGN(D.wo, up.matrix(L.wo));
    D.is_moe = L.is_moe;
    TS_ASSIGN(D.dense.gate, up.matrix(L.dense.gate));
    TS_ASSIGN(D.dense.up, up.matrix(L.dense.up));
    TS_ASSIGN(D.dense.down, up.matrix(L.dense.down));
    const auto report = [&] {
      if (opt_.on_layer) opt_.on_layer(l + 1, hp_.n_layers, arena_.bytes());
    };
    if (!L.is_moe) {
      report();
      continue;
    }
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
    report();
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
  // Every layer's ffn_norm is ones: the same bound the loaded weights are asked, once.
  const bool ones_fit_f16 = cpu::rmsnorm_fits_f16(std::vector<float>(size_t(d), 1.0f));
  for (int l = 0; l < hp_.n_layers; ++l) {
    DevLayer& D = w_.layers[size_t(l)];
    TS_ASSIGN(D.attn_norm, up.ones(d));
    TS_ASSIGN(D.ffn_norm, up.ones(d));
    D.experts_f16_input = ones_fit_f16;
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
    const DType down_t = syn.expert_down_dtype.value_or(syn.dtype);
    set_expert_layout(D, syn.dtype, down_t, hp_.d_expert, d);
    TS_ASSIGN(uint8_t* base, expert_layer_memory(D));
    for (int e = 0; e < hp_.n_experts; ++e) {
      uint8_t* at = base + size_t(e) * D.expert_bytes;
      TS_TRY(up.fill_random(syn.dtype, hp_.d_expert, d, ++seed, at));
      TS_TRY(up.fill_random(syn.dtype, hp_.d_expert, d, ++seed, at + D.up_off));
      TS_TRY(up.fill_random(down_t, d, hp_.d_expert, ++seed, at + D.down_off));
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
  const size_t d = size_t(hp.d_model), k = size_t(std::max(1, hp.top_k));
  const size_t kv = size_t(hp.n_layers) * size_t(n_ctx_) * size_t(hp.kv_dim());
  // The widest MLP the layers run (d_ff only where a layer is dense, d_shared where a MoE
  // layer has a shared expert).
  int widest_mlp = 1;
  for (const DevLayer& L : w_.layers)
    widest_mlp = std::max({widest_mlp, L.is_moe ? hp.d_expert : hp.d_ff,
                           L.is_moe && L.shared.gate.rows > 0 ? hp.d_shared : 1});
  const size_t hidden = size_t(widest_mlp);
  const size_t widest = std::max({d, size_t(hp.q_dim()), hidden});
  // BF16 cache rows unless a layer's weights are F32 (then F32 rows for every layer).
  bool kv_bf16 = !w_.layers.empty();
  for (const DevLayer& L : w_.layers) kv_bf16 &= L.wq.dtype != DType::kF32;
  const size_t kv_elem = kv_bf16 ? 2 : 4;
  const auto need_for = [&](size_t c) {  // bytes of KV cache and scratch at chunk c
    const size_t partial = std::max<size_t>(c, 64);
    return 2 * kv * kv_elem + c * d * 4 * 6 + c * size_t(hp.q_dim()) * 8 +
           c * size_t(hp.kv_dim()) * 8 +
           partial * size_t(hp.n_heads) * size_t(hp.head_dim + 2) * 4 +
           c * size_t(hp.n_experts) * 4 + c * k * (8 + d * 4) + 2 * c * k * hidden * 4 +
           std::min<size_t>(c, kLogitRows) * size_t(hp.vocab) * 4 + c * k * widest * 2;
  };
  size_t free_b = 0, total_b = 0;
  CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  // Prefill chunk: --prefill-chunk, else 4,096 tokens when that scratch fits with 2 GiB to
  // spare, else 2,048 (each chunk reads every used expert's weights once, so a longer chunk
  // reads them fewer times per token: docs/PERF.md). The same rule in every residency mode,
  // so modes chunk a prompt alike unless memory is that tight.
  chunk_ = opt_.prefill_chunk > 0 ? opt_.prefill_chunk : 2048;
  if (opt_.prefill_chunk <= 0 &&
      need_for(size_t(std::min(4096, n_ctx_))) + (size_t(2) << 30) <= free_b)
    chunk_ = 4096;
  chunk_ = std::min(chunk_, n_ctx_);
  const size_t c = size_t(chunk_);
  partial_rows_ = int(std::max<size_t>(c, 64));
  act_bytes_ = c * k * widest * 2;
  const size_t need = need_for(c);
  if (need + (64u << 20) > free_b)
    return make_error("the KV cache (n_ctx " + std::to_string(n_ctx_) + ") and scratch need " +
                      std::to_string(gib(need)) + " GiB on " + device_name_ + " after the weights (" +
                      std::to_string(gib(arena_.bytes())) + " GiB); " +
                      std::to_string(gib(free_b)) + " GiB are free: use a smaller --n-ctx");
  if (kv_bf16) {
    TS_ASSIGN(k_bf16_, arena_.alloc(kv * 2));
    TS_ASSIGN(v_bf16_, arena_.alloc(kv * 2));
  } else {
    TS_ASSIGN(k_cache_, arena_.alloc_n<float>(kv));
    TS_ASSIGN(v_cache_, arena_.alloc_n<float>(kv));
  }
  const std::vector<float>& inv = hp.rope.inv_freq;
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
  // group_plan's summary: each expert's first row, the total, the decisions.
  const size_t plan_ints = size_t(std::max(1, hp.n_experts)) + 1 + kPlanFields;
  TS_ASSIGN(plan_, arena_.alloc_n<int>(plan_ints));
  TS_ASSIGN(group_tiles_, arena_.alloc_n<GroupTile>(c * k / size_t(kQuantSmallTile) +
                                                    size_t(std::max(1, hp.n_experts)) + 1));
  TS_ASSIGN(slot_rows_, arena_.alloc_n<float>(c * k * d));
  TS_ASSIGN(h1_, arena_.alloc_n<float>(c * k * hidden));
  TS_ASSIGN(h2_, arena_.alloc_n<float>(c * k * hidden));
  logit_rows_ = int(std::min<size_t>(c, kLogitRows));
  TS_ASSIGN(logits_, arena_.alloc_n<float>(size_t(logit_rows_) * size_t(hp.vocab)));
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
  TS_ASSIGN(route_counter_, arena_.alloc_n<unsigned>(1));
  CUDA_TRY(cudaMemset(route_counter_, 0, sizeof(unsigned)));
  if (predict_) {
    // The best half of the predictions (more measured no faster: docs/PERF.md), as many as
    // half the L2 holds beside the attention's own bytes.
    int l2 = 0;
    CUDA_TRY(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device_));
    size_t expert_bytes = 0;
    for (const DevLayer& L : w_.layers)
      if (L.is_moe) expert_bytes = std::max(expert_bytes, 2 * L.experts[0].gate.n_bytes());
    predict_ranks_ =
        expert_bytes
            ? int(std::min<size_t>(size_t(hp.top_k + 1) / 2, size_t(l2) / 2 / expert_bytes))
            : 0;
    if (const char* r = std::getenv("TURBOSPARK_CUDA_PREDICT_RANKS"))
      predict_ranks_ = std::clamp(std::atoi(r), 0, hp.top_k);
    else if (predict_ranks_ == 0)
      predict_ = false;  // not one expert fits: nothing to gain
  }
  if (predict_) {
    const size_t lk = size_t(hp.n_layers) * k;
    TS_ASSIGN(pred_ids_, arena_.alloc_n<int>(lk));
    TS_ASSIGN(real_ids_, arena_.alloc_n<int>(lk));
    CUDA_TRY(cudaMemset(pred_ids_, 0xff, lk * 4));
    CUDA_TRY(cudaMemset(real_ids_, 0xff, lk * 4));
    TS_ASSIGN(pred_xn_, arena_.alloc_n<float>(d));
    TS_ASSIGN(pred_logits_, arena_.alloc_n<float>(size_t(std::max(1, hp.n_experts))));
    TS_ASSIGN(pred_w_, arena_.alloc_n<float>(k));
    TS_ASSIGN(pred_counter_, arena_.alloc_n<unsigned>(1));
    CUDA_TRY(cudaMemset(pred_counter_, 0, sizeof(unsigned)));
    TS_ASSIGN(pred_hits_, arena_.alloc_n<unsigned long long>(2));
    CUDA_TRY(cudaMemset(pred_hits_, 0, 16));
    CUDA_TRY(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    CUDA_TRY(cudaEventCreateWithFlags(&side_fork_, cudaEventDisableTiming));
    CUDA_TRY(cudaEventCreateWithFlags(&side_join_, cudaEventDisableTiming));
  }
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
  CUDA_TRY(cudaMallocHost(&h_plan_, plan_ints * 4));
  if (cached()) {
    CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&ids_flag_host_), size_t(k + 1) * 4,
                           cudaHostAllocMapped));
    CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ids_flag_dev_), ids_flag_host_, 0));
  }
  CUDA_TRY(cudaMallocHost(&h_slot_hit_, size_t(kGemvMaxTokens) * k * 4));
  TS_ASSIGN(slot_hit_, arena_.alloc_n<int>(size_t(kGemvMaxTokens) * k));
  segment_hits_.resize(size_t(hp.n_layers));
  CUDA_TRY(cudaMallocHost(&h_logits_, size_t(hp.vocab) * 4));
  TS_ASSIGN(pick_v_, arena_.alloc_n<float>(kGreedyBlocks));
  TS_ASSIGN(pick_i_, arena_.alloc_n<int>(kGreedyBlocks));
  TS_ASSIGN(pick_count_, arena_.alloc_n<unsigned>(2));
  CUDA_TRY(cudaMemset(pick_count_, 0, 2 * sizeof(unsigned)));
  CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&greedy_ring_host_), (1 + kGreedyRing) * 4,
                         cudaHostAllocMapped));
  CUDA_TRY(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&greedy_ring_dev_), greedy_ring_host_, 0));
  std::fill_n(h_logits_, hp.vocab, 0.0f);
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
  b.kv_bytes_per_position =
      2ull * uint64_t(hp_.n_layers) * uint64_t(hp_.kv_dim()) * (k_bf16_ ? 2 : 4);
  b.device_bytes = arena_.bytes();
  b.prefill_chunk = chunk_;
  for (const DevLayer& L : w_.layers)
    if (L.is_moe) {
      ++b.moe_layers;
      b.expert_bytes = mlp_bytes(L.experts[0]);
    }
  b.graphs = use_graphs_ && !cached() && iv_.capture_layers.empty() && !iv_.trace_router;
  // The driver's peak memory clock (kHz) and bus width (bits), two transfers per clock: the
  // H100 SXM's 2,619 MHz x 5,120 bits = 3,352 GB/s, its data sheet's 3.35 TB/s.
  int clock_khz = 0, bus_bits = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device_) == cudaSuccess &&
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device_) == cudaSuccess)
    b.device_peak_gbps = 2.0 * double(clock_khz) * 1e3 * double(bus_bits) / 8.0 / 1e9;
  return b;
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
// fixed for the whole context, as for the decode graph, and as there, steps over at most
// kClusterAttentionKeys keys have segments of their own (attention in clusters).
Status CudaSession::decode_segments() {
  std::vector<cudaGraphExec_t>& segments = segment_sets_[attn_cluster_ ? 1 : 0];
  if (segments.empty()) {
    graph_splits_ = attention_splits(1, n_ctx_);
    capturing_segments_ = true;
    Status st = [&]() -> Status {
      TS_TRY(begin_segment());
      CUDA_TRY(cudaMemcpyAsync(tokens_, h_tokens_, 4, cudaMemcpyHostToDevice, stream_));
      CUDA_TRY(cudaMemcpyAsync(pos_dev_, h_pos_, 4, cudaMemcpyHostToDevice, stream_));
      TS_TRY(run_layers(1, nullptr, true));
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
      for (cudaGraphExec_t e : segments) cudaGraphExecDestroy(e);
      segments.clear();
      return st;
    }
    segment_layers_.clear();
    for (int l = 0; l < hp_.n_layers; ++l)
      if (w_.layers[size_t(l)].is_moe) segment_layers_.push_back(l);
    return {};
  }
  for (size_t i = 0; i < segments.size(); ++i) {
    const bool binds = i < segment_layers_.size();
    if (binds) *reinterpret_cast<volatile int*>(ids_flag_host_) = 0;
    CUDA_TRY(cudaGraphLaunch(segments[i], stream_));
    if (!binds) break;
    TS_TRY(wait_ids_flag(hp_.top_k));
    TS_TRY(bind_ids(segment_layers_[i], 1, &segment_hits_[size_t(segment_layers_[i])]));
  }
  return {};
}

// Spins until the mapped word reaches at_least. Never hangs: the stream is polled, and an idle
// or failed stream before then is an error ("internal: <what> never reached the host").
Status CudaSession::wait_mapped(const int* word, int at_least, const char* what) {
  const volatile int* w = word;
  for (uint64_t spin = 1; *w < at_least; ++spin) {
    if (spin % 1024 != 0) continue;
    const cudaError_t q = cudaStreamQuery(stream_);
    if (q == cudaErrorNotReady) continue;
    if (q != cudaSuccess) return cuda_error("cudaStreamQuery", q, __FILE__, __LINE__);
    if (*w < at_least)
      return make_error(std::string("internal: ") + what + " never reached the host");
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  return {};
}

// Waits until the segment's router kernel has raised the flag (to 1), then copies its k ids
// to h_ids_.
Status CudaSession::wait_ids_flag(int k) {
  TS_TRY(wait_mapped(ids_flag_host_, 1, "the router's ids"));
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
    attn_cluster_ = cluster_step(n);
    TS_TRY(decode_segments());
  } else if (n == 1 && !all_rows && graph_eligible()) {
    // A decode step is the same launches every time (the position is read on the device):
    // capture it once, replay it after. Two graphs: steps over at most kClusterAttentionKeys
    // keys, whose attention merges in a cluster, and the rest, split over the whole context.
    attn_cluster_ = cluster_step(n);
    cudaGraphExec_t& graph = graphs_[attn_cluster_ ? 1 : 0];
    if (!graph) {
      graph_splits_ = attention_splits(1, n_ctx_);
      TS_TRY(capture_graph(graph, [&]() -> Status {
        CUDA_TRY(cudaMemcpyAsync(tokens_, h_tokens_, 4, cudaMemcpyHostToDevice, stream_));
        CUDA_TRY(cudaMemcpyAsync(pos_dev_, h_pos_, 4, cudaMemcpyHostToDevice, stream_));
        TS_TRY(run_layers(1, nullptr, true));
        CUDA_TRY(cudaMemcpyAsync(h_logits_, logits_, size_t(hp_.vocab) * 4,
                                 cudaMemcpyDeviceToHost, stream_));
        return {};
      }));
    }
    CUDA_TRY(cudaGraphLaunch(graph, stream_));
  } else {
    attn_cluster_ = cluster_step(n);
    CUDA_TRY(cudaMemcpyAsync(tokens_, h_tokens_, size_t(n) * 4, cudaMemcpyHostToDevice, stream_));
    CUDA_TRY(cudaMemcpyAsync(pos_dev_, h_pos_, 4, cudaMemcpyHostToDevice, stream_));
    TS_TRY(run_layers(n, logits_out, last_chunk));
    // With every row, the buffer holds the last block of logit_rows_ rows.
    const size_t last_row = all_rows ? size_t((n - 1) % logit_rows_) : 0;
    CUDA_TRY(cudaMemcpyAsync(h_logits_, logits_ + last_row * size_t(hp_.vocab),
                             size_t(hp_.vocab) * 4, cudaMemcpyDeviceToHost, stream_));
  }
  CUDA_TRY(cudaStreamSynchronize(stream_));
  CUDA_TRY(cudaGetLastError());
  prof_.collect();
  if (cached()) collect_copy_times();
  pos_ += n;
  count_expert_requests(n);
  return {};
}

void CudaSession::count_expert_requests(int tokens) {
  int moe_layers = 0;
  for (const DevLayer& L : w_.layers) moe_layers += L.is_moe;
  phases_.expert_requests += uint64_t(tokens) * uint64_t(hp_.top_k) * uint64_t(moe_layers);
}

Status CudaSession::capture_graph(cudaGraphExec_t& graph, const std::function<Status()>& body) {
  cudaGraph_t g = nullptr;
  CUDA_TRY(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  const Status st = body();
  const cudaError_t end = cudaStreamEndCapture(stream_, &g);  // closed whatever body returned
  if (!st.ok() && g) cudaGraphDestroy(g);
  TS_TRY(st);
  if (end != cudaSuccess) return cuda_error("cudaStreamEndCapture", end, __FILE__, __LINE__);
  const cudaError_t inst = cudaGraphInstantiate(&graph, g, 0);
  cudaGraphDestroy(g);
  if (inst != cudaSuccess) return cuda_error("cudaGraphInstantiate", inst, __FILE__, __LINE__);
  return {};
}

Status CudaSession::capture_greedy(bool cluster) {
  cudaGraphExec_t& graph = greedy_graphs_[cluster ? 1 : 0];
  if (graph) return {};
  attn_cluster_ = cluster;
  graph_splits_ = attention_splits(1, n_ctx_);
  return capture_graph(graph, [&]() -> Status {
    TS_TRY(run_layers(1, nullptr, true));
    greedy_pick({.logits = logits_,
                 .vocab = hp_.vocab,
                 .tokens = tokens_,
                 .pos = pos_dev_,
                 .part_v = pick_v_,
                 .part_i = pick_i_,
                 .count = pick_count_,
                 .seq = pick_count_ + 1,
                 .ring = greedy_ring_dev_,
                 .ring_size = kGreedyRing},
                stream_);
    CUDA_TRY(cudaGetLastError());
    return {};
  });
}

Status CudaSession::decode_greedy(int token, int n, const std::function<bool(int)>& on_token) {
  if (n < 1) return {};
  if (!graph_eligible() || cached() || pos_ + n > n_ctx_ || token < 0 || token >= hp_.vocab)
    return Engine::decode_greedy(token, n, on_token);
  CUDA_TRY(cudaSetDevice(device_));
  const auto t0 = Clock::now();
  // Step j runs at position start + j: in clusters while that covers at most
  // kClusterAttentionKeys keys. Both graphs are captured before anything is queued.
  const int start = pos_;
  const auto in_cluster = [&](int j) {
    return cluster_attention_ok_ && start + j + 1 <= kClusterAttentionKeys;
  };
  if (in_cluster(0)) TS_TRY(capture_greedy(true));
  if (!in_cluster(n - 1)) TS_TRY(capture_greedy(false));
  h_tokens_[0] = token;
  *h_pos_ = start;
  greedy_ring_host_[0] = 0;
  CUDA_TRY(cudaMemcpyAsync(tokens_, h_tokens_, 4, cudaMemcpyHostToDevice, stream_));
  CUDA_TRY(cudaMemcpyAsync(pos_dev_, h_pos_, 4, cudaMemcpyHostToDevice, stream_));
  CUDA_TRY(cudaMemsetAsync(pick_count_ + 1, 0, sizeof(unsigned), stream_));
  int launched = 0, read = 0;
  const auto launch = [&]() -> Status {
    CUDA_TRY(cudaGraphLaunch(greedy_graphs_[in_cluster(launched) ? 1 : 0], stream_));
    ++launched;
    return {};
  };
  Status st = [&]() -> Status {
    while (launched < std::min(n, kGreedyAhead)) TS_TRY(launch());
    while (read < launched) {
      TS_TRY(wait_mapped(greedy_ring_host_, read + 1, "a greedy step's id"));
      const int id = greedy_ring_host_[1 + read % kGreedyRing];
      ++read;
      if (!on_token(id)) break;
      if (launched < n) TS_TRY(launch());
    }
    return {};
  }();
  // The steps queued past the stop ran on ids nobody took: their KV rows lie past the
  // position kept, which the next step overwrites.
  const cudaError_t sync = cudaStreamSynchronize(stream_);
  TS_TRY(st);
  if (sync != cudaSuccess) return cuda_error("cudaStreamSynchronize", sync, __FILE__, __LINE__);
  CUDA_TRY(cudaGetLastError());
  pos_ = start + read;
  count_expert_requests(read);
  phases_.total_us += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  return {};
}

Result<double> CudaSession::replay_step_ms(int n) {
  cudaGraphExec_t graph = graphs_[attn_cluster_ ? 1 : 0];
  if (!graph || n < 1 || !graph_eligible()) return make_error("no decode graph to replay");
  cudaEvent_t ev[2] = {};
  float ms = 0;
  Status st = [&]() -> Status {
    for (cudaEvent_t& e : ev) CUDA_TRY(cudaEventCreate(&e));
    CUDA_TRY(cudaGraphLaunch(graph, stream_));  // untimed: the first replay waits on nothing
    CUDA_TRY(cudaEventRecord(ev[0], stream_));
    for (int i = 0; i < n; ++i) CUDA_TRY(cudaGraphLaunch(graph, stream_));
    CUDA_TRY(cudaEventRecord(ev[1], stream_));
    CUDA_TRY(cudaStreamSynchronize(stream_));
    CUDA_TRY(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    return {};
  }();
  for (cudaEvent_t e : ev)
    if (e) cudaEventDestroy(e);
  TS_TRY(st);
  return double(ms) / n;
}

Status CudaSession::predict_layer(int layer) {
  const DevLayer& L = w_.layers[size_t(layer)];
  if (!L.is_moe || !norm_route_applies(L.router.dtype, hp_.d_model)) return {};
  const int k = hp_.top_k;
  CUDA_TRY(cudaEventRecord(side_fork_, stream_));
  CUDA_TRY(cudaStreamWaitEvent(side_, side_fork_, 0));
  // x is read here while stream_ runs the attention, whose wo adds to x only after its norm,
  // q|k|v, RoPE and attention: long after these blocks have read it (were they ever that
  // late, the prediction would change, never the output).
  TS_TRY(launch([&] {
    norm_route({.x = x_,
                .norm_w = L.ffn_norm,
                .eps = hp_.rms_eps,
                .d = hp_.d_model,
                .xn = pred_xn_,
                .router = L.router.data,
                .router_dtype = L.router.dtype,
                .logits = pred_logits_,
                .counter = pred_counter_,
                .route = {.logits = pred_logits_,
                          .ids = pred_ids_ + size_t(layer) * size_t(k),
                          .weights = pred_w_,
                          .hist = nullptr,
                          .n = 1,
                          .n_experts = hp_.n_experts,
                          .top_k = k,
                          .renormalize = hp_.router.renormalize},
                // Blocks of 256 threads find room beside the q|k|v blocks already
                // resident (1,024 waited behind them and cost more than they saved).
                .block = 256},
               side_);
  }));
  if (predict_ranks_ == 0) return {};
  return launch([&] {
    prefetch_experts({.gate = L.gate_tab,
                      .up = L.up_tab,
                      .ids = pred_ids_ + size_t(layer) * size_t(k),
                      .ranks = predict_ranks_,
                      .bytes = L.experts[0].gate.n_bytes()},
                     side_);
  });
}

void CudaSession::read_prediction_counts() const {
  if (!pred_hits_) return;
  // Between steps (each ends with its stream synchronized), so the counts are complete.
  unsigned long long h[2] = {};
  if (cudaMemcpy(h, pred_hits_, sizeof h, cudaMemcpyDeviceToHost) != cudaSuccess) return;
  phases_.predicted_right = h[0];
  phases_.predicted_picks = h[1];
}

Status CudaSession::run_layers(int n, float* logits_out, bool last_chunk) {
  const size_t d = size_t(hp_.d_model);
  TS_TRY(prof_.time("embed", double(n) * double(w_.embed.row_bytes()), stream_,
                    [&] { return launch([&] { embed_rows(w_.embed, tokens_, n, x_, stream_); }); }));
  TS_TRY(layer_boundary(-1, n, last_chunk));
  // (Not with --routing uniform|zipf: the router does not pick the experts then.)
  predicting_ = predict_ && n == 1 && !logits_out && !sampled_routing_ && graph_eligible();
  if (predicting_) TS_TRY(predict_layer(0));
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
    if (predicting_ && l + 1 < hp_.n_layers) TS_TRY(predict_layer(l + 1));
  }
  if (predicting_) {
    CUDA_TRY(cudaEventRecord(side_join_, side_));
    CUDA_TRY(cudaStreamWaitEvent(stream_, side_join_, 0));
    TS_TRY(launch([&] {
      count_predicted(pred_ids_, real_ids_, hp_.n_layers, hp_.top_k, pred_hits_, stream_);
    }));
    predicting_ = false;
  }
  rmsnorm(x_, w_.final_norm, xn_, n, int(d), hp_.rms_eps, stream_);
  return prof_.time("lm head", double(w_.lm_head.n_bytes()), stream_, [&]() -> Status {
    if (!logits_out) return linear(w_.lm_head, xn_ + size_t(n - 1) * d, 1, logits_);
    // Every row (perplexity, logit dumps): logit_rows_ rows at a time through the buffer,
    // each block copied out before the next overwrites it (a copy to pageable memory returns
    // when it is done).
    const size_t vocab = size_t(hp_.vocab);
    for (int r0 = 0; r0 < n; r0 += logit_rows_) {
      const int m = std::min(logit_rows_, n - r0);
      TS_TRY(linear(w_.lm_head, xn_ + size_t(r0) * d, m, logits_));
      CUDA_TRY(cudaMemcpyAsync(logits_out + size_t(r0) * vocab, logits_, size_t(m) * vocab * 4,
                               cudaMemcpyDeviceToHost, stream_));
    }
    return {};
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
  // This layer's cache rows: the F32 pair or the BF16 pair (the other null).
  const size_t layer_off = size_t(layer) * size_t(n_ctx_) * size_t(kvd);
  float* const k_rows = k_cache_ ? k_cache_ + layer_off : nullptr;
  float* const v_rows = v_cache_ ? v_cache_ + layer_off : nullptr;
  uint16_t* const k_rows16 = k_bf16_ ? static_cast<uint16_t*>(k_bf16_) + layer_off : nullptr;
  uint16_t* const v_rows16 = v_bf16_ ? static_cast<uint16_t*>(v_bf16_) + layer_off : nullptr;
  const bool per_head = hp_.qk_norm == model::QkNorm::kPerHead;
  TS_TRY(prof_.time("rope + kv append", double(n) * (qd + 3 * kvd) * 8, stream_, [&] {
    return launch([&] {
      rope_kv_append({.q = q_,
                      .k = k_,
                      .v = v_,
                      .k_cache = k_rows,
                      .v_cache = v_rows,
                      .inv_freq = inv_freq_,
                      .pos = pos_dev_,
                      .n = n,
                      .n_heads = hp_.n_heads,
                      .n_kv_heads = hp_.n_kv_heads,
                      .head_dim = hp_.head_dim,
                      .rot_dim = hp_.rope.dim,
                      .q_norm = per_head ? L.q_norm : nullptr,
                      .k_norm = per_head ? L.k_norm : nullptr,
                      .eps = hp_.rms_eps,
                      .k_bf16 = k_rows16,
                      .v_bf16 = v_rows16},
                     stream_);
    });
  }));
  const int splits = n == 1 && graph_splits_ > 0 ? graph_splits_ : attention_splits(n, pos_ + n);
  // A Q8_0 wo reads the attention output as Q8 blocks, written by the attention's merge.
  const bool wo_q8 = n <= kGemvMaxTokens && q8_activations(L.wo.dtype, L.wo.cols);
  const double kv_bytes = 2.0 * double(pos_ + n) * kvd * (k_bf16_ ? 2 : 4);
  TS_TRY(prof_.time("attention", kv_bytes, stream_, [&] {
    return launch([&] {
      attention({.q = q_,
                 .k_cache = k_rows,
                 .v_cache = v_rows,
                 .out = att_,
                 .partial = partial_,
                 .pos = pos_dev_,
                 .n = n,
                 .n_heads = hp_.n_heads,
                 .n_kv_heads = hp_.n_kv_heads,
                 .head_dim = hp_.head_dim,
                 .n_splits = splits,
                 .k_bf16 = k_rows16,
                 .v_bf16 = v_rows16,
                 .out_q = wo_q8 ? qx_ : QAct{},
                 .cluster = n == 1 && attn_cluster_},
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
    CUBLAS_TRY(bl_->sgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &one,
                          static_cast<const float*>(w.data), cols, static_cast<const float*>(x),
                          cols, &beta, y, rows));
    return {};
  }
  const void* wd = w.data;
  cudaDataType_t t = w.dtype == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
  if (dtype_is_quantized(w.dtype)) {
    if (size_t(w.rows * w.cols) * 2 > wtmp_bytes_) return make_error("internal: dequant scratch");
    if (w.dtype == DType::kQ8_0 || w.dtype == DType::kQ4_K) {
      ExpertDequant q;
      q.type[0] = w.dtype;
      q.direct[0] = w.data;
      q.blocks[0] = w.rows * w.cols / 32;
      q.dst = wtmp_;
      dequantize_experts_bf16(q, stream_);
    } else {
      dequantize_bf16(w, wtmp_, stream_);
    }
    wd = wtmp_;
    t = CUDA_R_16BF;
  }
  CUBLAS_TRY(bl_->gemm_ex(blas_, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &one, wd, t, cols, x, t,
                          cols, &beta, y, CUDA_R_32F, rows, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT));
  return {};
}

}  // namespace detail

using detail::CudaSession;
using detail::gib;
using detail::open_device;

namespace {
// Weights first: `bytes` of them too many for the device's free memory fail before any is
// loaded or made, with the sizes ("<what> need [at least] N GiB on <where>, which has ...").
Status check_weights_fit(const std::string& what, uint64_t bytes, bool at_least,
                         const std::string& where) {
  size_t free_b = 0, total_b = 0;
  CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
  if (bytes <= free_b) return {};
  return make_error(what + " need " + (at_least ? "at least " : "") + std::to_string(gib(bytes)) +
                    " GiB on " + where + ", which has " + std::to_string(gib(free_b)) +
                    " GiB free of " + std::to_string(gib(total_b)) + " GiB");
}

// The layer kinds the CUDA forward pass runs: GQA with rotate-half RoPE on all or the first
// part of each head (no YaRN), full causal attention without sinks, output gates or biases on
// o_proj (no gated DeltaNet layers), and
// every RouterSpec but gpt-oss's (a router bias, a softmax over the top-k logits) with experts
// of SiLU * up and no biases. Others are refused before any upload, each missing kind named.
Status check_cuda_runs(const model::HParams& hp) {
  std::vector<std::string> missing;
  auto need = [&](bool cond, const char* what) {
    if (cond) missing.push_back(what);
  };
  bool sliding = false;
  for (int w : hp.layer_window) sliding |= w > 0;
  need(hp.attention == model::AttentionKind::kMla, "multi-head latent attention (MLA)");
  need(hp.has_deltanet(), "gated DeltaNet linear attention");
  need(hp.attn_output_gate, "an attention output gate");
  need(hp.rope.layout != model::RopeLayout::kHalf, "interleaved RoPE");
  need(hp.rope.yarn, "YaRN RoPE");
  need(hp.attention_sinks, "attention sinks");
  need(sliding, "sliding-window attention");
  need(hp.o_bias, "an o_proj bias");
  need(hp.router.logit_bias, "a router bias");
  need(hp.router.scoring == model::ScoreFn::kTopkSoftmax, "a softmax over the top-k router logits");
  need(hp.expert_bias, "expert biases");
  need(hp.expert_act.kind == model::ExpertAct::kClampedSwiglu, "the clamped SwiGLU");
  need(hp.n_experts > kMaxExperts, "more than 512 experts");
  need(hp.router.n_group > 64, "more than 64 expert groups");
  if (missing.empty()) return {};
  std::string list;
  for (size_t i = 0; i < missing.size(); ++i)
    list += (i == 0 ? "" : i + 1 == missing.size() ? " and " : ", ") + missing[i];
  return make_error("--device cuda: " + hp.model_type + " needs " + list +
                    ", which the CUDA backend does not run yet; use --device cpu");
}
}  // namespace

Result<std::unique_ptr<runtime::Engine>> make_cuda_session(const runtime::LoadedModel& model,
                                                           runtime::SessionOptions options,
                                                           int device) {
  TS_TRY(check_cuda_runs(model.hp()));
  TS_ASSIGN(std::string name, open_device(device));
  const bool all_experts = options.gpu_experts.residency == runtime::GpuResidency::kResident;
  const bool quantize = options.quantize_q8_0;
  auto s = std::make_unique<CudaSession>(model.hp(), std::move(options), device);
  TS_TRY(s->begin(device));
  // With the GPU expert cache only the dense weights must fit; the cache takes what is left.
  // Quantized to Q8_0 at load, no weight takes less than 34 / 128 of its bytes as stored (F32
  // matrices exactly that; BF16 ones twice it; quantized ones and the float embedding and
  // router as they are): the check is then on that bound, so it never refuses a model that
  // fits once quantized, and the allocator names the sizes where the bound passes and the
  // weights do not.
  const uint64_t stored =
      model.counts().dense_bytes + (all_experts ? model.counts().routed_bytes : 0);
  TS_TRY(check_weights_fit("the model's weights", quantize ? stored / 128 * 34 : stored, quantize,
                           quantize ? name + " (quantized to Q8_0 at load)" : name));
  TS_TRY(s->upload(model));
  TS_TRY(s->init(name));
  return std::unique_ptr<runtime::Engine>(std::move(s));
}

Result<std::unique_ptr<runtime::Engine>> make_synthetic_cuda_session(
    const model::HParams& hp, runtime::SessionOptions options, int device,
    SyntheticOptions synthetic) {
  TS_TRY(check_cuda_runs(hp));
  TS_ASSIGN(std::string name, open_device(device));
  const bool all_experts = options.gpu_experts.residency == runtime::GpuResidency::kResident;
  auto s = std::make_unique<CudaSession>(hp, std::move(options), device);
  TS_TRY(s->begin(device));
  TS_ASSIGN(const model::WeightBytes bytes,
            model::synthetic_weight_bytes(hp, synthetic.dtype,
                                          synthetic.expert_down_dtype.value_or(synthetic.dtype)));
  TS_TRY(check_weights_fit("the synthetic model's weights",
                           bytes.dense + (all_experts ? bytes.routed : 0), false, name));
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

Result<double> replay_step_ms(runtime::Engine& engine, int n) {
  auto* s = dynamic_cast<CudaSession*>(&engine);
  if (!s) return make_error("replay_step_ms: not a CUDA session");
  return s->replay_step_ms(n);
}

CudaBenchInfo bench_info(const runtime::Engine& engine) {
  const auto* s = dynamic_cast<const CudaSession*>(&engine);
  return s ? s->info() : CudaBenchInfo{};
}

}  // namespace ts::cuda
