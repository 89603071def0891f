// Expert selection from router logits: softmax over all experts (F32) -> top-k -> optional
// renormalisation. The result is in rank order (highest weight first; equal weights by lower
// expert id), and that order is the order in which routed outputs are summed (DESIGN.md:
// rank-order invariant). Computed once per token by this one function.
#pragma once

#include <span>

#include "model/hparams.h"

namespace ts::model {

struct Selection {
  std::span<int> ids;        // [top_k], rank order
  std::span<float> weights;  // [top_k]
};

// logits: [n_experts]. ids/weights: [top_k]. Precondition: 1 <= top_k <= n_experts.
void select_experts(std::span<const float> logits, const MoeOptions& opt, Selection out);

}  // namespace ts::model
