// CUDA kernels of the forward pass, with host launchers. Activations are F32; weights keep
// their dtype (F32, F16, BF16, or GGUF Q8_0 / Q4_K blocks) and are converted in registers.
// Every launcher takes the stream it runs on; none synchronizes.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace ts::cuda {

// A weight matrix in device memory: [rows, cols] row-major in its dtype.
struct DevMatrix {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_bytes() const { return size_t(dtype_row_bytes(dtype, cols)); }
  size_t n_bytes() const { return size_t(rows) * row_bytes(); }
  bool present() const { return data != nullptr; }
};

// y[t, r] = sum_c W[r, c] x[t, c] for t < n (accumulate: y += instead of =). x rows are
// `cols` floats apart. One warp per row; tokens in tiles of up to 4 share each weight load.
void gemv(const DevMatrix& w, const float* x, int n, float* y, bool accumulate, cudaStream_t s);

// Activations quantized to Q8 blocks of 32 (d = max|x| / 127): int8 q [n], F32 d [n / 32].
struct QAct {
  int8_t* q = nullptr;
  float* d = nullptr;
};
// n a multiple of 32; x 16-byte aligned.
void quantize_act(const float* x, int64_t n, QAct out, cudaStream_t s);

// The GEMV's input: F32 rows, and for Q8_0 weights optionally the same rows as Q8 blocks, in
// which case the integer dot products run on dp4a (llama.cpp's MMVQ scheme).
struct GemvInput {
  const float* x = nullptr;
  QAct q;  // {} = use x
};
// Up to 3 matrices of one dtype and width in one launch; y[i] gets w[i] . x.
void gemv_parts(const DevMatrix* w, float* const* y, int parts, GemvInput in, int n,
                bool accumulate, cudaStream_t s);

// x[t] = table[ids[t]] as F32. table: F32, F16 or BF16.
void embed_rows(const DevMatrix& table, const int* ids, int n, float* x, cudaStream_t s);

// y = x / rms(x) * w over rows of `cols` (in place allowed); with q (cols a multiple of 32),
// also y quantized to q as quantize_act would (one launch instead of two).
void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int cols, float eps,
             cudaStream_t s, QAct q = {});

// Whether this build holds a kernel image the current device can run (cudaSuccess), or why
// not (cudaErrorNoKernelImageForDevice, ...): asked before any work, not at the first launch.
cudaError_t kernel_image_status();

void add_bias(float* y, const float* b, int n, int dim, cudaStream_t s);
void add_inplace(float* x, const float* y, int64_t n, cudaStream_t s);
// h = silu(g) * u
void silu_mul(const float* g, const float* u, float* h, int64_t n, cudaStream_t s);
// x[t, i] += moe[t, i] + g_t * shared[t, i]; g_t = sigmoid(shared_z[t]) when shared_z, 1
// otherwise; shared may be null (no shared expert).
void moe_residual(float* x, const float* moe, const float* shared, const float* shared_z, int n,
                  int d, cudaStream_t s);

// RoPE (rotate-half) on q and k of n tokens at positions *pos + t, then k and v appended
// to the layer's cache rows *pos + t: F32 rows, BF16 rows, or both (tests).
struct RopeKvArgs {
  float* q;               // [n, n_heads * head_dim]
  const float* k;         // [n, kv_dim]
  const float* v;         // [n, kv_dim]
  float* k_cache;         // [n_ctx, kv_dim] of this layer, or null (no F32 rows)
  float* v_cache;
  const float* inv_freq;  // [head_dim / 2]
  const int* pos;         // device scalar: position of token 0
  int n, n_heads, n_kv_heads, head_dim;
  int rot_dim = 0;                // RoPE turns the first rot_dim of each head (0: all), pairs
                                  // (i, i + rot_dim / 2); inv_freq holds rot_dim / 2
  const float* q_norm = nullptr;  // per-head RMSNorm weights [head_dim] applied first, or null
  const float* k_norm = nullptr;
  float eps = 0;
  // BF16 cache rows, rounded to nearest even from the F32 values: [n_ctx, kv_dim] of this
  // layer each, or null.
  void* k_bf16 = nullptr;
  void* v_bf16 = nullptr;
};
void rope_kv_append(const RopeKvArgs& a, cudaStream_t s);

