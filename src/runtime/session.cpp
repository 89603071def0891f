#include "runtime/session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "backend/cpu/kernels.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/quant.h"
#include "core/thread_pool.h"
#include "model/router.h"

namespace ts::runtime {
namespace {

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// y[n, rows] = x[n, cols] . W^T; one token goes through the matrix-vector kernel.
void linear(ThreadPool& pool, const model::Matrix& w, const float* x, int n, float* y) {
  if (n == 1) {
    cpu::matvec(pool, w.data, w.dtype, x, y, w.rows, w.cols);
  } else {
    cpu::matmul(pool, w.data, w.dtype, x, n, y, w.rows, w.cols);
  }
}

void add_bias(float* y, const std::vector<float>& b, int n) {
  if (b.empty()) return;
  for (int t = 0; t < n; ++t)
    for (size_t i = 0; i < b.size(); ++i) y[size_t(t) * b.size() + i] += b[i];
}

// y[t, :] += b[row * width ..] for n rows of `width`: expert `row`'s bias out of the layer's
// array of all experts' biases (nothing when that array is empty).
void add_expert_bias(float* y, const std::vector<float>& all, int row, int n, int width) {
  if (all.empty()) return;
  const float* b = all.data() + size_t(row) * size_t(width);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < width; ++i) y[size_t(t) * size_t(width) + size_t(i)] += b[i];
}

// h = act(g, u) over n values, by the model's expert activation.
void expert_activation(const model::ExpertActSpec& act, const float* g, const float* u, float* h,
                       int64_t n) {
  switch (act.kind) {
    case model::ExpertAct::kSiluMul: cpu::silu_mul(g, u, h, n); break;
    case model::ExpertAct::kClampedSwiglu:
      cpu::clamped_swiglu(g, u, h, n, act.limit, act.alpha);
      break;
  }
}

}  // namespace

namespace {
int context_of(const model::HParams& hp, const SessionOptions& o) {
  return o.n_ctx > 0 ? o.n_ctx : std::min(hp.max_positions, 4096);
}
int blocks_of(const model::HParams& hp, const SessionOptions& o) {
  const int64_t kv_tokens = o.kv_tokens > 0 ? o.kv_tokens : context_of(hp, o);
  return int((kv_tokens + KvBlocks::kTokens - 1) / KvBlocks::kTokens);
}
}  // namespace

Session::Session(const LoadedModel& model, ThreadPool& pool, SessionOptions options)
    : model_(model), pool_(pool), blocks_(blocks_of(model.hp(), options)) {
  const model::HParams& hp = model.hp();
  n_ctx_ = context_of(hp, options);
  chunk_ = options.prefill_chunk > 0 ? options.prefill_chunk : 256;
  const bool mla = hp.attention == model::AttentionKind::kMla;
  n_blocks_ = blocks_.n_blocks();
  const size_t kv = size_t(hp.n_layers) * size_t(n_blocks_) * kKvBlock * size_t(hp.cache_row());
  // Not zeroed: untouched pages of a large allocation take no memory, so a pool sized for many
  // full-length sequences costs what the sequences use. Only written rows are ever read.
  k_cache_.reset(new float[kv]);
  if (!mla) v_cache_.reset(new float[kv]);
  seqs_.resize(1);
  seqs_[0].open = true;
  const size_t c = size_t(chunk_), d = size_t(hp.d_model);
  const size_t hidden = size_t(std::max({hp.d_expert, hp.d_ff, hp.d_shared}));
  x_.resize(c * d);
  xn_.resize(c * d);
  tmp_.resize(c * d);
  q_.resize(c * size_t(hp.q_dim()));
  att_.resize(c * size_t(std::max({hp.q_dim(), hp.attn_out_dim(), hp.deltanet.value_dim()})));
  if (hp.attn_output_gate) {
    qg_.resize(c * size_t(hp.q_proj_rows()));
    gate_.resize(c * size_t(hp.q_dim()));
  }
  dn_index_.assign(size_t(hp.n_layers), -1);
  int n_dn = 0;
  for (int l = 0; l < hp.n_layers; ++l)
    if (hp.layer_mixer[size_t(l)] == model::MixerKind::kGatedDeltaNet) dn_index_[size_t(l)] = n_dn++;
  clear_state(seqs_[0]);
  if (n_dn > 0) {
    const model::DeltaNetSpec& dn = hp.deltanet;
    dn_qkv_.resize(c * size_t(dn.conv_dim()));
    dn_x_.resize(c * size_t(dn.conv_dim()));
    dn_z_.resize(c * size_t(dn.value_dim()));
    dn_b_.resize(c * size_t(dn.n_v_heads));
    dn_a_.resize(c * size_t(dn.n_v_heads));
    if (dn.grouped_projection)
      dn_proj_.resize(c * size_t(2 * dn.key_dim() + 2 * dn.value_dim()));
  }
  if (mla) {
    lat_.resize(c * size_t(std::max(hp.mla.q_lora_rank, hp.cache_row())));
  } else {
    k_.resize(c * size_t(hp.kv_dim()));
    v_.resize(c * size_t(hp.kv_dim()));
  }
  router_.resize(c * size_t(hp.n_experts));
  slots_.resize(c * size_t(hp.top_k) * d);
  gather_.resize(c * d);
  h1_.resize(c * hidden);
  h2_.resize(c * hidden);
  h3_.resize(c * d);
  sel_ids_.resize(c * size_t(hp.top_k));
  sel_w_.resize(c * size_t(hp.top_k));
  last_logits_.resize(size_t(hp.vocab));
  router_hist_.assign(size_t(hp.n_layers) * size_t(hp.n_experts), 0);
  iv_ = std::move(options.interventions);
  iv_.steer.resize(size_t(hp.n_layers));
  capture_index_.assign(size_t(hp.n_layers) + 1, -1);
  for (int l : iv_.capture_layers) {
    TS_CHECK(l >= -1 && l < hp.n_layers, "capture layer validated by parse_layer_list");
    capture_index_[size_t(l + 1)] = int(captures_.size());
    captures_.emplace_back();
  }
}

