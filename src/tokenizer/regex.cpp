// PCRE2 wrapper; see regex.h.
#include "tokenizer/regex.h"

#include <pcre2.h>

namespace ts::tokenizer {

struct Regex::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Code() { pcre2_code_free(code); }
};

Result<Regex> Regex::compile(std::string_view pattern, const std::string& where) {
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &err, &err_offset, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    return make_error(where + ": regex '" + std::string(pattern) + "' does not compile at offset " +
                      std::to_string(err_offset) + ": " + reinterpret_cast<char*>(msg));
  }
  auto c = std::make_shared<Code>();
  c->code = code;
  // JIT is an optimisation only: a build of PCRE2 without it still matches, just slower.
  c->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  Regex r;
  r.code_ = std::move(c);
  return r;
}

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  out.clear();
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_->code, nullptr);
  TS_CHECK(md != nullptr, "out of memory for PCRE2 match data");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t search_from = 0;
  bool have_last = false;
  size_t last_end = 0;
  uint32_t options = PCRE2_NO_UTF_CHECK;
  while (search_from <= text.size()) {
    int rc = pcre2_match(code_->code, subject, text.size(), search_from, options, md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !(options & PCRE2_NO_JIT)) {
      // The JIT's 32 KiB default stack ran out (very long runs); the interpreter has none.
      options |= PCRE2_NO_JIT;
      continue;
    }
    // PCRE2_ERROR_NOMATCH ends the scan. Any other error (match limit) also ends it: the
    // rest of the text then stays one piece, which still encodes losslessly.
    if (rc < 0) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    size_t s = ov[0], e = ov[1];
    if (s == e && have_last && last_end == e) {
      // Step one code point past an empty match that touches the previous match.
      if (search_from >= text.size()) break;
      size_t step = 1;
      while (search_from + step < text.size() &&
             ((unsigned char)text[search_from + step] & 0xC0) == 0x80)
        ++step;
      search_from += step;
      continue;
    }
    out.emplace_back(s, e);
    have_last = true;
    last_end = e;
    search_from = e;
    if (s == e) {
      // Rust's onig find_iter retries at the same place and skips the empty repeat above.
      continue;
    }
  }
  pcre2_match_data_free(md);
}

std::string regex_escape(std::string_view literal) {
  std::string out;
  for (char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace ts::tokenizer
