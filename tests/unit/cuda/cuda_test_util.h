// What the CUDA tests share: whether a device is present, and the fixture models (the
// directories of tests/models with a ref.json and logits.npy).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace ts_test {

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// TS_TEST_DATA_DIR in the environment overrides the build-time path (the GPU machine runs
// binaries built elsewhere).
inline std::filesystem::path data_dir() {
  const char* env = std::getenv("TS_TEST_DATA_DIR");
  return std::filesystem::path(env && *env ? env : TS_TEST_DATA_DIR);
}

inline std::vector<std::string> fixture_names() {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(data_dir() / "models"))
    if (std::filesystem::exists(e.path() / "ref.json") &&
        std::filesystem::exists(e.path() / "logits.npy"))
      out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace ts_test
