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
