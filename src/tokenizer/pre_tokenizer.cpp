// Pre-tokenizers; see pre_tokenizer.h. The split logic follows Hugging Face's
// NormalizedString::split: find matches, classify every stretch as match / non-match, merge
// stretches by the behaviour, drop removed and empty ones.
#include "tokenizer/pre_tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <array>

#include "tokenizer/json_util.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/utf8.h"

namespace ts::tokenizer {

namespace {

// The pattern ByteLevel(use_regex=true) splits with (GPT-2).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct Stretch {
  size_t begin, end;
  bool is_match;
};

bool is_numeric(char32_t c) {
  // Unicode 16.0, as the reference's Rust char::is_numeric (utf8proc knows 15.0).
  if (std::string_view added = unicode16_added_category(c); !added.empty()) return added[0] == 'N';
  auto cat = utf8proc_category(utf8proc_int32_t(c));
  return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}

std::vector<Stretch> find_matches(const PreTokStep& step, const std::string& text) {
  using M = PreTokStep::Match;
  std::vector<Stretch> out;
  if (text.empty()) {
    out.push_back({0, 0, false});
  } else if (step.match == M::kRegex) {
    std::vector<std::pair<size_t, size_t>> m;
    step.regex->find_all(text, m);
    size_t prev = 0;
    for (auto [b, e] : m) {
      if (prev != b) out.push_back({prev, b, false});
      out.push_back({b, e, true});
      prev = e;
    }
    if (prev != text.size()) out.push_back({prev, text.size(), false});
  } else {
    size_t last = 0;
    for (size_t i = 0; i < text.size();) {
      size_t b = i;
      char32_t c = next_code_point(text, i);
      bool hit = step.match == M::kNumericChar      ? is_numeric(c)
                 : step.match == M::kWhitespaceChar ? is_unicode_whitespace(c)
                                                    : c == step.one_char;
      if (!hit) continue;
      if (last < b) out.push_back({last, b, false});
      out.push_back({b, i, true});
      last = i;
    }
    if (last < text.size()) out.push_back({last, text.size(), false});
  }
  if (step.invert)
    for (Stretch& s : out) s.is_match = !s.is_match;
  return out;
}

// Stretches to keep, as [begin, end), after applying the behaviour.
std::vector<std::pair<size_t, size_t>> merge_stretches(const std::vector<Stretch>& m,
                                                       SplitBehavior behavior) {
  std::vector<std::pair<size_t, size_t>> out;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Stretch& s : m) out.emplace_back(s.begin, s.end);
      break;
    case SplitBehavior::kRemoved:
      for (const Stretch& s : m)
        if (!s.is_match) out.emplace_back(s.begin, s.end);
      break;
    case SplitBehavior::kContiguous:
      for (const Stretch& s : m) {
        if (s.is_match == previous_match && !out.empty()) {
          out.back().second = s.end;
        } else {
          out.emplace_back(s.begin, s.end);
        }
        previous_match = s.is_match;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Stretch& s : m) {
        if (s.is_match && !previous_match && !out.empty()) {
          out.back().second = s.end;
        } else {
          out.emplace_back(s.begin, s.end);
        }
        previous_match = s.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = m.rbegin(); it != m.rend(); ++it) {
        if (it->is_match && !previous_match && !out.empty()) {
          out.back().first = it->begin;
        } else {
          out.emplace_back(it->begin, it->end);
        }
        previous_match = it->is_match;
      }
      std::reverse(out.begin(), out.end());
      break;
  }
  return out;
}

void split_piece(const PreTokStep& step, const Piece& piece, std::vector<Piece>& out) {
  for (auto [b, e] : merge_stretches(find_matches(step, piece.text), step.behavior)) {
    if (b == e) continue;
    out.push_back({piece.text.substr(b, e - b), piece.at_input_start && b == 0});
  }
}

std::string replace_spaces(const std::string& s, const std::string& with) {
  std::string out;
  for (char c : s) {
    if (c == ' ') {
      out += with;
    } else {
      out += c;
    }
  }
  return out;
}

Result<SplitBehavior> parse_behavior(const nlohmann::json& j, const std::string& where) {
  TS_ASSIGN(std::string b, json_string(j, "behavior", where));
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  return make_error(where + ".behavior: unknown split behaviour '" + b + "'");
}

}  // namespace

const char32_t* byte_to_unicode_table() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    std::array<bool, 256> printable{};
    for (int b = '!'; b <= '~'; ++b) printable[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
    int n = 0;
    for (int b = 0; b < 256; ++b) t[b] = printable[b] ? char32_t(b) : char32_t(256 + n++);
    return t;
  }();
  return table.data();
}

int unicode_to_byte(char32_t c) {
  static const std::array<int, 324> inverse = [] {
    std::array<int, 324> inv;
    inv.fill(-1);
    for (int b = 0; b < 256; ++b) inv[byte_to_unicode_table()[b]] = b;
    return inv;
  }();
  return c < inverse.size() ? inverse[c] : -1;
}

Result<PreTokenizer> PreTokenizer::parse(const nlohmann::json& j, const std::string& where) {
  PreTokenizer p;
  if (!j.is_null()) TS_TRY(p.add(j, where));
  return p;
}

