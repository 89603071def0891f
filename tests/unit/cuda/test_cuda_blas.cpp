// cuBLAS is opened at run time (backend/cuda/blas.h), so a missing library must be a named
// error, and the binary must not need it to start.
#include <gtest/gtest.h>

#include "backend/cuda/blas.h"
#include "cuda_test_util.h"

namespace {

TEST(CudaBlas, MissingLibraryIsANamedError) {
  auto b = ts::cuda::open_blas("libcublas_does_not_exist.so.99");
  ASSERT_FALSE(b);
  EXPECT_NE(b.error().message.find("cannot load libcublas_does_not_exist.so.99"), std::string::npos)
      << b.error().message;
  EXPECT_NE(b.error().message.find("LD_LIBRARY_PATH"), std::string::npos);
}

TEST(CudaBlas, LibraryWithoutTheFunctionsIsANamedError) {
  // libc is loaded in every process and has none of cuBLAS's functions.
  auto b = ts::cuda::open_blas("libc.so.6");
  ASSERT_FALSE(b);
  EXPECT_EQ(b.error().message, "libc.so.6 has no function cublasCreate_v2");
}

TEST(CudaBlas, ToolkitLibraryResolvesEveryFunction) {
  // Needs the library, not a device: where the toolkit's cuBLAS is on the path (the build
  // machine, CI, the GPU machine), all six names resolve.
  auto b = ts::cuda::open_blas(ts::cuda::blas_soname());
  if (!b) GTEST_SKIP() << b.error().message;
  EXPECT_TRUE(b->create && b->destroy && b->set_stream && b->set_math_mode && b->sgemm &&
              b->gemm_ex);
}

TEST(CudaBlas, ToolkitLibraryLoadsWhereAGpuIs) {
  if (!ts_test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto b = ts::cuda::load_blas();
  ASSERT_TRUE(b) << b.error().message;
  const ts::cuda::Blas* p = *b;
  EXPECT_TRUE(p->create && p->destroy && p->set_stream && p->set_math_mode && p->sgemm &&
              p->gemm_ex);
  cublasHandle_t h = nullptr;
  ASSERT_EQ(p->create(&h), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(p->destroy(h), CUBLAS_STATUS_SUCCESS);
}

}  // namespace
