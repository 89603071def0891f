// serve: the OpenAI- and Anthropic-compatible HTTP server (src/server). Loads the model once,
// starts the engine thread and the HTTP threads, and serves until SIGINT / SIGTERM.
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "cli/commands/commands.h"
#include "cli/commands/common.h"
#include "runtime/kv_blocks.h"
#include "server/engine.h"
#include "server/server.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace ts::cli {
namespace {

// The served model id: the directory's name ("/models/Qwen3-30B-A3B/" -> "Qwen3-30B-A3B").
std::string default_model_id(const std::string& dir) {
  std::filesystem::path p(dir);
  if (!p.has_filename()) p = p.parent_path();
  std::string name = p.filename().string();
  if (name.size() > 5 && name.compare(name.size() - 5, 5, ".gguf") == 0)
    name.resize(name.size() - 5);
  return name.empty() || name == "." ? "turbospark" : name;
}

}  // namespace

Status cmd_serve(const Args& args) {
  // Signals are taken by one thread (sigwait below); block them before any thread starts, so
  // every thread inherits the mask. A client that goes away must not kill the process.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  TS_ASSIGN(ModelFlags flags, read_model_flags(args));
  server::ServerOptions opt;
  opt.host = args.str_or("host", "127.0.0.1");
  TS_ASSIGN(int64_t port, args.integer_or("port", 8080, 0, 65535));
  opt.port = int(port);
  const char* env_key = std::getenv("TURBOSPARK_API_KEY");
  opt.api_key = args.str_or("api-key", env_key ? env_key : "");
  TS_ASSIGN(int64_t max_queue, args.integer_or("max-queue", 64, 1, 1 << 16));
  TS_ASSIGN(int64_t n_ctx, args.integer_or("n-ctx", 4096, 16, 1 << 24));
  TS_ASSIGN(int64_t parallel, args.integer_or("parallel", 4, 1, 1024));
  TS_ASSIGN(int64_t kv_tokens, args.integer_or("kv-tokens", 0, 0, int64_t(1) << 32));
  TS_ASSIGN(int64_t max_body, args.integer_or("max-body-bytes", 8 << 20, 1024, int64_t(1) << 32));
  opt.max_body_bytes = size_t(max_body);
  TS_ASSIGN(int64_t request_timeout, args.integer_or("request-timeout-s", 30, 1, 3600));
  opt.request_timeout_s = int(request_timeout);
  opt.cors_origins = args.all("cors-origin");
  opt.model_id = args.str_or("model-name", default_model_id(flags.name));
  // Running and queued streams hold an HTTP thread each; a few more serve /health, /metrics
  // and idle keep-alive connections.
  opt.http_threads = int(max_queue + parallel) + 16;
  const bool warmup = !args.has("no-warmup");
  TS_TRY(args.check_all_used());
  if (!flags.capture_layers.empty() || !flags.router_hist.empty() || !flags.router_trace.empty())
    return make_error(
        "--capture-residual, --router-hist and --router-trace are not available in "
        "serve (they grow with every request)");
  if (opt.model_id.empty()) return make_error("--model-name: the model id must not be empty");

  TS_ASSIGN(std::unique_ptr<tokenizer::Tokenizer> tok, tokenizer::Tokenizer::load(flags.dir));
  TS_ASSIGN(tokenizer::ChatTemplate tmpl, tokenizer::ChatTemplate::load(flags.dir));
  TS_ASSIGN(Loaded m, load_model(flags));
  TS_ASSIGN(runtime::Interventions iv, build_interventions(flags, m.model->hp()));
  const int ctx = int(std::min<int64_t>(n_ctx, m.model->hp().max_positions));

  // The KV pool (CPU): every request in flight may reach the whole context unless
  // --kv-tokens says less; rows take memory only as sequences fill them.
  if (kv_tokens > 0 && kv_tokens < ctx)
    return make_error("--kv-tokens " + std::to_string(kv_tokens) +
                      " is less than the context (--n-ctx " + std::to_string(ctx) +
                      "): one full-length request would never fit");
  const int64_t pool_tokens = kv_tokens > 0 ? kv_tokens : runtime::kv_pool_tokens(ctx, parallel);
  TS_ASSIGN(std::unique_ptr<runtime::Engine> session,
            make_session(flags, m,
                         {.n_ctx = ctx, .kv_tokens = pool_tokens, .interventions = std::move(iv)}));
  std::string warmed = ", no warm-up";
  if (warmup) {
    // Before the port opens, so no request waits on it; /metrics leaves it out.
    const auto t0 = std::chrono::steady_clock::now();
    TS_ASSIGN(server::WarmUp w, server::warm_up(*session, *tok));
    char line[128];
    std::snprintf(line, sizeof line, ", warmed up in %.2f s (%d prompt tokens, %d decode steps)",
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                  w.prompt_tokens, w.decode_steps);
    warmed = line;
  }
  server::EngineOptions eo{.model = m.model.get(),
                           .session = std::move(session),
                           .tokenizer = tok.get(),
                           .pool = m.pool.get(),
                           .max_queue = int(max_queue),
                           .parallel = int(parallel),
                           .log_stats = flags.stats};
  // Test hook: a fixed reply (tool calls, reasoning) from a model whose text is noise.
  if (const char* reply = std::getenv("TURBOSPARK_SERVE_TEST_REPLY"))
    eo.forced_reply = tok->encode(reply, /*add_special=*/false);
  server::Engine engine(std::move(eo));
  server::Server http(opt, engine, *tok, tmpl);

  std::thread waiter([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    engine.stop();
    http.stop();
  });
  std::string batching =
      ", one request at a time (the " + engine.device_name() + " backend does not batch)";
  if (engine.parallel() > 1) {
    const model::HParams& hp = m.model->hp();
    const double kv_gb = double(pool_tokens) * double(hp.n_layers) * double(hp.cache_row()) *
                         (hp.attention == model::AttentionKind::kMla ? 1 : 2) * 4 / 1e9;
    char line[160];
    std::snprintf(line, sizeof line,
                  ", %d requests at once over a KV pool of %lld positions (%.2f GB at most)",
                  engine.parallel(), (long long)pool_tokens, kv_gb);
    batching = line;
  } else if (parallel == 1) {
    batching = ", one request at a time";
  }
  Status st = http.run([&](int bound) {
    std::fprintf(stderr, "turbospark serve: %s on http://%s:%d (n_ctx %d%s, max queue %lld%s)\n",
                 opt.model_id.c_str(), opt.host.c_str(), bound, ctx, batching.c_str(),
                 (long long)max_queue, warmed.c_str());
  });
  if (!st.ok()) engine.stop();
  pthread_kill(waiter.native_handle(), SIGTERM);  // wakes the waiter if no signal came
  waiter.join();
  return st;
}

}  // namespace ts::cli
