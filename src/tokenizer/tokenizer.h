// Text <-> token ids for a Hugging Face model directory: tokenizer.json (required), plus
// tokenizer_config.json and generation_config.json when present (BOS / EOS).
//
// encode() follows the `tokenizers` library step by step, so ids match it exactly (tested on
// the Qwen3, DeepSeek-V3, gpt-oss and Llama-2 tokenizers):
//   1. invalid UTF-8 in the input is replaced by U+FFFD (maximal subparts; Rust strings can
//      never hold invalid UTF-8, so this is turbospark's own, documented policy);
//   2. added tokens with normalized=false are cut out first (leftmost-longest, honouring
//      lstrip / rstrip / single_word); special and non-special alike, always;
//   3. each remaining stretch is normalized, then added tokens with normalized=true are cut;
//   4. each stretch is pre-tokenized into words, and each word goes through the BPE model;
//   5. with add_special, the post-processor adds its tokens (TemplateProcessing: e.g. BOS;
//      ByteLevel adds none).
// decode() maps ids to token strings (added tokens by their content, special ones dropped
// when skip_special) and runs the decoder chain; the result is always valid UTF-8.
//
// A Tokenizer is immutable after load() except for the BPE word cache (mutex-guarded):
// encode() and decode() may be called from several threads.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace ts::tokenizer {

class Tokenizer {
 public:
  // Reads DIR/tokenizer.json (+ tokenizer_config.json, generation_config.json if present), or
  // the vocabulary in a GGUF file's metadata (tokenizer/gguf_vocab.h) when PATH is one.
  // Errors name the file and the key: a missing file, bad JSON, or a model / normalizer /
  // pre-tokenizer / post-processor / decoder type this implementation does not support.
  static Result<std::unique_ptr<Tokenizer>> load(const std::string& path);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  std::vector<int> encode(std::string_view text, bool add_special) const;
  // Unknown ids are skipped.
  std::string decode(std::span<const int> ids, bool skip_special) const;

  // BOS from tokenizer_config.json bos_token (else generation_config.json bos_token_id);
  // -1 when the model has none (Qwen3).
  int bos_id() const { return bos_id_; }
  // generation_config.json eos_token_id (int or list), then tokenizer_config.json eos_token
  // if not already listed. Empty when neither names one.
  const std::vector<int>& eos_ids() const { return eos_ids_; }
  // The token's string as stored in the vocab ("Ġthe", "▁the", "<|im_end|>"); empty for an
  // unknown id.
  std::string token_text(int id) const;
  // The bytes token `id` stands for in the middle of a text (llama.cpp's "piece"): no UTF-8
  // repair (part of a character where the tokenizer split one: byte-level BPE, byte
  // fallback), and its leading space kept (SentencePiece's "▁the" is " the"). The pieces of
  // encode(s) add up to s (after the normalizer: with a prepended space where it adds one).
  // Empty for an unknown id.
  std::string token_bytes(int id) const;
  std::optional<int> token_to_id(std::string_view token) const;
  bool is_special(int id) const;
  // One past the largest id of the vocab and added tokens.
  int vocab_size() const { return vocab_size_; }

  struct Impl;

 private:
  friend struct TokenizerBuilder;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  int bos_id_ = -1;
  std::vector<int> eos_ids_;
  int vocab_size_ = 0;
};

// Incremental detokenizer for generation: push ids one at a time, get the text that is
// final. Text is held back while it ends in an incomplete UTF-8 sequence (the window's
// decode ends in U+FFFD; after 8 such ids the U+FFFD is taken as real), and a decoder that
// strips a leading space only sees it at the stream's start. Concatenating every
// push() result and flush() gives decode(all ids) for the tokenizers tested, and every
// returned chunk is valid UTF-8. Exception: a stream that ends inside a character (or holds
// bytes that never form one) flushes U+FFFD for those bytes only, where one-shot decode may
// replace a longer run (Hugging Face ByteFallback turns a whole invalid byte run into U+FFFD).
// flush() ends the stream: a later push() starts afresh (a leading space may be stripped).
// Method (as Hugging Face's DecodeStream): decode a small window of recent ids, and emit
// what extends the previous window's text once it does not end in U+FFFD.
class StreamDecoder {
 public:
  StreamDecoder(const Tokenizer& tokenizer, bool skip_special);
  std::string push(int id);
  // Emits whatever is held back (an unfinished sequence comes out as U+FFFD) and resets.
  std::string flush();

 private:
  std::string pending_text(const std::string& window_text) const;
  const Tokenizer& tok_;
  bool skip_special_;
  std::vector<int> ids_;  // window: context ids, then ids not yet emitted
  std::string prefix_;    // decode of the window's context ids
  size_t prefix_index_ = 0;
};

}  // namespace ts::tokenizer
