// Text generation on a Session, shared by `run`, `chat` and the server: reuse the KV cache
// of the longest common prefix with the previous call, prefill the rest, then sample token
// by token, detokenize incrementally and hold back text that may be the start of a stop
// string. Each piece of final text goes to a callback, which can cancel the generation.
//
// Invariant kept for the next call: `cached` holds exactly the tokens whose KV rows are in
// the session (positions 0..cached.size()-1). On an error the cache is emptied.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "runtime/session.h"

namespace ts::tokenizer {
class Tokenizer;
class StreamDecoder;
}

namespace ts::runtime {

// Holds back text that might be the start of a stop string; reports a completed stop.
class StopFilter {
 public:
  explicit StopFilter(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  // Returns the text that is safe to show; sets *stopped when a stop string completed (the
  // stop string and anything after it are dropped).
  std::string feed(const std::string& text, bool* stopped);
  std::string flush() { return std::exchange(held_, {}); }
  // The stop string that completed, or -1.
  int matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  int matched_ = -1;
};

enum class StopReason { kLength, kEos, kStop, kCancelled };
const char* stop_reason_name(StopReason r);

struct GenerateParams {
  int64_t max_tokens = 256;
  std::vector<std::string> stops;
  // Picks the next token from the last logits (a Sampler, or a forced script in tests).
  std::function<int(std::span<const float>)> next_token;
  // next_token is the plain argmax (runtime::argmax) of the logits as they are: the ids after
  // the first are picked by the engine (Engine::decode_greedy), the same ids.
  bool greedy_on_engine = false;
  // Receives each piece of final text (possibly empty, once per token, so it can notice a
  // gone client between tokens); returning false cancels the generation.
  std::function<bool(std::string_view)> on_text;
};

struct Generation {
  std::string text;
  int64_t prompt_tokens = 0, generated = 0, reused_tokens = 0;
  double prefill_s = 0, decode_s = 0;
  StopReason stop_reason = StopReason::kLength;
  int stop_index = -1;  // which stop string ended it (kStop)
};

// One reply's token-by-token bookkeeping, shared by generate() and the server's batch
// scheduler: end-of-generation ids, incremental detokenization, text held back for stop
// strings, the text callback. Fills `r`'s text, generated count and stop reason.
class ReplyText {
 public:
  ReplyText(const tokenizer::Tokenizer& tok, const GenerateParams& g, Generation& r);
  ~ReplyText();
  ReplyText(const ReplyText&) = delete;
  ReplyText& operator=(const ReplyText&) = delete;
  // A picked id: whether the reply goes on with it (it is then fed to the model); false
  // when it ends the reply (end of generation, a stop string, the callback cancelling).
  bool take(int id);
  // At the end: the text still held back, unless a stop string or a cancel ended the reply.
  void finish();

 private:
  bool emit(const std::string& piece);
  const tokenizer::Tokenizer& tok_;
  const GenerateParams& g_;
  Generation& r_;
  std::unique_ptr<tokenizer::StreamDecoder> stream_;
  StopFilter stops_;
  bool stopped_ = false;
};

// Precondition: prompt is not empty. Errors: prompt + max_tokens beyond the session's
// context ("prompt of P tokens + N new tokens exceed the context of C"), a forward error.
Result<Generation> generate(Engine& session, std::vector<int>& cached, std::span<const int> prompt,
                            const tokenizer::Tokenizer& tok, const GenerateParams& params);

}  // namespace ts::runtime
