#include "model/router.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/status.h"

namespace ts::model {

void select_experts(std::span<const float> logits, const MoeOptions& opt, Selection out) {
  const size_t n = logits.size(), k = out.ids.size();
  TS_CHECK(k >= 1 && k <= n && out.weights.size() == k, "select_experts: bad top_k");
  float mx = -INFINITY;
  for (float v : logits) mx = std::max(mx, v);
  std::vector<float> p(n);
  float sum = 0;
  for (size_t i = 0; i < n; ++i) {
    p[i] = std::exp(logits[i] - mx);
    sum += p[i];
  }
  for (float& v : p) v /= sum;
  // Partial selection sort: k is small (<= 16 in practice), n up to a few hundred.
  std::vector<bool> taken(n, false);
  for (size_t r = 0; r < k; ++r) {
    size_t best = n;
    for (size_t i = 0; i < n; ++i)
      if (!taken[i] && (best == n || p[i] > p[best])) best = i;
    taken[best] = true;
    out.ids[r] = int(best);
    out.weights[r] = p[best];
  }
  if (opt.renormalize) {
    float s = 0;
    for (float w : out.weights) s += w;
    for (float& w : out.weights) w /= s;
  }
}

}  // namespace ts::model
