#include <dlfcn.h>

#include <vector>

#include "backend/cuda/blas.h"

namespace ts::cuda {
namespace {

template <class F>
void resolve(void* lib, const char* name, F& f, std::string& missing) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (!f && missing.empty()) missing = name;
}

}  // namespace

std::string blas_soname() { return "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR); }

Result<Blas> open_blas(const std::string& soname) {
  // The loader's search first (LD_LIBRARY_PATH, ld.so.cache), then the build's toolkit.
  std::vector<std::string> tried = {soname};
#ifdef TS_CUDA_LIB_DIR
  if (soname.find('/') == std::string::npos)
    tried.push_back(std::string(TS_CUDA_LIB_DIR) + "/" + soname);
#endif
  void* lib = nullptr;
  std::string why;
  for (const std::string& path : tried) {
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib) break;
    const char* e = dlerror();
    if (why.empty()) why = e ? e : "unknown reason";
  }
  if (!lib) {
    std::string where;
    for (size_t i = 1; i < tried.size(); ++i) where += ", nor " + tried[i];
    return make_error("cannot load " + soname + " (" + why + where +
                      "): the CUDA backend needs cuBLAS " + std::to_string(CUBLAS_VER_MAJOR) +
                      " from the CUDA toolkit on the library path (e.g. " +
                      "LD_LIBRARY_PATH=/usr/local/cuda/lib64)");
  }
  Blas b;
  std::string missing;
  resolve(lib, "cublasCreate_v2", b.create, missing);
  resolve(lib, "cublasDestroy_v2", b.destroy, missing);
  resolve(lib, "cublasSetStream_v2", b.set_stream, missing);
  resolve(lib, "cublasSetMathMode", b.set_math_mode, missing);
  resolve(lib, "cublasSgemm_v2", b.sgemm, missing);
  resolve(lib, "cublasGemmEx", b.gemm_ex, missing);
  if (!missing.empty()) return make_error(soname + " has no function " + missing);
  return b;
}

Result<const Blas*> load_blas() {
  static Result<Blas> loaded = open_blas(blas_soname());  // on the first call, once
  if (!loaded) return loaded.error();
  return &*loaded;
}

}  // namespace ts::cuda
