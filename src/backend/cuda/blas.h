// cuBLAS, loaded when the first CUDA session starts rather than linked: the library (and the
// ~500 MB cuBLASLt it pulls in) costs every process ~0.5 s of static initialization at start,
// which CPU-only commands (tokenize, generate on the CPU, the tests) should not pay. The
// backend calls six functions; they are resolved by name from the soname of the toolkit the
// code was compiled against (libcublas.so.<CUBLAS_VER_MAJOR>).
#pragma once

#include <cublas_v2.h>

#include <string>

#include "core/status.h"

namespace ts::cuda {

struct Blas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  // cublasGemmEx is overloaded in C++ (a wrapper taking a cudaDataType compute type).
  using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                    int, const void*, const void*, cudaDataType, int, const void*,
                                    cudaDataType, int, const void*, void*, cudaDataType, int,
                                    cublasComputeType_t, cublasGemmAlgo_t);
  GemmEx gemm_ex = nullptr;
};
// The library's own overload has exactly this type: the cast compiles only if one does
// (unevaluated, so the symbol itself is not referenced).
static_assert(sizeof(static_cast<Blas::GemmEx>(&cublasGemmEx)) > 0);

// The soname the code was compiled against: libcublas.so.<CUBLAS_VER_MAJOR>.
std::string blas_soname();

// Opens `soname` and resolves the functions (the library is never closed), or an error naming
// the library and why it could not be opened, or the first function it lacks.
Result<Blas> open_blas(const std::string& soname);

// open_blas(blas_soname()), once per process; later calls return the same functions or error.
Result<const Blas*> load_blas();

}  // namespace ts::cuda