// Causal attention of n queries (positions *pos + t) over the cache, split over the key
// range into n_splits parts that are merged afterwards (flash-decoding). The cache is F32
// rows (k_cache / v_cache: F32 models) or BF16 rows (k_bf16 / v_bf16: every other model);
// given both, the BF16 rows are read.
struct AttentionArgs {
  const float* q;        // [n, n_heads * head_dim]
  const float* k_cache;  // [n_ctx, kv_dim] F32, or null
  const float* v_cache;
  float* out;            // [n, n_heads * head_dim]
  float* partial;        // [n, n_heads, n_splits, head_dim + 2] scratch
  const int* pos;
  int n, n_heads, n_kv_heads, head_dim, n_splits;
  // BF16 cache rows [n_ctx, kv_dim], or null. With them, chunks of kTcAttentionMin+ tokens
  // with head_dim 64 or 128 run on tensor cores (Q, K, V and the probabilities in BF16, F32
  // accumulation and softmax), and so does one token on the split path (not the cluster)
  // where tc_decode_attention_applies; the other kernels widen the BF16 rows to F32 as they
  // read them (the bytes they give on F32 rows holding the same values).
  const void* k_bf16 = nullptr;
  const void* v_bf16 = nullptr;
  // Optional: out also as Q8 blocks (as quantize_act; n_heads * head_dim a multiple of 32),
  // written by the merge when heads are whole blocks, else by a quantize_act launch after.
  QAct out_q = {};
  // One token over at most kClusterAttentionKeys keys, by KV head (cluster_attention_applies):
  // one thread block cluster per KV head merges its splits itself (no partial rows, no merge
  // launch), the same bytes as the CUDA-core split path (attention_gqa_kernel and the merge)
  // on the same cache rows; n_splits and partial are then unused.
  bool cluster = false;
};
constexpr int kTcAttentionMin = 16;
// The current device launches thread block clusters (sm_90) and this build has the kernels.
bool cluster_launch_available();
constexpr int kClusterSplits = 8;
constexpr int kClusterAttentionKeys = kClusterSplits * 32;
// The device and build launch clusters, and TURBOSPARK_CUDA_ATTN_CLUSTER is not 0 (to measure).
bool cluster_attention_available();
bool cluster_attention_applies(int n_heads, int n_kv_heads, int head_dim);
// Decode (and n = 1 of a chunk) runs one block per KV head and split when this holds (K and V
// read once per group of query heads), else one block per query head and split.
bool gqa_attention_applies(int n_heads, int n_kv_heads, int head_dim);
// One token by KV head on tensor cores, from the BF16 copies: head dims 64 and 128, at most 16
// query heads per KV head, and TURBOSPARK_CUDA_DECODE_TC not 0 (to measure).
bool tc_decode_attention_applies(int n_heads, int n_kv_heads, int head_dim);
void attention(const AttentionArgs& a, cudaStream_t s);
constexpr int kMaxHeadDim = 256;

// Router: softmax over the logits -> top-k (rank order, ties to the lower id) -> optional
// renormalisation, one warp per token; counts each selection in hist[id] (may be null).
struct RouteArgs {
  const float* logits;  // [n, n_experts]
  int* ids;             // [n, top_k]
  float* weights;       // [n, top_k]
  unsigned long long* hist;  // [n_experts] of this layer
  int n, n_experts, top_k;
  bool renormalize;
  // The rest of model::RouterSpec (sigmoid scores, a selection-only correction bias, groups,
  // routed_scaling_factor). Only route() reads them (route_spec_kernel, model::select_experts'
  // rule); the fused decode kernels take plain softmax routing alone (plain()).
  bool sigmoid = false;
  const float* bias = nullptr;  // [n_experts] added to the scores for selection only, or null
  int n_group = 1, topk_group = 1;
  bool group_max = false;       // a group's score: its best (V2), else its two best summed
  float scale = 1.0f;
  bool plain() const { return !sigmoid && !bias && n_group == 1 && scale == 1.0f; }
  // Optional (n == 1 only; the GPU expert cache's decode segments): the ids also written to mapped
  // host memory, then *host_flag = 1 after a system-wide fence, so the host can bind without a
  // device-to-host copy and a stream synchronization.
  int* host_ids = nullptr;
  int* host_flag = nullptr;
};
// plain(): one warp a token (route_kernel); else one thread a token (route_spec_kernel).
void route(const RouteArgs& a, cudaStream_t s);
constexpr int kMaxExperts = 512;

