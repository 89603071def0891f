// inspect (shapes, parameters, bytes by kind) and bench (prefill and decode tokens/s against
// the memory-bandwidth roofline: bytes of weights read per decode token / measured time).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "backend/cpu/kernels.h"
#include "cli/commands/commands.h"
#include "cli/commands/common.h"
#include "runtime/kv_blocks.h"
#include "runtime/sampler.h"
#include "runtime/session.h"

namespace ts::cli {
namespace {

const char* scoring_name(model::ScoreFn f) {
  switch (f) {
    case model::ScoreFn::kSoftmax: return "softmax";
    case model::ScoreFn::kSigmoid: return "sigmoid";
    case model::ScoreFn::kTopkSoftmax: return "softmax over the top-k";
  }
  return "?";
}

nlohmann::json describe(const runtime::LoadedModel& m) {
  const model::HParams& hp = m.hp();
  const model::WeightCounts& c = m.counts();
  int n_moe = 0;
  for (bool b : hp.layer_is_moe) n_moe += b;
  return {
      {"model", m.dir()},
      {"family", std::string(model::family_name(hp.family))},
      {"d_model", hp.d_model},
      {"n_layers", hp.n_layers},
      {"n_moe_layers", n_moe},
      {"n_heads", hp.n_heads},
      {"n_kv_heads", hp.n_kv_heads},
      {"head_dim", hp.head_dim},
      {"vocab", hp.vocab},
      {"n_experts", hp.n_experts},
      {"top_k", hp.top_k},
      {"d_expert", hp.d_expert},
      {"d_ff", hp.d_ff},
      {"d_shared", hp.d_shared},
      {"rope_theta", hp.rope.theta},
      {"rope",
       {{"dim", hp.rope.dim},
        {"layout", hp.rope.layout == model::RopeLayout::kInterleaved ? "interleaved" : "half"},
        {"yarn", hp.rope.yarn},
        {"attention_factor", hp.rope.attention_factor}}},
      {"attention", hp.attention == model::AttentionKind::kMla ? "mla" : "gqa"},
      {"attention_sinks", hp.attention_sinks},
      {"layer_window", hp.layer_window},
      {"router",
       {{"scoring", scoring_name(hp.router.scoring)},
        {"logit_bias", hp.router.logit_bias},
        {"correction_bias", hp.router.correction_bias},
        {"n_group", hp.router.n_group},
        {"topk_group", hp.router.topk_group},
        {"renormalize", hp.router.renormalize},
        {"scale", hp.router.scale}}},
      {"mtp_layers_skipped", hp.n_nextn_layers},
      {"tie_word_embeddings", hp.tie_word_embeddings},
      {"params_total", c.params_total},
      {"params_active_per_token", c.params_active},
      {"bytes_dense", c.dense_bytes},
      {"bytes_routed_experts", c.routed_bytes},
      {"bytes_read_per_decode_token", c.decode_bytes},
  };
}

}  // namespace

Status cmd_inspect(const Args& args) {
  bool json = args.has("json");
  TS_ASSIGN(ModelFlags flags, read_model_flags(args));
  TS_TRY(args.check_all_used());
  TS_ASSIGN(Loaded m, load_model(flags));
  nlohmann::json j = describe(*m.model);
  if (json) {
    std::printf("%s\n", j.dump(2).c_str());
    return {};
  }
  const model::HParams& hp = m.model->hp();
  const model::WeightCounts& c = m.model->counts();
  std::printf("model      %s\nfamily     %s\n", m.model->dir().c_str(),
              j["family"].get<std::string>().c_str());
  std::printf("shape      d_model %d, %d layers (%d MoE), %d heads / %d kv, head_dim %d, vocab %d\n",
              hp.d_model, hp.n_layers, j["n_moe_layers"].get<int>(), hp.n_heads, hp.n_kv_heads,
              hp.head_dim, hp.vocab);
  std::printf("experts    %d, top-%d, d_expert %d, shared %d, dense d_ff %d\n", hp.n_experts,
              hp.top_k, hp.d_expert, hp.d_shared, hp.d_ff);
  if (hp.attention == model::AttentionKind::kMla)
    std::printf("attention  MLA: q_lora_rank %d, kv_lora_rank %d, nope %d + rope %d, v %d; "
                "cache %d floats a position and layer\n",
                hp.mla.q_lora_rank, hp.mla.kv_lora_rank, hp.mla.nope_dim, hp.mla.rope_dim,
                hp.mla.v_dim, hp.cache_row());
  int n_window = 0;
  for (int w : hp.layer_window) n_window += w > 0;
  if (hp.attention_sinks || n_window > 0)
    std::printf("attention  %s%s%d of %d layers with a sliding window of %d\n",
                hp.attention_sinks ? "a sink logit per head, " : "",
                hp.o_bias ? "o_proj bias, " : "", n_window, hp.n_layers,
                *std::max_element(hp.layer_window.begin(), hp.layer_window.end()));
  std::printf("rope       theta %g, %d of each head's dims, %s%s\n", double(hp.rope.theta),
              hp.rope.dim, j["rope"]["layout"].get<std::string>().c_str(),
              hp.rope.yarn ? ", YaRN" : "");
  std::printf("router     %s%s%s, groups %d (best %d), %s, scale %g\n",
              j["router"]["scoring"].get<std::string>().c_str(),
              hp.router.logit_bias ? ", logits with a bias" : "",
              hp.router.correction_bias ? " + correction bias" : "", hp.router.n_group,
              hp.router.topk_group, hp.router.renormalize ? "renormalised" : "not renormalised",
              double(hp.router.scale));
  if (hp.expert_act.kind == model::ExpertAct::kClampedSwiglu)
    std::printf("experts    %sclamped SwiGLU (limit %g, alpha %g)\n",
                hp.expert_bias ? "with biases, " : "", double(hp.expert_act.limit),
                double(hp.expert_act.alpha));
  else if (hp.expert_bias)
    std::printf("experts    with biases\n");
  if (hp.n_nextn_layers > 0)
    std::printf("mtp        %d multi-token-prediction layer(s) in the config: not loaded\n",
                hp.n_nextn_layers);
  std::printf("params     %.3f M total, %.3f M active per token\n", double(c.params_total) / 1e6,
              double(c.params_active) / 1e6);
  std::printf("bytes      dense %.3f MB, routed experts %.3f MB, per decode token %.3f MB\n",
              double(c.dense_bytes) / 1e6, double(c.routed_bytes) / 1e6,
              double(c.decode_bytes) / 1e6);
  return {};
}

namespace {

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[size_t(std::min(double(v.size() - 1), std::ceil(q * double(v.size())) - 1))];
}

// --parallel P: P sequences as llama-batched-bench runs them — every prompt prefilled
// (steps of up to step_tokens() tokens, prompts in order, each split where a step fills),
// then n_gen decode steps of one token for every sequence. Time to first token is from the
// start to the end of the step that finished the sequence's prompt.
Result<nlohmann::json> bench_parallel(runtime::Engine& session, const runtime::LoadedModel& model,
                                      int n_seq, int64_t n_prompt, int64_t n_gen) {
  const model::HParams& hp = model.hp();
  using Clock = std::chrono::steady_clock;
  std::vector<int> seqs;
  const size_t n_seqs = size_t(n_seq);
  std::vector<std::vector<int>> prompts(n_seqs, std::vector<int>(static_cast<size_t>(n_prompt)));
  for (int s = 0; s < n_seq; ++s) {
    TS_ASSIGN(int id, session.open_sequence(int(n_prompt + n_gen)));
    seqs.push_back(id);
    for (size_t i = 0; i < size_t(n_prompt); ++i)
      prompts[size_t(s)][i] = int((i * 7919 + 13 + size_t(s) * 104729) % size_t(hp.vocab));
  }
  std::vector<float> logits;
  std::vector<int> next(n_seqs);
  std::vector<double> ttft;
  const auto t0 = Clock::now();
  size_t s = 0, fed = 0;
  while (s < size_t(n_seq)) {
    std::vector<runtime::Engine::SeqInput> in;
    std::vector<std::pair<size_t, size_t>> done;  // (input, sequence) whose prompt ends here
    for (int left = session.step_tokens(); left > 0 && s < size_t(n_seq);) {
      const size_t n = std::min(size_t(n_prompt) - fed, size_t(left));
      in.push_back({.seq = seqs[s], .tokens = std::span<const int>(prompts[s].data() + fed, n)});
      left -= int(n);
      fed += n;
      if (fed == size_t(n_prompt)) done.emplace_back(in.size() - 1, s++), fed = 0;
    }
    TS_TRY(session.step(in, &logits));
    const double at = std::chrono::duration<double>(Clock::now() - t0).count();
    const size_t vocab = logits.size() / in.size();
    for (auto [k, seq] : done) {
      next[seq] = runtime::argmax(std::span<const float>(logits.data() + k * vocab, vocab));
      ttft.push_back(at);
    }
  }
  const double prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const experts::StoreStats store1 = model.experts().stats();
  const auto t1 = Clock::now();
  for (int64_t g = 0; g < n_gen; ++g) {
    std::vector<runtime::Engine::SeqInput> in;
    for (int i = 0; i < n_seq; ++i)
      in.push_back({.seq = seqs[size_t(i)], .tokens = std::span<const int>(&next[size_t(i)], 1)});
    TS_TRY(session.step(in, &logits));
    const size_t vocab = logits.size() / in.size();
    for (size_t i = 0; i < in.size(); ++i)
      next[i] = runtime::argmax(std::span<const float>(logits.data() + i * vocab, vocab));
  }
  const double decode_s = std::chrono::duration<double>(Clock::now() - t1).count();
  const experts::StoreStats decode_store = model.experts().stats().since(store1);
  for (int id : seqs) session.close_sequence(id);
  // Bytes a decode step reads: the dense weights once, and each distinct routed expert the
  // step selects once (the store counts distinct experts per layer and step).
  const model::WeightCounts& c = model.counts();
  int n_moe = 0;
  for (bool moe : hp.layer_is_moe) n_moe += moe ? 1 : 0;
  const double per_expert =
      n_moe > 0 ? double(c.routed_bytes) / (double(n_moe) * double(hp.n_experts)) : 0;
  const double dense_step = double(c.decode_bytes) - per_expert * double(hp.top_k) * n_moe;
  const double step_bytes = dense_step + per_expert * double(decode_store.requests) / double(n_gen);
  return nlohmann::json{{"parallel", n_seq},
                        {"prefill_s", prefill_s},
                        {"prefill_tokens_per_s", double(n_seq) * double(n_prompt) / prefill_s},
                        {"ttft_p50_ms", 1e3 * percentile(ttft, 0.5)},
                        {"ttft_p99_ms", 1e3 * percentile(ttft, 0.99)},
                        {"decode_s", decode_s},
                        {"decode_tokens_per_s", double(n_seq) * double(n_gen) / decode_s},
                        {"decode_tokens_per_s_per_sequence", double(n_gen) / decode_s},
                        {"decode_bytes_per_step", step_bytes},
                        {"decode_bytes_per_token", step_bytes / n_seq}};
}

}  // namespace