int64_t Session::captured_positions() const {
  if (captures_.empty()) return 0;
  return int64_t(captures_[0].size()) / model_.hp().d_model;
}

void Session::layer_boundary(int layer, int n, bool last_chunk) {
  const size_t d = size_t(model_.hp().d_model);
  if (layer >= 0)
    for (const SteerOp& op : iv_.steer[size_t(layer)])
      for (int t = 0; t < n; ++t) apply_steer(op, x_.data() + size_t(t) * d, int64_t(d));
  const int c = capture_index_[size_t(layer + 1)];
  if (c < 0 || !capturing_) return;
  if (iv_.capture_last) {
    if (!last_chunk) return;
    const float* row = x_.data() + size_t(n - 1) * d;
    captures_[size_t(c)].insert(captures_[size_t(c)].end(), row, row + d);
  } else {
    captures_[size_t(c)].insert(captures_[size_t(c)].end(), x_.data(), x_.data() + size_t(n) * d);
  }
}

void Session::reset() {
  release_blocks(seqs_[0]);
  seqs_[0].pos = 0;
  clear_state(seqs_[0]);
}

void Session::truncate(int n) {
  Sequence& s = seqs_[0];
  if (model_.hp().has_deltanet() && n < s.pos) {
    s.pos = 0;
    clear_state(s);
    return;
  }
  s.pos = std::min(s.pos, std::max(0, n));
}

void Session::clear_state(Sequence& s) const {
  const int64_t layers = std::count_if(dn_index_.begin(), dn_index_.end(), [](int i) { return i >= 0; });
  s.state.assign(size_t(layers * model_.hp().deltanet.state_floats()), 0.0f);
}

void Session::release_blocks(Sequence& s) {
  for (int b : s.blocks) blocks_.release(b);
  s.blocks.clear();
}

Status Session::grow_blocks(Sequence& s, int positions) {
  const size_t want = size_t(positions + kKvBlock - 1) / kKvBlock;
  if (want <= s.blocks.size()) return {};
  if (int64_t(want - s.blocks.size()) > blocks_.available())
    return make_error("the KV cache is full: " + std::to_string(int64_t(n_blocks_) * kKvBlock) +
                      " positions, all held by sequences (--kv-tokens sets the pool)");
  while (s.blocks.size() < want) s.blocks.push_back(blocks_.take());
  return {};
}

float* Session::kv_layer(float* cache, int layer, int row_floats) const {
  return cache + size_t(layer) * size_t(n_blocks_) * kKvBlock * size_t(row_floats);
}

float* Session::kv_row(float* cache, int layer, int seq, int pos, int row_floats) {
  return kv_layer(cache, layer, row_floats) + kv_rows(seq).row(pos) * size_t(row_floats);
}

