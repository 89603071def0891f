#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace ts::runtime {

int argmax(std::span<const float> v) {
  size_t best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] > v[best]) best = i;
  return int(best);
}

int Sampler::sample(std::span<const float> logits) {
  const bool penalize = opt_.presence_penalty != 0.0f || opt_.frequency_penalty != 0.0f;
  if ((penalize && !counts_.empty()) || !opt_.logit_bias.empty()) {
    penalized_.assign(logits.begin(), logits.end());
    for (const auto& [id, bias] : opt_.logit_bias)
      if (id >= 0 && size_t(id) < penalized_.size()) penalized_[size_t(id)] += bias;
    for (const auto& [id, n] : counts_)
      if (size_t(id) < penalized_.size())
        penalized_[size_t(id)] -= opt_.presence_penalty + opt_.frequency_penalty * float(n);
    logits = penalized_;
  }
  const int next = pick(logits);
  if (penalize) ++counts_[next];
  return next;
}

int Sampler::pick(std::span<const float> logits) {
  if (opt_.temperature <= 0.0f) return argmax(logits);
  std::vector<int> idx(logits.size());
  std::iota(idx.begin(), idx.end(), 0);
  auto by_logit = [&](int a, int b) {
    return logits[size_t(a)] > logits[size_t(b)] ||
           (logits[size_t(a)] == logits[size_t(b)] && a < b);
  };
  size_t keep = idx.size();
  if (opt_.top_k > 0 && size_t(opt_.top_k) < keep) keep = size_t(opt_.top_k);
  std::partial_sort(idx.begin(), idx.begin() + long(keep), idx.end(), by_logit);
  idx.resize(keep);
  std::vector<double> p(keep);
  const double mx = logits[size_t(idx[0])];
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) {
    p[i] = std::exp((double(logits[size_t(idx[i])]) - mx) / double(opt_.temperature));
    sum += p[i];
  }
  if (opt_.top_p < 1.0f) {
    double cum = 0;
    size_t n = 0;
    while (n < keep) {
      cum += p[n] / sum;
      ++n;
      if (cum >= double(opt_.top_p)) break;
    }
    keep = n;
    sum = std::accumulate(p.begin(), p.begin() + long(keep), 0.0);
  }
  if (opt_.min_p > 0.0f) {
    // p is sorted descending and p[0] = 1 (the max logit), so the cut is a prefix.
    size_t n = 1;
    while (n < keep && p[n] >= double(opt_.min_p)) ++n;
    keep = n;
    sum = std::accumulate(p.begin(), p.begin() + long(keep), 0.0);
  }
  // A uniform draw in [0, 1) from the top 53 bits: the same on every platform.
  double u = double(rng_() >> 11) * (1.0 / 9007199254740992.0) * sum;
  for (size_t i = 0; i < keep; ++i) {
    if (u < p[i]) return idx[i];
    u -= p[i];
  }
  return idx[keep - 1];
}

}  // namespace ts::runtime
