// tokenizer.json "pre_tokenizer": splits normalized text into the words the BPE model sees.
// Supported: Split (String/Regex pattern, every split behaviour, invert), ByteLevel
// (add_prefix_space, use_regex with the GPT-2 pattern), Digits, Metaspace, Whitespace,
// WhitespaceSplit, and Sequence (flattened: each step refines the pieces of the one before,
// which is what Hugging Face's Sequence does). Empty pieces are dropped after every step.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "tokenizer/regex.h"

namespace ts::tokenizer {

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Piece {
  std::string text;
  bool at_input_start;  // starts at offset 0 of the original input (Metaspace "first")
};

struct PreTokStep {
  enum class Kind { kSplit, kByteLevel, kMetaspace };  // Digits, Whitespace*: kSplit
  // What a Split matches; the char kinds are Hugging Face's char-predicate patterns, where
  // every matching code point is its own match.
  enum class Match { kRegex, kNumericChar, kWhitespaceChar, kOneChar };
  Kind kind = Kind::kSplit;
  Match match = Match::kRegex;
  std::optional<Regex> regex;
  char32_t one_char = 0;  // Match::kOneChar; Metaspace: the replacement
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel
  bool use_regex = false;         // ByteLevel: split with the GPT-2 pattern first
  enum class Prepend { kAlways, kFirst, kNever } prepend = Prepend::kAlways;  // Metaspace
  bool split = true;                                                          // Metaspace
};

class PreTokenizer {
 public:
  static Result<PreTokenizer> parse(const nlohmann::json& j, const std::string& where);

  // Splits `pieces` in place. Precondition: the texts are valid UTF-8.
  void apply(std::vector<Piece>& pieces) const;
  // True when a ByteLevel step maps bytes to the GPT-2 printable alphabet.
  bool byte_level() const;

 private:
  Status add(const nlohmann::json& j, const std::string& where);
  std::vector<PreTokStep> steps_;
};

// GPT-2's byte -> printable code point table and its inverse (-1 where not a byte char).
const char32_t* byte_to_unicode_table();
int unicode_to_byte(char32_t c);

}  // namespace ts::tokenizer
