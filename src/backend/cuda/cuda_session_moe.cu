// CudaSession's routed-expert pass: the MoE block (router, top-k, the two phases for few
// tokens), and the expert-grouped prefill (with the GPU expert cache's per-expert binding and
// Q8_0 experts dequantized to BF16 for long chunks).
#include "backend/cuda/cuda_session_impl.cuh"

namespace ts::cuda::detail {

Status CudaSession::moe_block(int layer, int n) {
  const DevLayer& L = w_.layers[size_t(layer)];
  const int d = hp_.d_model, k = hp_.top_k;
  // The norm also writes the Q8 copy the experts' gate|up GEMVs read (a Q8_0 router's
  // GEMV re-quantizes the same rows to the same bytes).
  const bool experts_q8 = n <= kGemvMaxTokens && q8_activations(L.experts[0].gate.dtype, d);
  const bool to_host = capturing_segments_;  // decode segments: one token
  // While predicting, each layer's picks are kept to be compared with the prediction.
  int* const ids = predicting_ ? real_ids_ + size_t(layer) * size_t(k) : sel_ids_;
  const RouteArgs route_args{.logits = router_,
                             .ids = ids,
                             .weights = sel_w_,
                             .hist = hist_ + size_t(layer) * size_t(hp_.n_experts),
                             .n = n,
                             .n_experts = hp_.n_experts,
                             .top_k = k,
                             .renormalize = hp_.router.renormalize,
                             .sigmoid = hp_.router.scoring == model::ScoreFn::kSigmoid,
                             .bias = L.corr_bias,
                             .n_group = hp_.router.n_group,
                             .topk_group = hp_.router.topk_group,
                             .group_max = hp_.router.group_score == model::GroupScore::kMax,
                             .scale = hp_.router.scale,
                             .host_ids = to_host ? ids_flag_dev_ + 1 : nullptr,
                             .host_flag = to_host ? ids_flag_dev_ : nullptr};
  // The fused norm + router + top-k (and the top-k in phase 1) rank by plain softmax only.
  const bool fused_route = n == 1 && !sampled_routing_ && route_args.plain() &&
                           norm_route_applies(L.router.dtype, d);
  // Decode with the experts resident: the top-k moves into phase 1's blocks, each ranking the
  // logits up to its own slot (MoeArgs::route), so the router's launch ends at its logits.
  // Not where the host reads the ids between the launches (the expert cache, router traces).
  const bool rank_in_p1 =
      fused_route && hp_.n_experts <= kMaxPhaseRouteExperts && !cached() && !to_host &&
      !iv_.trace_router &&
      (route_in_p1_ == 1 || (route_in_p1_ == -1 && L.experts[0].gate.dtype == DType::kQ8_0));
  if (fused_route) {
    // Decode: norm, router and top-k in one launch (each was a launch of its own, paid
    // mostly in latency: docs/PERF.md).
    TS_TRY(prof_.time("norm+router+top-k", double(L.router.n_bytes()), stream_, [&] {
      return launch([&] {
        norm_route({.x = x_,
                    .norm_w = L.ffn_norm,
                    .eps = hp_.rms_eps,
                    .d = d,
                    .xn = xn_,
                    .xq = experts_q8 ? qx_ : QAct{},
                    .router = L.router.data,
                    .router_dtype = L.router.dtype,
                    .logits = router_,
                    .counter = route_counter_,
                    .route = route_args,
                    .route_here = !rank_in_p1},
                   stream_);
      });
    }));
  } else {
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
    TS_TRY(prof_.time("top-k", double(n) * hp_.n_experts * 4, stream_,
                      [&] { return launch([&] { route(route_args, stream_); }); }));
  }
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
    MoeArgs a{.gate = L.gate_tab,
              .up = L.up_tab,
              .down = L.down_tab,
              .gate_dtype = L.experts[0].gate.dtype,
              .down_dtype = L.experts[0].down.dtype,
              .ids = ids,
              .weights = sel_w_,
              .xn = xn_,
              .h = h1_,
              .out = moe_out_,
              .n = n,
              .d_model = d,
              .d_expert = hp_.d_expert,
              .top_k = k,
              // Without a shared expert the sum goes straight onto the residual.
              .accumulate = !L.shared.gate.present()};
    if (a.accumulate) a.out = x_;
    if (experts_q8) {
      a.xq = qx_.q;
      a.xd = qx_.d;
    }
    if (rank_in_p1) a.route = route_args;
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
    // Phase 2 reads F32 h where its kernel takes Q8_0 rows against F32 h (one launch fewer:
    // docs/PERF.md); TURBOSPARK_CUDA_DOWN_Q8H=1 quantizes h for dp4a, as before (to measure).
    if (q8_activations(a.down_dtype, hp_.d_expert) && (down_q8_h() || !moe_down_f32_h(a))) {
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

// Rows per used expert (on average over the chunk) from which a chunk's quantized experts are
// dequantized to BF16 and run through the BF16 grouped kernel rather than read in place by
// grouped_quant_mma_kernel: docs/PERF.md measured in place faster for Q8_0 at 32 to 128 rows per
// expert and the copies at 256; for Q4_K (heavier to decode, two blocks an SM) in place at 8 to
// 64 rows, the copies at 128 and on the bench's concentrated 512-token chunks.
constexpr int kDequantQ8MinRows = 256, kDequantQ4KMinRows = 64;

namespace {
// Whether the experts can run on BF16 copies (dequantize_experts_bf16): each matrix Q8_0 or
// Q4_K (a Q4_K_M GGUF mixes Q4_K gate / up with Q6_K down, requantized to Q8_0 at load), of
// widths the BF16 grouped kernel takes.
bool dequantizable(const DevMlp& x) {
  for (const DevMatrix* w : {&x.gate, &x.up, &x.down})
    if (!dtype_is_quantized(w->dtype) || !grouped_supports(DType::kBF16, w->cols)) return false;
  return true;
}
}  // namespace

// Prefill: the chunk's (token, rank) slots sorted by expert; each expert used runs its
// three projections as GEMMs over its rows; the slots are then summed in rank order.

Status CudaSession::grouped_experts(int layer, int n) {
  const DevLayer& L = w_.layers[size_t(layer)];
  const int d = hp_.d_model, k = hp_.top_k, de = hp_.d_expert, ns = n * k;
  const DType gate_in = gemm_input_type(L.experts[0].gate.dtype);
  const DType down_in = gemm_input_type(L.experts[0].down.dtype);
  const size_t gate_es = gate_in == DType::kF32 ? 4 : 2;
  // BF16, Q8_0 and Q4_K experts run as two grouped tensor-core launches over tiles of each
  // expert's rows (all experts at once when all are bound together, else expert by expert),
  // phase 1 by the gate's type and phase 2 by the down matrix's (a Q4_K_M file's Q4_K gate /
  // up with Q8_0 down, requantized from Q6_K at load); other types run three cuBLAS GEMMs per
  // expert.
  const DType et = L.experts[0].gate.dtype, dt = L.experts[0].down.dtype;
  const bool in_place = L.experts[0].up.dtype == et &&
                        (dt == et || (dtype_is_quantized(et) && dtype_is_quantized(dt))) &&
                        grouped_supports(et, d) && grouped_supports(dt, de);
  // The slots sorted by expert and cut into tiles on the device (group_plan); the host reads
  // back each expert's first row and the plan's decisions, in one small copy. Long chunks of
  // quantized experts (and every chunk where the kernels cannot read them in place) run on
  // BF16 copies of them (kDequantQ8MinRows, kDequantQ4KMinRows). Quantized experts read in
  // place, none with more than kQuantSmallTile rows in the chunk: tiles of that height (half
  // the accumulators a block, four blocks an SM instead of three; +10% at 128-token Q8_0
  // prompts, docs/PERF.md). A taller expert would be cut in two tiles, each reading its
  // weights (measured slower at 512 tokens), so then the chunk keeps kGroupTile.
  const int ne = hp_.n_experts;
  const int dq_min_rows = dq_ && dequantizable(L.experts[0])
                              ? (et == DType::kQ4_K ? kDequantQ4KMinRows : kDequantQ8MinRows)
                              : 0;
  const int small_tile = dtype_is_quantized(et) ? kQuantSmallTile : 0;
  group_plan({.ids = sel_ids_,
              .ns = ns,
              .k = k,
              .n_experts = ne,
              .in_place = in_place,
              .dq_min_rows = dq_min_rows,
              .dq_tile = grouped_tile_rows(DType::kBF16),
              .small_tile = small_tile,
              .tile = grouped_tile_rows(et),
              .src = group_src_,
              .row_of = group_row_of_,
              .tiles = group_tiles_,
              .summary = plan_},
             stream_);
  // Without the expert cache, where the host can tell which tile heights the plan may have
  // without reading it, the GEMMs run on the plan unread: no synchronization in the layer.
  // The grids are bounded by the most tiles the chunk can have, and a launch's blocks exit
  // past the plan's tile count or when the plan's height is not the launch's. BF16 experts
  // have one height; quantized experts read in place have kQuantSmallTile rows or their
  // kernel's (a launch of each), where the chunk has too few slots for the BF16 copies
  // (every token routes to k distinct experts, so at least k are used). Quantized chunks of
  // at most kQuantSmallTile tokens read the plan: unread they measured ~3% slower on the
  // H100 (Q8_0, 16 and 32 tokens; 64 and 128 gain 2-3%; docs/PERF.md).
  std::vector<int> heights;
  if (!cached() && in_place && (dq_min_rows == 0 || ns < dq_min_rows * k) &&
      (small_tile == 0 || n > small_tile)) {
    if (small_tile > 0) heights.push_back(small_tile);
    heights.push_back(grouped_tile_rows(et));
  }
  const bool unread = !heights.empty();
  // The plan's tile count and tile rows, as the kernels read them (GroupedArgs::plan).
  const int* const unread_plan = unread ? plan_ + ne + 3 : nullptr;
  // count[e] .. count[e + 1]: expert e's sorted rows (read in place: only the next layer's
  // plan overwrites them); null on the unread plan.
  const int* count = nullptr;
  int n_tiles = 0, tile_rows = 0;
  bool dq = false;
  if (!unread) {
    CUDA_TRY(cudaMemcpyAsync(h_plan_, plan_, size_t(ne + 1 + kPlanFields) * 4,
                             cudaMemcpyDeviceToHost, stream_));
    CUDA_TRY(cudaStreamSynchronize(stream_));
    count = h_plan_;
    const int* decided = h_plan_ + ne + 1;
    used_fraction_ = double(decided[0]) / double(ne);
    n_tiles = decided[2];
    tile_rows = decided[3];
    dq = decided[4] != 0;
  }
  const bool tiled = in_place || dq;
  // Q8_0 / Q4_K gate and up read in place: phase 1 on F16 MMAs where the input fits F16
  // (fewer instructions a weight than the BF16 form, whose conversions bound it: docs/PERF.md).
  const bool x_f16 = L.experts_f16_input && in_place && !dq && grouped_takes_f16(et, d);
  // Gathered rows: F16/BF16 in act_; F32 in slot_rows_, where each expert's down projection
  // then overwrites its own rows after its gate/up GEMMs have read them (one stream, in
  // order). The down outputs [ns, d_model] always land in slot_rows_.
  //
  // With the GPU expert cache, each used expert is bound before its GEMMs: hits stay in
  // their slots (protected for the whole layer), misses are copied once into a free slot or,
  // when none is left, into the staging ring; the copy stream runs ahead of the GEMMs by up
  // to the ring's length, so loading the next experts overlaps computing this one.
  void* xg = gate_in == DType::kF32 ? static_cast<void*>(slot_rows_) : act_;
  gather_rows(xn_, group_src_, ns, d, xg, x_f16 ? DType::kF16 : gate_in, stream_);
  // Phase 1 into h2_ (BF16 [ns, de]), phase 2 into slot_rows_, for tiles [t0, t0 + nt):
  // weights through the tables tab (gate, up, down) or, for one expert's tiles, at direct.
  const auto run_tiles = [&](int t0, int nt, const void** const* tab, const void* const* direct,
                             DType dtype, DType down_dtype) {
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
                  .out = h2_,
                  .tile_rows = tile_rows,
                  .x_f16 = x_f16,
                  .plan = unread_plan};
    grouped_gate_up(a, stream_);
    a = GroupedArgs{.tiles = group_tiles_ + t0,
                    .n_tiles = nt,
                    .w0 = tab ? tab[2] : nullptr,
                    .direct0 = direct ? direct[2] : nullptr,
                    .dtype = down_dtype,
                    .x = h2_,
                    .n = d,
                    .k = de,
                    .out = slot_rows_,
                    .tile_rows = tile_rows,
                    .plan = unread_plan};
    grouped_down(a, stream_);
  };
  const void** layer_tab[3] = {L.gate_tab, L.up_tab, L.down_tab};
  if (unread) {
    for (const int h : heights) {
      tile_rows = h;  // run_tiles's launches are for tiles of this height
      run_tiles(0, (ns + h - 1) / h + std::min(ne, ns), layer_tab, nullptr, et, dt);
    }
    slot_sum(slot_rows_, group_row_of_, sel_w_, n, k, d, moe_out_, stream_);
    return {};
  }
  // Expert e's tiles are [first_tile[e], first_tile[e + 1]) of the plan's, in expert order.
  std::vector<int> first_tile(size_t(ne) + 1, 0);
  for (int e = 0; e < ne; ++e)
    first_tile[size_t(e) + 1] =
        first_tile[size_t(e)] +
        (tiled ? (count[size_t(e) + 1] - count[size_t(e)] + tile_rows - 1) / tile_rows : 0);
  if (count[size_t(ne)] != ns || first_tile[size_t(ne)] != n_tiles)
    return make_error("internal: the device's expert plan does not add up (" +
                      std::to_string(count[size_t(ne)]) + " rows, " + std::to_string(n_tiles) +
                      " tiles)");
  const void** dq_tab[3] = {dq_tab_, dq_tab_ + ne, dq_tab_ + 2 * size_t(ne)};
  const auto dq_args = [&] {
    ExpertDequant q;
    q.type[0] = L.experts[0].gate.dtype;
    q.type[1] = L.experts[0].up.dtype;
    q.type[2] = L.experts[0].down.dtype;
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
      run_tiles(0, n_tiles, layer_tab, nullptr, et, dt);
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
        ExpertDequant q = dq_args();
        q.experts = dq_ids_ + g0;
        for (int m = 0; m < 3; ++m) {
          q.src_tab[m] = layer_tab[m];
          q.dst_tab[m] = dq_tab[m];
        }
        q.count = int(g1 - g0);
        dequantize_experts_bf16(q, stream_);
        const int t0 = first_tile[size_t(ids[g0])], t1 = first_tile[size_t(ids[g1 - 1]) + 1];
        run_tiles(t0, t1 - t0, dq_tab, nullptr, DType::kBF16, DType::kBF16);
      }
    }
  }
  for (int e = 0; e < hp_.n_experts && !all_at_once; ++e) {
    const int m = count[size_t(e) + 1] - count[size_t(e)];
    if (m == 0) continue;
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
        ExpertDequant q = dq_args();
        q.direct[0] = x.gate.data;
        q.direct[1] = x.up.data;
        q.direct[2] = x.down.data;
        dequantize_experts_bf16(q, stream_);
        const void* copy[3];
        for (int m = 0; m < 3; ++m) copy[m] = dq_ + dq_off_[m];
        run_tiles(t0, nt, nullptr, copy, DType::kBF16, DType::kBF16);
      } else {
        const void* at[3] = {x.gate.data, x.up.data, x.down.data};
        run_tiles(t0, nt, nullptr, at, et, dt);
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
  const DevLayer* dql = nullptr;
  for (const DevLayer& L : w_.layers) {
    if (L.is_moe && dequantizable(L.experts[0])) {
      dql = &L;
      break;
    }
  }
  if (!dql) return {};
  const DevMlp& x = dql->experts[0];
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

}  // namespace ts::cuda::detail