// Decode (one token) of a MoE layer's entry in one launch: RMSNorm of x (written to xn and,
// with xq, its Q8 copy: the same bytes rmsnorm() writes), the router GEMV (the logits the
// GEMV gives, to logits) and route() on them. route.n must be 1.
struct NormRouteArgs {
  const float* x;       // [d] the residual stream
  const float* norm_w;  // [d]
  float eps;
  int d;
  float* xn;  // [d]
  QAct xq = {};
  const void* router;  // [n_experts, d] of router_dtype
  DType router_dtype;
  size_t row_bytes = 0;  // set by norm_route()
  int rows = 0;          // experts per block, set by norm_route()
  float* logits;         // [n_experts]
  unsigned* counter;     // a device counter, 0 between launches (the kernel leaves it 0)
  RouteArgs route;       // route.logits is set to logits
  // Threads per block: 0 = rmsnorm_block(d), whose bits rmsnorm() writes; a prediction may
  // take fewer, to find room beside other kernels' blocks (its bits then differ).
  int block = 0;
  // False: the logits only (phase 1 ranks them: MoeArgs::route); counter and route unused.
  bool route_here = true;
};
// Router types the fused launch takes (F32, BF16, F16) and widths (a multiple of 32).
bool norm_route_applies(DType router_dtype, int d);
void norm_route(const NormRouteArgs& a, cudaStream_t s);

// The routed-expert pass for few tokens, experts addressed through per-layer tables of
// device pointers indexed by expert id (so a cache can bind slots without changing this).
struct MoeArgs {
  const void* const* gate;  // [n_experts] -> [d_expert, d_model]
  const void* const* up;
  const void* const* down;  // [n_experts] -> [d_model, d_expert]
  DType gate_dtype, down_dtype;
  const int* ids;           // [n, top_k]
  const float* weights;     // [n, top_k]
  const float* xn;          // [n, d_model]
  float* h;                 // [n, top_k, d_expert]
  float* out;               // [n, d_model]
  int n, d_model, d_expert, top_k;
  bool accumulate = false;  // out += the sum (out is the residual stream) instead of out =
  // Q8_0 experts: xn and h as Q8 blocks (null: F32 inputs).
  const int8_t* xq = nullptr;
  const float* xd = nullptr;
  const int8_t* hq = nullptr;
  const float* hd = nullptr;
  // Phase 1 only for the slots s with slot_mask[s] == mask_value (null: every slot): with
  // the GPU expert cache, the slots whose experts hit run while the misses are copied.
  const int* slot_mask = nullptr;
  int mask_value = 0;
  // BF16 / F16 phase 1: -1 picks its kernel by the grid's waves (gemv.cu gate_up_wide);
  // tests force 1 (40 registers) or 0 (default) to compare the two.
  int force_wide = -1;
  // Decode (n == 1) with the top-k in the phases (route.logits set; n_experts at most
  // kMaxPhaseRouteExperts): every phase 1 block ranks the router's logits itself, as route()
  // does, up to its own slot's rank; block (0, 0) also writes route.ids, weights and hist (ids
  // and weights must then be route's arrays) for phase 2 and the statistics. Phase 2 by rank
  // stages its rows before its wait, before phase 1's ids exist: each of its warps ranks the
  // logits up to its own rank. The router's launch then ends at its logits
  // (NormRouteArgs::route_here false): its last block's count and ranking leave the chain.
  RouteArgs route = {};
};
// Up to this many experts the top-k may run in the expert phases (MoeArgs::route).
constexpr int kMaxPhaseRouteExperts = 128;
// The gate and up matrices of the experts a layer is predicted to pick, asked into L2 ahead
// of its phases (cp.async.bulk.prefetch.L2: no registers, no shared memory, nothing waits for
// it). Only a prediction: the phases read the experts the router picks, whatever was
// prefetched, so the output is the same bytes with or without it.
struct PrefetchArgs {
  const void* const* gate;  // [n_experts] tables, as MoeArgs
  const void* const* up;
  const int* ids;  // [ranks] the predicted experts, best first (-1: none)
  int ranks;
  size_t bytes;  // one expert's gate (= up) matrix
};
void prefetch_experts(const PrefetchArgs& a, cudaStream_t s);
// hits[0] += how many of real[l, :] are among pred[l, :], hits[1] += how many were compared,
// over layers l with real[l, 0] >= 0 and pred[l, 0] >= 0.
void count_predicted(const int* pred, const int* real, int layers, int top_k,
                     unsigned long long* hits, cudaStream_t s);
