// Expert selection from router logits by a RouterSpec — the one reference every backend is
// tested against:
//  scores   softmax over all experts, a sigmoid per expert, or (kTopkSoftmax) the logits;
//  choice   scores + the correction bias (selection only); with groups, only experts of the
//           topk_group best groups (a group scored by its best choice score, or the sum of its
//           two best) are eligible; the top_k eligible choice scores win;
//  weights  the winners' unbiased scores (kTopkSoftmax: a softmax over the winners' logits),
//           renormalised to sum 1 if asked, times scale.
// The result is in rank order (highest choice score first; equal scores by lower expert id),
// and that order is the order in which routed outputs are summed (DESIGN.md: rank-order
// invariant). A NaN score never wins a rank while a number is left.
#pragma once

#include <span>

#include "model/hparams.h"

namespace ts::model {

struct Selection {
  std::span<int> ids;        // [top_k], rank order
  std::span<float> weights;  // [top_k]
};

// logits: [n_experts]. bias: [n_experts] when spec.correction_bias, else empty.
// ids/weights: [top_k]. Precondition: 1 <= top_k <= the eligible experts (parse_hparams checks).
void select_experts(std::span<const float> logits, std::span<const float> bias,
                    const RouterSpec& spec, Selection out);

}  // namespace ts::model
