#include "server/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <optional>

#include "core/thread_pool.h"
#include "runtime/json_constraint.h"
#include "runtime/json_schema.h"
#include "tokenizer/tokenizer.h"

namespace ts::server {

Engine::Engine(EngineOptions options)
    : opt_(std::move(options)), session_(std::move(opt_.session)) {
  parallel_ = session_->batches() ? std::max(1, opt_.parallel) : 1;
  if (parallel_ > 1) kv_ = session_->kv_stats();
  // /metrics counts from here: what a warm-up before (warm_up below) did is not a request's.
  metrics_.set_baseline(opt_.model->experts().stats(), session_->expert_cache(),
                        session_->phases());
  thread_ = std::thread([this] { run(); });
}

Result<WarmUp> warm_up(runtime::Engine& session, const tokenizer::Tokenizer& tok) {
  // 64 tokens: past the few-token path (CUDA: GEMV up to 8 tokens), so the prefill a chat
  // prompt takes (cuBLAS, the grouped expert GEMMs) runs once too; then up to two decode steps
  // (the decode graph), all within the context.
  const int ctx = session.n_ctx();
  const int want = std::max(1, std::min(64, ctx - 2));
  std::vector<int> prompt = tok.encode("Hello", /*add_special=*/true);
  const std::vector<int> filler =
      tok.encode(" The quick brown fox jumps over the lazy dog.", /*add_special=*/false);
  for (size_t i = 0; int(prompt.size()) < want; ++i)
    prompt.push_back(filler.empty() ? 0 : filler[i % filler.size()]);
  prompt.resize(size_t(want));
  const WarmUp w{.prompt_tokens = want, .decode_steps = std::max(0, std::min(2, ctx - want))};
  const auto step = [&](std::span<const int> tokens) -> Status {
    if (Status st = session.forward(tokens, nullptr); !st.ok())
      return make_error("warm-up: " + st.error().message + " (--no-warmup skips it)");
    return {};
  };
  TS_TRY(step(prompt));
  for (int i = 0; i < w.decode_steps; ++i) {
    const int t = runtime::argmax(session.last_logits());
    TS_TRY(step(std::span<const int>(&t, 1)));
  }
  session.reset();
  return w;
}

Engine::~Engine() { stop(); }

Status Engine::submit(std::shared_ptr<Job> job) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return make_error("the server is shutting down");
    if (int(queue_.size()) >= opt_.max_queue)
      return make_error("the server is busy: " + std::to_string(queue_.size()) +
                        " requests are already waiting (--max-queue " +
                        std::to_string(opt_.max_queue) + ")");
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
  return {};
}

void Engine::stop() {
  std::deque<std::shared_ptr<Job>> left;
  {
    std::lock_guard lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    left.swap(queue_);
    for (const auto& job : current_) job->cancelled = true;
  }
  cv_.notify_one();
  for (auto& job : left)
    if (job->on_done) job->on_done(make_error("the server is shutting down"));
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

int Engine::queue_depth() const {
  std::lock_guard lock(mu_);
  return int(queue_.size());
}

void Engine::finish(Job& job, Result<runtime::Generation> r) {
  if (r.ok())
    metrics_.record_generation(*r, opt_.model->experts().stats(), session_->expert_cache(),
                               session_->phases());
  else
    metrics_.count_failure();
  if (opt_.log_stats && r.ok())
    std::fprintf(stderr,
                 "serve: prompt %lld tokens (%lld reused) in %.3f s, generated %lld in %.3f s "
                 "(%.1f tok/s), stop: %s\n",
                 (long long)r->prompt_tokens, (long long)r->reused_tokens, r->prefill_s,
                 (long long)r->generated, r->decode_s,
                 r->decode_s > 0 ? double(r->generated) / r->decode_s : 0.0,
                 runtime::stop_reason_name(r->stop_reason));
  if (job.on_done) job.on_done(std::move(r));
}

void Engine::run() {
  if (parallel_ > 1) return run_batched();
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      job = queue_.front();
      queue_.pop_front();
      current_.assign(1, job);
      running_ = 1;
    }
    Result<runtime::Generation> r =
        runtime::Generation{.stop_reason = runtime::StopReason::kCancelled};
    if (!job->cancelled) {
      // One request's failure (a bad allocation, a storage read error) fails that request only.
      try {
        r = generate(*job);
      } catch (const std::exception& e) {
        cached_.clear();
        session_->reset();
        r = make_error(std::string("internal error: ") + e.what());
      }
    }
    {
      std::lock_guard lock(mu_);
      current_.clear();
      running_ = 0;
    }
    finish(*job, std::move(r));
  }
}

