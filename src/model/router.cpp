#include "model/router.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/status.h"

namespace ts::model {
namespace {

// a ranks above b: the larger value, a number above NaN, equal values by lower id.
bool ranks_above(float a, int ia, float b, int ib) {
  if (std::isnan(b)) return !std::isnan(a) || ia < ib;
  if (std::isnan(a)) return false;
  return a > b || (a == b && ia < ib);
}

}  // namespace

void select_experts(std::span<const float> logits, std::span<const float> bias,
                    const RouterSpec& spec, Selection out) {
  const size_t n = logits.size(), k = out.ids.size();
  TS_CHECK(k >= 1 && k <= n && out.weights.size() == k, "select_experts: bad top_k");
  TS_CHECK(!spec.correction_bias || bias.size() == n, "select_experts: bias size");
  std::vector<float> p(n);
  if (spec.scoring == ScoreFn::kSoftmax) {
    float mx = -INFINITY;
    for (float v : logits) mx = std::max(mx, v);
    float sum = 0;
    for (size_t i = 0; i < n; ++i) {
      p[i] = std::exp(logits[i] - mx);
      sum += p[i];
    }
    for (float& v : p) v /= sum;
  } else if (spec.scoring == ScoreFn::kSigmoid) {
    for (size_t i = 0; i < n; ++i) p[i] = 1.0f / (1.0f + std::exp(-logits[i]));
  } else {
    p.assign(logits.begin(), logits.end());  // ranked as they are; weighed below
  }
  std::vector<float> choice(p);
  if (spec.correction_bias)
    for (size_t i = 0; i < n; ++i) choice[i] += bias[i];

  // Groups: all but the topk_group best are made ineligible.
  std::vector<bool> taken(n, false);
  if (spec.n_group > 1) {
    const size_t g_n = size_t(spec.n_group), g_size = n / g_n;
    std::vector<float> g_score(g_n);
    for (size_t g = 0; g < g_n; ++g) {
      float first = -INFINITY, second = -INFINITY;
      for (size_t i = g * g_size; i < (g + 1) * g_size; ++i) {
        const float v = choice[i];
        if (v > first || std::isnan(v)) {
          second = first;
          first = v;
        } else if (v > second) {
          second = v;
        }
      }
      g_score[g] = spec.group_score == GroupScore::kMax ? first : first + second;
    }
    std::vector<bool> g_taken(g_n, false);
    for (int r = 0; r < spec.topk_group; ++r) {
      size_t best = g_n;
      for (size_t g = 0; g < g_n; ++g)
        if (!g_taken[g] &&
            (best == g_n || ranks_above(g_score[g], int(g), g_score[best], int(best))))
          best = g;
      g_taken[best] = true;
    }
    for (size_t g = 0; g < g_n; ++g)
      if (!g_taken[g])
        for (size_t i = g * g_size; i < (g + 1) * g_size; ++i) taken[i] = true;
  }
  // Partial selection sort: k is small (<= 16 in practice), n up to a few hundred.
  for (size_t r = 0; r < k; ++r) {
    size_t best = n;
    for (size_t i = 0; i < n; ++i)
      if (!taken[i] && (best == n || ranks_above(choice[i], int(i), choice[best], int(best))))
        best = i;
    TS_CHECK(best < n, "select_experts: fewer eligible experts than top_k");
    taken[best] = true;
    out.ids[r] = int(best);
    out.weights[r] = p[best];
  }
  if (spec.scoring == ScoreFn::kTopkSoftmax) {
    // transformers' GptOssTopKRouter: softmax over the k chosen logits (the first is the max).
    const float mx = out.weights[0];
    float sum = 0;
    for (float& w : out.weights) {
      w = std::exp(w - mx);
      sum += w;
    }
    for (float& w : out.weights) w /= sum;
  }
  if (spec.renormalize) {
    float s = 0;
    for (float w : out.weights) s += w;
    // The sigmoid routers add 1e-20 to the sum (transformers); softmax ones do not.
    if (spec.scoring == ScoreFn::kSigmoid) s += 1e-20f;
    for (float& w : out.weights) w /= s;
  }
  if (spec.scale != 1.0f)
    for (float& w : out.weights) w *= spec.scale;
}

}  // namespace ts::model
