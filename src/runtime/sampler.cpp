#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <vector>

#include "core/thread_pool.h"

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

namespace {
// A uniform draw in [0, 1) from the top 53 bits: the same on every platform.
double uniform(std::mt19937_64& rng) { return double(rng() >> 11) * (1.0 / 9007199254740992.0); }

// Passes over the vocabulary run in kChunks fixed ranges (ThreadPool::fixed_chunks): the same
// bits for any thread count.
constexpr int kChunks = 16;

// argmax(logits) (the first of the largest; 0 where logits[0] is NaN) and, with kLowest, the
// lowest finite logit (the largest where none is lower; else +inf), by ranges.
template <bool kLowest>
std::pair<int, double> best_and_lowest(std::span<const float> v, ThreadPool* pool) {
  int best_at[kChunks];
  double low_at[kChunks];
  ThreadPool::fixed_chunks(pool, v.size(), kChunks, [&](size_t i0, size_t i1, int c) {
    int best = -1;  // the first of the chunk's largest, NaN skipped
    double low = INFINITY;
    for (size_t i = i0; i < i1; ++i) {
      if (std::isnan(v[i])) continue;
      if (best < 0 || v[i] > v[size_t(best)]) best = int(i);
      if constexpr (kLowest)
        if (std::isfinite(v[i])) low = std::min(low, double(v[i]));
    }
    best_at[c] = best;
    low_at[c] = low;
  });
  int best = -1;
  double low = INFINITY;
  for (int c = 0; c < kChunks; ++c) {
    if (best_at[c] >= 0 && (best < 0 || v[size_t(best_at[c])] > v[size_t(best)])) best = best_at[c];
    low = std::min(low, low_at[c]);
  }
  if (best < 0 || std::isnan(v[0])) best = 0;
  return {best, std::min(low, double(v[size_t(best)]))};
}
}  // namespace

