// tokenizer.json "decoder": token strings -> text. Supported: ByteLevel, Replace, ByteFallback,
// Fuse, Strip, Metaspace and Sequence (flattened). Each step maps the list of token strings
// to a new list (Hugging Face's decode_chain); the result is the concatenation. A null
// decoder joins the tokens with spaces, as Hugging Face does.
// Output is always valid UTF-8: ByteLevel and ByteFallback repair invalid byte sequences
// with U+FFFD exactly as Hugging Face does (maximal subparts / one per byte respectively).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "tokenizer/regex.h"

namespace ts::tokenizer {

struct DecoderStep {
  enum class Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace };
  Kind kind = Kind::kByteLevel;
  std::optional<Regex> regex;  // Replace: the pattern
  std::string text;            // Replace: the replacement; Metaspace: the replacement char
  char32_t strip_char = ' ';
  int strip_start = 0, strip_stop = 0;
  bool metaspace_strip_first = true;  // Metaspace: prepend_scheme != never
};

class Decoder {
 public:
  static Result<Decoder> parse(const nlohmann::json& j, const std::string& where);
  // pieces = true: each token's own bytes, as a piece of text in the middle of other text:
  // ByteLevel and ByteFallback keep the bytes as they are, valid UTF-8 or not, and Strip and
  // Metaspace leave the leading space (which they remove for the start of a text, where a
  // normalizer prepended it).
  std::string decode(std::vector<std::string> tokens, bool pieces = false) const;

 private:
  Status add(const nlohmann::json& j, const std::string& where);
  std::vector<DecoderStep> steps_;
  bool null_ = true;
};

}  // namespace ts::tokenizer
