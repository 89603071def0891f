// The GPU expert cache of CudaSession (--residency host|streamed on CUDA): slots per MoE
// layer, binding a step's experts, copying misses, the whole-layer prefetch, warm start.
#include "backend/cuda/cuda_session_impl.cuh"

namespace ts::cuda::detail {

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
  segment_sets_[attn_cluster_ ? 1 : 0].push_back(exec);
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

}  // namespace ts::cuda::detail
