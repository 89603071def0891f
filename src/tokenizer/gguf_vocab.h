// The tokenizer a GGUF model file carries in its metadata, rebuilt as the Hugging Face files
// it came from (tokenizer.json, tokenizer_config.json, generation_config.json), so that one
// tokenizer implementation serves both.
//
// Keys (llama.cpp's convert_hf_to_gguf): tokenizer.ggml.model, .pre, .tokens, .token_type
// (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), .merges ("left right"),
// .scores, .bos_token_id / .eos_token_id / .eot_token_id / .eom_token_id / .unknown_token_id,
// .add_bos_token, .add_space_prefix, and tokenizer.chat_template.
//   - model "gpt2": byte-level BPE with the file's merges; the pre-tokenizer's split pattern is
//     chosen by .pre (qwen2 and its kin, llama-bpe / llama3, gpt-2 / default / olmo);
//   - model "llama" (SentencePiece): BPE with byte fallback, its merges derived from the
//     scores as Hugging Face's SentencePiece converter derives them (every split of a piece
//     into two pieces of the vocab, ranked by the piece's score), "▁" for spaces, a space
//     prefix unless .add_space_prefix is false.
// Control tokens become special added tokens, user-defined ones non-special added tokens.
// BOS is added to an encoding when .add_bos_token says so (default: yes for "llama", no for
// "gpt2"); the end-of-generation ids are .eos_token_id, .eot_token_id and .eom_token_id.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "core/status.h"
#include "tokenizer/tokenizer_json.h"

namespace ts::tokenizer {

struct GgufVocab {
  TokenizerJson tokenizer;
  nlohmann::json tokenizer_config = nlohmann::json::object();   // bos/eos_token, chat_template
  nlohmann::json generation_config = nlohmann::json::object();  // eos_token_id (a list)
};

// Errors name the file and the key.
Result<GgufVocab> read_gguf_vocab(const std::string& path);

}  // namespace ts::tokenizer