namespace {
// log-softmax of the logits at `tok` and the `top` likeliest ids (ties to the lower id).
TokenLogprob token_logprob(std::span<const float> logits, int tok, int top,
                           const tokenizer::Tokenizer& t, ThreadPool* pool = nullptr) {
  // By 16 fixed ranges of the vocabulary (on the pool when given): each range's max, sum and
  // best `top`, combined in range order (the same values on any thread count).
  constexpr int kChunks = 16;
  const size_t k = std::min(size_t(std::max(top, 0)), logits.size());
  const auto better = [&](int a, int b) {
    return logits[size_t(a)] > logits[size_t(b)] ||
           (logits[size_t(a)] == logits[size_t(b)] && a < b);
  };
  float chunk_max[kChunks];
  std::fill(chunk_max, chunk_max + kChunks, -INFINITY);
  std::vector<int> best[kChunks];
  ThreadPool::fixed_chunks(pool, logits.size(), kChunks, [&](size_t i0, size_t i1, int c) {
    float m = -INFINITY;
    for (size_t i = i0; i < i1; ++i) m = std::max(m, logits[i]);
    chunk_max[c] = m;
    if (k == 0 || i0 == i1) return;
    std::vector<int>& ids = best[c];
    ids.resize(i1 - i0);
    for (size_t i = i0; i < i1; ++i) ids[i - i0] = int(i);
    const size_t kc = std::min(k, ids.size());
    std::partial_sort(ids.begin(), ids.begin() + long(kc), ids.end(), better);
    ids.resize(kc);
  });
  const float mx = *std::max_element(chunk_max, chunk_max + kChunks);
  double chunk_sum[kChunks] = {};
  ThreadPool::fixed_chunks(pool, logits.size(), kChunks, [&](size_t i0, size_t i1, int c) {
    double s = 0;
    for (size_t i = i0; i < i1; ++i) s += std::exp(double(logits[i]) - double(mx));
    chunk_sum[c] = s;
  });
  double sum = 0;
  for (double s : chunk_sum) sum += s;
  const double log_z = double(mx) + std::log(sum);
  const auto lp = [&](int id) { return float(double(logits[size_t(id)]) - log_z); };
  const auto text = [&](int id) { return t.token_bytes(id); };
  TokenLogprob out{.text = text(tok), .logprob = lp(tok)};
  if (k == 0) return out;
  std::vector<int> ids;
  for (const std::vector<int>& b : best) ids.insert(ids.end(), b.begin(), b.end());
  std::partial_sort(ids.begin(), ids.begin() + long(k), ids.end(), better);
  for (size_t i = 0; i < k; ++i) out.top.emplace_back(text(ids[i]), lp(ids[i]));
  return out;
}
}  // namespace

