// Added tokens (tokenizer.json "added_tokens"): strings cut out of the input before the
// model sees it, each becoming one id. Two sets, as in Hugging Face's AddedVocabulary:
// tokens with normalized=false are matched in the raw input, tokens with normalized=true are
// matched (in their normalized form) in the normalized text. Matching is leftmost-longest
// and non-overlapping; lstrip / rstrip swallow adjacent whitespace into the token and
// single_word rejects a match glued to a word character.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace ts::tokenizer {

struct AddedToken {
  int id;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// A stretch of text, or an added token (id >= 0, text empty).
struct Segment {
  std::string text;
  int id = -1;
  size_t offset = 0;  // byte offset of the stretch in the string that was split
};

class AddedTokenMatcher {
 public:
  // `patterns[k]` is the string matched for `tokens[k]` (its content, or its normalized form).
  void build(std::vector<AddedToken> tokens, std::vector<std::string> patterns);
  bool empty() const { return tokens_.empty(); }
  // Splits `text` into stretches and tokens, in order; empty stretches are left out.
  void split(std::string_view text, std::vector<Segment>& out) const;

 private:
  std::vector<AddedToken> tokens_;
  std::vector<std::string> patterns_;
  std::vector<std::vector<int>> by_first_byte_;  // indices into tokens_, longest first
};

}  // namespace ts::tokenizer