Result<int> Session::open_sequence(int max_tokens, std::span<const int> prefix) {
  if (max_tokens < 1 || max_tokens > n_ctx_)
    return make_error("a sequence of " + std::to_string(max_tokens) +
                      " positions does not fit the context of " + std::to_string(n_ctx_));
  size_t id = 1;
  while (id < seqs_.size() && seqs_[id].open) ++id;
  if (id == seqs_.size()) seqs_.emplace_back();
  Sequence& s = seqs_[id];
  s = Sequence{.reserve = max_tokens, .open = true};
  clear_state(s);
  // The prefix's whole blocks found in the cache, all but its last token, within the reserve.
  // A recurrent state is not in the blocks: with DeltaNet layers nothing is shared.
  const size_t most = prefix.empty() || model_.hp().has_deltanet()
                          ? 0
                          : std::min(prefix.size() - 1, size_t(max_tokens)) / kKvBlock;
  for (size_t b = 0; b < most; ++b) {
    const int block = blocks_.find(b == 0 ? -1 : s.blocks.back(),
                                   prefix.subspan(b * kKvBlock, kKvBlock));
    if (block < 0) break;
    blocks_.hold(block);
    s.blocks.push_back(block);
  }
  const int found = int(s.blocks.size());
  if (Status st = grow_blocks(s, max_tokens); !st.ok()) {
    release_blocks(s);
    s.open = false;
    return st.error();
  }
  s.pos = found * kKvBlock;
  s.tokens.assign(prefix.begin(), prefix.begin() + s.pos);
  prefix_tokens_ += prefix.size();
  reused_tokens_ += uint64_t(s.pos);
  return int(id);
}

void Session::close_sequence(int seq) {
  if (seq <= 0 || size_t(seq) >= seqs_.size() || !seqs_[size_t(seq)].open) return;
  release_blocks(seqs_[size_t(seq)]);
  seqs_[size_t(seq)] = Sequence{};
}

int Session::sequence_position(int seq) const {
  if (seq < 0 || size_t(seq) >= seqs_.size()) return 0;
  return seqs_[size_t(seq)].pos;
}

Engine::KvStats Session::kv_stats() const {
  return {.block_tokens = kKvBlock,
          .blocks = n_blocks_,
          .used = blocks_.held(),
          .cached = blocks_.cached(),
          .prefix_tokens = prefix_tokens_,
          .reused_tokens = reused_tokens_};
}

namespace {
Status check_tokens(std::span<const int> tokens, int vocab) {
  if (tokens.empty()) return make_error("the token list is empty");
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      return make_error("token id " + std::to_string(tokens[i]) + " at index " +
                        std::to_string(i) + " is outside the vocabulary [0, " +
                        std::to_string(vocab) + ")");
  return {};
}
}  // namespace

Status Session::forward(std::span<const int> tokens, std::vector<float>* all_logits) {
  const model::HParams& hp = model_.hp();
  TS_TRY(check_tokens(tokens, hp.vocab));
  Sequence& seq = seqs_[0];
  if (seq.pos + int64_t(tokens.size()) > n_ctx_)
    return make_error("context overflow: " + std::to_string(seq.pos) + " + " +
                      std::to_string(tokens.size()) + " tokens exceed n_ctx = " +
                      std::to_string(n_ctx_));
  TS_TRY(grow_blocks(seq, seq.pos + int(tokens.size())));
  if (all_logits) all_logits->assign(tokens.size() * size_t(hp.vocab), 0.0f);
  const auto t_start = Clock::now();
  capturing_ = true;
  for (size_t b = 0; b < tokens.size(); b += size_t(chunk_)) {
    const bool last_chunk = b + size_t(chunk_) >= tokens.size();
    int n = int(std::min(tokens.size() - b, size_t(chunk_)));
    spans_.assign(1, Span{.seq = 0, .row0 = 0, .n = n, .pos0 = seq.pos, .all_logits = true});
    // A failed chunk leaves the position where it was: its KV rows are ignored, earlier
    // chunks stay.
    Status st = run_rows(tokens.data() + b, n,
                         all_logits ? all_logits->data() + b * size_t(hp.vocab) : nullptr,
                         last_chunk);
    if (!st.ok()) {
      capturing_ = false;
      return st;
    }
  }
  capturing_ = false;
  phases_.total_us += us_since(t_start);
  return {};
}

Status Session::step(std::span<const SeqInput> inputs, std::vector<float>* logits) {
  const model::HParams& hp = model_.hp();
  if (inputs.empty()) return make_error("a step needs at least one sequence");
  size_t total = 0, rows_out = 0;
  std::vector<bool> seen(seqs_.size(), false);
  for (const SeqInput& in : inputs) {
    if (in.seq <= 0 || size_t(in.seq) >= seqs_.size() || !seqs_[size_t(in.seq)].open)
      return make_error("sequence " + std::to_string(in.seq) + " is not open");
    if (seen[size_t(in.seq)])
      return make_error("sequence " + std::to_string(in.seq) + " appears twice in one step");
    seen[size_t(in.seq)] = true;
    TS_TRY(check_tokens(in.tokens, hp.vocab));
    const Sequence& s = seqs_[size_t(in.seq)];
    if (s.pos + int64_t(in.tokens.size()) > s.reserve)
      return make_error("sequence " + std::to_string(in.seq) + ": " + std::to_string(s.pos) +
                        " + " + std::to_string(in.tokens.size()) +
                        " tokens exceed its reserve of " + std::to_string(s.reserve));
    total += in.tokens.size();
    rows_out += in.all_logits ? in.tokens.size() : 1;
  }
  if (total > size_t(chunk_))
    return make_error("a step of " + std::to_string(total) + " tokens exceeds step_tokens() = " +
                      std::to_string(chunk_));
  std::vector<int> tokens;
  tokens.reserve(total);
  spans_.clear();
  for (const SeqInput& in : inputs) {
    spans_.push_back({.seq = in.seq,
                      .row0 = int(tokens.size()),
                      .n = int(in.tokens.size()),
                      .pos0 = seqs_[size_t(in.seq)].pos,
                      .all_logits = in.all_logits});
    tokens.insert(tokens.end(), in.tokens.begin(), in.tokens.end());
  }
  if (logits) logits->assign(rows_out * size_t(hp.vocab), 0.0f);
  const auto t_start = Clock::now();
  TS_TRY(run_rows(tokens.data(), int(total), logits ? logits->data() : nullptr, true));
  phases_.total_us += us_since(t_start);
  return {};
}