// How a job picks each token: its sampler, JSON mode's mask, the test hook's forced reply,
// and the log-probabilities it records. The same for both ways jobs run.
struct Engine::Picker {
  Picker(Engine& e, Job& job) : e_(e), job_(job), sampler_(job.sampling) {
    sampler_.set_pool(e.opt_.pool);
    if (job.json_object) {
      if (e.token_bytes_.empty()) {
        const tokenizer::Tokenizer& t = *e.opt_.tokenizer;
        e.token_bytes_.resize(size_t(t.vocab_size()));
        for (int id = 0; id < t.vocab_size(); ++id)
          if (!t.is_special(id)) e.token_bytes_[size_t(id)] = t.token_bytes(id);
      }
      json_.emplace(e.token_bytes_, e.opt_.tokenizer->eos_ids(), job.schema.get());
    }
  }
  // Plain greedy with nothing read from the logits but the argmax: the session may pick.
  bool greedy_on_engine() const {
    return e_.opt_.forced_reply.empty() && !json_ && job_.top_logprobs < 0 &&
           sampler_.options().plain_greedy();
  }
  // The first prompt token's entry, when the prompt's log-probabilities are asked for.
  void echo_first() {
    const int first = job_.prompt[0];
    job_.logprobs.push_back({.text = e_.opt_.tokenizer->token_bytes(first), .first = true});
  }
  // The log-probabilities of prompt tokens [i0 + 1, i0 + 1 + rows.size() / vocab) from the
  // rows of positions [i0, ...) (on the pool's threads when there is one: the same values).
  // vocab: the model's logits per row (the tokenizer may name fewer).
  void echo_rows(std::span<const float> rows, size_t vocab, size_t i0) {
    const size_t n = std::min(rows.size() / vocab, job_.prompt.size() - 1 - i0);
    const size_t base = job_.logprobs.size();
    job_.logprobs.resize(base + n);
    const auto score = [&](int64_t a, int64_t b) {
      for (size_t i = size_t(a); i < size_t(b); ++i)
        job_.logprobs[base + i] =
            token_logprob(rows.subspan(i * vocab, vocab), job_.prompt[i0 + i + 1],
                          job_.top_logprobs, *e_.opt_.tokenizer);
    };
    if (e_.opt_.pool)
      e_.opt_.pool->parallel_for(int64_t(n), 8, score);
    else
      score(0, int64_t(n));
  }
  int pick(std::span<const float> logits) {
    const std::vector<int>& forced = e_.opt_.forced_reply;
    const std::vector<int>& eos = e_.opt_.tokenizer->eos_ids();
    int tok;
    if (!forced.empty()) {
      tok = forced_at_ < forced.size() ? forced[forced_at_++]
                                       : (eos.empty() ? forced.back() : eos[0]);
    } else if (!json_) {
      tok = sampler_.sample(logits);
    } else {
      // From the logits with the tokens JSON mode refuses at -inf (should no token be left,
      // which the automaton's alphabet rules out, the reply ends).
      json_->mask(logits, masked_, e_.opt_.pool);
      tok = sampler_.sample(masked_);
      if (!json_->accept(tok) && !eos.empty()) tok = eos[0];
    }
    // An end-of-generation token ends the reply without being part of it.
    const bool ends = std::find(eos.begin(), eos.end(), tok) != eos.end();
    if (job_.top_logprobs >= 0 && !ends)
      job_.logprobs.push_back(
          token_logprob(logits, tok, job_.top_logprobs, *e_.opt_.tokenizer, e_.opt_.pool));
    return tok;
  }

 private:
  Engine& e_;
  Job& job_;
  runtime::Sampler sampler_;
  std::optional<runtime::JsonConstraint> json_;
  std::vector<float> masked_;
  size_t forced_at_ = 0;
};

Result<runtime::Generation> Engine::generate(Job& job) {
  Picker picker(*this, job);
  const bool echo = job.echo && job.top_logprobs >= 0;
  if (echo) {
    // Every prompt row's logits: a whole prefill (no reuse), which leaves the prompt cached.
    session_->reset();
    cached_.clear();
    std::vector<float> rows;
    TS_TRY(session_->forward(job.prompt, &rows));
    cached_ = job.prompt;
    picker.echo_first();
    picker.echo_rows(rows, rows.size() / job.prompt.size(), 0);
  }
  runtime::GenerateParams params{
      .max_tokens = job.max_tokens,
      .stops = job.stops,
      .next_token = [&](std::span<const float> logits) { return picker.pick(logits); },
      .greedy_on_engine = picker.greedy_on_engine(),
      .on_text =
          [&](std::string_view piece) {
            if (job.on_text && !job.on_text(piece)) job.cancelled = true;
            return !job.cancelled;
          },
  };
  return runtime::generate(*session_, cached_, job.prompt, *opt_.tokenizer, params);
}

