#include "cli/args.h"

#include <cerrno>
#include <cstdlib>

namespace ts::cli {

Result<Args> Args::parse(const std::vector<std::string>& argv,
                         const std::set<std::string>& flags_without_value) {
  Args a;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& s = argv[i];
    if (s.rfind("--", 0) == 0 && s.size() > 2) {
      std::string name = s.substr(2), value;
      size_t eq = name.find('=');
      if (eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      } else if (flags_without_value.count(name)) {
        value = "1";
      } else {
        if (i + 1 >= argv.size()) return make_error("flag --" + name + " needs a value");
        value = argv[++i];
      }
      a.values_[name].push_back(value);
    } else {
      a.positional_.push_back(s);
    }
  }
  return a;
}

bool Args::has(const std::string& name) const {
  used_.insert(name);
  return values_.count(name) > 0;
}

std::vector<std::string> Args::all(const std::string& name) const {
  used_.insert(name);
  repeatable_.insert(name);
  auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>{} : it->second;
}

Result<std::string> Args::single(const std::string& name) const {
  used_.insert(name);
  auto it = values_.find(name);
  if (it == values_.end()) return make_error("missing required flag --" + name);
  if (it->second.size() > 1) return make_error("flag --" + name + " given twice");
  return it->second[0];
}

Result<std::string> Args::str(const std::string& name) const { return single(name); }

std::string Args::str_or(const std::string& name, const std::string& fallback) const {
  auto r = single(name);
  return r.ok() ? r.value() : fallback;
}

Result<int64_t> Args::integer_or(const std::string& name, int64_t fallback, int64_t lo,
                                 int64_t hi) const {
  used_.insert(name);
  if (!values_.count(name)) return fallback;
  TS_ASSIGN(std::string text, single(name));
  const char* s = text.c_str();
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s, &end, 10);
  if (errno || end == s || *end)
    return make_error("flag --" + name + ": '" + text + "' is not an integer");
  if (v < lo || v > hi)
    return make_error("flag --" + name + ": " + text + " is outside [" +
                      std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return int64_t(v);
}

Result<double> Args::number_or(const std::string& name, double fallback, double lo,
                               double hi) const {
  used_.insert(name);
  if (!values_.count(name)) return fallback;
  TS_ASSIGN(std::string text, single(name));
  const char* s = text.c_str();
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s, &end);
  if (errno || end == s || *end || !(v >= lo && v <= hi))
    return make_error("flag --" + name + ": '" + text + "' is not a number in [" +
                      std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

Status Args::check_all_used() const {
  for (const auto& [name, values] : values_) {
    if (!used_.count(name)) return make_error("unknown flag --" + name);
    if (values.size() > 1 && !repeatable_.count(name))
      return make_error("flag --" + name + " given twice");
  }
  return {};
}

Result<std::vector<int>> parse_token_list(const std::string& s) {
  std::vector<int> out;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string item = s.substr(i, j - i);
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || errno || *end || v < 0 || v > 0x7fffffff)
      return make_error("--tokens: element " + std::to_string(out.size()) + " ('" + item +
                        "') is not a non-negative integer");
    out.push_back(int(v));
    i = j + 1;
  }
  if (out.empty()) return make_error("--tokens: the token list is empty");
  return out;
}

Result<std::vector<std::pair<int, float>>> parse_logit_biases(
    const std::vector<std::string>& items) {
  std::vector<std::pair<int, float>> out;
  for (const std::string& item : items) {
    const size_t eq = item.find('=');
    const std::string id_s = item.substr(0, eq),
                      bias_s = eq == std::string::npos ? "" : item.substr(eq + 1);
    char* end = nullptr;
    errno = 0;
    const long long id = std::strtoll(id_s.c_str(), &end, 10);
    const bool id_ok = !id_s.empty() && !errno && !*end && id >= 0 && id <= 0x7fffffff;
    errno = 0;
    const double bias = std::strtod(bias_s.c_str(), &end);
    const bool bias_ok = !bias_s.empty() && !errno && !*end && bias >= -100 && bias <= 100;
    if (!id_ok || !bias_ok)
      return make_error("--logit-bias '" + item +
                        "': expected TOKEN_ID=BIAS, a non-negative id and a bias from -100 to 100");
    out.emplace_back(int(id), float(bias));
  }
  return out;
}

}  // namespace ts::cli
