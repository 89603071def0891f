#include "runtime/generate.h"

#include <algorithm>
#include <chrono>

#include "tokenizer/tokenizer.h"

namespace ts::runtime {

std::string StopFilter::feed(const std::string& text, bool* stopped) {
  held_ += text;
  for (size_t i = 0; i < stops_.size(); ++i) {
    size_t at = held_.find(stops_[i]);
    if (at != std::string::npos) {
      *stopped = true;
      matched_ = int(i);
      std::string out = held_.substr(0, at);
      held_.clear();
      return out;
    }
  }
  size_t keep = 0;  // longest suffix of held_ that is a proper prefix of a stop string
  for (const std::string& s : stops_)
    for (size_t n = std::min(s.size() - 1, held_.size()); n > keep; --n)
      if (held_.compare(held_.size() - n, n, s, 0, n) == 0) {
        keep = n;
        break;
      }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

const char* stop_reason_name(StopReason r) {
  switch (r) {
    case StopReason::kLength:
      return "length";
    case StopReason::kEos:
      return "eos";
    case StopReason::kStop:
      return "stop";
    case StopReason::kCancelled:
      return "cancelled";
  }
  return "?";
}

ReplyText::ReplyText(const tokenizer::Tokenizer& tok, const GenerateParams& g, Generation& r)
    : tok_(tok),
      g_(g),
      r_(r),
      stream_(std::make_unique<tokenizer::StreamDecoder>(tok, /*skip_special=*/true)),
      stops_(g.stops) {}

ReplyText::~ReplyText() = default;

bool ReplyText::emit(const std::string& piece) {
  r_.text += piece;
  return !g_.on_text || g_.on_text(piece);
}

bool ReplyText::take(int id) {
  const std::vector<int>& eos = tok_.eos_ids();
  if (std::find(eos.begin(), eos.end(), id) != eos.end()) {
    r_.stop_reason = StopReason::kEos;
    return false;
  }
  ++r_.generated;
  if (!emit(stops_.feed(stream_->push(id), &stopped_))) {
    r_.stop_reason = StopReason::kCancelled;
    return false;
  }
  if (stopped_) {
    r_.stop_reason = StopReason::kStop;
    r_.stop_index = stops_.matched();
    return false;
  }
  return true;
}

void ReplyText::finish() {
  if (stopped_ || r_.stop_reason == StopReason::kCancelled) return;
  std::string tail = stops_.feed(stream_->flush(), &stopped_);
  if (stopped_) {
    r_.stop_reason = StopReason::kStop;
    r_.stop_index = stops_.matched();
  } else {
    tail += stops_.flush();
  }
  emit(tail);
}

namespace {

Result<Generation> generate_on_cache(Engine& session, std::vector<int>& cached,
                                     std::span<const int> prompt, const tokenizer::Tokenizer& tok,
                                     const GenerateParams& g) {
  Generation r;
  size_t common = 0;
  while (common < cached.size() && common < prompt.size() && cached[common] == prompt[common])
    ++common;
  if (common == prompt.size() && common > 0) --common;  // recompute the last token's logits
  session.truncate(int(common));
  common = std::min(common, size_t(session.position()));  // a recurrent state starts again
  cached.resize(common);
  if (int64_t(prompt.size()) + g.max_tokens > session.n_ctx())
    return make_error("prompt of " + std::to_string(prompt.size()) + " tokens + " +
                      std::to_string(g.max_tokens) + " new tokens exceed the context of " +
                      std::to_string(session.n_ctx()));
  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  TS_TRY(session.forward(prompt.subspan(common), nullptr));
  cached.assign(prompt.begin(), prompt.end());
  r.prompt_tokens = int64_t(prompt.size());
  r.reused_tokens = int64_t(common);
  r.prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  t0 = Clock::now();
  ReplyText reply(tok, g, r);
  const auto take = [&](int next) { return reply.take(next); };
  if (g.greedy_on_engine && g.max_tokens > 1) {
    // The first id from the prefill's logits, the rest picked by the engine (on CUDA without a
    // host round trip per token); every accepted id is fed, as in the loop below.
    int fed = g.next_token(session.last_logits());
    if (take(fed)) {
      bool all = true;
      TS_TRY(session.decode_greedy(fed, int(g.max_tokens - 1), [&](int id) {
        cached.push_back(fed);  // its KV row is in
        fed = id;
        all = take(id);
        return all;
      }));
      if (all) {
        TS_TRY(session.forward(std::span<const int>(&fed, 1), nullptr));
        cached.push_back(fed);
      }
    }
  } else {
    for (int64_t i = 0; i < g.max_tokens; ++i) {
      const int next = g.next_token(session.last_logits());
      if (!take(next)) break;
      TS_TRY(session.forward(std::span<const int>(&next, 1), nullptr));
      cached.push_back(next);
    }
  }
  reply.finish();
  r.decode_s = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

}  // namespace

Result<Generation> generate(Engine& session, std::vector<int>& cached, std::span<const int> prompt,
                            const tokenizer::Tokenizer& tok, const GenerateParams& params) {
  auto r = generate_on_cache(session, cached, prompt, tok, params);
  if (!r.ok()) {
    // The session may hold rows that `cached` does not describe: start afresh next time.
    cached.clear();
    session.reset();
  }
  return r;
}

}  // namespace ts::runtime