// ---- continuous batching ------------------------------------------------------------------

using Clock = std::chrono::steady_clock;

// A job in flight: its sequence, how far its prompt has been fed, the token to feed next.
struct Engine::Active {
  std::shared_ptr<Job> job;
  int seq = -1;
  std::unique_ptr<Picker> picker;
  runtime::Generation gen;
  runtime::GenerateParams params;
  std::unique_ptr<runtime::ReplyText> reply;
  size_t fed = 0;   // prompt tokens whose KV rows are in
  int next = -1;    // the picked token to feed (decoding)
  bool done = false;
  Clock::time_point t_start, t_decode;
};

bool Engine::admit(std::vector<std::unique_ptr<Active>>& active) {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || !active.empty(); });
  if (stopping_) return false;
  while (!queue_.empty() && int(active.size()) < parallel_) {
    std::shared_ptr<Job> job = queue_.front();
    if (job->cancelled) {
      queue_.pop_front();
      lock.unlock();
      finish(*job, runtime::Generation{.stop_reason = runtime::StopReason::kCancelled});
      lock.lock();
      continue;
    }
    const int need = int(std::min<int64_t>(int64_t(job->prompt.size()) + job->max_tokens,
                                           session_->n_ctx()));
    // The prompt's blocks cached from earlier or running requests are shared, not computed
    // again (echo needs every prompt row's logits: no reuse).
    const bool echo = job->echo && job->top_logprobs >= 0;
    Result<int> opened = session_->open_sequence(
        need, echo ? std::span<const int>() : std::span<const int>(job->prompt));
    const int seq = opened.ok() ? *opened : -1;
    const size_t reused = opened.ok() ? size_t(session_->sequence_position(seq)) : 0;
    if (seq < 0 && active.empty()) {  // more rows than the whole cache: it can never run
      queue_.pop_front();
      lock.unlock();
      finish(*job, make_error("the request needs " + std::to_string(need) +
                              " KV positions; the cache holds " +
                              std::to_string(session_->free_kv_tokens())));
      lock.lock();
      continue;
    }
    if (seq < 0) break;  // its KV rows are held by running jobs: it waits for one to end
    queue_.pop_front();
    current_.push_back(job);
    auto a = std::make_unique<Active>();
    a->job = job;
    a->seq = seq;
    a->fed = reused;
    a->t_start = Clock::now();
    a->gen.prompt_tokens = int64_t(job->prompt.size());
    a->gen.reused_tokens = int64_t(reused);
    a->picker = std::make_unique<Picker>(*this, *job);
    Job& j = *job;
    a->params = {.max_tokens = job->max_tokens,
                 .stops = job->stops,
                 .on_text = [&j](std::string_view piece) {
                   if (j.on_text && !j.on_text(piece)) j.cancelled = true;
                   return !j.cancelled;
                 }};
    a->reply = std::make_unique<runtime::ReplyText>(*opt_.tokenizer, a->params, a->gen);
    if (echo) a->picker->echo_first();
    active.push_back(std::move(a));
  }
  running_ = int(active.size());
  return true;
}

void Engine::retire(Active& a) {
  a.done = true;
  if (a.gen.stop_reason != runtime::StopReason::kCancelled) a.reply->finish();
  if (a.t_decode != Clock::time_point{})
    a.gen.decode_s = std::chrono::duration<double>(Clock::now() - a.t_decode).count();
  // Its whole blocks stay cached for a request that continues this one.
  session_->close_sequence(a.seq);
  {
    std::lock_guard lock(mu_);
    current_.erase(std::find(current_.begin(), current_.end(), a.job));
  }
  finish(*a.job, std::move(a.gen));
}

