// Checkpoints that stack a layer's routed experts in one tensor per kind (FamilyNames::
// stacked, gpt-oss's Hub layout) seen as the per-expert tensors of the table (tensor_specs.h):
// for each MoE layer and expert e,
//   experts.e.<gate>.weight [d_expert, d_model] = gate_up[e][:, 0::2]^T
//   experts.e.<up>.weight   [d_expert, d_model] = gate_up[e][:, 1::2]^T
//   experts.e.<down>.weight [d_model, d_expert] = down[e]^T
//   experts.e.<gate>.bias = gate_up_bias[e][0::2], <up>.bias = gate_up_bias[e][1::2],
//   experts.e.<down>.bias = down_bias[e]
// in the stacked tensors' dtype (F32, F16 or BF16: values move, none is rounded), in memory
// the set owns; the stacked tensors leave the set. Such copies are not in any file, so the
// streamed residency needs a pack of the checkpoint.
#pragma once

#include <string>

#include "core/status.h"
#include "model/hparams.h"

namespace ts::io {
class TensorSet;
}

namespace ts::model {

// Splits hp's family's stacked experts in `set`, where it has them; returns a note for the
// user ("" when the family does not stack its experts, or `set` already names each expert, as
// a pack does). Errors name the tensor: missing, of the wrong shape, or not a float dtype.
Result<std::string> unstack_experts(const HParams& hp, io::TensorSet& set);

}  // namespace ts::model
