// tokenizer.json "normalizer": the text rewrite applied to each stretch of input between
// added tokens, before pre-tokenization. Supported types: NFC, NFD, NFKC, NFKD (utf8proc),
// Prepend, Replace (String or Regex pattern), Strip, Sequence (flattened). A null normalizer
// is the identity. Anything else is a load error naming the key.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "tokenizer/regex.h"

namespace ts::tokenizer {

struct NormalizerStep {
  enum class Kind { kNfc, kNfd, kNfkc, kNfkd, kPrepend, kReplace, kStrip };
  Kind kind = Kind::kNfc;
  std::string text;            // Prepend: the prefix; Replace: the replacement
  std::optional<Regex> regex;  // Replace: the pattern (a String pattern is escaped)
  bool strip_left = false, strip_right = false;
};

class Normalizer {
 public:
  // `j` is the "normalizer" value (may be null); `where` is its JSON path for errors.
  static Result<Normalizer> parse(const nlohmann::json& j, const std::string& where);

  // Precondition: `s` is valid UTF-8. The result is valid UTF-8.
  std::string apply(std::string s) const;
  bool empty() const { return steps_.empty(); }

 private:
  Status add(const nlohmann::json& j, const std::string& where);
  std::vector<NormalizerStep> steps_;
};

// Unicode White_Space (Rust char::is_whitespace).
bool is_unicode_whitespace(char32_t c);

}  // namespace ts::tokenizer