// phase 1: h[t, r] = silu(gate_e . xn[t]) * (up_e . xn[t]), e = ids[t, r]
void moe_gate_up(const MoeArgs& a, cudaStream_t s);
// phase 2: out[t] (+)= sum over r = 0..k-1, in rank order, of weights[t, r] * (down_e . h[t, r])
void moe_down_sum(const MoeArgs& a, cudaStream_t s);
// Whether phase 2 of these Q8_0 experts runs its by-rank kernel on F32 h (hq null), which
// then needs no quantize_act of h before it.
bool moe_down_f32_h(const MoeArgs& a);
// TURBOSPARK_CUDA_DOWN_Q8H=1: phase 2 of Q8_0 experts on h quantized to Q8 (dp4a) even where
// moe_down_f32_h holds (to measure the difference).
bool down_q8_h();

// Prefill helpers (expert-grouped GEMMs).
// dst[i] = src[src_row[i]] (rows of d floats), converted to dst_type (F32, F16 or BF16).
void gather_rows(const float* src, const int* src_row, int n_rows, int d, void* dst,
                 DType dst_type, cudaStream_t s);
void convert_f32(const float* src, void* dst, DType dst_type, int64_t n, cudaStream_t s);
// Any matrix -> BF16 [rows, cols].
void dequantize_bf16(const DevMatrix& w, void* dst, cudaStream_t s);
// BF16 copies of Q8_0 or Q4_K matrices, the values dequantize_bf16 gives (rounded to BF16),
// for the grouped GEMMs of prefill chunks and cuBLAS: up to three matrices (gate, up, down) of
// each of `count` experts, or of one set of `direct` matrices. Expert j of the list lands at
// dst + j * dst_stride + dst_off[m] (all three 16-byte aligned), and with dst_tab set,
// dst_tab[m][experts[j]] receives that address (the table the grouped GEMMs read). Sources
// need only 2-byte alignment (Q8_0: 16-byte aligned ones are staged by cp.async; Q4_K:
// 8-byte aligned ones are read 8 quants at a time).
struct ExpertDequant {
  // Each matrix's type: Q8_0 or Q4_K (super-blocks of 256 values: rows of 256-multiples).
  DType type[3] = {DType::kQ8_0, DType::kQ8_0, DType::kQ8_0};
  const int* experts = nullptr;        // device ids [count]; null: direct
  const void* const* src_tab[3] = {};  // per-expert addresses (device tables)
  const void* direct[3] = {};          // the matrices when experts is null
  int64_t blocks[3] = {};              // 32-value blocks per matrix (0: none)
  void* dst = nullptr;
  size_t dst_off[3] = {};
  size_t dst_stride = 0;         // bytes per expert
  const void** dst_tab[3] = {};  // device tables, [n_experts] each
  int count = 1;
};
void dequantize_experts_bf16(const ExpertDequant& a, cudaStream_t s);
// out[t] = sum over r in rank order of weights[t, r] * rows[row_of[t * k + r]].
void slot_sum(const float* rows, const int* row_of, const float* weights, int n, int k, int d,
              float* out, cudaStream_t s);