Status cmd_bench(const Args& args) {
  if (args.str_or("device", "cpu").rfind("cuda", 0) == 0) return cmd_bench_cuda(args);
  bool json = args.has("json");
  TS_ASSIGN(int64_t n_prompt, args.integer_or("prompt-tokens", 128, 1, 1 << 20));
  TS_ASSIGN(int64_t n_gen, args.integer_or("gen-tokens", 32, 1, 1 << 20));
  TS_ASSIGN(double roofline_gbps, args.number_or("roofline-gbps", 28.0, 0.001, 1e6));
  const bool warmup = !args.has("no-warmup");
  std::vector<int> parallel;
  if (args.has("parallel")) {
    TS_ASSIGN(std::string list, args.str("parallel"));
    TS_ASSIGN(parallel, parse_token_list(list));
    for (int p : parallel)
      if (p < 1 || p > 1024)
        return make_error("--parallel: " + std::to_string(p) + " is outside [1, 1024]");
  }
  TS_ASSIGN(ModelFlags flags, read_model_flags(args));
  TS_TRY(args.check_all_used());
  TS_ASSIGN(Loaded m, load_model(flags));
  const model::HParams& hp = m.model->hp();
  const int most = parallel.empty() ? 1 : *std::max_element(parallel.begin(), parallel.end());
  TS_ASSIGN(std::unique_ptr<runtime::Engine> engine,
            make_session(flags, m,
                         {.n_ctx = int(n_prompt + n_gen),
                          .kv_tokens = runtime::kv_pool_tokens(n_prompt + n_gen, most)}));
  runtime::Engine& session = *engine;
  std::vector<int> prompt(static_cast<size_t>(n_prompt));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int((i * 7919 + 13) % size_t(hp.vocab));
  using Clock = std::chrono::steady_clock;
  if (warmup) {
    // One untimed pass faults in the mapped weights (and warms a streamed cache) so the
    // timed passes measure steady state, as llama-bench's warm-up run does.
    TS_TRY(session.forward(prompt, nullptr));
    int t = runtime::argmax(session.last_logits());
    for (int64_t i = 0; i < std::min<int64_t>(n_gen, 8); ++i) {
      TS_TRY(session.forward(std::span<const int>(&t, 1), nullptr));
      t = runtime::argmax(session.last_logits());
    }
    session.reset();
  }
  // Stats cover the timed passes only (the store's counters live as long as the model).
  const RunCounters since{session.phases(), m.model->experts().stats(),
                          session.expert_cache().value_or(runtime::ExpertCacheReport{})};
  auto t0 = Clock::now();
  TS_TRY(session.forward(prompt, nullptr));
  double prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  int next = runtime::argmax(session.last_logits());
  t0 = Clock::now();
  for (int64_t i = 0; i < n_gen; ++i) {
    TS_TRY(session.forward(std::span<const int>(&next, 1), nullptr));
    next = runtime::argmax(session.last_logits());
  }
  double decode_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const double bytes = double(m.model->counts().decode_bytes);
  const double decode_tps = double(n_gen) / decode_s;
  const double achieved_gbps = bytes * decode_tps / 1e9;
  nlohmann::json j = describe(*m.model);
  j["threads"] = m.pool->size();
  j["isa"] = std::string(cpu::isa_name(cpu::active_isa()));
  j["warmup"] = warmup;
  j["prompt_tokens"] = n_prompt;
  j["gen_tokens"] = n_gen;
  j["prefill_tokens_per_s"] = double(n_prompt) / prefill_s;
  j["decode_tokens_per_s"] = decode_tps;
  j["decode_weight_bytes_per_token"] = bytes;
  j["decode_achieved_gbps"] = achieved_gbps;
  j["roofline_gbps"] = roofline_gbps;
  j["decode_roofline_fraction"] = achieved_gbps / roofline_gbps;
  j["stats"] = stats_json(*m.model, session, n_prompt + n_gen, since);
  if (!parallel.empty() && !session.batches())
    return make_error("--parallel: the " + session.device_name() +
                      " backend does not batch sequences yet");
  session.reset();  // its KV rows go back to the pool the sequences take
  for (int p : parallel) {
    TS_ASSIGN(nlohmann::json r, bench_parallel(session, *m.model, p, n_prompt, n_gen));
    j["parallel"].push_back(r);
  }
  if (json) {
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("model %s (%s), %d threads, %s\n", m.model->dir().c_str(),
                j["family"].get<std::string>().c_str(), m.pool->size(),
                j["isa"].get<std::string>().c_str());
    std::printf("prefill  %lld tokens: %.1f tok/s\n", (long long)n_prompt,
                double(n_prompt) / prefill_s);
    std::printf("decode   %lld tokens: %.2f tok/s, %.1f MB weights/token, %.2f GB/s = %.0f%% of "
                "%.1f GB/s roofline\n",
                (long long)n_gen, decode_tps, bytes / 1e6, achieved_gbps,
                100.0 * achieved_gbps / roofline_gbps, roofline_gbps);
  }
  if (!parallel.empty() && !json) {
    std::printf("parallel  decode tok/s (all / per seq)  prefill tok/s  TTFT p50 / p99 ms  "
                "MB read per step / per token\n");
    for (const nlohmann::json& r : j["parallel"])
      std::printf("%8d  %12.2f / %-10.2f  %13.1f  %8.1f / %-8.1f  %8.1f / %.1f\n",
                  r["parallel"].get<int>(), r["decode_tokens_per_s"].get<double>(),
                  r["decode_tokens_per_s_per_sequence"].get<double>(),
                  r["prefill_tokens_per_s"].get<double>(), r["ttft_p50_ms"].get<double>(),
                  r["ttft_p99_ms"].get<double>(), r["decode_bytes_per_step"].get<double>() / 1e6,
                  r["decode_bytes_per_token"].get<double>() / 1e6);
  }
  if (flags.stats && !json) print_stats(j["stats"]);
  if (!flags.router_hist.empty()) TS_TRY(write_router_hist(flags.router_hist, *m.model, session));
  return {};
}

}  // namespace ts::cli
