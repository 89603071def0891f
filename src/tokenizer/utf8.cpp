// UTF-8 validation and lossy repair; see utf8.h.
#include "tokenizer/utf8.h"

namespace ts::tokenizer {

namespace {

bool in(unsigned char c, unsigned lo, unsigned hi) { return c >= lo && c <= hi; }

// How many bytes of a sequence starting at s[i] are a valid prefix, and the full length the
// lead byte announces (0 for a byte that can never start a sequence).
struct Prefix {
  size_t valid;
  size_t need;
};

Prefix valid_prefix(std::string_view s, size_t i) {
  auto b = [&](size_t k) -> int { return i + k < s.size() ? (unsigned char)s[i + k] : -1; };
  const unsigned char c0 = (unsigned char)s[i];
  if (c0 < 0x80) return {1, 1};
  // Range of the second byte allowed after each lead byte (table 3-7).
  unsigned lo = 0x80, hi = 0xBF;
  size_t need;
  if (in(c0, 0xC2, 0xDF)) {
    need = 2;
  } else if (c0 == 0xE0) {
    need = 3, lo = 0xA0;
  } else if (in(c0, 0xE1, 0xEC) || in(c0, 0xEE, 0xEF)) {
    need = 3;
  } else if (c0 == 0xED) {
    need = 3, hi = 0x9F;
  } else if (c0 == 0xF0) {
    need = 4, lo = 0x90;
  } else if (in(c0, 0xF1, 0xF3)) {
    need = 4;
  } else if (c0 == 0xF4) {
    need = 4, hi = 0x8F;
  } else {
    return {0, 0};
  }
  int c1 = b(1);
  if (c1 < 0 || !in((unsigned char)c1, lo, hi)) return {1, need};
  size_t k = 2;
  for (; k < need; ++k) {
    int c = b(k);
    if (c < 0 || !in((unsigned char)c, 0x80, 0xBF)) break;
  }
  return {k, need};
}

}  // namespace

size_t utf8_valid_len(std::string_view s, size_t i) {
  Prefix p = valid_prefix(s, i);
  return p.need != 0 && p.valid == p.need ? p.need : 0;
}

size_t utf8_invalid_len(std::string_view s, size_t i) {
  Prefix p = valid_prefix(s, i);
  return p.valid == 0 ? 1 : p.valid;
}

bool is_valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    size_t n = utf8_valid_len(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string to_valid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t n = utf8_valid_len(s, i);
    if (n) {
      out.append(s.data() + i, n);
      i += n;
    } else {
      append_utf8(out, kReplacementChar);
      i += utf8_invalid_len(s, i);
    }
  }
  return out;
}

char32_t next_code_point(std::string_view s, size_t& i) {
  const unsigned char c0 = (unsigned char)s[i];
  if (c0 < 0x80) {
    ++i;
    return c0;
  }
  int n = c0 >= 0xF0 ? 4 : c0 >= 0xE0 ? 3 : 2;
  char32_t cp = c0 & (0x7F >> n);
  for (int k = 1; k < n && i + k < s.size(); ++k) cp = (cp << 6) | ((unsigned char)s[i + k] & 0x3F);
  i += n;
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

size_t count_code_points(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

}  // namespace ts::tokenizer
