#include "runtime/interventions.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>

namespace ts::runtime {

Result<SteerMode> parse_steer_mode(const std::string& s) {
  if (s == "add") return SteerMode::kAdd;
  if (s == "ablate") return SteerMode::kAblate;
  if (s == "clamp") return SteerMode::kClamp;
  if (s == "renorm") return SteerMode::kRenorm;
  return make_error("steering mode '" + s + "' is not one of add, ablate, clamp, renorm");
}

void apply_steer(const SteerOp& op, float* x, int64_t d) {
  const float* v = op.v.data();
  switch (op.mode) {
    case SteerMode::kAdd:
      for (int64_t i = 0; i < d; ++i) x[i] += op.scale * v[i];
      return;
    case SteerMode::kAblate:
    case SteerMode::kClamp: {
      double vv = 0, xv = 0;
      for (int64_t i = 0; i < d; ++i) {
        vv += double(v[i]) * v[i];
        xv += double(x[i]) * v[i];
      }
      if (vv == 0) return;  // no direction: nothing to remove or set
      const double norm = std::sqrt(vv), along = xv / norm;  // x . u
      const double delta = op.mode == SteerMode::kAblate ? -double(op.scale) * along
                                                         : double(op.scale) - along;
      for (int64_t i = 0; i < d; ++i) x[i] = float(x[i] + delta * (v[i] / norm));
      return;
    }
    case SteerMode::kRenorm: {
      double before = 0, after = 0;
      for (int64_t i = 0; i < d; ++i) before += double(x[i]) * x[i];
      for (int64_t i = 0; i < d; ++i) {
        x[i] += op.scale * v[i];
        after += double(x[i]) * x[i];
      }
      if (after == 0) return;
      const float k = float(std::sqrt(before / after));
      for (int64_t i = 0; i < d; ++i) x[i] *= k;
      return;
    }
  }
}

Result<std::vector<int>> parse_layer_list(const std::string& s, int n_layers, bool allow_embedding) {
  std::set<int> out;
  const int lo = allow_embedding ? -1 : 0;
  if (s == "all") {
    for (int l = 0; l < n_layers; ++l) out.insert(l);
    return std::vector<int>(out.begin(), out.end());
  }
  size_t i = 0;
  while (i <= s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string item = s.substr(i, j - i);
    // a range "a-b" (a may be -1, so look for a dash after the first character)
    size_t dash = item.find('-', 1);
    char* end = nullptr;
    long a = std::strtol(item.c_str(), &end, 10);
    long b = a;
    bool ok = !item.empty() && end != item.c_str();
    if (ok && dash != std::string::npos) {
      ok = size_t(end - item.c_str()) == dash;
      const char* bs = item.c_str() + dash + 1;
      b = std::strtol(bs, &end, 10);
      ok = ok && end != bs;
    }
    ok = ok && *end == '\0';
    if (!ok) return make_error("layer list '" + s + "': '" + item + "' is not a layer or a range a-b");
    if (a > b || a < lo || b >= n_layers)
      return make_error("layer list '" + s + "': " + item + " is out of range [" +
                        std::to_string(lo) + ", " + std::to_string(n_layers - 1) + "]");
    for (long l = a; l <= b; ++l) out.insert(int(l));
    i = j + 1;
  }
  return std::vector<int>(out.begin(), out.end());
}

}  // namespace ts::runtime