Status Session::run_rows(const int* tokens, int n, float* logits_out, bool last_chunk) {
  const model::HParams& hp = model_.hp();
  const model::DenseWeights& w = model_.dense();
  const size_t d = size_t(hp.d_model);
  row_pos_.resize(size_t(n));
  for (const Span& sp : spans_)
    for (int t = 0; t < sp.n; ++t) row_pos_[size_t(sp.row0 + t)] = sp.pos0 + t;
  // Embedding rows, converted to F32 (a quantized table by its reference dequantization).
  for (int t = 0; t < n; ++t) {
    const model::Matrix& e = w.embed;
    const uint8_t* row = static_cast<const uint8_t*>(e.data) +
                         size_t(tokens[t]) * dtype_row_bytes(e.dtype, int64_t(d));
    float* out = x_.data() + size_t(t) * d;
    if (dtype_is_quantized(e.dtype))
      cpu::dequantize_row(e.dtype, row, out, int64_t(d));
    else
      float_row_to_f32(row, e.dtype, out, int64_t(d));
  }
  layer_boundary(-1, n, last_chunk);
  for (int l = 0; l < hp.n_layers; ++l) {
    attention_block(l, n);
    const model::LayerWeights& L = w.layers[size_t(l)];
    if (L.is_moe) {
      TS_TRY(moe_block(l, n));
    } else {
      auto t0 = Clock::now();
      cpu::rmsnorm_rows(x_.data(), L.ffn_norm.data(), xn_.data(), n, int64_t(d), hp.rms_eps);
      dense_mlp_block(L.dense, n, hp.d_ff, tmp_.data());
      for (size_t i = 0; i < size_t(n) * d; ++i) x_[i] += tmp_[i];
      phases_.dense_ffn_us += us_since(t0);
    }
    layer_boundary(l, n, last_chunk);
  }
  // Each step sequence's blocks this pass completed: later sequences may find them.
  for (const Span& sp : spans_) {
    Sequence& s = seqs_[size_t(sp.seq)];
    s.pos = sp.pos0 + sp.n;
    // Sequence 0's rows are rewritten after truncate(); a recurrent state is not in blocks.
    if (sp.seq == 0 || model_.hp().has_deltanet()) continue;
    s.tokens.insert(s.tokens.end(), tokens + sp.row0, tokens + sp.row0 + sp.n);
    for (int b = sp.pos0 / kKvBlock; (b + 1) * kKvBlock <= s.pos; ++b)
      blocks_.remember(s.blocks[size_t(b)], b == 0 ? -1 : s.blocks[size_t(b - 1)],
                       std::span<const int>(s.tokens.data() + size_t(b) * kKvBlock, kKvBlock));
  }
  auto t0 = Clock::now();
  cpu::rmsnorm_rows(x_.data(), w.final_norm.data(), xn_.data(), n, int64_t(d), hp.rms_eps);
  // The rows whose logits are wanted, gathered (in place: a row never moves down) to the
  // front of xn_.
  int m = 0;
  for (const Span& sp : spans_) {
    const bool all = logits_out && sp.all_logits;
    for (int t = all ? 0 : sp.n - 1; t < sp.n; ++t, ++m)
      if (sp.row0 + t != m)
        std::copy_n(xn_.data() + size_t(sp.row0 + t) * d, d, xn_.data() + size_t(m) * d);
  }
  const size_t vocab = size_t(hp.vocab);
  if (logits_out) {
    linear(pool_, w.lm_head, xn_.data(), m, logits_out);
    std::copy_n(logits_out + size_t(m - 1) * vocab, vocab, last_logits_.data());
  } else {
    linear(pool_, w.lm_head, xn_.data() + size_t(m - 1) * d, 1, last_logits_.data());
  }
  phases_.lm_head_us += us_since(t0);
  return {};
}

