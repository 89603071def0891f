// A compiled PCRE2 pattern (UTF + UCP, JIT when available) for the pre-tokenizer and
// normalizer patterns of tokenizer.json. The Hugging Face files are written for Oniguruma;
// the constructs they use (\p{L}, \p{N}, (?i:'s|...), \s+(?!\S), literal CR/LF in classes)
// mean the same in PCRE2 with UCP. Known difference: \s in PCRE2 also matches U+180E.
// Thread safety: a Regex is immutable after compile(); find_all() allocates its own match
// data, so one Regex serves many threads.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace ts::tokenizer {

class Regex {
 public:
  // `where` names the JSON key the pattern came from, for the error message.
  static Result<Regex> compile(std::string_view pattern, const std::string& where);

  // Non-overlapping matches, left to right, as [start, end) byte offsets; an empty match
  // right after the previous match is skipped (Rust onig find_iter semantics).
  // Precondition: `text` is valid UTF-8.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
};

// The pattern string with every regex metacharacter escaped (for literal String patterns).
std::string regex_escape(std::string_view literal);

}  // namespace ts::tokenizer
