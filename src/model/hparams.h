// Model hyper-parameters read from a Hugging Face config.json. Family differences that the
// forward pass needs are data here (QkNorm, MoeOptions), never `if (family == ...)` in the
// shared layers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace ts::model {

enum class Family : uint8_t { kMixtral, kQwen2Moe, kQwen3Moe, kOlmoe };

// Where q/k RMSNorm is applied, if anywhere.
enum class QkNorm : uint8_t {
  kNone,
  kPerHead,         // qwen3_moe: over each head's head_dim, weight [head_dim]
  kFullProjection,  // olmoe: over the whole q (k) projection, weight [n_heads * head_dim]
};

struct MoeOptions {
  bool renormalize = false;  // divide the top-k softmax weights by their sum
};

struct HParams {
  Family family = Family::kMixtral;
  std::string model_type;
  int d_model = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int vocab = 0;
  int n_experts = 0;
  int top_k = 0;
  int d_expert = 0;        // routed expert hidden size
  int d_ff = 0;            // dense MLP hidden size (layers without experts), 0 if none
  int d_shared = 0;        // shared expert hidden size, 0 if none
  bool shared_expert_gate = false;  // sigmoid gate on the shared expert (qwen2_moe)
  bool qkv_bias = false;
  QkNorm qk_norm = QkNorm::kNone;
  MoeOptions moe;
  float rms_eps = 1e-6f;
  float rope_theta = 10000.0f;
  int max_positions = 0;
  bool tie_word_embeddings = false;
  std::vector<bool> layer_is_moe;  // [n_layers]

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
};

std::string_view family_name(Family f);

// Reads DIR/config.json. Errors name the file and the key.
Result<HParams> load_hparams(const std::string& dir);
// Parses config.json text; `source` names it in errors.
Result<HParams> parse_hparams(const std::string& json_text, const std::string& source);

}  // namespace ts::model