// Expert-grouped GEMMs on tensor cores (BF16 x BF16, F32 accumulation) for prefill: the
// chunk's (token, rank) rows are sorted by expert and cut into tiles of up to kGroupTile rows
// of one expert; one launch runs every tile. Weights are read in place as BF16, Q8_0 or Q4_K
// blocks (dequantized to BF16 in shared memory, the value dequantize_bf16 gives).
constexpr int kGroupTile = 64;
constexpr int kQuantSmallTile = 32;  // Q8_0 / Q4_K tiles where no expert has more rows
constexpr int kWgTile = 128;  // the warpgroup-MMA kernels' tiles (grouped_sm90.cu)
struct GroupTile {
  int expert;  // index into the weight tables
  int row0;    // first sorted row
  int m;       // rows, 1..grouped_tile_rows(dtype)
};
struct GroupedArgs {
  const GroupTile* tiles = nullptr;  // device
  int n_tiles = 0;
  // Per-expert weight addresses (device tables): phase 1 gate / up, phase 2 down (w1 null).
  const void* const* w0 = nullptr;
  const void* const* w1 = nullptr;
  // When set, every tile uses these addresses instead of the tables (one expert's tiles).
  const void* direct0 = nullptr;
  const void* direct1 = nullptr;
  DType dtype = DType::kBF16;
  const void* x = nullptr;  // BF16 [rows, k]: the sorted rows
  int n = 0;                // output columns (rows of each weight matrix)
  int k = 0;                // weight columns
  void* out = nullptr;      // phase 1: BF16 [rows, n]; phase 2: F32 [rows, n]
  // The most rows a tile has: grouped_tile_rows(dtype), or kQuantSmallTile for Q8_0 / Q4_K
  // weights cut into tiles of that height (grouped_quant_mma_kernel then holds half the
  // accumulators).
  int tile_rows = kGroupTile;
  // x is F16 (phase 1 of Q8_0 / Q4_K weights read in place: grouped_takes_f16), else BF16.
  bool x_f16 = false;
  // A plan the host has not read (device: its tile count and tile rows, GroupPlanArgs's
  // summary from its tile count on): n_tiles is then a bound, and the blocks of tiles past the
  // plan's count, or of a launch whose tile_rows is not the plan's, exit without reading.
  const int* plan = nullptr;
};
// A prefill chunk's plan for the grouped GEMMs, made on the device from the router's ids (so
// the host reads back a few counts instead of sorting every slot): the (token, rank) slots
// sorted by expert, stable (slot order within an expert), and the expert's rows cut into
// tiles. The tile height follows the rule grouped_experts used on the host:
//   dq        = dq_min_rows > 0 && (!in_place || ns >= dq_min_rows * used)
//   tile_rows = dq ? dq_tile : (small_tile > 0 && most_rows <= small_tile) ? small_tile : tile
// and there are tiles only where in_place || dq.
struct GroupPlanArgs {
  const int* ids = nullptr;  // [ns] expert of each slot (token t, rank r at t * k + r)
  int ns = 0;
  int k = 1;
  int n_experts = 0;  // <= kMaxExperts
  bool in_place = false;
  int dq_min_rows = 0;  // 0: never on BF16 copies
  int dq_tile = 0;
  int small_tile = 0;  // 0: no small tiles
  int tile = kGroupTile;
  int* src = nullptr;          // [ns] token of sorted row i
  int* row_of = nullptr;       // [ns] sorted row of slot s
  GroupTile* tiles = nullptr;  // [<= ns / min tile rows + n_experts]
  // [n_experts + 1 + kPlanFields]: the first sorted row of each expert (and ns), then
  // used experts, most rows of one expert, tiles, tile rows, dq (0 / 1).
  int* summary = nullptr;
};
constexpr int kPlanFields = 5;
void group_plan(const GroupPlanArgs& a, cudaStream_t s);

