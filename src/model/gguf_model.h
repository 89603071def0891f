// A GGUF model file (llama.cpp's convert_hf_to_gguf / llama-quantize output) seen as what the
// rest of the engine loads from a Hugging Face directory: a config.json equivalent and the
// tensors under their Hub names, each a view into the mapped file.
//
// Architectures (general.architecture -> family; model/gguf_arch.h holds the table): qwen3moe,
// qwen2moe, olmoe, llama with {arch}.expert_count > 0 (Mixtral), deepseek2 (DeepSeek-V2 or
// V3 / Kimi-K2 by expert_gating_func), glm4moe, minimax-m2. Hyper-parameters come from the
// {arch}.* keys; sizes the tensors fix (vocab, expert / shared / dense hidden sizes, which
// layers have a router, q LoRA rank) from the tensors' shapes. Stacked expert tensors
// (blk.N.ffn_{gate,up,down}_exps, ggml dims [in, out, n_expert]) become one [out, in] view
// per expert; the older per-expert names (blk.N.ffn_gate.E.weight) are read too. llama.cpp's
// converter permutes the rows of a llama-arch attn_q / attn_k for its interleaved RoPE; those
// two are un-permuted into owned copies (a row permutation, so quantized rows move whole).
// It splits MLA's kv_b_proj into attn_k_b (each head's k rows transposed) and attn_v_b; the
// two are joined back into an owned kv_b_proj. Blocks past block_count - nextn_predict_layers
// (multi-token prediction) are skipped and named in the note.
//
// Tensor types: F32, F16, BF16, Q8_0 and Q4_K are read in place (the GGUF block layouts the
// kernels read as they are). Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K and Q6_K (K-quant
// mixes like Q4_K_M hold some) are requantized to Q8_0 at load into memory the set owns
// (model/ggml_dequant.h: ggml's reference dequantization, then Q8_0's quantization); such
// tensors are not in the file, so they cannot be streamed (a pack made from the file can).
// Any other type is an error naming the tensor and its type.
#pragma once

#include <memory>
#include <string>

#include "core/status.h"
#include "model/hparams.h"

namespace ts::io {
class TensorSet;
struct GgufFile;
}  // namespace ts::io

namespace ts::model {

struct GgufModel {
  HParams hp;                              // config_json through parse_hparams' checks
  std::string config_json;                 // what config.json would hold
  std::unique_ptr<io::TensorSet> tensors;  // Hub names
  std::string note;  // what was converted at load, for the user ("" when nothing was)
};

// Errors name the file and the key or tensor.
Result<GgufModel> open_gguf_model(const std::string& path);

}  // namespace ts::model