void Session::attention_block(int layer, int n) {
  auto t0 = Clock::now();
  const model::LayerWeights& L = model_.dense().layers[size_t(layer)];
  const model::Matrix* out = &L.wo;
  if (model_.hp().layer_mixer[size_t(layer)] == model::MixerKind::kGatedDeltaNet) {
    deltanet(layer, n);
    out = &L.deltanet.out;
  } else if (model_.hp().attention == model::AttentionKind::kMla) {
    mla_attention(layer, n);
  } else {
    gqa_attention(layer, n);
  }
  linear(pool_, *out, att_.data(), n, tmp_.data());
  add_bias(tmp_.data(), L.bo, n);
  const size_t d = size_t(model_.hp().d_model);
  for (size_t i = 0; i < size_t(n) * d; ++i) x_[i] += tmp_[i];
  phases_.attention_us += us_since(t0);
}

cpu::RopeTable Session::rope_table(int head_stride, int offset) const {
  const model::RopeSpec& r = model_.hp().rope;
  return {.head_stride = head_stride,
          .offset = offset,
          .dim = r.dim,
          .interleaved = r.layout == model::RopeLayout::kInterleaved,
          .attention_factor = r.attention_factor,
          .inv_freq = r.inv_freq};
}

void Session::mla_attention(int layer, int n) {
  const model::HParams& hp = model_.hp();
  const model::MlaSpec& m = hp.mla;
  const model::LayerWeights& L = model_.dense().layers[size_t(layer)];
  const int d = hp.d_model, qk = m.qk_dim(), row = hp.cache_row();
  cpu::rmsnorm_rows(x_.data(), L.attn_norm.data(), xn_.data(), n, d, hp.rms_eps);
  if (m.q_lora_rank > 0) {
    linear(pool_, L.q_a, xn_.data(), n, lat_.data());
    cpu::rmsnorm_rows(lat_.data(), L.q_a_norm.data(), lat_.data(), n, m.q_lora_rank, hp.rms_eps);
    linear(pool_, L.q_b, lat_.data(), n, q_.data());
  } else {
    linear(pool_, L.wq, xn_.data(), n, q_.data());
  }
  // The latent rows: kv_a -> RMSNorm over the first kv_lora_rank, RoPE on the shared key.
  linear(pool_, L.kv_a, xn_.data(), n, lat_.data());
  const cpu::RopeTable q_rope = rope_table(qk, m.nope_dim), k_rope = rope_table(row, m.kv_lora_rank);
  const float* cache = kv_layer(k_cache_.get(), layer, row);
  for (const Span& sp : spans_) {
    for (int t = sp.row0; t < sp.row0 + sp.n; ++t) {
      float* c = lat_.data() + size_t(t) * size_t(row);
      cpu::rmsnorm_rows(c, L.kv_a_norm.data(), c, 1, m.kv_lora_rank, hp.rms_eps);
      cpu::rope_apply(c, 1, k_rope, row_pos_[size_t(t)]);
      cpu::rope_apply(q_.data() + size_t(t) * size_t(hp.q_dim()), hp.n_heads, q_rope,
                      row_pos_[size_t(t)]);
      std::copy_n(c, row, kv_row(k_cache_.get(), layer, sp.seq, row_pos_[size_t(t)], row));
    }
    cpu::mla_attention(pool_, {.q = q_.data() + size_t(sp.row0) * size_t(hp.q_dim()),
                               .cache = cache,
                               .rows = kv_rows(sp.seq),
                               .kv_b = L.kv_b.data,
                               .kv_b_dtype = L.kv_b.dtype,
                               .out = att_.data() + size_t(sp.row0) * size_t(hp.attn_out_dim()),
                               .n_tokens = sp.n,
                               .pos0 = sp.pos0,
                               .n_heads = hp.n_heads,
                               .nope_dim = m.nope_dim,
                               .rope_dim = m.rope_dim,
                               .v_dim = m.v_dim,
                               .kv_lora_rank = m.kv_lora_rank,
                               .scale = hp.attn_scale});
  }
}

