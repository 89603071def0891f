// Python str semantics over UTF-8; see jinja_pystr.h.
#include "tokenizer/jinja_pystr.h"

#include <utf8proc.h>

#include <algorithm>
#include <cctype>
#include <cmath>

namespace ts::tokenizer::jinja {

namespace {

const std::string& need_sep(const Value& v) {
  if (!v.is_string()) throw TemplateError("must be str or None, not " + v.type_name());
  return v.as_string();
}

}  // namespace

uint32_t cp_upper(uint32_t c) { return uint32_t(utf8proc_toupper(utf8proc_int32_t(c))); }
uint32_t cp_lower(uint32_t c) { return uint32_t(utf8proc_tolower(utf8proc_int32_t(c))); }
uint32_t cp_title(uint32_t c) { return uint32_t(utf8proc_totitle(utf8proc_int32_t(c))); }
bool cp_is_alpha(uint32_t c) {
  switch (utf8proc_category(utf8proc_int32_t(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
      return true;
    default:
      return false;
  }
}
bool cp_is_digit(uint32_t c) {
  return utf8proc_category(utf8proc_int32_t(c)) == UTF8PROC_CATEGORY_ND;
}
bool cp_is_numeric(uint32_t c) {
  auto cat = utf8proc_category(utf8proc_int32_t(c));
  return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}
bool cp_is_cased_upper(uint32_t c) { return cp_lower(c) != c; }
bool cp_is_cased_lower(uint32_t c) { return cp_upper(c) != c; }
bool cp_is_cased(uint32_t c) {
  return cp_is_cased_upper(c) || cp_is_cased_lower(c) ||
         utf8proc_category(utf8proc_int32_t(c)) == UTF8PROC_CATEGORY_LT;
}

namespace {

// Python's full case mappings (SpecialCasing.txt) that differ from the simple one-to-one
// mappings utf8proc gives, for the characters real text has: the sharp s and Latin ligatures.
const char* special_upper(uint32_t c) {
  switch (c) {
    case 0x00DF:
      return "SS";
    case 0x0149:
      return "\u02BCN";
    case 0xFB00:
      return "FF";
    case 0xFB01:
      return "FI";
    case 0xFB02:
      return "FL";
    case 0xFB03:
      return "FFI";
    case 0xFB04:
      return "FFL";
    case 0xFB05:
    case 0xFB06:
      return "ST";
    default:
      return nullptr;
  }
}

const char* special_title(uint32_t c) {
  switch (c) {
    case 0x00DF:
      return "Ss";
    case 0xFB00:
      return "Ff";
    case 0xFB01:
      return "Fi";
    case 0xFB02:
      return "Fl";
    case 0xFB03:
      return "Ffi";
    case 0xFB04:
      return "Ffl";
    case 0xFB05:
    case 0xFB06:
      return "St";
    default:
      return nullptr;
  }
}

}  // namespace

void append_upper(std::string& out, uint32_t c) {
  if (const char* s = special_upper(c))
    out += s;
  else
    utf8_append(out, cp_upper(c));
}

void append_lower(std::string& out, uint32_t c) {
  if (c == 0x0130)
    out += "i\u0307";  // İ -> i + combining dot above
  else
    utf8_append(out, cp_lower(c));
}

void append_title(std::string& out, uint32_t c) {
  if (const char* s = special_title(c))
    out += s;
  else
    utf8_append(out, cp_title(c));
}

std::string py_upper(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (uint32_t c : utf8_decode(s)) append_upper(out, c);
  return out;
}

std::string py_lower(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (uint32_t c : utf8_decode(s)) append_lower(out, c);
  return out;
}

std::string py_swapcase(const std::string& s) {
  std::string out;
  for (uint32_t c : utf8_decode(s)) {
    if (cp_is_cased_upper(c))
      append_lower(out, c);
    else if (cp_is_cased_lower(c))
      append_upper(out, c);
    else
      utf8_append(out, c);
  }
  return out;
}

std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  CodePoints cps = utf8_decode(s);
  CodePoints set;
  bool whitespace = chars.is_none() || chars.is_undefined();
  if (!whitespace) set = utf8_decode(need_sep(chars));
  auto strip_it = [&](uint32_t c) {
    return whitespace ? is_py_space(c) : std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strip_it(cps[b])) ++b;
  if (right)
    while (e > b && strip_it(cps[e - 1])) --e;
  return utf8_encode(CodePoints(cps.begin() + long(b), cps.begin() + long(e)));
}

std::vector<Value> py_split(const std::string& s, const Value& sep_v, int64_t maxsplit) {
  std::vector<Value> out;
  if (sep_v.is_none() || sep_v.is_undefined()) {
    CodePoints cps = utf8_decode(s);
    size_t i = 0, n = cps.size();
    while (true) {
      while (i < n && is_py_space(cps[i])) ++i;
      if (i >= n) break;
      if (maxsplit >= 0 && int64_t(out.size()) >= maxsplit) {
        out.emplace_back(utf8_encode(CodePoints(cps.begin() + long(i), cps.end())));
        break;
      }
      size_t j = i;
      while (j < n && !is_py_space(cps[j])) ++j;
      out.emplace_back(utf8_encode(CodePoints(cps.begin() + long(i), cps.begin() + long(j))));
      i = j;
    }
    return out;
  }
  const std::string& sep = need_sep(sep_v);
  if (sep.empty()) throw TemplateError("empty separator");
  size_t start = 0;
  while (true) {
    size_t p = s.find(sep, start);
    if (p == std::string::npos || (maxsplit >= 0 && int64_t(out.size()) >= maxsplit)) {
      out.emplace_back(s.substr(start));
      break;
    }
    out.emplace_back(s.substr(start, p - start));
    start = p + sep.size();
  }
  return out;
}

std::vector<Value> py_rsplit(const std::string& s, const Value& sep_v, int64_t maxsplit) {
  if (maxsplit < 0) return py_split(s, sep_v, -1);
  std::vector<Value> out;
  if (sep_v.is_none() || sep_v.is_undefined()) {
    CodePoints cps = utf8_decode(s);
    int64_t i = int64_t(cps.size());
    while (true) {
      while (i > 0 && is_py_space(cps[size_t(i - 1)])) --i;
      if (i <= 0) break;
      if (int64_t(out.size()) >= maxsplit) {
        out.emplace_back(utf8_encode(CodePoints(cps.begin(), cps.begin() + i)));
        break;
      }
      int64_t j = i;
      while (j > 0 && !is_py_space(cps[size_t(j - 1)])) --j;
      out.emplace_back(utf8_encode(CodePoints(cps.begin() + j, cps.begin() + i)));
      i = j;
    }
    std::reverse(out.begin(), out.end());
    return out;
  }
  const std::string& sep = need_sep(sep_v);
  if (sep.empty()) throw TemplateError("empty separator");
  size_t end = s.size();
  while (true) {
    size_t p = end >= sep.size() ? s.rfind(sep, end - sep.size()) : std::string::npos;
    if (p == std::string::npos || int64_t(out.size()) >= maxsplit) {
      out.emplace_back(s.substr(0, end));
      break;
    }
    out.emplace_back(s.substr(p + sep.size(), end - p - sep.size()));
    end = p;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl,
                       int64_t count) {
  if (count == 0) return s;
  std::string out;
  if (old.empty()) {  // Python inserts repl between every character
    CodePoints cps = utf8_decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      if (i < cps.size()) utf8_append(out, cps[i]);
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t p = s.find(old, start);
    if (p == std::string::npos) break;
    out += s.substr(start, p - start) + repl;
    start = p + old.size();
    ++done;
  }
  return out + s.substr(start);
}

// Python str.title(): a letter after a cased letter is lowered, others are title-cased.
std::string py_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (uint32_t c : utf8_decode(s)) {
    if (cp_is_cased(c)) {
      if (prev_cased)
        append_lower(out, c);
      else
        append_title(out, c);
      prev_cased = true;
    } else {
      utf8_append(out, c);
      prev_cased = false;
    }
  }
  return out;
}

std::string py_capitalize(const std::string& s) {
  CodePoints cps = utf8_decode(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (i == 0)
      append_title(out, cps[i]);
    else
      append_lower(out, cps[i]);
  }
  return out;
}

bool all_cps(const std::string& s, bool (*pred)(uint32_t)) {
  CodePoints cps = utf8_decode(s);
  if (cps.empty()) return false;
  for (uint32_t c : cps)
    if (!pred(c)) return false;
  return true;
}

// Python's int(str): optional sign, digits with single underscores, surrounding whitespace.
bool parse_py_int(const std::string& text, int base, int64_t* out) {
  std::string s = py_strip(text, Value::none(), true, true);
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
  if (base == 16 && s.size() > i + 1 && s[i] == '0' && (s[i + 1] == 'x' || s[i + 1] == 'X')) i += 2;
  if (i >= s.size()) return false;
  int64_t v = 0;
  bool prev_digit = false;
  for (; i < s.size(); ++i) {
    char c = s[i];
    if (c == '_' && prev_digit) {
      prev_digit = false;
      continue;
    }
    int d = std::isdigit(static_cast<unsigned char>(c))   ? c - '0'
            : std::isalpha(static_cast<unsigned char>(c)) ? std::tolower(c) - 'a' + 10
                                                          : 99;
    if (d >= base) return false;
    if (__builtin_mul_overflow(v, int64_t(base), &v) || __builtin_add_overflow(v, int64_t(d), &v))
      return false;
    prev_digit = true;
  }
  if (!prev_digit) return false;
  *out = neg ? -v : v;
  return true;
}

bool parse_py_float(const std::string& text, double* out) {
  std::string s = py_strip(text, Value::none(), true, true);
  std::string clean;
  for (char c : s)
    if (c != '_') clean += c;
  if (clean.empty()) return false;
  std::string lower = clean;
  for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
  size_t sign = (lower[0] == '+' || lower[0] == '-') ? 1 : 0;
  std::string body = lower.substr(sign);
  if (body == "inf" || body == "infinity" || body == "nan") {
    double v = body == "nan" ? NAN : INFINITY;
    *out = lower[0] == '-' ? -v : v;
    return true;
  }
  try {
    size_t used = 0;
    double v = std::stod(clean, &used);
    if (used != clean.size()) return false;
    *out = v;
    return true;
  } catch (...) {
    return false;
  }
}

// str.format: "{}", "{0}", "{name}", "{0.attr}"-free subset, "{{" / "}}" escapes.
std::string py_format(const std::string& fmt, const CallArgs& a) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '{' && i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      ++i;
    } else if (c == '}' && i + 1 < fmt.size() && fmt[i + 1] == '}') {
      out += '}';
      ++i;
    } else if (c == '{') {
      size_t close = fmt.find('}', i);
      if (close == std::string::npos)
        throw TemplateError("Single '{' encountered in format string");
      std::string field = fmt.substr(i + 1, close - i - 1);
      if (field.find_first_of(":!.[") != std::string::npos)
        throw TemplateError("str.format: format specs and conversions are not supported ('{" +
                            field + "}')");
      Value v;
      if (field.empty()) {
        if (auto_index >= a.positional.size())
          throw TemplateError("Replacement index " + std::to_string(auto_index) +
                              " out of range for positional args tuple");
        v = a.positional[auto_index++];
      } else if (std::all_of(field.begin(), field.end(), [](char ch) {
                   return std::isdigit(static_cast<unsigned char>(ch));
                 })) {
        size_t idx = std::stoul(field);
        if (idx >= a.positional.size())
          throw TemplateError("Replacement index " + field +
                              " out of range for positional args tuple");
        v = a.positional[idx];
      } else {
        bool found = false;
        for (const auto& [k, val] : a.keyword)
          if (k == field) {
            v = val;
            found = true;
          }
        if (!found) throw TemplateError("KeyError: '" + field + "'");
      }
      out += to_str(v);
      i = close;
    } else if (c == '}') {
      throw TemplateError("Single '}' encountered in format string");
    } else {
      out += c;
    }
  }
  return out;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::vector<std::string> splitlines(const std::string& s, bool keepends) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\n' || s[i] == '\r') {
      size_t end = i;
      if (s[i] == '\r' && i + 1 < s.size() && s[i + 1] == '\n') ++i;
      out.push_back(s.substr(start, (keepends ? i + 1 : end) - start));
      start = i + 1;
    }
  }
  if (start < s.size()) out.push_back(s.substr(start));
  return out;
}

}  // namespace ts::tokenizer::jinja
