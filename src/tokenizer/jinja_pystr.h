// Python str semantics over UTF-8 for the template builtins: case mapping (utf8proc's simple
// mappings), strip / split / rsplit / replace / splitlines, title / capitalize, int() and float()
// parsing, str.format, and character classes. Lengths and positions count code points.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace ts::tokenizer::jinja {

using CodePoints = std::vector<uint32_t>;

uint32_t cp_upper(uint32_t c);
uint32_t cp_lower(uint32_t c);
uint32_t cp_title(uint32_t c);
bool cp_is_alpha(uint32_t c);
bool cp_is_digit(uint32_t c);
bool cp_is_numeric(uint32_t c);
bool cp_is_cased_upper(uint32_t c);  // has a lowercase mapping
bool cp_is_cased_lower(uint32_t c);  // has an uppercase mapping
bool cp_is_cased(uint32_t c);

// str.upper() / lower() / swapcase(), with Python's one-to-many mappings for ß, İ and ligatures.
std::string py_upper(const std::string& s);
std::string py_lower(const std::string& s);
std::string py_swapcase(const std::string& s);
// One character of the above, appended to out (title: Python's title-case mapping).
void append_upper(std::string& out, uint32_t c);
void append_lower(std::string& out, uint32_t c);
void append_title(std::string& out, uint32_t c);
// True when s is non-empty and every character satisfies pred (str.isalpha() and friends).
bool all_cps(const std::string& s, bool (*pred)(uint32_t));

// str.strip / lstrip / rstrip; `chars` None or Undefined = whitespace.
std::string py_strip(const std::string& s, const Value& chars, bool left, bool right);
// str.split / rsplit; `sep` None or Undefined = runs of whitespace; maxsplit < 0 = no limit.
std::vector<Value> py_split(const std::string& s, const Value& sep, int64_t maxsplit);
std::vector<Value> py_rsplit(const std::string& s, const Value& sep, int64_t maxsplit);
std::string py_replace(const std::string& s, const std::string& old, const std::string& repl,
                       int64_t count);
std::string py_title(const std::string& s);
std::string py_capitalize(const std::string& s);
std::vector<std::string> splitlines(const std::string& s, bool keepends);
// int(str, base) and float(str); false when Python would raise ValueError.
bool parse_py_int(const std::string& text, int base, int64_t* out);
bool parse_py_float(const std::string& text, double* out);
// str.format with "{}", "{0}", "{name}" fields (no format specs or conversions).
std::string py_format(const std::string& fmt, const CallArgs& a);
// markupsafe.escape: & < > " '
std::string html_escape(const std::string& s);

}  // namespace ts::tokenizer::jinja
