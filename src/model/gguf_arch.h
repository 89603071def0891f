// The GGUF architectures a model file may name (general.architecture) and, for each, how its
// {arch}.* metadata and the facts its tensors fix become the config.json keys of the family
// it stands for. What differs between architectures lives here, as table fields and one
// config function each; model/gguf_model.cpp maps the tensors and writes the shared keys.
//
// The metadata is read as llama.cpp (de3ff81) reads it (src/models/<arch>.cpp
// load_arch_hparams), except where llama.cpp departs from the checkpoint the file was
// converted from; those departures are named at the function that makes them.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "io/gguf.h"
#include "model/hparams.h"

namespace ts::model::gguf {

using json = nlohmann::ordered_json;

// The {arch}.* metadata through GgufFile's typed accessors; errors name the file and the key.
struct Meta {
  const io::GgufFile& g;
  const std::string& path;
  std::string arch;

  Error err(const std::string& key, const std::string& what) const {
    return make_error(path + ": metadata '" + key + "' " + what);
  }
  std::string k(const std::string& key) const { return arch + "." + key; }

  // A required positive integer (a count or a size) `{arch}.key`.
  Result<int64_t> integer(const std::string& key) const;
  // Optional ones; a present value must be in [0, 2^30].
  Result<std::optional<int64_t>> opt_integer(const std::string& key) const;
  Result<std::optional<double>> opt_number(const std::string& key) const;
  Result<std::optional<bool>> opt_boolean(const std::string& key) const;
};

// What the tensors fix, gathered while gguf_model.cpp maps them.
struct TensorFacts {
  int64_t vocab = 0;
  int64_t d_expert = 0;  // a routed expert's hidden size (ffn_*_exps)
  int64_t d_shared = 0;  // rows of ffn_gate_shexp
  int64_t d_ff = 0;      // rows of a dense layer's ffn_gate
  int64_t q_lora = 0;    // rows of attn_q_a (MLA's q LoRA); 0 when the file has none
  bool has_output = false;
  bool qkv_bias = false;         // attn_q.bias
  bool probs_b = false;          // exp_probs_b.bias (a router correction bias)
  bool q_norm = false;           // attn_q_norm.weight
  std::vector<bool> has_router;  // [n_layers]: ffn_gate_inp present
};

struct ArchInput {
  const Meta& m;
  const TensorFacts& t;
  int64_t n_layers;  // block_count less the multi-token-prediction blocks
  int64_t n_heads;
  int64_t d_model;
};

struct GgufArch {
  std::string_view arch;  // general.architecture
  Family names;           // the family whose FamilyNames the Hub tensor names follow
  const char* ffn_norm;   // GGUF name (after blk.N.) of the norm before the FFN
  bool permuted_qk;       // the converter permutes attn_q / attn_k rows (LlamaModel.permute)
  bool yarn;              // rope.scaling.type 'yarn' is read (else refused)
  // The name also covers dense models (llama): expert_count says which, so it is checked
  // before anything else.
  bool names_dense_models;
  // Writes model_type and the family's keys: attention shape, FFN sizes, router.
  Status (*config)(const ArchInput& in, json& cfg);
};

const GgufArch* find_arch(std::string_view arch);
std::string supported_archs();

}  // namespace ts::model::gguf
