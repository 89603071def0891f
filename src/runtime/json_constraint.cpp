#include "runtime/json_constraint.h"

#include <algorithm>
#include <cmath>

#include "core/thread_pool.h"
#include "runtime/json_schema.h"

namespace ts::runtime {

namespace {
bool is_ws(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
bool is_hex(uint8_t c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
}  // namespace

bool JsonPrefix::feed(uint8_t c) {
  const JsonPrefix save = *this;
  if (step(c)) return true;
  *this = save;
  return false;
}

bool JsonPrefix::feed_all(std::string_view s) {
  const JsonPrefix save = *this;
  for (char ch : s)
    if (!step(uint8_t(ch))) {
      *this = save;
      return false;
    }
  return true;
}

bool JsonPrefix::end_value() {
  mode_ = depth_ == 0 ? Mode::kDone : Mode::kAfter;
  return true;
}

bool JsonPrefix::close(uint8_t c) {
  if (depth_ == 0 || stack_[size_t(depth_ - 1)] != (c == '}' ? '{' : '[')) return false;
  --depth_;
  return end_value();
}

bool JsonPrefix::value_start(uint8_t c) {
  switch (c) {
    case '{':
    case '[':
      if (depth_ == kMaxDepth) return false;
      stack_[size_t(depth_++)] = char(c);
      mode_ = c == '{' ? Mode::kKeyFirst : Mode::kArrayFirst;
      return true;
    case '"':
      key_ = false, mode_ = Mode::kString;
      return true;
    case '-':
      mode_ = Mode::kNumber, num_ = Num::kMinus, int_digits_ = 0, exp_digits_ = 0;
      return true;
    case '0':
      mode_ = Mode::kNumber, num_ = Num::kZero, int_digits_ = 1, exp_digits_ = 0;
      return true;
    case 't':
      mode_ = Mode::kLiteral, lit_ = "rue";
      return true;
    case 'f':
      mode_ = Mode::kLiteral, lit_ = "alse";
      return true;
    case 'n':
      mode_ = Mode::kLiteral, lit_ = "ull";
      return true;
    default:
      if (c >= '1' && c <= '9') {
        mode_ = Mode::kNumber, num_ = Num::kInt, int_digits_ = 1, exp_digits_ = 0;
        return true;
      }
      return false;
  }
}

bool JsonPrefix::utf8_lead(uint8_t c) {
  if (c >= 0xc2 && c <= 0xdf) {
    utf8_left_ = 1;
  } else if (c >= 0xe0 && c <= 0xef) {
    utf8_left_ = 2;
    if (c == 0xe0) utf8_lo_ = 0xa0;  // no overlong 3-byte forms
    if (c == 0xed) utf8_hi_ = 0x9f;  // no surrogates
  } else if (c >= 0xf0 && c <= 0xf4) {
    utf8_left_ = 3;
    if (c == 0xf0) utf8_lo_ = 0x90;  // no overlong 4-byte forms
    if (c == 0xf4) utf8_hi_ = 0x8f;  // nothing past U+10FFFF
  } else {
    return false;  // a continuation byte without a lead, C0, C1, F5-FF
  }
  return true;
}

bool JsonPrefix::number_ends(Num n) const {
  return n == Num::kZero || n == Num::kInt || n == Num::kFrac || n == Num::kExp;
}

bool JsonPrefix::step(uint8_t c) {
  switch (mode_) {
    case Mode::kStart:
      if (is_ws(c)) return true;
      return c == '{' && value_start(c);
    case Mode::kKeyFirst:
      if (is_ws(c)) return true;
      if (c == '}') return close(c);
      if (c == '"') return key_ = true, mode_ = Mode::kString, true;
      return false;
    case Mode::kKey:
      if (is_ws(c)) return true;
      if (c == '"') return key_ = true, mode_ = Mode::kString, true;
      return false;
    case Mode::kColon:
      if (is_ws(c)) return true;
      if (c == ':') return mode_ = Mode::kValue, true;
      return false;
    case Mode::kValue:
      if (is_ws(c)) return true;
      return value_start(c);
    case Mode::kArrayFirst:
      if (is_ws(c)) return true;
      if (c == ']') return close(c);
      return value_start(c);
    case Mode::kAfter:
      if (is_ws(c)) return true;
      if (c == ',') {
        mode_ = stack_[size_t(depth_ - 1)] == '{' ? Mode::kKey : Mode::kValue;
        return true;
      }
      if (c == '}' || c == ']') return close(c);
      return false;
    case Mode::kString:
      if (utf8_left_ > 0) {
        if (c < utf8_lo_ || c > utf8_hi_) return false;
        --utf8_left_;
        utf8_lo_ = 0x80, utf8_hi_ = 0xbf;
        return true;
      }
      if (c >= 0x80) return utf8_lead(c);
      if (c == '"') {
        if (!key_) return end_value();
        key_ = false;
        mode_ = Mode::kColon;
        return true;
      }
      if (c == '\\') return mode_ = Mode::kEscape, true;
      return c >= 0x20;  // control characters must be escaped
    case Mode::kEscape:
      if (c == 'u') return hex_left_ = 4, mode_ = Mode::kUnicode, true;
      if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' ||
          c == 't')
        return mode_ = Mode::kString, true;
      return false;
    case Mode::kUnicode:
      if (!is_hex(c)) return false;
      if (--hex_left_ == 0) mode_ = Mode::kString;
      return true;
    case Mode::kNumber: {
      const Num n = num_;
      if (is_digit(c)) {
        switch (n) {
          case Num::kMinus:
            num_ = c == '0' ? Num::kZero : Num::kInt;
            int_digits_ = 1;
            return true;
          case Num::kZero:
            break;  // no digit after a leading 0: the number may only end
          case Num::kInt:
            if (int_digits_ == kMaxIntDigits) return false;
            ++int_digits_;
            return true;
          case Num::kFrac:
            return true;
          case Num::kExp:
            if (exp_digits_ == kMaxExpDigits) return false;
            ++exp_digits_;
            return true;
          case Num::kDot:
            num_ = Num::kFrac;
            return true;
          case Num::kE:
          case Num::kESign:
            num_ = Num::kExp;
            exp_digits_ = 1;
            return true;
        }
      } else if (c == '.' && (n == Num::kZero || n == Num::kInt)) {
        num_ = Num::kDot;
        return true;
      } else if ((c == 'e' || c == 'E') && (n == Num::kZero || n == Num::kInt || n == Num::kFrac)) {
        num_ = Num::kE;
        return true;
      } else if ((c == '+' || c == '-') && n == Num::kE) {
        num_ = Num::kESign;
        return true;
      }
      // Anything else ends the number, if it may end here, and is read after it.
      if (!number_ends(n)) return false;
      end_value();
      return step(c);
    }
    case Mode::kLiteral:
      if (c != uint8_t(*lit_)) return false;
      if (*++lit_ == '\0') end_value();
      return true;
    case Mode::kDone:
      return is_ws(c);
  }
  return false;
}

JsonConstraint::JsonConstraint(std::span<const std::string> token_bytes, std::vector<int> eos,
                               const JsonSchema* schema)
    : bytes_(token_bytes),
      eos_(std::move(eos)),
      is_eos_(token_bytes.size()),
      plain_(token_bytes.size()),
      state_(std::make_unique<SchemaPrefix>(schema)) {
  for (int e : eos_)
    if (e >= 0 && size_t(e) < is_eos_.size()) is_eos_[size_t(e)] = true;
  JsonPrefix in_string;
  in_string.feed_all("{\"");
  for (size_t i = 0; i < bytes_.size(); ++i) {
    const std::string& b = bytes_[i];
    // Never leaving the string (a token such as `":"` ends one string and starts another).
    const bool stays = std::none_of(
        b.begin(), b.end(), [](char ch) { return ch == '"' || ch == '\\' || uint8_t(ch) < 0x20; });
    JsonPrefix s = in_string;
    plain_[i] = !b.empty() && !is_eos_[i] && stays && s.feed_all(b) && s.in_plain_string();
  }
}

JsonConstraint::~JsonConstraint() = default;
JsonConstraint::JsonConstraint(JsonConstraint&&) noexcept = default;
JsonConstraint& JsonConstraint::operator=(JsonConstraint&&) noexcept = default;

bool JsonConstraint::complete() const { return state_->complete(); }

bool JsonConstraint::is_eos(int token) const {
  if (token >= 0 && size_t(token) < is_eos_.size()) return is_eos_[size_t(token)];
  return std::find(eos_.begin(), eos_.end(), token) != eos_.end();
}

bool JsonConstraint::allowed(int token) const {
  if (is_eos(token)) return state_->complete();
  if (token < 0 || size_t(token) >= bytes_.size() || state_->complete()) return false;
  const std::string& b = bytes_[size_t(token)];
  if (b.empty()) return false;
  if (!state_->schema()) {
    JsonPrefix s = state_->json();
    return s.feed_all(b);
  }
  SchemaPrefix s = *state_;
  return s.feed_all(b);
}

void JsonConstraint::mask(std::span<const float> logits, std::vector<float>& out,
                          ThreadPool* pool) const {
  out.assign(logits.begin(), logits.end());
  // Shortcuts, each giving allowed()'s answer: inside a string most tokens are plain
  // content; elsewhere most fail on their first byte, tested once per byte value.
  const bool in_string = state_->in_plain_string();
  std::array<bool, 256> first_ok;
  for (int b = 0; b < 256; ++b) {
    if (state_->schema()) {
      SchemaPrefix s = *state_;
      first_ok[size_t(b)] = !state_->complete() && s.feed(uint8_t(b));
    } else {
      JsonPrefix s = state_->json();
      first_ok[size_t(b)] = !state_->complete() && s.feed(uint8_t(b));
    }
  }
  const auto range = [&](int64_t i0, int64_t i1) {
    for (size_t i = size_t(i0); i < size_t(i1); ++i) {
      if (i < bytes_.size() && !is_eos_[i]) {
        if (in_string && plain_[i]) continue;
        if (bytes_[i].empty() || !first_ok[uint8_t(bytes_[i][0])]) {
          out[i] = -INFINITY;
          continue;
        }
      }
      if (!allowed(int(i))) out[i] = -INFINITY;
    }
  };
  if (pool)
    pool->parallel_for(int64_t(out.size()), 1024, range);
  else
    range(0, int64_t(out.size()));
}

bool JsonConstraint::accept(int token) {
  if (!allowed(token)) return false;
  if (!is_eos(token)) state_->feed_all(bytes_[size_t(token)]);
  return true;
}

}  // namespace ts::runtime
