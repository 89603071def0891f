// JSON mode (the server's response_format {"type": "json_object"}): generation constrained so
// that the reply is one JSON object (RFC 8259), byte by byte.
//
// JsonPrefix is a pushdown automaton over bytes: feed() refuses a byte that no JSON object
// could continue with, complete() says a whole top-level object has been read. JsonConstraint
// applies it to tokens: before each draw every token whose bytes the automaton would refuse
// gets -inf (end-of-generation tokens are allowed exactly when the object is complete, and
// then nothing else is), so the sampler, greedy or not, only picks tokens that keep the reply
// a prefix of some JSON object, and the reply ends when the object does.
#pragma once

#include <array>
#include <memory>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ts {
class ThreadPool;
}

namespace ts::runtime {

class SchemaPrefix;
struct JsonSchema;

class JsonPrefix {
 public:
  // Nesting deeper than this is refused (the state stays a small fixed-size value, cheap to
  // copy for every candidate token).
  static constexpr int kMaxDepth = 48;
  // Numbers stay within a double's range, so that every parser reads them (RFC 8259 allows
  // any length; some parsers refuse what overflows): at most this many integer digits and
  // exponent digits (< 10^299 in magnitude).
  static constexpr int kMaxIntDigits = 200, kMaxExpDigits = 2;
  // Whether the byte continues a prefix of a JSON object; on false the state is unchanged.
  bool feed(uint8_t c);
  // Every byte of s in turn; false (state unchanged) if any is refused.
  bool feed_all(std::string_view s);
  // A whole top-level object has been read (only whitespace may follow).
  bool complete() const { return mode_ == Mode::kDone; }
  // Inside a string, between characters (not after '\\' or within a UTF-8 sequence).
  bool in_plain_string() const { return mode_ == Mode::kString && utf8_left_ == 0; }

 private:
  enum class Mode : uint8_t {
    kStart,       // before the top-level '{'
    kValue,       // a value is expected (after ':' or ',' in an array, or '[')
    kArrayFirst,  // after '[': a value or ']'
    kKeyFirst,    // after '{': a key or '}'
    kKey,         // after ',' in an object: a key
    kColon,       // after a key
    kAfter,       // after a value inside a container: ',' or the closing bracket
    kString,      // inside a string (a key or a value)
    kEscape,      // after '\' in a string
    kUnicode,     // in the 4 hex digits of \u
    kNumber,      // inside a number (sub-state in num_)
    kLiteral,     // inside true / false / null
    kDone,        // the top-level object is closed
  };
  // Where a number is: after '-', after a leading 0, in the integer digits, after '.', in the
  // fraction, after 'e', after the exponent's sign, in the exponent.
  enum class Num : uint8_t { kMinus, kZero, kInt, kDot, kFrac, kE, kESign, kExp };
  bool step(uint8_t c);  // feed() without restoring the state on refusal
  bool value_start(uint8_t c);
  bool utf8_lead(uint8_t c);      // a byte >= 0x80 starting a character in a string
  bool end_value();               // a value just ended: back to the container
  bool number_ends(Num n) const;  // whether a number may end in this sub-state
  bool close(uint8_t c);          // ']' or '}' ending the innermost container

  friend class SchemaPrefix;  // reads where the automaton is, to apply a schema's rules
  Mode mode_ = Mode::kStart;
  Num num_ = Num::kInt;
  uint8_t int_digits_ = 0, exp_digits_ = 0;  // of the number being read
  bool key_ = false;      // the string being read is an object key
  uint8_t hex_left_ = 0;  // \u digits still to come
  // Inside a string: UTF-8 continuation bytes still to come, and the range the next one must
  // fall in (narrower after E0, ED, F0, F4: no overlong forms, surrogates or code points past
  // U+10FFFF).
  uint8_t utf8_left_ = 0, utf8_lo_ = 0x80, utf8_hi_ = 0xbf;
  const char* lit_ = nullptr;  // the rest of the literal being matched
  int depth_ = 0;
  std::array<char, kMaxDepth> stack_{};  // '{' or '[' per open container
};

class JsonConstraint {
 public:
  // token_bytes[id]: each token's bytes as a piece of text (Tokenizer::token_bytes); empty
  // for tokens that never belong in JSON text. eos: the end-of-generation tokens.
  // With a schema (json_schema.h; kept alive by the caller), the object is one it accepts.
  JsonConstraint(std::span<const std::string> token_bytes, std::vector<int> eos,
                 const JsonSchema* schema = nullptr);
  ~JsonConstraint();
  JsonConstraint(JsonConstraint&&) noexcept;
  JsonConstraint& operator=(JsonConstraint&&) noexcept;
  // logits with every token that cannot come next at -inf, into out; with a pool, over ranges
  // of the vocabulary on its threads (the same out either way).
  void mask(std::span<const float> logits, std::vector<float>& out,
            ThreadPool* pool = nullptr) const;
  // The chosen token: its bytes go into the automaton (false if it was not allowed).
  bool accept(int token);
  bool complete() const;
  // Whether the token may come next.
  bool allowed(int token) const;

 private:
  std::span<const std::string> bytes_;
  // Whether token is an end-of-generation token (one in eos_; ids past the vocabulary too).
  bool is_eos(int token) const;

  std::vector<int> eos_;
  std::vector<bool> is_eos_;  // per token of the vocabulary
  // Per token: its bytes are whole characters of string content (no quote, backslash or
  // control character), so inside a string, between characters, it is always allowed.
  std::vector<bool> plain_;
  std::unique_ptr<SchemaPrefix> state_;
};

}  // namespace ts::runtime
