// bench --device cuda: decode tok/s at given contexts and prefill tok/s for given prompt
// lengths, on a model directory or on random weights generated on the GPU (--synthetic
// CONFIG). Decode is compared with the memory-bandwidth roofline (weights + KV bytes read per
// step / --roofline-gbps, default the H200's 4,100 GB/s), prefill with --roofline-tflops
// (default 790, BF16 tensor cores). Decode is also given as a fraction of the GPU's own DRAM
// peak as its driver reports it (memory clock x bus width), for runs on another card.
//
// Decode feeds a fixed pseudo-random token stream rather than the argmax: random weights
// tend to repeat one token, whose routing then repeats and would flatter an expert cache
// (--residency host). Speed does not depend on which token is fed.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands/commands.h"
#include "cli/commands/common.h"
#include "runtime/sampler.h"

#ifdef TS_HAVE_CUDA
#include "backend/cuda/cuda_session.h"
#endif

namespace ts::cli {
#ifdef TS_HAVE_CUDA
namespace {

Result<std::vector<int64_t>> int_list(const std::string& flag, const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end || v < 1 || v > (1 << 24))
      return make_error("--" + flag + ": '" + item + "' is not a positive integer");
    out.push_back(v);
  }
  if (out.empty()) return make_error("--" + flag + ": empty list");
  return out;
}

}  // namespace
#endif

