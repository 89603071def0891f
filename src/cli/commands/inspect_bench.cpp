// inspect (shapes, parameters, bytes by kind) and bench (prefill and decode tokens/s against
// the memory-bandwidth roofline: bytes of weights read per decode token / measured time).
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "backend/cpu/kernels.h"
#include "cli/commands/commands.h"
#include "cli/commands/common.h"
#include "runtime/sampler.h"
#include "runtime/session.h"

namespace ts::cli {
namespace {

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
      {"rope", {{"dim", hp.rope.dim},
                {"layout", hp.rope.layout == model::RopeLayout::kInterleaved ? "interleaved" : "half"},
                {"yarn", hp.rope.yarn},
                {"attention_factor", hp.rope.attention_factor}}},
      {"attention", hp.attention == model::AttentionKind::kMla ? "mla" : "gqa"},
      {"router", {{"scoring", hp.router.scoring == model::ScoreFn::kSigmoid ? "sigmoid" : "softmax"},
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
  std::printf("rope       theta %g, %d of each head's dims, %s%s\n", double(hp.rope.theta),
              hp.rope.dim, j["rope"]["layout"].get<std::string>().c_str(),
              hp.rope.yarn ? ", YaRN" : "");
  std::printf("router     %s%s, groups %d (best %d), %s, scale %g\n",
              j["router"]["scoring"].get<std::string>().c_str(),
              hp.router.correction_bias ? " + correction bias" : "", hp.router.n_group,
              hp.router.topk_group, hp.router.renormalize ? "renormalised" : "not renormalised",
              double(hp.router.scale));
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

Status cmd_bench(const Args& args) {
  if (args.str_or("device", "cpu").rfind("cuda", 0) == 0) return cmd_bench_cuda(args);
  bool json = args.has("json");
  TS_ASSIGN(int64_t n_prompt, args.integer_or("prompt-tokens", 128, 1, 1 << 20));
  TS_ASSIGN(int64_t n_gen, args.integer_or("gen-tokens", 32, 1, 1 << 20));
  TS_ASSIGN(double roofline_gbps, args.number_or("roofline-gbps", 28.0, 0.001, 1e6));
  const bool warmup = !args.has("no-warmup");
  TS_ASSIGN(ModelFlags flags, read_model_flags(args));
  TS_TRY(args.check_all_used());
  TS_ASSIGN(Loaded m, load_model(flags));
  const model::HParams& hp = m.model->hp();
  TS_ASSIGN(std::unique_ptr<runtime::Engine> engine,
            make_session(flags, m, {.n_ctx = int(n_prompt + n_gen)}));
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
  if (flags.stats && !json) print_stats(j["stats"]);
  if (!flags.router_hist.empty()) TS_TRY(write_router_hist(flags.router_hist, *m.model, session));
  return {};
}

}  // namespace ts::cli