// Tokens go in descending logit order (ties: lower id first); the weights are
// exp((logit - max) / T), the best 1. The cuts keep a prefix of that order and the draw walks
// it. A vocabulary of 152k sorted whole took ~20 ms a draw where a GPU decode step takes ~2.5
// (docs/PERF.md), so the order is built only where it is looked at: with top-k, by a partial
// sort of the best k; without, the tokens are binned by max - logit (kBins equal bins over the
// finite range; -inf and NaN in the last), every bin ranking below the ones before it, and a
// walk over whole bins steps by their summed weight, sorting only the bin it stops in.
int Sampler::pick(std::span<const float> logits) {
  // Large vocabularies by ranges on the pool; small ones are not worth its wake-up.
  constexpr size_t kPoolFrom = 32768;
  ThreadPool* const pool =
      logits.size() >= kPoolFrom && pool_ && pool_->size() > 1 ? pool_ : nullptr;
  if (opt_.temperature <= 0.0f)
    return pool ? best_and_lowest<false>(logits, pool).first : argmax(logits);
  const auto by_logit = [&](int a, int b) {
    return logits[size_t(a)] > logits[size_t(b)] ||
           (logits[size_t(a)] == logits[size_t(b)] && a < b);
  };
  const size_t vocab = logits.size();
  const double t = double(opt_.temperature);
  double mx = 0;  // the best logit
  const auto weight_of = [&](int id) { return std::exp((double(logits[size_t(id)]) - mx) / t); };
  order_.resize(vocab);

  if (opt_.top_k > 0 && size_t(opt_.top_k) < vocab) {
    size_t keep = size_t(opt_.top_k);
    std::iota(order_.begin(), order_.end(), 0);
    std::partial_sort(order_.begin(), order_.begin() + long(keep), order_.end(), by_logit);
    mx = logits[size_t(order_[0])];
    std::vector<double>& p = weights_;
    p.resize(keep);
    double sum = 0;
    for (size_t i = 0; i < keep; ++i) sum += p[i] = weight_of(order_[i]);
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
      size_t n = 1;
      while (n < keep && p[n] >= double(opt_.min_p)) ++n;
      keep = n;
      sum = std::accumulate(p.begin(), p.begin() + long(keep), 0.0);
    }
    double u = uniform(rng_) * sum;
    for (size_t i = 0; i < keep; ++i) {
      if (u < p[i]) return order_[i];
      u -= p[i];
    }
    return order_[keep - 1];
  }

  // Bins: bin b holds max - logit in [b, b + 1) * width; start[b] is its first rank; the
  // passes over the vocabulary by ranges (ThreadPool::fixed_chunks).
  constexpr int kBins = 1024;

  const auto [best, lo] = best_and_lowest<true>(logits, pool);
  mx = logits[size_t(best)];
  const double width = mx > lo ? (mx - lo) / (kBins - 1) : 1.0;
  bins_.resize(vocab);
  std::vector<uint32_t>& count = chunk_count_;   // [chunk][bin]
  std::vector<double>& chunk_w = chunk_weight_;  // [chunk][bin]
  count.assign(size_t(kChunks) * kBins, 0);
  chunk_w.assign(size_t(kChunks) * kBins, 0.0);
  double chunk_total[kChunks] = {};
  ThreadPool::fixed_chunks(pool, vocab, kChunks, [&](size_t i0, size_t i1, int c) {
    uint32_t* n = &count[size_t(c) * kBins];
    double* cw = &chunk_w[size_t(c) * kBins];
    double sum = 0;
    for (size_t i = i0; i < i1; ++i) {
      const double d = (mx - double(logits[i])) / width;
      const int b = d < double(kBins - 1) ? int(d) : kBins - 1;  // -inf, NaN: the last bin
      bins_[i] = uint16_t(b);
      ++n[b];
      const double w = weight_of(int(i));
      cw[b] += w;
      sum += w;
    }
    chunk_total[c] = sum;
  });
  std::vector<uint32_t>& start = bin_start_;
  std::vector<double>& bin_w = bin_weight_;
  std::vector<uint32_t>& at = bin_fill_;  // [chunk][bin]: where the chunk's next id goes
  start.assign(kBins + 1, 0);
  bin_w.assign(kBins, 0.0);
  at.resize(size_t(kChunks) * kBins);
  double total = 0;
  for (int c = 0; c < kChunks; ++c) total += chunk_total[c];
  for (int b = 0; b < kBins; ++b) {
    uint32_t run = start[size_t(b)];
    for (int c = 0; c < kChunks; ++c) {
      at[size_t(c) * kBins + size_t(b)] = run;
      run += count[size_t(c) * kBins + size_t(b)];
      bin_w[size_t(b)] += chunk_w[size_t(c) * kBins + size_t(b)];
    }
    start[size_t(b) + 1] = run;
  }
  // Each bin's ids in id order.
  ThreadPool::fixed_chunks(pool, vocab, kChunks, [&](size_t i0, size_t i1, int c) {
    uint32_t* next = &at[size_t(c) * kBins];
    for (size_t i = i0; i < i1; ++i) order_[next[bins_[i]]++] = int(i);
  });
  std::vector<bool>& sorted = bin_sorted_;
  sorted.assign(kBins, false);
  const auto sort_bin = [&](int b) {
    if (sorted[size_t(b)]) return;
    std::sort(order_.begin() + start[size_t(b)], order_.begin() + start[size_t(b) + 1], by_logit);
    sorted[size_t(b)] = true;
  };
  const auto bin_of_rank = [&](size_t r) {
    return int(std::upper_bound(start.begin(), start.end(), uint32_t(r)) - start.begin()) - 1;
  };
  // Sum of the first n ranks' weights: whole bins by their sums, the last one rank by rank.
  const auto prefix_sum = [&](size_t n) {
    if (n >= vocab) return total;
    double sum = 0;
    const int last = bin_of_rank(n);
    for (int b = 0; b < last; ++b) sum += bin_w[size_t(b)];
    sort_bin(last);
    for (size_t r = start[size_t(last)]; r < n; ++r) sum += weight_of(order_[r]);
    return sum;
  };
  size_t keep = vocab;
  double sum = total;
  if (opt_.top_p < 1.0f) {
    double cum = 0;
    size_t n = vocab;
    for (int b = 0; b < kBins && n == vocab; ++b) {
      if (start[size_t(b)] == start[size_t(b) + 1]) continue;
      if (cum + bin_w[size_t(b)] / total < double(opt_.top_p)) {
        cum += bin_w[size_t(b)] / total;
        continue;
      }
      sort_bin(b);
      for (size_t r = start[size_t(b)]; r < start[size_t(b) + 1]; ++r) {
        cum += weight_of(order_[r]) / total;
        if (cum >= double(opt_.top_p)) {
          n = r + 1;
          break;
        }
      }
    }
    keep = n;
    sum = prefix_sum(keep);
  }
  if (opt_.min_p > 0.0f) {
    // Weights fall with rank and the best is 1, so the cut is a prefix. A bin whose every
    // weight is surely >= min_p (its far edge's, with a margin for rounding) is passed whole;
    // not the last, which has no far edge (-inf).
    size_t n = 1;
    for (int b = 0; b < kBins && n < keep; ++b) {
      const size_t end = std::min<size_t>(start[size_t(b) + 1], keep);
      if (end <= n) continue;
      if (b < kBins - 1 && std::exp(-(double(b) + 1.0) * width / t - 1e-9) >= double(opt_.min_p)) {
        n = end;
        continue;
      }
      sort_bin(b);
      while (n < end && weight_of(order_[n]) >= double(opt_.min_p)) ++n;
      if (n < end) break;
    }
    if (n < keep) {
      keep = n;
      sum = prefix_sum(keep);
    }
  }
  double u = uniform(rng_) * sum;
  for (int b = 0; b < kBins && start[size_t(b)] < keep; ++b) {
    const size_t end = start[size_t(b) + 1];
    if (end <= keep && u >= bin_w[size_t(b)]) {
      u -= bin_w[size_t(b)];
      continue;
    }
    sort_bin(b);
    for (size_t r = start[size_t(b)]; r < std::min(end, keep); ++r) {
      const double w = weight_of(order_[r]);
      if (u < w) return order_[r];
      u -= w;
    }
  }
  // Past the end only by the sums' rounding: the last kept token that has a weight.
  for (size_t r = keep; r-- > 1;) {
    sort_bin(bin_of_rank(r));
    if (weight_of(order_[r]) > 0) return order_[r];
  }
  sort_bin(0);
  return order_[0];
}

}  // namespace ts::runtime