Status cmd_bench_cuda(const Args& args) {
#ifndef TS_HAVE_CUDA
  (void)args;
  return make_error("--device cuda: this turbospark was built without CUDA");
#else
  const bool json = args.has("json");
  const bool profile = args.has("profile");
  const bool no_warmup = args.has("no-warmup");
  TS_ASSIGN(std::vector<int64_t> contexts, int_list("contexts", args.str_or("contexts", "128,4096")));
  TS_ASSIGN(std::vector<int64_t> prompts, int_list("prompts", args.str_or("prompts", "512,4096")));
  TS_ASSIGN(int64_t n_gen, args.integer_or("gen-tokens", 64, 1, 1 << 16));
  TS_ASSIGN(double roofline_gbps, args.number_or("roofline-gbps", 4100.0, 0.001, 1e7));
  TS_ASSIGN(double roofline_tflops, args.number_or("roofline-tflops", 790.0, 0.001, 1e7));
  TS_ASSIGN(runtime::Device device, runtime::parse_device(args.str_or("device", "cuda")));
  const std::string synthetic = args.str_or("synthetic", "");
  const std::string dtype_s = args.str_or("dtype", "bf16");
  TS_ASSIGN(int64_t seed, args.integer_or("seed", 1, 0, INT64_MAX));
  const bool quant = args.str_or("quant", "") == "q8_0";
  if (args.has("quant") && !quant) return make_error("--quant: only q8_0");
  int64_t max_ctx = 0;
  for (int64_t c : contexts) max_ctx = std::max(max_ctx, c + n_gen + 2);
  for (int64_t p : prompts) max_ctx = std::max(max_ctx, p);
  TS_ASSIGN(int64_t chunk, args.integer_or("prefill-chunk", 0, 1, 1 << 20));
  runtime::SessionOptions so{.n_ctx = int(max_ctx), .prefill_chunk = int(chunk), .quantize_q8_0 = quant};
  std::unique_ptr<runtime::Engine> engine;
  model::HParams hp;
  Loaded m;
  std::string source;
  // --routing model|uniform|zipf:S (synthetic weights): see SyntheticOptions.
  const std::string routing = args.str_or("routing", "model");
  double route_skew = 0;
  if (routing.rfind("zipf:", 0) == 0) {
    char* end = nullptr;
    route_skew = std::strtod(routing.c_str() + 5, &end);
    if (*end || !(route_skew > 0 && route_skew <= 100))
      return make_error("--routing: '" + routing + "': zipf:S needs an exponent S in (0, 100]");
  } else if (routing != "model" && routing != "uniform") {
    return make_error("--routing: '" + routing + "' is not one of model, uniform, zipf:S");
  }
  if (!synthetic.empty()) {
    if (args.has("model")) return make_error("give --model or --synthetic, not both");
    // The GPU expert cache on random weights: experts in pinned host memory.
    const std::string residency = args.str_or("residency", "resident");
    if (residency == "host") so.gpu_experts.residency = runtime::GpuResidency::kHost;
    else if (residency != "resident")
      return make_error("--residency: synthetic weights are 'resident' or 'host' (they have no "
                        "files to map or stream)");
    TS_ASSIGN(int64_t slots, args.integer_or("expert-cache-slots", 0, 1, 1 << 20));
    so.gpu_experts.slots_per_layer = int(slots);
    TS_ASSIGN(so.gpu_experts.cache_gb, args.number_or("gpu-expert-cache-gb", 0, 1e-6, 1e6));
    const std::string policy = args.str_or("cache-policy", "lru");
    if (policy == "lfu") so.gpu_experts.policy = experts::CachePolicy::kLfu;
    else if (policy != "lru") return make_error("--cache-policy: '" + policy + "' is not one of lru, lfu");
    if (residency == "resident" && (slots || so.gpu_experts.cache_gb > 0 || args.has("cache-policy")))
      return make_error("--expert-cache-slots, --gpu-expert-cache-gb and --cache-policy need "
                        "--residency host");
    DType dtype;
    if (dtype_s == "bf16") dtype = DType::kBF16;
    else if (dtype_s == "f16") dtype = DType::kF16;
    else if (dtype_s == "f32") dtype = DType::kF32;
    else if (dtype_s == "q8_0") dtype = DType::kQ8_0;
    else if (dtype_s == "q4_k") dtype = DType::kQ4_K;
    else return make_error("--dtype: '" + dtype_s + "' is not one of bf16, f16, f32, q8_0, q4_k");
    TS_TRY(args.check_all_used());
    std::ifstream f(synthetic, std::ios::binary);
    if (!f) return make_error("--synthetic: cannot read " + synthetic);
    std::stringstream ss;
    ss << f.rdbuf();
    TS_ASSIGN(hp, model::parse_hparams(ss.str(), synthetic));
    TS_ASSIGN(engine, cuda::make_synthetic_cuda_session(
                          hp, so, device.index,
                          {.dtype = dtype, .seed = uint64_t(seed),
                           .sampled_routing = routing != "model", .zipf = route_skew}));
    source = synthetic + " (random " + dtype_s + " weights on the device)";
  } else {
    if (route_skew > 0) return make_error("--routing zipf:S needs --synthetic weights");
    TS_ASSIGN(ModelFlags flags, read_model_flags(args));
    TS_TRY(args.check_all_used());
    TS_ASSIGN(m, load_model(flags));
    hp = m.model->hp();
    flags.device = device;
    TS_ASSIGN(engine, make_session(flags, m, so));
    if (routing == "uniform") cuda::set_sampled_routing(*engine, uint64_t(seed) * 7919);
    source = m.model->dir() + (quant ? " (quantized to Q8_0 at load)" : "");
  }
  const cuda::CudaBenchInfo info = cuda::bench_info(*engine);
  using Clock = std::chrono::steady_clock;
  auto prompt_of = [&](int64_t n) {
    std::vector<int> p(size_t(n), 0);
    for (size_t i = 0; i < p.size(); ++i) p[i] = int((i * 7919 + 13) % size_t(hp.vocab));
    return p;
  };
  // This GPU's DRAM peak as its driver reports it; 0 where the driver does not.
  const double peak = info.device_peak_gbps;
  char peak_s[64] = "";
  if (peak > 0) std::snprintf(peak_s, sizeof peak_s, " (DRAM peak %.0f GB/s by its driver)", peak);
  nlohmann::json j = {{"device", engine->device_name()},
                      {"model", source},
                      {"decode_weight_bytes_per_token", info.decode_weight_bytes},
                      {"kv_bytes_per_position", info.kv_bytes_per_position},
                      {"device_bytes_allocated", info.device_bytes},
                      {"cuda_graphs", info.graphs},
                      {"prefill_chunk", info.prefill_chunk},
                      {"roofline_gbps", roofline_gbps},
                      {"device_peak_gbps", peak > 0 ? nlohmann::json(peak) : nullptr},
                      {"roofline_tflops", roofline_tflops}};
  // The GPU expert cache's counters over one timed run.
  runtime::ExpertCacheReport cache0;
  auto cache_begin = [&] { cache0 = engine->expert_cache().value_or(runtime::ExpertCacheReport{}); };
  auto cache_json = [&](double seconds, int64_t tokens, const char* indent) -> nlohmann::json {
    const auto c = engine->expert_cache();
    if (!c) return nullptr;
    const double req = double(c->requests - cache0.requests);
    const double bytes = double(c->copied_bytes - cache0.copied_bytes);
    const double copy_s = (c->copy_ms - cache0.copy_ms) / 1e3;
    const double bind_s = (c->bind_ms - cache0.bind_ms) / 1e3;
    nlohmann::json out = {{"hit_rate", req > 0 ? double(c->hits - cache0.hits) / req : 1.0},
                          {"h2d_bytes_per_token", bytes / double(tokens)},
                          {"h2d_gbps_copying", copy_s > 0 ? bytes / copy_s / 1e9 : 0.0},
                          {"h2d_gbps_overall", bytes / seconds / 1e9},
                          {"copy_share", copy_s / seconds},
                          {"bind_us_per_token", bind_s * 1e6 / double(tokens)}};
    if (!json)
      std::printf("%sexpert cache: hit rate %.1f%%, %.1f MB/token host->device, %.1f GB/s while "
                  "copying, %.1f GB/s over the run, copying %.0f%% of the time, host binding "
                  "%.0f us/token\n",
                  indent, 100.0 * out["hit_rate"].get<double>(), bytes / double(tokens) / 1e6,
                  out["h2d_gbps_copying"].get<double>(), bytes / seconds / 1e9,
                  100.0 * copy_s / seconds, bind_s * 1e6 / double(tokens));
    return out;
  };
  if (!json)
    std::printf(
        "%s on %s%s\nweights read per decode token %.3f GB, KV %.1f KB per position, %.1f "
        "GiB on the device, prefill chunks of %d tokens\n",
        source.c_str(), engine->device_name().c_str(), peak_s,
        double(info.decode_weight_bytes) / 1e9, double(info.kv_bytes_per_position) / 1e3,
        double(info.device_bytes) / double(1ull << 30), info.prefill_chunk);
  if (const auto c = engine->expert_cache()) {
    j["expert_cache"] = {{"residency", c->residency},
                         {"slots_per_layer", c->slots_per_layer},
                         {"fraction", double(c->slots_per_layer) / double(std::max(1, hp.n_experts))},
                         {"expert_bytes", info.expert_bytes},
                         {"routing", routing}};
    if (!json)
      std::printf("experts in %s memory, GPU cache %d of %d slots per layer (%.0f%%), %.2f MB "
                  "per expert%s\n",
                  c->residency == "host" ? "pinned host" : "file", c->slots_per_layer,
                  hp.n_experts, 100.0 * c->slots_per_layer / std::max(1, hp.n_experts),
                  double(info.expert_bytes) / 1e6,
                  (", routing: " + routing).c_str());
  }
  // Warm-up: one short prefill and a few decode steps (graph capture, cuBLAS heuristics).
  {
    const std::vector<int> p = prompt_of(std::min<int64_t>(64, max_ctx - 8));
    TS_TRY(engine->forward(p, nullptr));
    int t = runtime::argmax(engine->last_logits());
    for (int i = 0; i < 4; ++i) TS_TRY(engine->forward(std::span<const int>(&t, 1), nullptr));
    engine->reset();
  }
  nlohmann::json decode = nlohmann::json::array();
  for (int64_t ctx : contexts) {
    engine->reset();
    TS_TRY(engine->forward(prompt_of(ctx), nullptr));
    const auto step = [&](int64_t i) {
      int next = int((uint64_t(ctx + i) * 2654435761ull + 97) % uint64_t(hp.vocab));
      return engine->forward(std::span<const int>(&next, 1), nullptr);
    };
    // Two untimed steps at this context: a decode graph of its own (the CUDA session keeps one
    // for steps over at most 256 keys and one for longer ones) is captured outside the timing.
    for (int64_t i = 0; i < 2; ++i) TS_TRY(step(i));
    cache_begin();
    const runtime::PhaseTimes ph0 = engine->phases();
    const auto t0 = Clock::now();
    for (int64_t i = 2; i < n_gen + 2; ++i) TS_TRY(step(i));
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    const double tps = double(n_gen) / s;
    // KV read per step: every cached position up to the middle of the timed run.
    const double kv = double(info.kv_bytes_per_position) * (double(ctx) + 2 + double(n_gen) / 2);
    const double bytes = double(info.decode_weight_bytes) + kv;
    const double gbps = bytes * tps / 1e9;
    decode.push_back({{"context", ctx},
                      {"tokens", n_gen},
                      {"tokens_per_s", tps},
                      {"bytes_per_token", bytes},
                      {"achieved_gbps", gbps},
                      {"roofline_fraction", gbps / roofline_gbps},
                      {"roofline_tokens_per_s", roofline_gbps * 1e9 / bytes},
                      {"device_peak_fraction", peak > 0 ? nlohmann::json(gbps / peak) : nullptr}});
    char of_peak[64] = "";
    if (peak > 0)
      std::snprintf(of_peak, sizeof of_peak, ", %.1f%% of this GPU's peak", 100.0 * gbps / peak);
    if (!json)
      std::printf(
          "decode  context %6lld: %8.1f tok/s, %.3f GB/token, %7.0f GB/s = %4.1f%% of "
          "%.0f GB/s (roofline %.0f tok/s)%s\n",
          (long long)ctx, tps, bytes / 1e9, gbps, 100.0 * gbps / roofline_gbps, roofline_gbps,
          roofline_gbps * 1e9 / bytes, of_peak);
    decode.back()["expert_cache"] = cache_json(s, n_gen, "        ");
    // The experts predicted a layer ahead (CUDA decode graphs with resident experts).
    const runtime::PhaseTimes& ph = engine->phases();
    const uint64_t picks = ph.predicted_picks - ph0.predicted_picks;
    const double rate =
        picks ? double(ph.predicted_right - ph0.predicted_right) / double(picks) : 0;
    decode.back()["expert_prediction_rate"] = picks ? nlohmann::json(rate) : nullptr;
    if (!json && picks)
      std::printf(
          "        experts predicted a layer ahead: %.1f%% of the picks (the best ranks "
          "prefetched into L2)\n",
          100.0 * rate);
    // The same step's graph replayed back to back: the device's time for a step alone, and
    // what the host's round trip between steps (synchronize, return, next launch) adds.
    if (auto r = cuda::replay_step_ms(*engine, int(n_gen)); r.ok()) {
      const double host_ms = 1e3 / tps;
      decode.back()["step_ms"] = host_ms;
      decode.back()["step_ms_back_to_back"] = r.value();
      if (!json)
        std::printf(
            "        the step's graph back to back: %.4f ms (%.1f tok/s); between "
            "steps the host adds %.1f us\n",
            r.value(), 1e3 / r.value(), 1e3 * (host_ms - r.value()));
    }
    // Greedy decoding as `generate` and `run` do it (Engine::decode_greedy: each step feeds
    // the argmax of the one before on the device, steps queued ahead of the host reading the
    // ids), from the same context; with resident experts only (random weights repeat their
    // tokens, which would flatter an expert cache).
    if (!engine->expert_cache()) {
      engine->reset();
      TS_TRY(engine->forward(prompt_of(ctx), nullptr));
      int t = runtime::argmax(engine->last_logits());
      int64_t got = 0;
      const auto count = [&](int id) {
        t = id;
        ++got;
        return true;
      };
      TS_TRY(engine->decode_greedy(t, 2, count));  // untimed, as the steps above
      got = 0;
      const auto g0 = Clock::now();
      TS_TRY(engine->decode_greedy(t, int(n_gen), count));
      const double gs = std::chrono::duration<double>(Clock::now() - g0).count();
      if (got != n_gen)
        return make_error("bench: greedy decoding gave " + std::to_string(got) + " of " +
                          std::to_string(n_gen) + " ids");
      decode.back()["greedy_tokens_per_s"] = double(n_gen) / gs;
      if (!json)
        std::printf("        greedy decoding (the argmax fed back on the device): %.1f tok/s\n",
                    double(n_gen) / gs);
    }
  }
  nlohmann::json prefill = nlohmann::json::array();
  // FLOPs per prompt token: 2 per active weight (dense, lm head once, top_k experts) plus
  // causal attention (QK^T and PV: 2 * 2 * head_dim per head per visible key, ~n/2 keys).
  int64_t params_active = int64_t(hp.d_model) * (2 * hp.q_dim() + 2 * hp.kv_dim()) * hp.n_layers;
  for (int l = 0; l < hp.n_layers; ++l) {
    if (hp.layer_is_moe[size_t(l)])
      params_active += int64_t(hp.d_model) * (3 * int64_t(hp.top_k) * hp.d_expert +
                                              3 * int64_t(hp.d_shared) + hp.n_experts);
    else params_active += 3 * int64_t(hp.d_model) * hp.d_ff;
  }
  // Each prompt length runs once untimed first (as llama-bench warms up): the first prefill of
  // a length pays one-time costs — kernels loaded on first use, cuBLAS's heuristics for the
  // new shapes. Not with --no-warmup (a cold first prompt), nor with an expert cache, whose
  // slots would then hold the prompt's experts.
  const bool warm_prefill = !no_warmup && !engine->expert_cache();
  for (int64_t n : prompts) {
    const std::vector<int> p = prompt_of(n);
    if (warm_prefill) {
      engine->reset();
      TS_TRY(engine->forward(p, nullptr));
    }
    engine->reset();
    cache_begin();
    const auto t0 = Clock::now();
    TS_TRY(engine->forward(p, nullptr));
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    const double flops = 2.0 * double(params_active) * double(n) +
                         2.0 * double(hp.d_model) * double(hp.vocab) +  // last row's lm head
                         4.0 * double(hp.head_dim) * hp.n_heads * hp.n_layers * double(n) *
                             double(n) / 2.0;
    const double tflops = flops / s / 1e12;
    prefill.push_back({{"prompt_tokens", n},
                       {"tokens_per_s", double(n) / s},
                       {"seconds", s},
                       {"tflops", tflops},
                       {"roofline_fraction", tflops / roofline_tflops},
                       {"warm", warm_prefill}});
    if (!json)
      std::printf("prefill %6lld tokens: %8.0f tok/s (%.3f s), %6.1f TFLOP/s = %4.1f%% of %.0f\n",
                  (long long)n, double(n) / s, s, tflops, 100.0 * tflops / roofline_tflops,
                  roofline_tflops);
    prefill.back()["expert_cache"] = cache_json(s, n, "        ");
  }
  if (profile) {
    // Where the time goes: every launch timed with events (graphs off), decode at the first
    // context, then prefill of the last prompt length.
    auto table = [&](const char* what, double per) {
      nlohmann::json rows = nlohmann::json::array();
      double total = 0;
      for (const cuda::KernelStat& k : cuda::profile_table(*engine)) total += k.ms;
      if (!json)
        std::printf("profile %s (per %s): %-18s %9s %7s %9s %7s %6s\n", what,
                    per == 1 ? "run" : "token", "kernel", "ms", "calls", "GB/s", "of roof",
                    "share");
      for (const cuda::KernelStat& k : cuda::profile_table(*engine)) {
        const double gbps = k.ms > 0 ? k.bytes / (k.ms * 1e-3) / 1e9 : 0;
        rows.push_back({{"kernel", k.name}, {"ms", k.ms / per}, {"calls", double(k.calls) / per},
                        {"bytes", k.bytes / per}, {"gbps", gbps},
                        {"roofline_fraction", gbps / roofline_gbps}, {"share", k.ms / total}});
        if (!json)
          std::printf("  %-30s %9.4f %7.1f %9.0f %6.1f%% %5.1f%%\n", k.name.c_str(), k.ms / per,
                      double(k.calls) / per, gbps, 100.0 * gbps / roofline_gbps,
                      100.0 * k.ms / total);
      }
      return rows;
    };
    engine->reset();
    TS_TRY(engine->forward(prompt_of(contexts[0]), nullptr));
    cuda::set_profiling(*engine, true);
    int next = runtime::argmax(engine->last_logits());
    for (int64_t i = 0; i < n_gen; ++i) {
      TS_TRY(engine->forward(std::span<const int>(&next, 1), nullptr));
      next = runtime::argmax(engine->last_logits());
    }
    j["profile_decode"] = table("decode", double(n_gen));
    engine->reset();
    cuda::set_profiling(*engine, true);
    TS_TRY(engine->forward(prompt_of(prompts.back()), nullptr));
    j["profile_prefill"] = table("prefill", 1);
    cuda::set_profiling(*engine, false);
  }
  j["decode"] = decode;
  j["prefill"] = prefill;
  j["params_active_per_token"] = params_active;
  if (json) std::printf("%s\n", j.dump(2).c_str());
  return {};
#endif
}

}  // namespace ts::cli