void Session::gqa_attention(int layer, int n) {
  const model::HParams& hp = model_.hp();
  const model::LayerWeights& L = model_.dense().layers[size_t(layer)];
  const int d = hp.d_model, qd = hp.q_dim(), kvd = hp.kv_dim();
  cpu::rmsnorm_rows(x_.data(), L.attn_norm.data(), xn_.data(), n, d, hp.rms_eps);
  if (hp.attn_output_gate) {
    // Per head: head_dim query values, then head_dim gate values.
    linear(pool_, L.wq, xn_.data(), n, qg_.data());
    const size_t hd = size_t(hp.head_dim);
    for (size_t r = 0; r < size_t(n) * size_t(hp.n_heads); ++r) {
      std::copy_n(qg_.data() + 2 * r * hd, hd, q_.data() + r * hd);
      std::copy_n(qg_.data() + (2 * r + 1) * hd, hd, gate_.data() + r * hd);
    }
  } else {
    linear(pool_, L.wq, xn_.data(), n, q_.data());
  }
  linear(pool_, L.wk, xn_.data(), n, k_.data());
  linear(pool_, L.wv, xn_.data(), n, v_.data());
  add_bias(q_.data(), L.bq, n);
  add_bias(k_.data(), L.bk, n);
  add_bias(v_.data(), L.bv, n);
  switch (hp.qk_norm) {
    case model::QkNorm::kNone: break;
    case model::QkNorm::kPerHead:
      cpu::rmsnorm_rows(q_.data(), L.q_norm.data(), q_.data(), int64_t(n) * hp.n_heads,
                        hp.head_dim, hp.rms_eps);
      cpu::rmsnorm_rows(k_.data(), L.k_norm.data(), k_.data(), int64_t(n) * hp.n_kv_heads,
                        hp.head_dim, hp.rms_eps);
      break;
    case model::QkNorm::kFullProjection:
      cpu::rmsnorm_rows(q_.data(), L.q_norm.data(), q_.data(), n, qd, hp.rms_eps);
      cpu::rmsnorm_rows(k_.data(), L.k_norm.data(), k_.data(), n, kvd, hp.rms_eps);
      break;
  }
  const cpu::RopeTable rope = rope_table(hp.head_dim, 0);
  const float* k_layer = kv_layer(k_cache_.get(), layer, kvd);
  const float* v_layer = kv_layer(v_cache_.get(), layer, kvd);
  for (const Span& sp : spans_) {
    for (int t = sp.row0; t < sp.row0 + sp.n; ++t) {
      const int pos = row_pos_[size_t(t)];
      cpu::rope_apply(q_.data() + size_t(t) * qd, hp.n_heads, rope, pos);
      cpu::rope_apply(k_.data() + size_t(t) * kvd, hp.n_kv_heads, rope, pos);
      std::copy_n(k_.data() + size_t(t) * kvd, kvd, kv_row(k_cache_.get(), layer, sp.seq, pos, kvd));
      std::copy_n(v_.data() + size_t(t) * kvd, kvd, kv_row(v_cache_.get(), layer, sp.seq, pos, kvd));
    }
    cpu::attention(pool_, {.q = q_.data() + size_t(sp.row0) * qd,
                           .k_cache = k_layer,
                           .v_cache = v_layer,
                           .rows = kv_rows(sp.seq),
                           .out = att_.data() + size_t(sp.row0) * qd,
                           .n_tokens = sp.n,
                           .pos0 = sp.pos0,
                           .n_heads = hp.n_heads,
                           .n_kv_heads = hp.n_kv_heads,
                           .head_dim = hp.head_dim,
                           .scale = hp.attn_scale,
                           .window = hp.layer_window[size_t(layer)],
                           .sinks = L.sinks});
  }
  if (hp.attn_output_gate)
    for (size_t i = 0; i < size_t(n) * size_t(qd); ++i)
      att_[i] *= 1.0f / (1.0f + std::exp(-gate_[i]));
}

