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

}  // namespace ts_test
