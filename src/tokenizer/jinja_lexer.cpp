// Jinja2 lexer with transformers' whitespace settings: see jinja_lexer.h. The rules mirror
// jinja2/lexer.py (3.1): the root rule's OptionalLStrip, the tag rules' order (tag end first,
// then whitespace, float, integer, name, string, operator) and the bracket balancing that stops
// `}}` inside a dict literal from ending a tag.
#include "tokenizer/jinja_lexer.h"

#include <utf8proc.h>

#include <cctype>
#include <string_view>

#include "tokenizer/jinja_value.h"

namespace ts::tokenizer::jinja {

namespace {

// Python's newline normalisation plus keep_trailing_newline=False.
std::string normalize_source(const std::string& in) {
  std::string s;
  s.reserve(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == '\r') {
      s += '\n';
      if (i + 1 < in.size() && in[i + 1] == '\n') ++i;
    } else {
      s += in[i];
    }
  }
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

// Length in bytes of the Python-whitespace code point at s[i], or 0.
size_t space_at(std::string_view s, size_t i) {
  if (i >= s.size()) return 0;
  unsigned char c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return is_py_space(c) ? 1 : 0;
  utf8proc_int32_t cp = 0;
  utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                        utf8proc_ssize_t(s.size() - i), &cp);
  if (n <= 0) return 0;
  return is_py_space(uint32_t(cp)) ? size_t(n) : 0;
}

size_t skip_spaces(std::string_view s, size_t i) {
  while (size_t n = space_at(s, i)) i += n;
  return i;
}

// str.rstrip(): remove trailing Python whitespace.
std::string py_rstrip(std::string_view s) {
  std::vector<uint32_t> cps = utf8_decode(s);
  while (!cps.empty() && is_py_space(cps.back())) cps.pop_back();
  return utf8_encode(cps);
}

bool all_spaces(std::string_view s) {
  if (s.empty()) return false;  // jinja2's whitespace_re is \s+
  size_t i = 0;
  while (i < s.size()) {
    size_t n = space_at(s, i);
    if (!n) return false;
    i += n;
  }
  return true;
}

int count_newlines(std::string_view s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

bool starts_with(std::string_view s, size_t i, std::string_view p) {
  return s.size() >= i + p.size() && s.compare(i, p.size(), p) == 0;
}

// Decodes a Python string literal body (the lexer runs it through "unicode-escape").
std::string unescape(std::string_view body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    char c = body[i];
    if (c != '\\' || i + 1 >= body.size()) {
      out += c;
      continue;
    }
    char e = body[++i];
    auto hex = [&](size_t n) -> uint32_t {
      uint32_t v = 0;
      for (size_t k = 1; k <= n; ++k) {
        if (i + k >= body.size() || !std::isxdigit(static_cast<unsigned char>(body[i + k])))
          throw TemplateError("truncated \\x/\\u escape in string literal", line);
        int h = std::tolower(static_cast<unsigned char>(body[i + k]));
        v = v * 16 + uint32_t(std::isdigit(h) ? h - '0' : h - 'a' + 10);
      }
      i += n;
      return v;
    };
    switch (e) {
      case '\n':
        break;  // line continuation
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x':
        utf8_append(out, hex(2));
        break;
      case 'u':
        utf8_append(out, hex(4));
        break;
      case 'U':
        utf8_append(out, hex(8));
        break;
      default:
        if (e >= '0' && e <= '7') {
          uint32_t v = uint32_t(e - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7';
               ++k)
            v = v * 8 + uint32_t(body[++i] - '0');
          utf8_append(out, v);
        } else {
          out += '\\';  // unknown escapes stay as written
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(const std::string& source) : s_(normalize_source(source)) {}

  std::vector<Token> run() {
    while (pos_ < s_.size()) {
      size_t idx = find_tag_start(pos_);
      if (idx == std::string::npos) {
        emit_data(s_.substr(pos_));
        line_ += count_newlines(std::string_view(s_).substr(pos_));
        pos_ = s_.size();
        break;
      }
      char kind = s_[idx + 1];
      size_t after = idx + 2;
      char sign = (after < s_.size() && (s_[after] == '-' || s_[after] == '+')) ? s_[after] : 0;
      size_t raw_end = kind == '%' ? match_raw_begin(idx) : 0;
      std::string text = s_.substr(pos_, idx - pos_);
      int text_lines = count_newlines(text);
      emit_data(lstrip(text, sign, kind != '{'));
      line_ += text_lines;
      if (raw_end) {
        lex_raw(idx, raw_end);
      } else if (kind == '#') {
        lex_comment(after + (sign ? 1 : 0));
      } else {
        lex_tag(kind, after + (sign ? 1 : 0));
      }
    }
    tokens_.push_back({TokenType::kEof, "", 0, 0.0, line_});
    return std::move(tokens_);
  }

 private:
  size_t find_tag_start(size_t from) const {
    for (size_t i = s_.find('{', from); i != std::string::npos; i = s_.find('{', i + 1)) {
      if (i + 1 < s_.size() && (s_[i + 1] == '{' || s_[i + 1] == '%' || s_[i + 1] == '#')) return i;
    }
    return std::string::npos;
  }

  // The data before a tag, after `-` stripping or lstrip_blocks.
  std::string lstrip(const std::string& text, char sign, bool lstrip_allowed) const {
    if (sign == '-') return py_rstrip(text);
    if (sign == '+' || !lstrip_allowed) return text;
    size_t nl = text.rfind('\n');
    size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
    if ((l_pos > 0 || line_starting_) && all_spaces(std::string_view(text).substr(l_pos)))
      return text.substr(0, l_pos);
    return text;
  }

  void emit_data(std::string text) {
    if (text.empty()) return;
    tokens_.push_back({TokenType::kData, std::move(text), 0, 0.0, line_});
  }

  // `{%(-|+|)\s*raw\s*(-%}\s*|%})` at idx: returns the position after it, or 0.
  size_t match_raw_begin(size_t idx) const {
    size_t p = idx + 2;
    if (p < s_.size() && (s_[p] == '-' || s_[p] == '+')) ++p;
    p = skip_spaces(s_, p);
    if (!starts_with(s_, p, "raw")) return 0;
    p = skip_spaces(s_, p + 3);
    if (starts_with(s_, p, "-%}")) return skip_spaces(s_, p + 3);
    if (starts_with(s_, p, "%}")) return p + 2;
    return 0;
  }

  void lex_raw(size_t idx, size_t body_start) {
    line_ += count_newlines(std::string_view(s_).substr(idx, body_start - idx));
    line_starting_ = s_[body_start - 1] == '\n';
    for (size_t j = s_.find("{%", body_start); j != std::string::npos; j = s_.find("{%", j + 1)) {
      size_t p = j + 2;
      char sign = 0;
      if (p < s_.size() && (s_[p] == '-' || s_[p] == '+')) sign = s_[p++];
      p = skip_spaces(s_, p);
      if (!starts_with(s_, p, "endraw")) continue;
      p = skip_spaces(s_, p + 6);
      size_t end = 0;
      if (starts_with(s_, p, "+%}"))
        end = p + 3;
      else if (starts_with(s_, p, "-%}"))
        end = skip_spaces(s_, p + 3);
      else if (starts_with(s_, p, "%}"))
        end = p + 2 + (p + 2 < s_.size() && s_[p + 2] == '\n');
      if (!end) continue;
      std::string body = s_.substr(body_start, j - body_start);
      int body_lines = count_newlines(body);
      emit_data(lstrip(body, sign, true));
      line_ += body_lines + count_newlines(std::string_view(s_).substr(j, end - j));
      line_starting_ = s_[end - 1] == '\n';
      pos_ = end;
      return;
    }
    throw TemplateError("missing end of raw directive", line_);
  }

  void lex_comment(size_t content_start) {
    int start_line = line_;
    size_t q = s_.find("#}", content_start);
    if (q == std::string::npos) throw TemplateError("missing end of comment tag", start_line);
    size_t end;
    if (q > content_start && s_[q - 1] == '-')
      end = skip_spaces(s_, q + 2);
    else if (q > content_start && s_[q - 1] == '+')
      end = q + 2;
    else
      end = q + 2 + (q + 2 < s_.size() && s_[q + 2] == '\n');
    line_ += count_newlines(std::string_view(s_).substr(content_start, end - content_start));
    line_starting_ = s_[end - 1] == '\n';
    pos_ = end;
  }

  void lex_tag(char kind, size_t p) {
    bool block = kind == '%';
    tokens_.push_back(
        {block ? TokenType::kBlockBegin : TokenType::kVariableBegin, "", 0, 0.0, line_});
    std::vector<char> balance;
    while (true) {
      if (p >= s_.size())
        throw TemplateError(std::string("unclosed '") + (block ? "{%" : "{{") + "' tag", line_);
      if (balance.empty()) {
        size_t end = 0;
        if (block) {
          if (starts_with(s_, p, "+%}"))
            end = p + 3;
          else if (starts_with(s_, p, "-%}"))
            end = skip_spaces(s_, p + 3);
          else if (starts_with(s_, p, "%}"))
            end = p + 2 + (p + 2 < s_.size() && s_[p + 2] == '\n');
        } else {
          if (starts_with(s_, p, "-}}"))
            end = skip_spaces(s_, p + 3);
          else if (starts_with(s_, p, "}}"))
            end = p + 2;
        }
        if (end) {
          tokens_.push_back(
              {block ? TokenType::kBlockEnd : TokenType::kVariableEnd, "", 0, 0.0, line_});
          line_ += count_newlines(std::string_view(s_).substr(p, end - p));
          line_starting_ = s_[end - 1] == '\n';
          pos_ = end;
          return;
        }
      }
      if (size_t n = space_at(s_, p)) {
        line_ += s_[p] == '\n';
        p += n;
        continue;
      }
      if (size_t n = match_float(p)) {
        std::string digits;
        for (size_t k = p; k < p + n; ++k)
          if (s_[k] != '_') digits += s_[k];
        tokens_.push_back({TokenType::kFloat, s_.substr(p, n), 0, std::stod(digits), line_});
        p += n;
        continue;
      }
      if (size_t n = match_integer(p)) {
        std::string digits;
        for (size_t k = p; k < p + n; ++k)
          if (s_[k] != '_') digits += s_[k];
        int base = 10;
        size_t skip = 0;
        if (digits.size() > 1 && digits[0] == '0' &&
            std::isalpha(static_cast<unsigned char>(digits[1]))) {
          char b = char(std::tolower(digits[1]));
          base = b == 'b' ? 2 : (b == 'o' ? 8 : 16);
          skip = 2;
        }
        int64_t v = 0;
        try {
          v = std::stoll(digits.substr(skip), nullptr, base);
        } catch (...) {
          throw TemplateError("integer literal out of range: " + s_.substr(p, n), line_);
        }
        tokens_.push_back({TokenType::kInteger, s_.substr(p, n), v, 0.0, line_});
        p += n;
        continue;
      }
      unsigned char c = static_cast<unsigned char>(s_[p]);
      if (std::isalpha(c) || c == '_') {
        size_t q = p;
        while (q < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[q])) || s_[q] == '_'))
          ++q;
        tokens_.push_back({TokenType::kName, s_.substr(p, q - p), 0, 0.0, line_});
        p = q;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t q = p + 1;
        while (q < s_.size() && s_[q] != char(c)) q += s_[q] == '\\' ? 2 : 1;
        if (q >= s_.size()) throw TemplateError("unterminated string literal", line_);
        std::string_view body = std::string_view(s_).substr(p + 1, q - p - 1);
        tokens_.push_back({TokenType::kString, unescape(body, line_), 0, 0.0, line_});
        line_ += count_newlines(body);
        p = q + 1;
        continue;
      }
      static const char* kOps2[] = {"//", "**", "==", "!=", ">=", "<="};
      std::string op;
      for (const char* o : kOps2)
        if (starts_with(s_, p, o)) op = o;
      if (op.empty() && std::string_view("+-/*%~[](){}><=.:|,;").find(char(c)) != std::string::npos)
        op = std::string(1, char(c));
      if (op.empty()) {
        std::string ch;
        utf8_append(ch, utf8_decode(std::string_view(s_).substr(p, 4)).front());
        throw TemplateError("unexpected character '" + ch + "'", line_);
      }
      if (op == "(" || op == "[" || op == "{") {
        balance.push_back(op == "(" ? ')' : (op == "[" ? ']' : '}'));
      } else if (op == ")" || op == "]" || op == "}") {
        if (balance.empty()) throw TemplateError("unexpected '" + op + "'", line_);
        if (balance.back() != op[0])
          throw TemplateError("unexpected '" + op + "', expected '" + balance.back() + "'", line_);
        balance.pop_back();
      }
      tokens_.push_back({TokenType::kOperator, op, 0, 0.0, line_});
      p += op.size();
    }
  }

  size_t digits_at(size_t p) const {  // (\d+_)*\d+
    size_t q = p;
    if (q >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[q]))) return 0;
    while (q < s_.size()) {
      if (std::isdigit(static_cast<unsigned char>(s_[q]))) {
        ++q;
      } else if (s_[q] == '_' && q + 1 < s_.size() &&
                 std::isdigit(static_cast<unsigned char>(s_[q + 1]))) {
        ++q;
      } else {
        break;
      }
    }
    return q - p;
  }

  size_t match_float(size_t p) const {
    if (p > 0 && s_[p - 1] == '.') return 0;
    size_t n = digits_at(p);
    if (!n) return 0;
    size_t q = p + n;
    bool frac = false;
    if (q + 1 < s_.size() && s_[q] == '.' && digits_at(q + 1)) {
      q += 1 + digits_at(q + 1);
      frac = true;
    }
    if (q < s_.size() && (s_[q] == 'e' || s_[q] == 'E')) {
      size_t e = q + 1;
      if (e < s_.size() && (s_[e] == '+' || s_[e] == '-')) ++e;
      if (size_t d = digits_at(e)) return e + d - p;
    }
    return frac ? q - p : 0;
  }

  size_t match_integer(size_t p) const {
    if (p >= s_.size() || !std::isdigit(static_cast<unsigned char>(s_[p]))) return 0;
    auto run = [&](size_t q, auto is_digit) {  // (_?D)+
      size_t start = q;
      while (q < s_.size()) {
        if (is_digit(s_[q]))
          ++q;
        else if (s_[q] == '_' && q + 1 < s_.size() && is_digit(s_[q + 1]))
          q += 2;
        else
          break;
      }
      return q - start;
    };
    if (s_[p] == '0' && p + 1 < s_.size()) {
      char b = char(std::tolower(static_cast<unsigned char>(s_[p + 1])));
      size_t n = 0;
      if (b == 'b')
        n = run(p + 2, [](char ch) { return ch == '0' || ch == '1'; });
      else if (b == 'o')
        n = run(p + 2, [](char ch) { return ch >= '0' && ch <= '7'; });
      else if (b == 'x')
        n = run(p + 2, [](char ch) { return std::isxdigit(static_cast<unsigned char>(ch)) != 0; });
      if (n) return n + 2;
    }
    if (s_[p] == '0') return 1 + run(p + 1, [](char ch) { return ch == '0'; });
    return 1 +
           run(p + 1, [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)) != 0; });
  }

  std::string s_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(const std::string& source) { return Lexer(source).run(); }

std::string describe(const Token& t) {
  switch (t.type) {
    case TokenType::kData:
      return "template data";
    case TokenType::kVariableBegin:
      return "begin of print statement";
    case TokenType::kVariableEnd:
      return "end of print statement";
    case TokenType::kBlockBegin:
      return "begin of statement block";
    case TokenType::kBlockEnd:
      return "end of statement block";
    case TokenType::kEof:
      return "end of template";
    case TokenType::kString:
      return "string";
    case TokenType::kInteger:
      return "integer";
    case TokenType::kFloat:
      return "float";
    default:
      return "'" + t.text + "'";
  }
}

}  // namespace ts::tokenizer::jinja
