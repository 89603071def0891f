// A family is a description: the config keys that set its HParams (attention, rope, router,
// layer schedule) and the checkpoint names of its tensors. Everything else — binding,
// synth, byte counts, pack, the backends — reads the HParams and names it produces.
#pragma once

#include <span>
#include <string_view>

#include "core/status.h"
#include "model/config_reader.h"
#include "model/hparams.h"

namespace ts::model {

// A checkpoint that stores a layer's routed experts as one tensor per kind (gpt-oss), names
// below `<moe_block>.experts.`: gate_up [n_experts, d_model, 2 * d_expert] (x @ W, gate and up
// interleaved by column: gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...), gate_up_bias
// [n_experts, 2 * d_expert] (interleaved alike), down [n_experts, d_expert, d_model] (h @ W),
// down_bias [n_experts, d_model]. model/stacked_experts.h splits them into the per-expert
// tensors of the table at load.
struct StackedExperts {
  const char* gate_up;
  const char* gate_up_bias;
  const char* down;
  const char* down_bias;
};

// Checkpoint (Hub) tensor names that differ between families; paths below a layer's MoE block.
struct FamilyNames {
  const char* moe_block = "mlp";  // "mlp" or "block_sparse_moe"
  const char* router = "gate";    // gpt-oss: "router"
  const char* expert_gate = "gate_proj";
  const char* expert_up = "up_proj";
  const char* expert_down = "down_proj";
  const char* correction_bias = "gate.e_score_correction_bias";
  const char* shared = "shared_expert";  // qwen2_moe; DeepSeek / GLM: "shared_experts"
  const StackedExperts* stacked = nullptr;  // null: each expert's matrices are named
};

struct FamilyDef {
  std::string_view name;  // HParams::family's name (pack manifests, inspect)
  std::span<const std::string_view> model_types;  // config.json model_type values
  Family family;
  FamilyNames names;
  // Reads the family's own keys after the common ones (hparams.cpp) are in hp.
  Status (*parse)(const ConfigReader& c, HParams& hp);
};

std::span<const FamilyDef* const> all_families();
const FamilyDef& family_def(Family f);
const FamilyDef* find_family(std::string_view model_type);

// Shared pieces of the families' parsers.
// "num_local_experts" (Mixtral, MiniMax-M2, some Qwen exports) where present, else "num_experts".
inline std::string experts_key(const ConfigReader& c) {
  return c.has("num_local_experts") ? "num_local_experts" : "num_experts";
}
// The routed experts' count and top-k from `experts_key`, checked against each other.
Status read_expert_counts(const ConfigReader& c, HParams& hp, const std::string& key);
// Layers before first_k_dense_replace (and those of mlp_only_layers / decoder_sparse_step,
// when the family has them) are dense, reading d_ff from intermediate_size.
Status mark_dense_lead_layers(const ConfigReader& c, HParams& hp);
// The sigmoid router with a correction bias of DeepSeek-V3, GLM-4.5 and MiniMax-M2; the
// defaults stand for absent keys (n_group, topk_group, routed_scaling_factor).
struct RouterDefaults {
  int n_group = 1;
  int topk_group = 1;
  double scale = 1.0;
};
Status read_sigmoid_router(const ConfigReader& c, HParams& hp, RouterDefaults defaults = {});

}  // namespace ts::model