Status Engine::run_step(std::vector<std::unique_ptr<Active>>& active) {
  // Decoding jobs' tokens first (one each), then prompt chunks in arrival order within what
  // is left of the step's token budget: a long prompt never holds the others back for more
  // than one step.
  std::vector<runtime::Engine::SeqInput> inputs;
  std::vector<Active*> who;
  int left = session_->step_tokens();
  for (auto& a : active)
    if (a->next >= 0 && left > 0) {
      inputs.push_back({.seq = a->seq, .tokens = std::span<const int>(&a->next, 1)});
      who.push_back(a.get());
      --left;
    }
  for (auto& a : active) {
    const size_t n_prompt = a->job->prompt.size();
    if (a->next >= 0 || a->fed >= n_prompt || left <= 0) continue;
    const size_t n = std::min(n_prompt - a->fed, size_t(left));
    inputs.push_back({.seq = a->seq,
                      .tokens = std::span<const int>(a->job->prompt.data() + a->fed, n),
                      .all_logits = a->job->echo && a->job->top_logprobs >= 0});
    who.push_back(a.get());
    left -= int(n);
  }
  std::vector<float> logits;
  TS_TRY(session_->step(inputs, &logits));
  size_t rows_out = 0;
  for (const auto& in : inputs) rows_out += in.all_logits ? in.tokens.size() : 1;
  const size_t vocab = logits.size() / rows_out;  // the model's (the tokenizer may name fewer)
  size_t row = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Active& a = *who[i];
    const size_t rows = inputs[i].all_logits ? inputs[i].tokens.size() : 1;
    const std::span<const float> out(logits.data() + row * vocab, rows * vocab);
    row += rows;
    if (a.next < 0) {  // a prompt chunk
      if (inputs[i].all_logits) a.picker->echo_rows(out, vocab, a.fed);
      a.fed += inputs[i].tokens.size();
      if (a.fed < a.job->prompt.size()) continue;
      a.t_decode = Clock::now();
      a.gen.prefill_s = std::chrono::duration<double>(a.t_decode - a.t_start).count();
      if (a.job->max_tokens <= 0) {  // echo alone: the prompt scored, nothing generated
        retire(a);
        continue;
      }
    }
    // The next token from the last row: the reply goes on with it while the job allows.
    const int tok = a.picker->pick(out.subspan((rows - 1) * vocab, vocab));
    if (a.job->cancelled) a.gen.stop_reason = runtime::StopReason::kCancelled;
    if (a.job->cancelled || !a.reply->take(tok) || a.gen.generated >= a.job->max_tokens) {
      retire(a);
    } else {
      a.next = tok;
    }
  }
  return {};
}

void Engine::run_batched() {
  std::vector<std::unique_ptr<Active>> active;
  for (;;) {
    if (!admit(active)) break;
    for (auto& a : active)
      if (a->job->cancelled) {
        a->gen.stop_reason = runtime::StopReason::kCancelled;
        retire(*a);
      }
    std::erase_if(active, [](const auto& a) { return a->done; });
    if (active.empty()) continue;
    Status st;
    try {
      st = run_step(active);
    } catch (const std::exception& e) {
      st = make_error(std::string("internal error: ") + e.what());
    }
    if (!st.ok()) {
      // A failed step (a storage read error) fails the jobs it held, which give up their rows.
      for (auto& a : active) {
        if (a->done) continue;
        session_->close_sequence(a->seq);
        {
          std::lock_guard lock(mu_);
          current_.erase(std::find(current_.begin(), current_.end(), a->job));
        }
        a->done = true;
        finish(*a->job, st.error());
      }
    }
    std::erase_if(active, [](const auto& a) { return a->done; });
    running_ = int(active.size());
    const runtime::Engine::KvStats kv = session_->kv_stats();
    std::lock_guard lock(mu_);
    kv_ = kv;
  }
  // Stopping: the running jobs end as cancelled.
  for (auto& a : active) {
    a->gen.stop_reason = runtime::StopReason::kCancelled;
    retire(*a);
  }
  running_ = 0;
}

}  // namespace ts::server
