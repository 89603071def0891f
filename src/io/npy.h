// NumPy .npy (format 1.0) float32 little-endian C-order arrays: write and read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace ts::io {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// Writes via a temporary file renamed into place: a failure leaves no partial output.
Status write_npy_f32(const std::string& path, const std::vector<int64_t>& shape,
                     const float* data);
// Reads '<f4' C-order arrays; errors name the path and what was wrong.
Result<NpyArray> read_npy_f32(const std::string& path);

}  // namespace ts::io
