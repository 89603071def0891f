// A compiled PCRE2 pattern (UTF + UCP, JIT when available) for the pre-tokenizer and
// normalizer patterns of tokenizer.json. The Hugging Face files are written for Oniguruma;
// the constructs they use (\p{L}, \p{N}, (?i:'s|...), \s+(?!\S), literal CR/LF in classes)
// mean the same in PCRE2 with UCP, except for Unicode versions and two shorthands: the
// reference (tokenizers 0.23's Oniguruma) classifies by Unicode 16.0 and Debian 12's PCRE2 by
// 14.0, and Oniguruma's \w takes marks (and not \p{No}) and its \s is White_Space (not U+180E).
// compile() rewrites the pattern to the reference's reading (widen_unicode_properties). Left
// as PCRE2 reads them: \P{..}, \W, \S, \D inside a character class (a class cannot hold a
// complement) and \p{C} / \p{Cn}; no tokenizer we know writes them.
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

// `pattern` as the reference reads it: each general-category escape (\p{L}, \pN, \p{Lu},
// \P{L} outside a class, ...) extended by the code points Unicode 16.0 put in that category
// after 14.0 (\p{L}+ becomes [\p{L}\x{1C89}...]+; inside a class the ranges join it), and
// \w, \s, \d (and \W, \S, \D outside a class) spelled out as Oniguruma's sets.
std::string widen_unicode_properties(std::string_view pattern);

// The Unicode 16.0 general category ("Lo", "Nd", ...) of a code point that Unicode 14.0 left
// unassigned, else an empty view (then the libraries' tables are current for it).
std::string_view unicode16_added_category(char32_t c);

// The pattern string with every regex metacharacter escaped (for literal String patterns).
std::string regex_escape(std::string_view literal);

}  // namespace ts::tokenizer
