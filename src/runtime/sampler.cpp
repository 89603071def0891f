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
  // Tokens in descending logit order (ties: lower id first), sorted only as far as the cuts
  // and the draw look: a vocabulary of 152k sorted whole took ~20 ms a token, where a GPU
  // decode step takes ~2.5 (docs/PERF.md). Each token falls in a bin of (max - logit) / T
  // (a quarter of T wide; the last bin holds the rest), so a bin's tokens rank below every
  // earlier bin's; order_ grows a run of whole bins at a time, each run sorted, and is the
  // head of the full order.
  const auto by_logit = [&](int a, int b) {
    return logits[size_t(a)] > logits[size_t(b)] ||
           (logits[size_t(a)] == logits[size_t(b)] && a < b);
  };
  const size_t vocab = logits.size();
  const int best = argmax(logits);
  const double mx = logits[size_t(best)];
  const double t = double(opt_.temperature);
  constexpr int kBins = 512;
  size_t count[kBins] = {};
  int next_bin = 0;
  order_.clear();
  size_t keep = vocab;
  if (opt_.top_k > 0 && size_t(opt_.top_k) < vocab) {
    // The best top_k, sorted: nothing past them is ever looked at.
    keep = size_t(opt_.top_k);
    order_.resize(vocab);
    std::iota(order_.begin(), order_.end(), 0);
    std::partial_sort(order_.begin(), order_.begin() + long(keep), order_.end(), by_logit);
    order_.resize(keep);
    next_bin = kBins;
  } else {
    bins_.resize(vocab);
    const double scale = 4.0 / t;
    for (size_t i = 0; i < vocab; ++i) {
      const double d = (mx - double(logits[i])) * scale;
      const int b = d < double(kBins - 1) ? int(d) : kBins - 1;  // NaN: the last bin
      bins_[i] = uint16_t(b);
      ++count[b];
    }
  }
  const auto sorted_to = [&](size_t n) {  // order_ holds at least the best min(n, keep)
    if (n <= order_.size() || next_bin == kBins) return;
    const size_t want = std::max({n, 2 * order_.size(), size_t(256)});
    size_t have = order_.size();
    int end = next_bin;
    while (end < kBins && have < want) have += count[end++];
    const size_t from = order_.size();
    for (size_t i = 0; i < vocab; ++i)
      if (bins_[i] >= next_bin && bins_[i] < end) order_.push_back(int(i));
    std::sort(order_.begin() + long(from), order_.end(), by_logit);
    next_bin = end;
  };
  const auto weight = [&](size_t rank) {
    return std::exp((double(logits[size_t(order_[rank])]) - mx) / t);
  };
  const auto prefix_sum = [&](size_t n) {
    sorted_to(n);
    double s = 0;
    for (size_t i = 0; i < n; ++i) s += weight(i);
    return s;
  };
  // The kept tokens' weights summed: in rank order for a prefix, over the vocabulary in id
  // order (no sort) while every token is kept.
  double sum = -1;
  const auto kept_sum = [&] {
    if (sum >= 0) return sum;
    if (keep < vocab) return sum = prefix_sum(keep);
    sum = 0;
    for (float l : logits) sum += std::exp((double(l) - mx) / t);
    return sum;
  };
  if (opt_.top_p < 1.0f) {
    const double all = kept_sum();
    double cum = 0;
    size_t n = 0;
    while (n < keep) {
      sorted_to(n + 1);
      cum += weight(n) / all;
      ++n;
      if (cum >= double(opt_.top_p)) break;
    }
    if (n < keep) {
      keep = n;
      sum = -1;
    }
  }
  if (opt_.min_p > 0.0f) {
    // Weights fall with rank and the best is 1, so the cut is a prefix.
    size_t n = 1;
    while (n < keep) {
      sorted_to(n + 1);
      if (weight(n) < double(opt_.min_p)) break;
      ++n;
    }
    if (n < keep) {
      keep = n;
      sum = -1;
    }
  }
  kept_sum();
  // A uniform draw in [0, 1) from the top 53 bits: the same on every platform.
  double u = double(rng_() >> 11) * (1.0 / 9007199254740992.0) * sum;
  for (size_t i = 0; i < keep; ++i) {
    sorted_to(i + 1);
    const double w = weight(i);
    if (u < w) return order_[i];
    u -= w;
  }
  sorted_to(keep);
  return order_[keep - 1];
}

}  // namespace ts::runtime
