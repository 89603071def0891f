// UTF-8 helpers shared by the tokenizer stages. Invalid input is never rejected: it is
// repaired the way Rust's String::from_utf8_lossy does it (each maximal invalid subpart
// becomes one U+FFFD), because the reference tokenizers decode bytes that way and callers
// (the CLI, chat input) hand us text from outside.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ts::tokenizer {

inline constexpr char32_t kReplacementChar = 0xFFFD;

// Length of the well-formed UTF-8 sequence starting at s[i], or 0 when the bytes there are
// not one (Unicode table 3-7: no overlongs, no surrogates, nothing past U+10FFFF).
size_t utf8_valid_len(std::string_view s, size_t i);

// Length of the maximal subpart at s[i] (>= 1) for a position where utf8_valid_len() is 0:
// the bytes that one U+FFFD replaces.
size_t utf8_invalid_len(std::string_view s, size_t i);

bool is_valid_utf8(std::string_view s);

// `s` with every maximal invalid subpart replaced by U+FFFD (from_utf8_lossy semantics).
std::string to_valid_utf8(std::string_view s);

// Decodes the code point at s[i] of a valid UTF-8 string and advances i.
char32_t next_code_point(std::string_view s, size_t& i);

void append_utf8(std::string& out, char32_t cp);

// Number of code points in valid UTF-8.
size_t count_code_points(std::string_view s);

}  // namespace ts::tokenizer
