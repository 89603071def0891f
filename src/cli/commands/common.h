// Pieces shared by the subcommands: loading the model named by --model with a thread pool.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli/args.h"
#include "core/thread_pool.h"
#include "hub/hub_cache.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "runtime/sampler.h"
#include "runtime/session.h"

namespace ts::cli {

struct Loaded {
  std::unique_ptr<runtime::LoadedModel> model;
  std::unique_ptr<ThreadPool> pool;
};

// The flags every model-running command takes. Read them (with the command's own flags)
// before Args::check_all_used(), so a typo is reported before a slow load.
struct ModelFlags {
  std::string dir;   // the path to load (an ORG/NAME resolved to its cached snapshot)
  std::string name;  // --model as given
  int threads = 1;
  runtime::Device device;  // --device cpu|cuda[:N]
  bool quantize_q8_0 = false;  // --quant q8_0 (CUDA: quantize float matrices at load)
  int prefill_chunk = 0;       // --prefill-chunk N: tokens per prefill chunk (0: the backend's)
  runtime::LoadOptions load;
  runtime::GpuExpertOptions gpu;  // --residency host|streamed on --device cuda
  std::string cache_warm;         // --cache-warm HIST.json (read once the model is known)
  bool stats = false;       // --stats or TURBOSPARK_PHASES=1: phase summary on stderr
  std::string router_hist;  // --router-hist FILE: per-layer per-expert selection counts
  // Interventions (runtime/interventions.h), validated against the model after loading.
  std::string capture_layers;      // --capture-residual LAYERS
  std::string capture_out;         // --capture-out FILE.npy | FILE.safetensors
  bool capture_last = false;       // --capture-last
  std::vector<std::string> steer;  // --steer FILE@LAYERS[:SCALE[:MODE]], repeatable
  std::string router_trace;        // --router-trace FILE.jsonl
};

// --model: a directory, a .gguf file or a pack, or ORG/NAME[@REV] from the Hugging Face
// cache (hub::resolve_model_arg), read offline.
inline Result<std::string> model_path(const Args& args) {
  TS_ASSIGN(std::string arg, args.str("model"));
  return hub::resolve_model_arg(arg);
}

inline Result<ModelFlags> read_model_flags(const Args& args) {
  ModelFlags f;
  TS_ASSIGN(f.name, args.str("model"));
  TS_ASSIGN(f.dir, hub::resolve_model_arg(f.name));
  TS_ASSIGN(int64_t threads,
            args.integer_or("threads", std::max(1u, std::thread::hardware_concurrency()), 1, 1024));
  f.threads = int(threads);
  TS_ASSIGN(f.device, runtime::parse_device(args.str_or("device", "cpu")));
  if (args.has("quant")) {
    if (args.str_or("quant", "") != "q8_0") return make_error("--quant: only q8_0 is supported");
    if (f.device.kind != runtime::DeviceKind::kCuda)
      return make_error("--quant q8_0 quantizes at load on --device cuda; for the CPU, make a "
                        "pack: turbospark pack --experts-quant q8_0 --dense-quant q8_0");
    f.quantize_q8_0 = true;
  }
  TS_ASSIGN(int64_t chunk, args.integer_or("prefill-chunk", 0, 1, 1 << 20));
  f.prefill_chunk = int(chunk);
  // --residency: on the CPU where the experts live; on CUDA resident and mapped put every
  // expert in GPU memory (the host side is only where they load from), host and streamed put
  // a GPU expert cache in front of pinned host memory or the model's files.
  const std::string residency = args.str_or("residency", "mapped");
  const bool cuda = f.device.kind == runtime::DeviceKind::kCuda;
  if (residency == "host") {
    if (!cuda)
      return make_error("--residency host (experts in pinned host memory behind a GPU cache) "
                        "needs --device cuda; on the CPU use resident, mapped or streamed");
    f.gpu.residency = runtime::GpuResidency::kHost;
    f.load.residency = experts::Residency::kMapped;
  } else {
    auto r = experts::parse_residency(residency);
    if (!r.ok())
      return make_error("--residency: '" + residency + "' is not one of resident, mapped, "
                        "streamed, host (host: --device cuda only)");
    f.load.residency = r.value();
    if (cuda && f.load.residency == experts::Residency::kStreamed)
      f.gpu.residency = runtime::GpuResidency::kStreamed;
  }
  const bool gpu_cache = f.gpu.residency != runtime::GpuResidency::kResident;
  const bool streamed = f.load.residency == experts::Residency::kStreamed;
  TS_ASSIGN(int64_t slots, args.integer_or("expert-cache-slots", 0, 1, 1 << 20));
  TS_ASSIGN(f.load.expert_cache_mb, args.integer_or("expert-cache-mb", 0, 1, int64_t(1) << 40));
  TS_ASSIGN(f.gpu.cache_gb, args.number_or("gpu-expert-cache-gb", 0, 1e-6, 1e6));
  std::string policy = args.str_or("cache-policy", "lru");
  if (policy == "lru") f.load.streamed.policy = experts::CachePolicy::kLru;
  else if (policy == "lfu") f.load.streamed.policy = experts::CachePolicy::kLfu;
  else return make_error("--cache-policy: '" + policy + "' is not one of lru, lfu");
  f.gpu.policy = f.load.streamed.policy;
  f.load.streamed.direct_io = args.has("direct-io");
  TS_ASSIGN(int64_t io_threads, args.integer_or("io-threads", 4, 1, 256));
  f.load.streamed.io_threads = int(io_threads);
  f.cache_warm = args.str_or("cache-warm", "");
  if (!streamed && !gpu_cache && (slots || f.load.expert_cache_mb || args.has("cache-policy")))
    return make_error("--expert-cache-slots, --expert-cache-mb and --cache-policy need "
                      "--residency streamed (or host on --device cuda)");
  if (!streamed && f.load.streamed.direct_io)
    return make_error("--direct-io needs --residency streamed");
  if (!gpu_cache && f.gpu.cache_gb > 0)
    return make_error("--gpu-expert-cache-gb needs --device cuda with --residency host or "
                      "streamed");
  if (!gpu_cache && !streamed && !f.cache_warm.empty())
    return make_error("--cache-warm needs an expert cache: --residency streamed (or host on "
                      "--device cuda)");
  if (gpu_cache && f.load.expert_cache_mb)
    return make_error("--expert-cache-mb sizes the CPU's cache; on --device cuda give "
                      "--gpu-expert-cache-gb or --expert-cache-slots");
  if (slots && (f.load.expert_cache_mb || f.gpu.cache_gb > 0))
    return make_error("give --expert-cache-slots or a cache size, not both");
  // On CUDA the slots are the GPU's; the streamed store then only stages reads.
  if (slots && gpu_cache) f.gpu.slots_per_layer = int(slots);
  else if (slots) f.load.streamed.slots_per_layer = int(slots);
  const char* env = std::getenv("TURBOSPARK_PHASES");
  f.stats = args.has("stats") || (env && std::string(env) == "1");
  f.router_hist = args.str_or("router-hist", "");
  f.capture_layers = args.str_or("capture-residual", "");
  f.capture_out = args.str_or("capture-out", "");
  f.capture_last = args.has("capture-last");
  f.steer = args.all("steer");
  f.router_trace = args.str_or("router-trace", "");
  if (f.capture_layers.empty() != f.capture_out.empty())
    return make_error("--capture-residual and --capture-out go together");
  return f;
}

// Steering ops, capture layers and tracing from the flags; errors name the file and what
// was wrong (vector length, a layer out of range, a NaN).
Result<runtime::Interventions> build_interventions(const ModelFlags& flags,
                                                   const model::HParams& hp);

// Work done layer by layer, shown on stderr when it is a terminal (else nothing is printed):
// "turbospark: WHAT: layer L/N, X.X GB" rewritten in place, the line ended after the last.
experts::LayerProgress tty_layer_progress(std::string what);

inline Result<Loaded> load_model(const ModelFlags& flags) {
  Loaded out;
  runtime::LoadOptions load = flags.load;
  if (load.residency == experts::Residency::kResident)
    load.on_layer = tty_layer_progress("routed experts into memory");
  TS_ASSIGN(out.model, runtime::LoadedModel::load(flags.dir, load));
  if (!out.model->load_note().empty())
    std::fprintf(stderr, "turbospark: %s: %s\n", flags.dir.c_str(), out.model->load_note().c_str());
  out.pool = std::make_unique<ThreadPool>(flags.threads);
  return out;
}

// --logit-bias ids against the model's vocabulary.
inline Status check_logit_bias(const runtime::SamplerOptions& so, int64_t vocab) {
  if (const int id = so.bias_outside(vocab); id >= 0)
    return make_error("--logit-bias names token id " + std::to_string(id) +
                      ", outside the vocabulary of " + std::to_string(vocab));
  return {};
}

// --cache-warm: a router histogram (--router-hist's JSON) for this model, as counts per
// [layer][expert]; errors name the file and the field.
Result<std::vector<std::vector<uint64_t>>> read_cache_warm(const std::string& path,
                                                           const model::HParams& hp);

// --cache-warm on the CPU's streamed store: each layer's slots filled with its most selected
// experts (ties: lower id), before the first token and outside the statistics.
Status warm_store(experts::ExpertStore& store, const std::vector<std::vector<uint64_t>>& counts);

// The session for the --device flag.
inline Result<std::unique_ptr<runtime::Engine>> make_session(const ModelFlags& flags,
                                                             const Loaded& m,
                                                             runtime::SessionOptions options) {
  options.quantize_q8_0 = flags.quantize_q8_0;
  if (flags.prefill_chunk > 0) options.prefill_chunk = flags.prefill_chunk;
  options.gpu_experts = flags.gpu;
  if (flags.device.kind == runtime::DeviceKind::kCuda)
    options.on_layer =
        tty_layer_progress("weights onto cuda:" + std::to_string(flags.device.index));
  if (!flags.cache_warm.empty()) {
    TS_ASSIGN(auto counts, read_cache_warm(flags.cache_warm, m.model->hp()));
    if (flags.gpu.residency != runtime::GpuResidency::kResident) {
      options.gpu_experts.warm = std::move(counts);
    } else {
      TS_TRY(warm_store(m.model->experts(), counts));
    }
  }
  return runtime::make_engine(*m.model, *m.pool, std::move(options), flags.device);
}

// Phase times, expert cache counters and storage bytes of a finished run, for --stats.
// Counters at a point of a run (e.g. after bench's warm-up), to report only what follows.
struct RunCounters {
  runtime::PhaseTimes phases;
  experts::StoreStats store;
  runtime::ExpertCacheReport cache;  // the engine's own expert cache, if any
};
nlohmann::json stats_json(const runtime::LoadedModel& model, const runtime::Engine& session,
                          int64_t tokens_processed, const RunCounters& since);
nlohmann::json stats_json(const runtime::LoadedModel& model, const runtime::Engine& session,
                          int64_t tokens_processed);
void print_stats(const nlohmann::json& stats);
// Writes the session's router histogram as JSON: {"n_layers", "n_experts", "counts": [[..]]}.
Status write_router_hist(const std::string& path, const runtime::LoadedModel& model,
                         const runtime::Engine& session);
// --stats, --router-hist, --capture-out and --router-trace at the end of a run.
Status finish_run(const ModelFlags& flags, const Loaded& m, const runtime::Engine& session,
                  int64_t tokens_processed);

}  // namespace ts::cli
