// Command-line flags: `--name value` and bare `--flag`. Every flag a command does not read is
// an error (so a typo never silently changes a run).
#pragma once

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace ts::cli {

class Args {
 public:
  // `flags_without_value` lists the bare switches the command accepts.
  static Result<Args> parse(const std::vector<std::string>& argv,
                            const std::set<std::string>& flags_without_value);

  bool has(const std::string& name) const;
  // Every value of a repeatable flag, in order (empty when absent).
  std::vector<std::string> all(const std::string& name) const;
  Result<std::string> str(const std::string& name) const;  // required
  std::string str_or(const std::string& name, const std::string& fallback) const;
  Result<int64_t> integer_or(const std::string& name, int64_t fallback, int64_t lo,
                             int64_t hi) const;
  Result<double> number_or(const std::string& name, double fallback, double lo, double hi) const;
  // Error for any flag not consumed by the accessors above.
  Status check_all_used() const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  Result<std::string> single(const std::string& name) const;  // error if given twice
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> positional_;
  mutable std::set<std::string> used_;
  mutable std::set<std::string> repeatable_;  // read through all()
};

// "1,2,3" -> ids. Errors name the bad element.
Result<std::vector<int>> parse_token_list(const std::string& s);

// --logit-bias values "ID=BIAS" (BIAS in [-100, 100]) -> (id, bias) pairs. Errors name the item.
Result<std::vector<std::pair<int, float>>> parse_logit_biases(
    const std::vector<std::string>& items);

}  // namespace ts::cli
