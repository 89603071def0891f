#include "server/engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <optional>

#include "core/thread_pool.h"
#include "runtime/json_constraint.h"
#include "tokenizer/tokenizer.h"

namespace ts::server {

Engine::Engine(EngineOptions options)
    : opt_(std::move(options)), session_(std::move(opt_.session)) {
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
    if (current_) current_->cancelled = true;
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

void Engine::run() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      job = queue_.front();
      queue_.pop_front();
      current_ = job;
      running_ = true;
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
    {
      std::lock_guard lock(mu_);
      current_.reset();
      running_ = false;
    }
    if (job->on_done) job->on_done(std::move(r));
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

Result<runtime::Generation> Engine::generate(Job& job) {
  if (job.echo && job.top_logprobs >= 0) {
    // Every prompt row's logits: a whole prefill (no reuse), which leaves the prompt cached.
    session_->reset();
    cached_.clear();
    std::vector<float> rows;
    TS_TRY(session_->forward(job.prompt, &rows));
    cached_ = job.prompt;
    const size_t vocab = rows.size() / job.prompt.size();
    const int first = job.prompt[0];
    job.logprobs.push_back({.text = opt_.tokenizer->token_bytes(first), .first = true});
    // Each row on its own (on the pool's threads when there is one: the same values).
    const size_t base = job.logprobs.size();
    job.logprobs.resize(base + job.prompt.size() - 1);
    const auto score = [&](int64_t i0, int64_t i1) {
      for (size_t i = size_t(i0) + 1; i < size_t(i1) + 1; ++i)
        job.logprobs[base + i - 1] =
            token_logprob(std::span<const float>(rows.data() + (i - 1) * vocab, vocab),
                          job.prompt[i], job.top_logprobs, *opt_.tokenizer);
    };
    if (opt_.pool)
      opt_.pool->parallel_for(int64_t(job.prompt.size()) - 1, 8, score);
    else
      score(0, int64_t(job.prompt.size()) - 1);
  }
  runtime::Sampler sampler(job.sampling);
  sampler.set_pool(opt_.pool);
  size_t forced_at = 0;
  const std::vector<int>& forced = opt_.forced_reply;
  const std::vector<int>& eos = opt_.tokenizer->eos_ids();
  std::optional<runtime::JsonConstraint> json;
  std::vector<float> masked;
  if (job.json_object) {
    if (token_bytes_.empty()) {
      const tokenizer::Tokenizer& t = *opt_.tokenizer;
      token_bytes_.resize(size_t(t.vocab_size()));
      for (int id = 0; id < t.vocab_size(); ++id)
        if (!t.is_special(id)) token_bytes_[size_t(id)] = t.token_bytes(id);
    }
    json.emplace(token_bytes_, eos);
  }
  // A draw: from the logits with the tokens JSON mode refuses at -inf, when it is on (should
  // no token be left, which the automaton's alphabet rules out, the reply ends).
  const auto draw = [&](std::span<const float> logits) {
    if (!json) return sampler.sample(logits);
    json->mask(logits, masked, opt_.pool);
    const int tok = sampler.sample(masked);
    return json->accept(tok) || eos.empty() ? tok : eos[0];
  };
  runtime::GenerateParams params{
      .max_tokens = job.max_tokens,
      .stops = job.stops,
      .next_token =
          [&](std::span<const float> logits) {
            const int tok = !forced.empty() ? forced_at < forced.size()
                                                  ? forced[forced_at++]
                                                  : (eos.empty() ? forced.back() : eos[0])
                                            : draw(logits);
            // An end-of-generation token ends the reply without being part of it.
            const bool ends = std::find(eos.begin(), eos.end(), tok) != eos.end();
            if (job.top_logprobs >= 0 && !ends)
              job.logprobs.push_back(
                  token_logprob(logits, tok, job.top_logprobs, *opt_.tokenizer, opt_.pool));
            return tok;
          },
      // Plain greedy with nothing read from the logits but the argmax: the engine picks.
      .greedy_on_engine =
          forced.empty() && !json && job.top_logprobs < 0 && sampler.options().plain_greedy(),
      .on_text =
          [&](std::string_view piece) {
            if (job.on_text && !job.on_text(piece)) job.cancelled = true;
            return !job.cancelled;
          },
  };
  return runtime::generate(*session_, cached_, job.prompt, *opt_.tokenizer, params);
}

}  // namespace ts::server
