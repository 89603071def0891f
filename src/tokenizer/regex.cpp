// PCRE2 wrapper; see regex.h.
#include "tokenizer/regex.h"

#include <pcre2.h>

#include <algorithm>
#include <cctype>
#include <cstdio>

#include "tokenizer/unicode_ranges.h"

namespace ts::tokenizer {

namespace {

struct AddedRange {
  char32_t first, last;
  const char* category;  // two letters
};

constexpr AddedRange kUnicode16Added[] = {
#include "tokenizer/unicode_delta.inc"
};

// The two-letter categories a property name stands for ("L" -> Lu Ll Lt Lm Lo), by PCRE2's
// loose matching (case, spaces, '_' and '-' ignored); empty for scripts and other properties.
std::vector<std::string> categories_of(std::string_view name) {
  std::string n;
  for (char c : name)
    if (c != ' ' && c != '_' && c != '-') n += char(std::tolower((unsigned char)c));
  static const std::pair<const char*, const char*> kLong[] = {
      {"letter", "l"},           {"mark", "m"},
      {"number", "n"},           {"punctuation", "p"},
      {"symbol", "s"},           {"separator", "z"},
      {"casedletter", "l&"},     {"lc", "l&"},
      {"uppercaseletter", "lu"}, {"lowercaseletter", "ll"},
      {"titlecaseletter", "lt"}, {"modifierletter", "lm"},
      {"otherletter", "lo"},     {"nonspacingmark", "mn"},
      {"spacingmark", "mc"},     {"enclosingmark", "me"},
      {"decimalnumber", "nd"},   {"letternumber", "nl"},
      {"othernumber", "no"},     {"otherpunctuation", "po"},
      {"dashpunctuation", "pd"}, {"mathsymbol", "sm"},
      {"othersymbol", "so"},     {"format", "cf"}};
  for (auto [from, to] : kLong)
    if (n == from) n = to;
  std::vector<std::string> out;
  if (n == "l&") return {"Lu", "Ll", "Lt"};
  if (n.size() == 1 && std::string_view("lmnpsz").find(n[0]) != std::string_view::npos) {
    for (const AddedRange& r : kUnicode16Added)
      if (std::tolower((unsigned char)r.category[0]) == n[0] &&
          std::find(out.begin(), out.end(), r.category) == out.end())
        out.emplace_back(r.category);
    return out;
  }
  // Two letters: one category (Cn, Co, Cs, Cc and C are left alone: new assignments leave Cn).
  if (n.size() == 2 && n[0] != 'c') {
    std::string cat = {char(std::toupper((unsigned char)n[0])), n[1]};
    for (const AddedRange& r : kUnicode16Added)
      if (cat == r.category) return {cat};
  }
  if (n == "cf") return {"Cf"};
  return out;
}

void append_range(std::string& out, char32_t first, char32_t last) {
  char buf[40];
  if (first == last)
    std::snprintf(buf, sizeof buf, "\\x{%X}", unsigned(first));
  else
    std::snprintf(buf, sizeof buf, "\\x{%X}-\\x{%X}", unsigned(first), unsigned(last));
  out += buf;
}

// "\x{..}-\x{..}..." for the code points added to any of `cats`.
std::string added_ranges(const std::vector<std::string>& cats) {
  std::string out;
  for (const AddedRange& r : kUnicode16Added)
    if (std::find(cats.begin(), cats.end(), r.category) != cats.end())
      append_range(out, r.first, r.last);
  return out;
}

// Oniguruma's \w beyond \p{L}\p{M}\p{Nd}\p{Pc}\p{Nl}, and its \s (White_Space), Unicode 16.0.
constexpr CodeRange kWordExtra[] = {
#include "tokenizer/unicode_word.inc"
};
constexpr CodeRange kSpace[] = {
#include "tokenizer/unicode_space.inc"
};

// Class members (no brackets) for \p{name} as the reference reads it.
std::string property_members(std::string_view name) {
  return "\\p{" + std::string(name) + "}" + added_ranges(categories_of(name));
}

// Class members for the shorthand \w, \s or \d (lower case), as Oniguruma reads them.
std::string shorthand_members(char e) {
  std::string out;
  if (e == 'd') return property_members("Nd");
  if (e == 's') {
    for (const CodeRange& r : kSpace) append_range(out, r.first, r.last);
    return out;
  }
  for (const char* cat : {"L", "M", "Nd", "Pc", "Nl"}) out += property_members(cat);
  for (const CodeRange& r : kWordExtra) append_range(out, r.first, r.last);
  return out;
}

}  // namespace

std::string_view unicode16_added_category(char32_t c) {
  const AddedRange* r = find_code_range(kUnicode16Added, c);
  return r ? r->category : std::string_view();
}

std::string widen_unicode_properties(std::string_view p) {
  std::string out;
  out.reserve(p.size());
  bool in_class = false, class_start = false;
  size_t i = 0;
  while (i < p.size()) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      if (e == 'Q') {  // \Q...\E: literal text
        size_t end = p.find("\\E", i + 2);
        end = end == std::string_view::npos ? p.size() : end + 2;
        out += p.substr(i, end - i);
        i = end;
        class_start = false;
        continue;
      }
      if (std::string_view("wWsSdD").find(e) != std::string_view::npos) {
        const bool negated = std::isupper((unsigned char)e);
        const std::string members = shorthand_members(char(std::tolower((unsigned char)e)));
        if (negated && in_class)
          out += p.substr(i, 2);  // a class can't hold a complement; left as PCRE2 reads it
        else if (in_class)
          out += members;
        else
          out += (negated ? "[^" : "[") + members + "]";
        i += 2;
        class_start = false;
        continue;
      }
      if ((e == 'p' || e == 'P') && i + 2 < p.size()) {
        size_t j = i + 3;
        std::string_view name = p.substr(i + 2, 1);
        if (p[i + 2] == '{') {
          const size_t close = p.find('}', i + 3);
          if (close == std::string_view::npos) {  // malformed: PCRE2 reports it
            out += p.substr(i);
            break;
          }
          name = p.substr(i + 3, close - i - 3);
          j = close + 1;
        }
        bool negated = e == 'P';
        if (!name.empty() && name[0] == '^') {
          negated = !negated;
          name.remove_prefix(1);
        }
        const std::string_view original = p.substr(i, j - i);
        if (categories_of(name).empty() || (negated && in_class))
          out += original;  // nothing to add, or no way to add it (a class can't subtract)
        else if (in_class)
          out += property_members(name);
        else
          out += (negated ? "[^" : "[") + property_members(name) + "]";
        i = j;
        class_start = false;
        continue;
      }
      out += p.substr(i, 2);
      i += 2;
      class_start = false;
      continue;
    }
    if (in_class) {
      if (c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:]
        const size_t close = p.find(":]", i + 2);
        const size_t end = close == std::string_view::npos ? i + 1 : close + 2;
        out += p.substr(i, end - i);
        i = end;
        class_start = false;
        continue;
      }
      if (c == ']' && !class_start) in_class = false;  // a ']' first in a class is literal
      class_start = false;
      out += c;
      ++i;
      continue;
    }
    out += c;
    ++i;
    if (c == '[') {
      in_class = class_start = true;
      if (i < p.size() && p[i] == '^') out += p[i++];
    }
  }
  return out;
}

struct Regex::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Code() { pcre2_code_free(code); }
};

Result<Regex> Regex::compile(std::string_view pattern, const std::string& where) {
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  const auto compile_text = [](std::string_view text, int* e, PCRE2_SIZE* at) {
    return pcre2_compile(reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                         PCRE2_UTF | PCRE2_UCP, e, at, nullptr);
  };
  pcre2_code* code = compile_text(widen_unicode_properties(pattern), &err, &err_offset);
  if (!code) {
    // The error and its offset as the file wrote the pattern, where that fails too.
    int plain_err = 0;
    PCRE2_SIZE plain_offset = 0;
    if (pcre2_code* plain = compile_text(pattern, &plain_err, &plain_offset))
      pcre2_code_free(plain);
    else
      err = plain_err, err_offset = plain_offset;
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
