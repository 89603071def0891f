// GGUF (ggml's single-file container, versions 2 and 3, little-endian): a strict reader of the
// header, the metadata and the tensor table; llama.cpp control vectors on top of it, and
// models (model/gguf_model.h). Tensors of the ggml types whose block size this reader knows
// (ggml_type_block) are accepted and bounds-checked; what a consumer can compute with is its
// own check. Layout in gguf.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "core/status.h"
#include "io/mapped_file.h"

namespace ts::io {

// gguf_type, as stored (u32).
enum class GgufType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

struct GgufValue {
  GgufType type = GgufType::kU8;
  // Scalars: the value (integers widened, floats as double). Arrays: monostate; their
  // elements are validated and skipped, only the element type and count are kept.
  std::variant<std::monostate, int64_t, uint64_t, double, bool, std::string> value;
  GgufType array_type = GgufType::kU8;
  uint64_t array_len = 0;
  uint64_t array_pos = 0;  // file offset of the first element (validated by read_gguf)
};

// ggml tensor types by id (ggml.h's enum ggml_type; the ones MoE checkpoints use).
constexpr uint32_t kGgmlF32 = 0, kGgmlF16 = 1, kGgmlQ4_0 = 2, kGgmlQ8_0 = 8, kGgmlQ4_K = 12,
                   kGgmlQ5_K = 13, kGgmlQ6_K = 14, kGgmlBF16 = 30;
// "Q6_K", "BF16", ...; "type N" for an id this reader does not name.
std::string ggml_type_name(uint32_t type);
// Elements and bytes per block (1 and the element size for float types); false for a type
// whose layout this reader does not know.
bool ggml_type_block(uint32_t type, int64_t* block_elems, uint64_t* block_bytes);

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> dims;  // ggml order: dims[0] is the contiguous (fastest) one
  uint32_t ggml_type = 0;     // a type ggml_type_block knows
  uint64_t offset = 0;        // from the start of the data section, a multiple of alignment
  int64_t numel = 0;
  uint64_t n_bytes = 0;  // dims[0] is a whole number of blocks
};

struct GgufFile {
  std::unique_ptr<MappedFile> file;
  uint32_t version = 0;
  uint32_t alignment = 32;                            // general.alignment, default 32
  uint64_t data_offset = 0;                           // absolute offset of the data section
  std::vector<std::pair<std::string, GgufValue>> kv;  // file order
  std::vector<GgufTensorInfo> tensors;                // file order

  const GgufValue* find(std::string_view key) const;
  const GgufTensorInfo* tensor(std::string_view name) const;
  // The tensor's values (bounds were checked by read_gguf); the tensor must be F32.
  std::vector<float> f32(const GgufTensorInfo& t) const;
  const uint8_t* tensor_data(const GgufTensorInfo& t) const {
    return file->data() + data_offset + t.offset;
  }
  // A scalar value of the key, nullopt when the key is absent; an error naming the file and
  // the key when it has another type. Integers of any width (a u64 above INT64_MAX saturates);
  // numbers are integers or floats.
  Result<std::optional<int64_t>> integer(std::string_view key) const;
  Result<std::optional<double>> number(std::string_view key) const;
  Result<std::optional<std::string>> string(std::string_view key) const;
  Result<std::optional<bool>> boolean(std::string_view key) const;
  // The elements of an array value: strings; numbers of any integer or float type (as
  // double). Error naming the key if `key` is absent or not such an array.
  Result<std::vector<std::string>> strings(std::string_view key) const;
  Result<std::vector<double>> numbers(std::string_view key) const;
};

// A regular file that starts with the GGUF magic (a model path may be a directory or this).
bool is_gguf_file(const std::string& path);

// Reads and validates everything but the tensor values: magic, version, counts against the
// file size, every string and array length, value types, duplicate keys and tensor names,
// general.alignment (u32, a power of two), dims, tensor type (known block layout, dims[0] a
// whole number of blocks), offsets (aligned, inside the file, not overlapping). Errors name the
// path and the field, key or tensor.
Result<GgufFile> read_gguf(const std::string& path);

// A llama.cpp control vector (what llama-cvector-generator writes, --control-vector reads):
// metadata general.architecture = "controlvector", controlvector.model_hint (string) and
// controlvector.layer_count (integer), and one F32 tensor "direction.N" of shape [n_embd] per
// steered layer, N >= 1. llama.cpp adds direction.N to the output of its block N (0-based):
// after that block's FFN residual add (build_cvec, before "l_out"), which is the point where
// our layer_boundary(N) acts; so direction.N steers our layer N. Block 0 has no direction.
struct ControlVector {
  std::string model_hint;                                      // "" when absent
  int64_t layer_count = -1;                                    // -1 when absent
  std::vector<std::pair<int, std::vector<float>>> directions;  // ascending N, each [n_embd]
};

// Every tensor must be a direction.N (decimal N >= 1, no sign or leading zeros) holding
// n_embd finite F32 values; there must be at least one.
Result<ControlVector> read_control_vector(const std::string& path, int64_t n_embd);

}  // namespace ts::io
