// Decoders; see decoder.h. Each step mirrors Hugging Face's decode_chain for that type.
#include "tokenizer/decoder.h"

#include "tokenizer/json_util.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/utf8.h"

namespace ts::tokenizer {

namespace {

// ByteLevel: map every char back to its byte; a token holding a char outside the byte
// alphabet (an added token such as "<｜User｜>") contributes its UTF-8 bytes unchanged. All
// tokens become one string, repaired like from_utf8_lossy.
std::vector<std::string> byte_level(const std::vector<std::string>& tokens, bool lossy) {
  std::string bytes;
  std::string mapped;
  for (const std::string& t : tokens) {
    mapped.clear();
    bool all = true;
    for (size_t i = 0; i < t.size() && all;) {
      int b = unicode_to_byte(next_code_point(t, i));
      if (b < 0) {
        all = false;
      } else {
        mapped += char(b);
      }
    }
    bytes += all ? mapped : t;
  }
  return {lossy ? to_valid_utf8(bytes) : bytes};
}

int byte_token_value(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// ByteFallback: runs of <0xXX> tokens become their bytes when those are valid UTF-8, else
// one U+FFFD per byte.
std::vector<std::string> byte_fallback(std::vector<std::string> tokens, bool lossy) {
  std::vector<std::string> out;
  std::string pending;
  size_t pending_count = 0;
  auto flush = [&] {
    if (pending_count == 0) return;
    if (!lossy || is_valid_utf8(pending)) {
      out.push_back(pending);
    } else {
      for (size_t k = 0; k < pending_count; ++k) out.emplace_back("\xEF\xBF\xBD");
    }
    pending.clear();
    pending_count = 0;
  };
  for (std::string& t : tokens) {
    int b = byte_token_value(t);
    if (b >= 0) {
      pending += char(b);
      ++pending_count;
    } else {
      flush();
      out.push_back(std::move(t));
    }
  }
  flush();
  return out;
}

std::string strip_token(const std::string& t, char32_t c, int start, int stop) {
  std::vector<std::pair<char32_t, size_t>> chars;  // code point, byte offset
  for (size_t i = 0; i < t.size();) {
    size_t at = i;
    chars.emplace_back(next_code_point(t, i), at);
  }
  size_t start_cut = 0;
  for (size_t i = 0; i < chars.size() && i < size_t(start); ++i) {
    if (chars[i].first != c) break;
    start_cut = i + 1;
  }
  size_t stop_cut = chars.size();
  for (size_t i = 0; i < std::min(size_t(stop), chars.size() - start_cut); ++i) {
    size_t index = chars.size() - i - 1;
    if (chars[index].first != c) break;
    stop_cut = index;
  }
  size_t b = start_cut < chars.size() ? chars[start_cut].second : t.size();
  size_t e = stop_cut < chars.size() ? chars[stop_cut].second : t.size();
  return b < e ? t.substr(b, e - b) : std::string();
}

std::string replace_matches(const std::string& t, const Regex& re, const std::string& with) {
  std::vector<std::pair<size_t, size_t>> m;
  re.find_all(t, m);
  if (m.empty()) return t;
  std::string out;
  size_t prev = 0;
  for (auto [b, e] : m) {
    out.append(t, prev, b - prev);
    out += with;
    prev = e;
  }
  out.append(t, prev, std::string::npos);
  return out;
}

std::string metaspace_token(const std::string& t, const std::string& rep, bool drop) {
  std::string out;
  for (size_t p = 0; p < t.size();) {
    if (t.compare(p, rep.size(), rep) == 0) {
      if (!drop) out += ' ';
      p += rep.size();
    } else {
      out += t[p++];
    }
  }
  return out;
}

}  // namespace

Result<Decoder> Decoder::parse(const nlohmann::json& j, const std::string& where) {
  Decoder d;
  if (!j.is_null()) {
    d.null_ = false;
    TS_TRY(d.add(j, where));
  }
  return d;
}

Status Decoder::add(const nlohmann::json& j, const std::string& where) {
  TS_ASSIGN(std::string type, json_string(j, "type", where));
  using K = DecoderStep::Kind;
  DecoderStep step;
  if (type == "Sequence") {
    TS_ASSIGN(const nlohmann::json* list, json_array(j, "decoders", where));
    for (size_t i = 0; i < list->size(); ++i)
      TS_TRY(add((*list)[i], where + ".decoders[" + std::to_string(i) + "]"));
    return {};
  } else if (type == "ByteLevel") {
    step.kind = K::kByteLevel;
  } else if (type == "Replace") {
    step.kind = K::kReplace;
    TS_ASSIGN(step.text, json_string(j, "content", where));
    TS_ASSIGN(step.regex, parse_pattern(j, where));
  } else if (type == "ByteFallback") {
    step.kind = K::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = K::kFuse;
  } else if (type == "Strip") {
    step.kind = K::kStrip;
    TS_ASSIGN(std::string content, json_string(j, "content", where));
    size_t i = 0;
    if (content.empty() || (next_code_point(content, i), i != content.size()))
      return make_error(where + ".content: expected one character");
    i = 0;
    step.strip_char = next_code_point(content, i);
    TS_ASSIGN(step.strip_start, json_count_or(j, "start", 0, 1 << 20, where));
    TS_ASSIGN(step.strip_stop, json_count_or(j, "stop", 0, 1 << 20, where));
  } else if (type == "Metaspace") {
    step.kind = K::kMetaspace;
    TS_ASSIGN(step.text, json_string_or(j, "replacement", "\u2581", where));
    TS_ASSIGN(std::string scheme, json_string_or(j, "prepend_scheme", "always", where));
    TS_ASSIGN(bool prefix, json_bool_or(j, "add_prefix_space", true, where));
    step.metaspace_strip_first = scheme != "never" && prefix;
  } else {
    return make_error(where + ".type: decoder '" + type +
                      "' is not supported (supported: ByteLevel, Replace, ByteFallback, Fuse, "
                      "Strip, Metaspace, Sequence)");
  }
  steps_.push_back(std::move(step));
  return {};
}

std::string Decoder::decode(std::vector<std::string> tokens, bool pieces) const {
  const bool lossy = !pieces;
  if (null_) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  using K = DecoderStep::Kind;
  for (const DecoderStep& step : steps_) {
    switch (step.kind) {
      case K::kByteLevel:
        tokens = byte_level(tokens, lossy);
        break;
      case K::kByteFallback:
        tokens = byte_fallback(std::move(tokens), lossy);
        break;
      case K::kReplace:
        for (std::string& t : tokens) t = replace_matches(t, *step.regex, step.text);
        break;
      case K::kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        break;
      }
      case K::kStrip:
        if (pieces) break;
        for (std::string& t : tokens)
          t = strip_token(t, step.strip_char, step.strip_start, step.strip_stop);
        break;
      case K::kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i)
          tokens[i] = metaspace_token(tokens[i], step.text,
                                      i == 0 && step.metaspace_strip_first && !pieces);
        break;
    }
  }
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

}  // namespace ts::tokenizer