// Whether the grouped kernels take weights of `type` with `cols` columns (BF16: a multiple
// of 8; Q8_0: of 32).
bool grouped_supports(DType type, int64_t cols);
// Whether phase 1 of `type` weights with `cols` columns runs on F16 x (GroupedArgs::x_f16):
// the quantized experts read in place (Q8_0 with cols a multiple of 128, Q4_K).
bool grouped_takes_f16(DType type, int64_t cols);
// Phase 1: out = bf16(silu(x W0^T) * (x W1^T)) (gate, up). Phase 2: out = x W0^T (down).
void grouped_gate_up(const GroupedArgs& a, cudaStream_t s);
void grouped_down(const GroupedArgs& a, cudaStream_t s);
// Rows per tile the grouped kernels take for weights of `type`: kWgTile on the
// warpgroup-MMA kernels, else kGroupTile.
int grouped_tile_rows(DType type);
// Whether BF16 weights take the warpgroup-MMA kernels (grouped_sm90.cu): a compute 9.0 device
// and a build for sm_90a (checked once by running a probe kernel).
bool grouped_wgmma_available();
// Those kernels (BF16 weights only): phase 1 when gate_up, else phase 2.
void grouped_wgmma(bool gate_up, const GroupedArgs& a, cudaStream_t s);
// The mma.sync kernels for BF16 weights on tiles of kGroupTile rows, which devices without
// warpgroup MMA run (called directly by the kernel tests on devices that have it).
void grouped_mma(bool gate_up, const GroupedArgs& a, cudaStream_t s);

// F32 -> Q8_0 blocks (llama.cpp's reference rounding); n a multiple of 32.
void quantize_q8_0(const float* x, void* out, int64_t n, cudaStream_t s);
// Any float matrix -> F32 (for quantizing at load).
void to_f32(const DevMatrix& w, float* dst, cudaStream_t s);
// Uniform(-scale, scale) from a counter hash, written as `type` (F32, F16, BF16).
void fill_uniform(void* dst, DType type, int64_t n, float scale, uint64_t seed, cudaStream_t s);
void fill_value(float* dst, int64_t n, float value, cudaStream_t s);
// n values (a multiple of 256) as random Q4_K blocks in about [-scale, 2 * scale].
void fill_q4_k_random(void* dst, int64_t n, float scale, uint64_t seed, cudaStream_t s);
// bench --routing: router logits [n, n_experts] replaced by bias[e] (null: 0) plus Gumbel
// noise hashed from (seed, pos[0] + t, e), so top-k samples softmax(bias) afresh per position.
void synthetic_route(float* logits, const float* bias, const int* pos, int n, int n_experts,
                     uint64_t seed, cudaStream_t s);

// Greedy decoding on the device (CudaSession::decode_greedy): the argmax of logits[vocab] (the
// first of the largest, NaN skipped; 0 where logits[0] is NaN or every logit is), as
// runtime::argmax. One launch of kGreedyBlocks blocks; the last block to finish (counted in
// *count, left 0 again) writes the id as the next step's input (tokens[0]), advances pos[0]
// by one, and hands it to the host: ring[1 + seq % ring_size] = id, then ring[0] = seq + 1
// (ring in mapped pinned memory; the store of the id is fenced before the count's), where seq
// (*seq, incremented) counts the picks since it was last zeroed.
struct GreedyPick {
  const float* logits = nullptr;
  int vocab = 0;
  int* tokens = nullptr;
  int* pos = nullptr;
  float* part_v = nullptr;  // [kGreedyBlocks]
  int* part_i = nullptr;    // [kGreedyBlocks]
  unsigned* count = nullptr;
  unsigned* seq = nullptr;
  int* ring = nullptr;  // device pointer of the mapped ring, 1 + ring_size ints
  int ring_size = 0;
};
constexpr int kGreedyBlocks = 64;
void greedy_pick(const GreedyPick& a, cudaStream_t s);

}  // namespace ts::cuda
