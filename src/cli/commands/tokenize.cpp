// tokenize: text -> token ids, the contract scripts and tests rely on.
//   turbospark tokenize --model DIR --input FILE.jsonl [--add-special]
// Each input line is one JSON string; each output line is the JSON array of its ids. DIR
// needs only tokenizer.json (+ tokenizer_config.json); no config.json or weights. A GGUF file
// serves through its tokenizer metadata.
// Invalid UTF-8 inside an input string (raw bytes, or a lone \uD800-style surrogate escape)
// is replaced by U+FFFD, one per maximal invalid subpart, and then encoded like any text.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "cli/commands/commands.h"
#include "hub/hub_cache.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace ts::cli {

namespace {

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Parses one JSON string literal (the whole line, surrounding whitespace allowed). Hand
// written rather than nlohmann::json::parse because that rejects invalid UTF-8 and lone
// surrogates, which this command repairs instead.
Result<std::string> parse_json_string_line(std::string_view line, const std::string& where) {
  auto is_ws = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
  size_t b = 0, e = line.size();
  while (b < e && is_ws(line[b])) ++b;
  while (e > b && is_ws(line[e - 1])) --e;
  if (e - b < 2 || line[b] != '"' || line[e - 1] != '"')
    return make_error(where + ": expected a JSON string (\"...\")");
  std::string raw;  // bytes as written, escapes resolved; validated at the end
  for (size_t i = b + 1; i < e - 1; ++i) {
    char c = line[i];
    if (c == '"') return make_error(where + ": unescaped '\"' inside the string");
    if (c != '\\') {
      raw += c;
      continue;
    }
    if (++i >= e - 1) return make_error(where + ": string ends in a lone backslash");
    switch (line[i]) {
      case '"':
        raw += '"';
        break;
      case '\\':
        raw += '\\';
        break;
      case '/':
        raw += '/';
        break;
      case 'b':
        raw += '\b';
        break;
      case 'f':
        raw += '\f';
        break;
      case 'n':
        raw += '\n';
        break;
      case 'r':
        raw += '\r';
        break;
      case 't':
        raw += '\t';
        break;
      case 'u': {
        auto read4 = [&](size_t at) -> int {
          if (at + 4 > e - 1) return -1;
          int v = 0;
          for (size_t k = 0; k < 4; ++k) {
            int h = hex_value(line[at + k]);
            if (h < 0) return -1;
            v = v * 16 + h;
          }
          return v;
        };
        int cp = read4(i + 1);
        if (cp < 0) return make_error(where + ": bad \\u escape (need 4 hex digits)");
        i += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF && i + 2 < e - 1 && line[i + 1] == '\\' &&
            line[i + 2] == 'u') {
          int lo = read4(i + 3);
          if (lo >= 0xDC00 && lo <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            i += 6;
          }
        }
        // A surrogate left unpaired is not a character: U+FFFD.
        if (cp >= 0xD800 && cp <= 0xDFFF) cp = tokenizer::kReplacementChar;
        tokenizer::append_utf8(raw, char32_t(cp));
        break;
      }
      default:
        return make_error(where + ": unknown escape '\\" + std::string(1, line[i]) + "'");
    }
  }
  return tokenizer::to_valid_utf8(raw);
}

}  // namespace

Status cmd_tokenize(const Args& args) {
  TS_ASSIGN(std::string model, args.str("model"));
  TS_ASSIGN(std::string dir, hub::resolve_model_arg(model));
  TS_ASSIGN(std::string input, args.str("input"));
  const bool add_special = args.has("add-special");
  TS_TRY(args.check_all_used());
  std::ifstream f(input, std::ios::binary);
  if (!f) return make_error(input + ": cannot open");
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  TS_ASSIGN(auto tok, tokenizer::Tokenizer::load(dir));

  // Parse every line before printing anything, so a bad line leaves no partial output.
  std::vector<std::string> lines;
  size_t start = 0;
  for (int line_no = 1; start < text.size(); ++line_no) {
    size_t nl = text.find('\n', start);
    if (nl == std::string::npos) nl = text.size();
    std::string where = input + ":" + std::to_string(line_no);
    TS_ASSIGN(std::string s,
              parse_json_string_line(std::string_view(text).substr(start, nl - start), where));
    lines.push_back(std::move(s));
    start = nl + 1;
  }
  std::string out;
  for (const std::string& s : lines) {
    std::vector<int> ids = tok->encode(s, add_special);
    out += '[';
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) out += ',';
      out += std::to_string(ids[i]);
    }
    out += "]\n";
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return {};
}

}  // namespace ts::cli
