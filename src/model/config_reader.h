// Typed reads of config.json keys; every error names the file and the key.
#pragma once

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/status.h"

namespace ts::model {

struct ConfigReader {
  const nlohmann::json& j;
  const std::string& source;

  Error err(const std::string& key, const std::string& what) const {
    return make_error(source + ": key '" + key + "' " + what);
  }
  bool has(const std::string& key) const { return j.contains(key) && !j.at(key).is_null(); }

  Result<int> integer(const std::string& key) const {
    if (!has(key)) return err(key, "is missing");
    const nlohmann::json& v = j.at(key);
    if (!v.is_number_integer()) return err(key, "must be an integer");
    int64_t x = v.get<int64_t>();
    if (x <= 0 || x > (int64_t(1) << 30)) return err(key, "must be positive, got " + v.dump());
    return int(x);
  }
  Result<int> integer_or(const std::string& key, int fallback) const {
    if (!has(key)) return fallback;
    return integer(key);
  }
  // A count that may be 0 (e.g. q_lora_rank null / absent, num_nextn_predict_layers 0).
  Result<int> count_or(const std::string& key, int fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& v = j.at(key);
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (int64_t(1) << 30))
      return err(key, "must be an integer >= 0, got " + v.dump());
    return int(v.get<int64_t>());
  }
  Result<double> number_or(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& v = j.at(key);
    if (!v.is_number()) return err(key, "must be a number");
    return v.get<double>();
  }
  Result<bool> boolean_or(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& v = j.at(key);
    if (!v.is_boolean()) return err(key, "must be true or false");
    return v.get<bool>();
  }
  Result<std::string> string_or(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& v = j.at(key);
    if (!v.is_string()) return err(key, "must be a string");
    return v.get<std::string>();
  }
  // A list of strings; empty when absent.
  Result<std::vector<std::string>> string_list(const std::string& key) const {
    std::vector<std::string> out;
    if (!has(key)) return out;
    const nlohmann::json& v = j.at(key);
    if (!v.is_array()) return err(key, "must be a list of strings");
    for (const nlohmann::json& e : v) {
      if (!e.is_string()) return err(key, "must be a list of strings, has " + e.dump());
      out.push_back(e.get<std::string>());
    }
    return out;
  }
  Result<std::set<int>> int_set(const std::string& key) const {
    std::set<int> out;
    if (!has(key)) return out;
    const nlohmann::json& v = j.at(key);
    if (!v.is_array()) return err(key, "must be a list of layer indices");
    for (const nlohmann::json& e : v) {
      if (!e.is_number_integer()) return err(key, "must be a list of layer indices");
      out.insert(e.get<int>());
    }
    return out;
  }
};

}  // namespace ts::model