void Session::deltanet(int layer, int n) {
  const model::HParams& hp = model_.hp();
  const model::DeltaNetSpec& dn = hp.deltanet;
  const model::LayerWeights::DeltaNet& W = model_.dense().layers[size_t(layer)].deltanet;
  const model::LayerWeights& L = model_.dense().layers[size_t(layer)];
  cpu::rmsnorm_rows(x_.data(), L.attn_norm.data(), xn_.data(), n, hp.d_model, hp.rms_eps);
  const size_t conv_dim = size_t(dn.conv_dim()), key_dim = size_t(dn.key_dim());
  const size_t value_dim = size_t(dn.value_dim()), nv = size_t(dn.n_v_heads);
  if (dn.grouped_projection) {
    // Rows grouped per key head g: q_g, k_g, then v and z of its value heads; b and a alike.
    const size_t per_key = nv / size_t(dn.n_k_heads), dk = size_t(dn.k_dim);
    const size_t vg = per_key * size_t(dn.v_dim), group = 2 * dk + 2 * vg;
    linear(pool_, W.qkvz, xn_.data(), n, dn_proj_.data());
    for (size_t t = 0; t < size_t(n); ++t) {
      const float* src = dn_proj_.data() + t * size_t(dn.n_k_heads) * group;
      float* qkv = dn_qkv_.data() + t * conv_dim;
      for (size_t g = 0; g < size_t(dn.n_k_heads); ++g, src += group) {
        std::copy_n(src, dk, qkv + g * dk);
        std::copy_n(src + dk, dk, qkv + key_dim + g * dk);
        std::copy_n(src + 2 * dk, vg, qkv + 2 * key_dim + g * vg);
        std::copy_n(src + 2 * dk + vg, vg, dn_z_.data() + t * value_dim + g * vg);
      }
    }
    linear(pool_, W.ba, xn_.data(), n, dn_proj_.data());
    for (size_t t = 0; t < size_t(n); ++t)
      for (size_t g = 0; g < size_t(dn.n_k_heads); ++g) {
        const float* src = dn_proj_.data() + t * 2 * nv + g * 2 * per_key;
        std::copy_n(src, per_key, dn_b_.data() + t * nv + g * per_key);
        std::copy_n(src + per_key, per_key, dn_a_.data() + t * nv + g * per_key);
      }
  } else {
    linear(pool_, W.qkv, xn_.data(), n, dn_qkv_.data());
    linear(pool_, W.z, xn_.data(), n, dn_z_.data());
    linear(pool_, W.b, xn_.data(), n, dn_b_.data());
    linear(pool_, W.a, xn_.data(), n, dn_a_.data());
  }
  const int64_t state_floats = dn.state_floats();
  const size_t conv_floats = conv_dim * size_t(dn.conv_kernel - 1);
  for (const Span& sp : spans_) {
    float* st = seqs_[size_t(sp.seq)].state.data() + size_t(dn_index_[size_t(layer)]) * state_floats;
    const size_t r0 = size_t(sp.row0);
    cpu::gated_delta_net(pool_, {.qkv = dn_qkv_.data() + r0 * conv_dim,
                                 .b = dn_b_.data() + r0 * nv,
                                 .a = dn_a_.data() + r0 * nv,
                                 .conv = W.conv.data(),
                                 .a_log = W.a_log.data(),
                                 .dt_bias = W.dt_bias.data(),
                                 .conv_state = st,
                                 .state = st + conv_floats,
                                 .x = dn_x_.data() + r0 * conv_dim,
                                 .out = att_.data() + r0 * value_dim,
                                 .n = sp.n,
                                 .n_k_heads = dn.n_k_heads,
                                 .n_v_heads = dn.n_v_heads,
                                 .k_dim = dn.k_dim,
                                 .v_dim = dn.v_dim,
                                 .kernel = dn.conv_kernel});
  }
  // The gated RMSNorm per value head: w * norm(o) * SiLU(z).
  for (size_t r = 0; r < size_t(n) * nv; ++r) {
    float* o = att_.data() + r * size_t(dn.v_dim);
    cpu::rmsnorm_rows(o, W.norm.data(), o, 1, dn.v_dim, hp.rms_eps);
    const float* z = dn_z_.data() + r * size_t(dn.v_dim);
    for (int j = 0; j < dn.v_dim; ++j) o[j] *= z[j] / (1.0f + std::exp(-z[j]));
  }
}

void Session::dense_mlp_block(const model::ExpertWeights& mlp, int n, int d_hidden, float* out) {
  linear(pool_, mlp.gate, xn_.data(), n, h1_.data());
  linear(pool_, mlp.up, xn_.data(), n, h2_.data());
  cpu::silu_mul(h1_.data(), h2_.data(), h1_.data(), int64_t(n) * d_hidden);
  linear(pool_, mlp.down, h1_.data(), n, out);
}