Status PreTokenizer::add(const nlohmann::json& j, const std::string& where) {
  TS_ASSIGN(std::string type, json_string(j, "type", where));
  using K = PreTokStep::Kind;
  using M = PreTokStep::Match;
  PreTokStep step;
  if (type == "Sequence") {
    TS_ASSIGN(const nlohmann::json* list, json_array(j, "pretokenizers", where));
    for (size_t i = 0; i < list->size(); ++i)
      TS_TRY(add((*list)[i], where + ".pretokenizers[" + std::to_string(i) + "]"));
    return {};
  } else if (type == "Split") {
    TS_ASSIGN(step.regex, parse_pattern(j, where));
    TS_ASSIGN(step.behavior, parse_behavior(j, where));
    TS_ASSIGN(step.invert, json_bool_or(j, "invert", false, where));
  } else if (type == "ByteLevel") {
    step.kind = K::kByteLevel;
    TS_ASSIGN(step.add_prefix_space, json_bool_or(j, "add_prefix_space", true, where));
    TS_ASSIGN(step.use_regex, json_bool_or(j, "use_regex", true, where));
    if (step.use_regex) {
      TS_ASSIGN(step.regex, Regex::compile(kGpt2Pattern, where));
    }
  } else if (type == "Digits") {
    step.match = M::kNumericChar;
    TS_ASSIGN(bool individual, json_bool_or(j, "individual_digits", false, where));
    step.behavior = individual ? SplitBehavior::kIsolated : SplitBehavior::kContiguous;
  } else if (type == "Whitespace") {
    TS_ASSIGN(step.regex, Regex::compile(R"(\w+|[^\w\s]+)", where));
    step.invert = true;
    step.behavior = SplitBehavior::kRemoved;
  } else if (type == "WhitespaceSplit") {
    step.match = M::kWhitespaceChar;
    step.behavior = SplitBehavior::kRemoved;
  } else if (type == "Metaspace") {
    step.kind = K::kMetaspace;
    TS_ASSIGN(std::string rep, json_string_or(j, "replacement", "\u2581", where));
    size_t i = 0;
    if (rep.empty() || !is_valid_utf8(rep) || (next_code_point(rep, i), i != rep.size()))
      return make_error(where + ".replacement: expected one character");
    i = 0;
    step.one_char = next_code_point(rep, i);
    step.match = M::kOneChar;
    step.behavior = SplitBehavior::kMergedWithNext;
    TS_ASSIGN(step.split, json_bool_or(j, "split", true, where));
    TS_ASSIGN(std::string s, json_string_or(j, "prepend_scheme", "", where));
    if (!s.empty()) {
      if (s == "always") {
        step.prepend = PreTokStep::Prepend::kAlways;
      } else if (s == "first") {
        step.prepend = PreTokStep::Prepend::kFirst;
      } else if (s == "never") {
        step.prepend = PreTokStep::Prepend::kNever;
      } else {
        return make_error(where + ".prepend_scheme: unknown value '" + s + "'");
      }
    } else {
      TS_ASSIGN(bool prefix, json_bool_or(j, "add_prefix_space", true, where));
      step.prepend = prefix ? PreTokStep::Prepend::kAlways : PreTokStep::Prepend::kNever;
    }
  } else {
    return make_error(where + ".type: pre-tokenizer '" + type +
                      "' is not supported (supported: Split, ByteLevel, Digits, Metaspace, "
                      "Whitespace, WhitespaceSplit, Sequence)");
  }
  steps_.push_back(std::move(step));
  return {};
}

bool PreTokenizer::byte_level() const {
  for (const PreTokStep& s : steps_)
    if (s.kind == PreTokStep::Kind::kByteLevel) return true;
  return false;
}

void PreTokenizer::apply(std::vector<Piece>& pieces) const {
  using K = PreTokStep::Kind;
  std::vector<Piece> next;
  for (const PreTokStep& step : steps_) {
    next.clear();
    for (Piece& piece : pieces) {
      switch (step.kind) {
        case K::kSplit:
          split_piece(step, piece, next);
          break;
        case K::kByteLevel: {
          if (step.add_prefix_space && (piece.text.empty() || piece.text[0] != ' '))
            piece.text.insert(piece.text.begin(), ' ');
          size_t first = next.size();
          if (step.use_regex) {
            split_piece(step, piece, next);
          } else if (!piece.text.empty()) {
            next.push_back(std::move(piece));
          }
          const char32_t* table = byte_to_unicode_table();
          for (size_t k = first; k < next.size(); ++k) {
            std::string mapped;
            mapped.reserve(next[k].text.size() * 2);
            for (unsigned char c : next[k].text) append_utf8(mapped, table[c]);
            next[k].text = std::move(mapped);
          }
          break;
        }
        case K::kMetaspace: {
          std::string rep;
          append_utf8(rep, step.one_char);
          piece.text = replace_spaces(piece.text, rep);
          bool starts_with_rep = piece.text.compare(0, rep.size(), rep) == 0;
          bool prepend = step.prepend == PreTokStep::Prepend::kAlways ||
                         (step.prepend == PreTokStep::Prepend::kFirst && piece.at_input_start);
          if (prepend && !starts_with_rep) piece.text = rep + piece.text;
          if (step.split) {
            split_piece(step, piece, next);
          } else if (!piece.text.empty()) {
            next.push_back(std::move(piece));
          }
          break;
        }
      }
    }
    pieces.swap(next);
  }
}

}  // namespace ts::tokenizer
