// Normalizers; see normalizer.h.
#include "tokenizer/normalizer.h"

#include <utf8proc.h>

#include <cstdlib>

#include "tokenizer/json_util.h"
#include "tokenizer/unicode_ranges.h"
#include "tokenizer/utf8.h"

namespace ts::tokenizer {

namespace {

std::string utf8proc_normalize(const std::string& s, int options) {
  if (s.empty()) return s;
  utf8proc_uint8_t* dst = nullptr;
  utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), utf8proc_ssize_t(s.size()),
                   &dst, utf8proc_option_t(options | UTF8PROC_STABLE));
  // utf8proc only fails on invalid UTF-8 or out of memory; the input was repaired before,
  // so keep the text unchanged rather than lose it.
  if (n < 0) return s;
  std::string out(reinterpret_cast<char*>(dst), size_t(n));
  std::free(dst);
  return out;
}

// Code points assigned after Unicode 9.0 (and by 16.0), sorted.
constexpr CodeRange kSinceUnicode9[] = {
#include "tokenizer/unicode_since9.inc"
};

bool new_since_unicode9(char32_t c) { return find_code_range(kSinceUnicode9, c) != nullptr; }

// The reference normalizes with Unicode 9.0's tables: to it a later character has no
// decomposition and combining class 0, so nothing reorders or composes across it. Such a
// character is kept as it is and the text between them is normalized by utf8proc (15.0),
// which for characters of 9.0 gives what 9.0's tables give (decompositions and classes of
// assigned characters are stable between versions).
std::string normalize_as_unicode9(const std::string& s, int options) {
  std::string out;
  size_t segment = 0, i = 0;
  while (i < s.size()) {
    const size_t at = i;
    if (!new_since_unicode9(next_code_point(s, i))) continue;
    out += utf8proc_normalize(s.substr(segment, at - segment), options);
    out.append(s, at, i - at);
    segment = i;
  }
  if (segment == 0) return utf8proc_normalize(s, options);
  return out + utf8proc_normalize(s.substr(segment), options);
}

std::string replace_all(const std::string& s, const NormalizerStep& step) {
  std::vector<std::pair<size_t, size_t>> matches;
  step.regex->find_all(s, matches);
  if (matches.empty()) return s;
  std::string out;
  size_t prev = 0;
  for (auto [b, e] : matches) {
    out.append(s, prev, b - prev);
    out += step.text;
    prev = e;
  }
  out.append(s, prev, std::string::npos);
  return out;
}

std::string strip(const std::string& s, bool left, bool right) {
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e) {
      size_t i = b;
      if (!is_unicode_whitespace(next_code_point(s, i))) break;
      b = i;
    }
  }
  if (right) {
    while (e > b) {
      size_t start = e - 1;
      while (start > b && ((unsigned char)s[start] & 0xC0) == 0x80) --start;
      size_t i = start;
      if (!is_unicode_whitespace(next_code_point(s, i))) break;
      e = start;
    }
  }
  return s.substr(b, e - b);
}

}  // namespace

bool is_unicode_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

Result<Normalizer> Normalizer::parse(const nlohmann::json& j, const std::string& where) {
  Normalizer n;
  if (!j.is_null()) TS_TRY(n.add(j, where));
  return n;
}

Status Normalizer::add(const nlohmann::json& j, const std::string& where) {
  // Bound by reference: with TS_ASSIGN GCC 12 warns (falsely) that `type` may be
  // uninitialized in the comparisons below.
  Result<std::string> type_r = json_string(j, "type", where);
  if (!type_r.ok()) return type_r.error();
  const std::string& type = type_r.value();
  using K = NormalizerStep::Kind;
  NormalizerStep step;
  if (type == "Sequence") {
    TS_ASSIGN(const nlohmann::json* list, json_array(j, "normalizers", where));
    for (size_t i = 0; i < list->size(); ++i)
      TS_TRY(add((*list)[i], where + ".normalizers[" + std::to_string(i) + "]"));
    return {};
  } else if (type == "NFC") {
    step.kind = K::kNfc;
  } else if (type == "NFD") {
    step.kind = K::kNfd;
  } else if (type == "NFKC") {
    step.kind = K::kNfkc;
  } else if (type == "NFKD") {
    step.kind = K::kNfkd;
  } else if (type == "Prepend") {
    step.kind = K::kPrepend;
    TS_ASSIGN(step.text, json_string(j, "prepend", where));
  } else if (type == "Replace") {
    step.kind = K::kReplace;
    TS_ASSIGN(step.text, json_string(j, "content", where));
    TS_ASSIGN(step.regex, parse_pattern(j, where));
  } else if (type == "Strip") {
    step.kind = K::kStrip;
    TS_ASSIGN(step.strip_left, json_bool_or(j, "strip_left", true, where));
    TS_ASSIGN(step.strip_right, json_bool_or(j, "strip_right", true, where));
  } else {
    return make_error(where + ".type: normalizer '" + type +
                      "' is not supported (supported: NFC, NFD, NFKC, NFKD, Prepend, Replace, "
                      "Strip, Sequence)");
  }
  steps_.push_back(std::move(step));
  return {};
}

std::string Normalizer::apply(std::string s) const {
  using K = NormalizerStep::Kind;
  for (const NormalizerStep& step : steps_) {
    switch (step.kind) {
      case K::kNfc:
        s = normalize_as_unicode9(s, UTF8PROC_COMPOSE);
        break;
      case K::kNfd:
        s = normalize_as_unicode9(s, UTF8PROC_DECOMPOSE);
        break;
      case K::kNfkc:
        s = normalize_as_unicode9(s, UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
        break;
      case K::kNfkd:
        s = normalize_as_unicode9(s, UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
        break;
      case K::kPrepend:
        // Hugging Face prepends only to non-empty text.
        if (!s.empty()) s = step.text + s;
        break;
      case K::kReplace:
        s = replace_all(s, step);
        break;
      case K::kStrip:
        s = strip(s, step.strip_left, step.strip_right);
        break;
    }
  }
  return s;
}

}  // namespace ts::tokenizer