Status Session::moe_block(int layer, int n) {
  const model::HParams& hp = model_.hp();
  const model::LayerWeights& L = model_.dense().layers[size_t(layer)];
  const size_t d = size_t(hp.d_model), k = size_t(hp.top_k);
  auto t0 = Clock::now();
  cpu::rmsnorm_rows(x_.data(), L.ffn_norm.data(), xn_.data(), n, int64_t(d), hp.rms_eps);
  linear(pool_, L.router, xn_.data(), n, router_.data());
  add_bias(router_.data(), L.router_logit_bias, n);
  for (int t = 0; t < n; ++t) {
    model::select_experts(
        std::span<const float>(router_.data() + size_t(t) * size_t(hp.n_experts),
                               size_t(hp.n_experts)),
        L.router_bias, hp.router,
        {.ids = std::span<int>(sel_ids_.data() + size_t(t) * k, k),
         .weights = std::span<float>(sel_w_.data() + size_t(t) * k, k)});
  }
  phases_.router_us += us_since(t0);
  phases_.expert_requests += uint64_t(n) * k;

  // Group (token, rank) slots by expert; experts are visited in id order, but every slot has
  // its own output row, so the visiting order cannot change the result.
  t0 = Clock::now();
  std::vector<std::vector<int>> slots_of(size_t(hp.n_experts));
  for (size_t s = 0; s < size_t(n) * k; ++s) {
    slots_of[size_t(sel_ids_[s])].push_back(int(s));
    ++router_hist_[size_t(layer) * size_t(hp.n_experts) + size_t(sel_ids_[s])];
  }
  if (iv_.trace_router)
    for (int t = 0; t < n; ++t)
      trace_.push_back({row_pos_[size_t(t)], layer,
                        std::vector<int>(sel_ids_.begin() + long(size_t(t) * k),
                                         sel_ids_.begin() + long(size_t(t + 1) * k)),
                        std::vector<float>(sel_w_.begin() + long(size_t(t) * k),
                                           sel_w_.begin() + long(size_t(t + 1) * k))});
  std::vector<int> used;
  for (int e = 0; e < hp.n_experts; ++e)
    if (!slots_of[size_t(e)].empty()) used.push_back(e);
  // Experts are acquired in batches no larger than the store can hold at once (a cache with
  // fewer slots than top_k still works, just with more reads); each batch is released
  // before the next, so its slots may be reused.
  experts::ExpertStore& store = model_.experts();
  const size_t batch = size_t(std::max(1, store.max_batch(layer)));
  std::vector<model::ExpertWeights> views(std::min(batch, used.size()));
  std::vector<size_t> order;
  for (size_t b0 = 0; b0 < used.size(); b0 += batch) {
    const size_t nb = std::min(batch, used.size() - b0);
    t0 = Clock::now();
    Status st = store.acquire_begin(layer, std::span<const int>(used.data() + b0, nb),
                                    std::span<model::ExpertWeights>(views.data(), nb));
    phases_.expert_io_us += us_since(t0);
    if (!st.ok()) return st;
    // Experts already in memory first; the others as their reads land (streamed store).
    order.clear();
    std::vector<bool> in_now(nb);
    for (size_t u = 0; u < nb; ++u) in_now[u] = store.ready(layer, u);
    for (bool first : {true, false})
      for (size_t u = 0; u < nb; ++u)
        if (in_now[u] == first) order.push_back(u);
    for (size_t u : order) {
      t0 = Clock::now();
      st = store.wait_ready(layer, u);
      phases_.expert_io_us += us_since(t0);
      if (!st.ok()) {
        store.release(layer);
        return st;
      }
      t0 = Clock::now();
      const int e = used[b0 + u];
      const auto& slots = slots_of[size_t(e)];
      const int m = int(slots.size());
      // phase 1: gate|up + activation over the tokens routed to this expert.
      for (int i = 0; i < m; ++i)
        std::copy_n(xn_.data() + size_t(slots[size_t(i)]) / k * d, d,
                    gather_.data() + size_t(i) * d);
      linear(pool_, views[u].gate, gather_.data(), m, h1_.data());
      linear(pool_, views[u].up, gather_.data(), m, h2_.data());
      add_expert_bias(h1_.data(), L.expert_gate_bias, e, m, hp.d_expert);
      add_expert_bias(h2_.data(), L.expert_up_bias, e, m, hp.d_expert);
      expert_activation(hp.expert_act, h1_.data(), h2_.data(), h1_.data(),
                        int64_t(m) * hp.d_expert);
      // phase 2 (first half): down projection into each slot's own row.
      linear(pool_, views[u].down, h1_.data(), m, h3_.data());
      add_expert_bias(h3_.data(), L.expert_down_bias, e, m, hp.d_model);
      for (int i = 0; i < m; ++i)
        std::copy_n(h3_.data() + size_t(i) * d, d, slots_.data() + size_t(slots[size_t(i)]) * d);
      phases_.expert_compute_us += us_since(t0);
    }
    store.release(layer);
  }
  t0 = Clock::now();
  // phase 2 (second half): weighted sum in router rank order.
  for (int t = 0; t < n; ++t) {
    float* out = tmp_.data() + size_t(t) * d;
    std::fill(out, out + d, 0.0f);
    for (size_t r = 0; r < k; ++r) {
      const float wgt = sel_w_[size_t(t) * k + r];
      const float* s = slots_.data() + (size_t(t) * k + r) * d;
      for (size_t i = 0; i < d; ++i) out[i] += wgt * s[i];
    }
  }
  phases_.expert_compute_us += us_since(t0);

  if (L.shared.gate.present()) {
    t0 = Clock::now();
    // Shared expert output goes to slots_ (free again) and is added after the routed sum.
    dense_mlp_block(L.shared, n, hp.d_shared, slots_.data());
    for (int t = 0; t < n; ++t) {
      float g = 1.0f;
      if (L.shared_gate.present()) {
        float z;
        cpu::matvec_rows(L.shared_gate.data, L.shared_gate.dtype, xn_.data() + size_t(t) * d, &z,
                         int64_t(d), 0, 1);
        g = 1.0f / (1.0f + std::exp(-z));
      }
      for (size_t i = 0; i < d; ++i) tmp_[size_t(t) * d + i] += g * slots_[size_t(t) * d + i];
    }
    phases_.dense_ffn_us += us_since(t0);
  }
  for (size_t i = 0; i < size_t(n) * d; ++i) x_[i] += tmp_[i];
  return {};
}

}  // namespace ts::runtime
