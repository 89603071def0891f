// GGUF (ggml's single-file container, versions 2 and 3, little-endian): a strict reader of the
// header, the metadata and the tensor table, and llama.cpp control vectors on top of it.
// Only F32 tensors are accepted: control vectors are F32, and a reader that cannot size a
// quantized tensor cannot check that it lies inside the file. Layout in gguf.cpp.
#pragma once

#include <cstdint>
#include <memory>
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
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> dims;  // ggml order: dims[0] is the contiguous (fastest) one
  uint32_t ggml_type = 0;     // always 0 = GGML_TYPE_F32 after read_gguf
  uint64_t offset = 0;        // from the start of the data section, a multiple of alignment
  int64_t numel = 0;
};

struct GgufFile {
  std::unique_ptr<MappedFile> file;
  uint32_t version = 0;
  uint32_t alignment = 32;                            // general.alignment, default 32
  uint64_t data_offset = 0;                           // absolute offset of the data section
  std::vector<std::pair<std::string, GgufValue>> kv;  // file order
  std::vector<GgufTensorInfo> tensors;                // file order

  const GgufValue* find(std::string_view key) const;
  // The tensor's values (bounds were checked by read_gguf).
  std::vector<float> f32(const GgufTensorInfo& t) const;
};

// Reads and validates everything but the tensor values: magic, version, counts against the
// file size, every string and array length, value types, duplicate keys and tensor names,
// general.alignment (u32, a power of two), dims, tensor type (F32 only), offsets (aligned,
// inside the file, not overlapping). Errors name the path and the field, key or tensor.
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
