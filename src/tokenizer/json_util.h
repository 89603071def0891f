// Typed access to tokenizer.json fields with errors that name the JSON path.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "core/status.h"
#include "tokenizer/regex.h"

namespace ts::tokenizer {

inline Result<std::string> json_string(const nlohmann::json& j, const char* key,
                                       const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string())
    return make_error(where + "." + key + ": missing or not a string");
  return it->get<std::string>();
}

inline Result<const nlohmann::json*> json_array(const nlohmann::json& j, const char* key,
                                                const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_array())
    return make_error(where + "." + key + ": missing or not an array");
  return &*it;
}

// Optional fields: missing or null gives the fallback; a value of another type is an error
// that names the field (Hugging Face's loader refuses such a file too).
inline Result<bool> json_bool_or(const nlohmann::json& j, const char* key, bool fallback,
                                 const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return make_error(where + "." + key + ": expected true or false");
  return it->get<bool>();
}

inline Result<std::string> json_string_or(const nlohmann::json& j, const char* key,
                                          const std::string& fallback, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_string()) return make_error(where + "." + key + ": expected a string or null");
  return it->get<std::string>();
}

// A count: a non-negative integer no larger than `max`.
inline Result<int> json_count_or(const nlohmann::json& j, const char* key, int fallback, int max,
                                 const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > max)
    return make_error(where + "." + key + ": expected an integer from 0 to " + std::to_string(max));
  return int(it->get<int64_t>());
}

// A "pattern": {"String": s} (matched literally) or {"Regex": r}, compiled as a PCRE2 regex
// either way, as Hugging Face does (it escapes String patterns into a regex).
inline Result<Regex> parse_pattern(const nlohmann::json& j, const std::string& where) {
  auto it = j.find("pattern");
  if (it == j.end() || !it->is_object())
    return make_error(where + ".pattern: missing or not an object");
  if (auto s = it->find("String"); s != it->end() && s->is_string())
    return Regex::compile(regex_escape(s->get<std::string>()), where + ".pattern.String");
  if (auto r = it->find("Regex"); r != it->end() && r->is_string())
    return Regex::compile(r->get<std::string>(), where + ".pattern.Regex");
  return make_error(where + ".pattern: expected {\"String\": ...} or {\"Regex\": ...}");
}

}  // namespace ts::tokenizer
