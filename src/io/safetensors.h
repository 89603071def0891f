// Safetensors reading: one file, or a sharded checkpoint through model.safetensors.index.json.
//
// File layout: u64 little-endian header length N, then N bytes of JSON
//   {"__metadata__": {...}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...}
// then the data area; offsets are relative to the data area start (8 + N).
// Invariants checked on open (each failure is an Error naming the file and tensor):
//   N <= file size - 8; the header is valid JSON of that form; dtype is known; every
//   [b, e) lies inside the data area, e - b == product(shape) * dtype size, and no two
//   tensors' ranges overlap.
//
// Extension (ours, not the safetensors format): dtypes "Q8_0" and "Q4_K" hold GGUF's
// block-quantized layouts (core/dtype.h, backend/cpu/quant.h). Only `turbospark pack`
// writes them, into a pack's dense.safetensors; other tools will refuse such a file. Their
// shape is the logical [rows, cols] (2-D, cols a whole number of 32 / 256-weight blocks)
// and e - b == rows * dtype_row_bytes(dtype, cols).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "io/mapped_file.h"

namespace ts::io {

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // inside a MappedFile owned by the TensorSet
  size_t n_bytes = 0;
  std::string file;  // path of the file holding it
  uint64_t file_offset = 0;  // byte offset of data in that file (for pread-based streaming)
  bool owned = false;        // data is a rearranged or converted copy in memory, not in `file`
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// All tensors of a checkpoint directory (or of one file), memory-mapped.
class TensorSet {
 public:
  // A directory: model.safetensors.index.json if present (every shard it names must exist
  // and hold the tensors the index maps to it), else model.safetensors, else all
  // *.safetensors files in name order. Error if the directory is missing or holds none.
  static Result<std::unique_ptr<TensorSet>> open_dir(const std::string& dir);
  // A single .safetensors file.
  static Result<std::unique_ptr<TensorSet>> open_file(const std::string& path);

  // nullptr when absent.
  const TensorView* find(const std::string& name) const;
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  // Sum of the sizes of the mapped files.
  uint64_t file_bytes() const;
  // Adds tensors that live in another mapped file (a pack's expert file), taking ownership
  // of the mapping. The caller has checked each view lies inside the file. Error on a name
  // that is already present.
  Status add_mapped(std::unique_ptr<MappedFile> file, std::vector<TensorView> views);
  // Adds tensors whose bytes live in `bytes` (a rearranged copy of a file's tensor), taking
  // ownership. Their `file` names where the bytes came from; they are not streamable.
  Status add_owned(std::unique_ptr<uint8_t[]> bytes, std::vector<TensorView> views);
  // Removes a tensor from the set's index (one rearranged into owned copies, so that nothing
  // reads or packs it twice); its file stays mapped. No-op when absent.
  void drop(const std::string& name) { tensors_.erase(name); }

 private:
  Status add_file(const std::string& path);
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::vector<std::unique_ptr<uint8_t[]>> owned_;
  std::map<std::string, TensorView> tensors_;
};

// Parses a safetensors dtype string ("F32", "F16", "BF16", and our pack-internal "Q8_0",
// "Q4_K"); error for anything else.
Result<DType> parse_safetensors_dtype(const std::string& s);

// Writes a safetensors file (tensors in the given order, 8-byte aligned data), via a
// temporary file renamed into place so a failure leaves no partial file.
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;
  size_t n_bytes;
};
Status write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors);

}  // namespace ts::io
