// The engine: one thread that owns the Session and runs the queued jobs. Where the backend
// batches (the CPU) and --parallel is above 1, it is a continuous-batching scheduler: up to
// `parallel` jobs in flight, one step at a time over all of them (each decoding job's next
// token, then prefill chunks of the others within the step's token budget), jobs admitted
// in arrival order as soon as a place and their KV rows are free, retired as they finish.
// The session's prefix cache shares the KV rows of whole blocks a new request's prompt has in
// common with a finished or running one (a chat that goes on, a common system prompt).
// Otherwise jobs run one at a time in arrival order on the session's own sequence, reusing
// the previous request's rows for the prefix they share.
//
// Threads: HTTP threads call submit(); the engine thread calls a job's on_text (per token)
// and on_done (once). A job whose `cancelled` flag is set stops at the next token (or is
// skipped if it has not started); on_done still comes, with StopReason::kCancelled.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "server/api.h"
#include "server/metrics.h"

namespace ts {
class ThreadPool;
}
namespace ts::tokenizer {
class Tokenizer;
}

namespace ts::server {

struct Job {
  std::vector<int> prompt;  // not empty; prompt + max_tokens fit the context
  runtime::SamplerOptions sampling;
  int64_t max_tokens = 1;
  std::vector<std::string> stops;
  // >= 0: each sampled token's log-probability and this many alternatives go to logprobs
  // (an end-of-generation token that stops the reply is left out).
  int top_logprobs = -1;
  std::vector<TokenLogprob> logprobs;
  // With top_logprobs >= 0: the prompt's tokens go first in logprobs (the first without one);
  // the prompt is then prefilled whole, with every row's logits.
  bool echo = false;
  // response_format json_object: the reply is constrained to one JSON object
  // (runtime/json_constraint.h) and ends with it.
  bool json_object = false;
  std::shared_ptr<const runtime::JsonSchema> schema;  // with json_object: json_schema's rules
  // Each piece of final text (may be empty); returning false cancels. May be unset.
  std::function<bool(std::string_view)> on_text;
  std::function<void(Result<runtime::Generation>)> on_done;
  std::atomic<bool> cancelled{false};
};

struct EngineOptions {
  const runtime::LoadedModel* model = nullptr;  // for the expert cache counters
  // The session (CPU or CUDA, from runtime::make_engine); only the engine thread uses it.
  std::unique_ptr<runtime::Engine> session;
  const tokenizer::Tokenizer* tokenizer = nullptr;
  // Threads for sampling's passes over the vocabulary (the session's own, idle between its
  // steps); may be null.
  ThreadPool* pool = nullptr;
  int max_queue = 64;  // jobs waiting (not counting running ones) before submit() refuses
  // Jobs in flight at once where the session batches (Engine::batches); 1: one at a time.
  int parallel = 1;
  // Test hook (TURBOSPARK_SERVE_TEST_REPLY): when set, every reply is these tokens and then
  // EOS instead of sampled ones; the model still runs on them.
  std::vector<int> forced_reply;
  bool log_stats = false;  // one line per request on stderr
};

// Runs a 64-token prompt and two decode steps, then forgets them, so the first request does not
// pay the one-time costs (weights paged in, CUDA kernels loaded, cuBLAS started, the decode
// graph captured), as llama.cpp's server warms up (fewer where the context is shorter). Build
// the Engine after it: its metrics count from its construction.
struct WarmUp {
  int prompt_tokens = 0;
  int decode_steps = 0;
};
Result<WarmUp> warm_up(runtime::Engine& session, const tokenizer::Tokenizer& tok);

class Engine {
 public:
  explicit Engine(EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues the job; an error (queue full, or stopping) leaves it unqueued.
  Status submit(std::shared_ptr<Job> job);
  // Cancels the running job, fails the waiting ones and ends the thread.
  void stop();

  int n_ctx() const { return session_->n_ctx(); }
  int queue_depth() const;
  // The KV pool as of the last step (batching; zeros otherwise).
  runtime::Engine::KvStats kv_stats() const {
    std::lock_guard lock(mu_);
    return kv_;
  }
  int running() const { return running_; }
  int parallel() const { return parallel_; }
  std::string device_name() const { return session_->device_name(); }
  const runtime::LoadedModel& model() const { return *opt_.model; }
  Metrics& metrics() { return metrics_; }

 private:
  struct Picker;
  struct Active;
  void run();          // one job at a time
  void run_batched();  // the continuous-batching scheduler
  Result<runtime::Generation> generate(Job& job);
  void finish(Job& job, Result<runtime::Generation> r);  // metrics, log line, on_done
  // Batched: admits waiting jobs while places and KV rows allow; false when stopping.
  bool admit(std::vector<std::unique_ptr<Active>>& active);
  Status run_step(std::vector<std::unique_ptr<Active>>& active);
  void retire(Active& a);

  EngineOptions opt_;
  std::unique_ptr<runtime::Engine> session_;
  std::vector<int> cached_;  // tokens whose KV rows the session holds
  // Every token's bytes (special tokens: none), built by the first JSON-mode request.
  std::vector<std::string> token_bytes_;
  Metrics metrics_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<std::shared_ptr<Job>> current_;  // running jobs (stop() cancels them)
  bool stopping_ = false;
  int parallel_ = 1;
  runtime::Engine::KvStats kv_;  // under mu_
  std::atomic<int> running_{0};
  std::thread thread_;
};

}  // namespace ts::server
