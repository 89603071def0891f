// What the CUDA tests share: whether a device is present, and (test_data.h) the fixture
// models and where the test data is.
#pragma once

#include <cuda_runtime.h>

#include "../test_data.h"

namespace ts_test {

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// The fixtures whose layer kinds the CUDA backend runs (GQA attention: the Llama-style
// families, GLM-4.5, MiniMax-M2); the others (MLA; gpt-oss's sinks, sliding windows, clamped
// SwiGLU and biases) it refuses, which
// CudaErrors.LayerKindsItDoesNotRunAreRefusedByName checks.
inline bool cuda_runs_fixture(const std::string& name) {
  for (const char* family : {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "minimax_m2"})
    if (name.rfind(family, 0) == 0) return true;
  return false;
}
inline std::vector<std::string> cuda_fixture_names() {
  std::vector<std::string> out;
  for (const std::string& name : fixture_names())
    if (cuda_runs_fixture(name)) out.push_back(name);
  return out;
}

}  // namespace ts_test
