// Added-token matching; see added_vocab.h. Candidates are bucketed by first byte and tried
// longest first, which gives leftmost-longest matches without an automaton; real vocabularies
// have at most a few thousand added tokens, almost all starting with '<'.
#include "tokenizer/added_vocab.h"

#include <utf8proc.h>

#include <algorithm>

#include "tokenizer/normalizer.h"
#include "tokenizer/utf8.h"

namespace ts::tokenizer {

namespace {

bool is_word_char(char32_t c) {
  auto cat = utf8proc_category(utf8proc_int32_t(c));
  return c == '_' || (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
         (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
}

// Start of the code point that ends at `end` (exclusive).
size_t prev_char_start(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) --i;
  return i;
}

}  // namespace

void AddedTokenMatcher::build(std::vector<AddedToken> tokens, std::vector<std::string> patterns) {
  tokens_ = std::move(tokens);
  patterns_ = std::move(patterns);
  by_first_byte_.assign(256, {});
  for (size_t k = 0; k < patterns_.size(); ++k)
    if (!patterns_[k].empty()) by_first_byte_[(unsigned char)patterns_[k][0]].push_back(int(k));
  for (auto& bucket : by_first_byte_) {
    std::stable_sort(bucket.begin(), bucket.end(), [&](int a, int b) {
      return patterns_[size_t(a)].size() > patterns_[size_t(b)].size();
    });
  }
}

void AddedTokenMatcher::split(std::string_view text, std::vector<Segment>& out) const {
  size_t start_offset = 0;  // end of the last emitted token
  size_t pos = 0;
  auto emit_text = [&](size_t b, size_t e) {
    if (b < e) out.push_back({std::string(text.substr(b, e - b)), -1, b});
  };
  while (pos < text.size()) {
    int hit = -1;
    for (int k : by_first_byte_[(unsigned char)text[pos]]) {
      if (text.compare(pos, patterns_[size_t(k)].size(), patterns_[size_t(k)]) == 0) {
        hit = k;
        break;
      }
    }
    if (hit < 0) {
      ++pos;
      continue;
    }
    const AddedToken& tok = tokens_[size_t(hit)];
    size_t start = pos, stop = pos + patterns_[size_t(hit)].size();
    pos = stop;
    if (tok.single_word) {
      bool word_before = false, word_after = false;
      if (start > 0) {
        size_t i = prev_char_start(text, start);
        word_before = is_word_char(next_code_point(text, i));
      }
      if (stop < text.size()) {
        size_t i = stop;
        word_after = is_word_char(next_code_point(text, i));
      }
      if (word_before || word_after) continue;
    }
    if (tok.lstrip) {
      size_t s = start;
      while (s > start_offset) {
        size_t p = prev_char_start(text, s);
        size_t i = p;
        if (!is_unicode_whitespace(next_code_point(text, i))) break;
        s = p;
      }
      start = s;
    }
    if (tok.rstrip) {
      while (stop < text.size()) {
        size_t i = stop;
        if (!is_unicode_whitespace(next_code_point(text, i))) break;
        stop = i;
      }
      pos = stop;
    }
    emit_text(start_offset, start);
    out.push_back({std::string(), tok.id, start});
    start_offset = stop;
  }
  emit_text(start_offset, text.size());
}

}  // namespace ts::tokenizer
