// The engine: one thread that owns the Session and runs queued jobs one at a time, in
// arrival order (FIFO). The KV cache of the previous request is kept, so a request that
// shares a prefix with it (a chat that goes on) skips that part of the prefill.
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
  int max_queue = 64;  // jobs waiting (not counting the running one) before submit() refuses
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
  int running() const { return running_ ? 1 : 0; }
  Metrics& metrics() { return metrics_; }

 private:
  void run();
  Result<runtime::Generation> generate(Job& job);

  EngineOptions opt_;
  std::unique_ptr<runtime::Engine> session_;
  std::vector<int> cached_;  // tokens whose KV rows the session holds
  // Every token's bytes (special tokens: none), built by the first JSON-mode request.
  std::vector<std::string> token_bytes_;
  Metrics metrics_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::shared_ptr<Job> current_;
  bool stopping_ = false;
  std::atomic<bool> running_{false};
  std::thread thread_;
};

}  // namespace ts::server
