// CPU kernels for the hot paths: matrix-vector (decode) and matrix-matrix (prefill) with
// F32 activations and F32 / F16 / BF16 or block-quantized Q8_0 / Q4_K weights (quant.h;
// cols must then be a whole number of blocks). One dispatch point picks the instruction set
// at run time (AVX-512 with BF16 and VNNI, AVX2+FMA+F16C with or without AVX-VNNI, or portable
// C++); every SIMD path is tested against the portable one on random inputs.
//
// Determinism: the value of an output element depends only on its row of W and its row of
// X, never on the [r0, r1) range a call covers nor on the other tokens of a call, and matvec
// gives matmul's bits for its one token, on every dtype. So splitting rows across threads,
// prefill against decode, and a sequence alone against the same sequence in a batch of
// others (runtime batching) cannot change results.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/dtype.h"

namespace ts {
class ThreadPool;
}

namespace ts::cpu {

// In order of preference. kAvx2Vnni is kAvx2 with AVX-VNNI's vpdpbusd (ymm) for the int8
// dots of Q8_0 / Q4_K weights; F32 / F16 / BF16 weights take kAvx2's kernels. The order is
// not one of supersets: an AVX-512 CPU may lack AVX-VNNI (Ice Lake, Zen 4), so "supported"
// is isa_supported, not a comparison with detect_isa().
enum class Isa : uint8_t { kPortable, kAvx2, kAvx2Vnni, kAvx512 };

Isa detect_isa();             // best this CPU supports
bool isa_supported(Isa isa);  // this CPU (and its OS) can run it
// In use; env TURBOSPARK_ISA=portable|avx2|avx2vnni|avx512 lowers it (as set_active_isa).
Isa active_isa();
void set_active_isa(Isa isa);  // tests; the best supported ISA not above isa
std::string_view isa_name(Isa isa);

// y[r] = sum_c W[r, c] * x[c] for r in [r0, r1). W row-major [rows, cols] of type wt.
void matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                 int64_t r1);

// Y[t, r] = sum_c W[r, c] * X[t, c] for t in [0, n_tokens), r in [r0, r1).
// X is [n_tokens, cols] contiguous; Y has row stride ldy (floats).
// BF16 weights on AVX-512-BF16 round X to BF16 and use vdpbf16ps (as llama.cpp does);
// Q8_0 / Q4_K weights quantize X to int8 blocks on every path (quant.h's contract: every
// ISA gives the same bits, and matmul equals matvec per token); other paths keep X in F32.
void matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y, int64_t ldy,
                 int64_t cols, int64_t r0, int64_t r1);

// Parallel wrappers: rows split across the pool.
void matvec(ThreadPool& pool, const void* w, DType wt, const float* x, float* y, int64_t rows,
            int64_t cols);
void matmul(ThreadPool& pool, const void* w, DType wt, const float* x, int64_t n_tokens, float* y,
            int64_t rows, int64_t cols);

// True when matmul_rows and matvec_rows on `isa` round X to BF16 before multiplying (BF16
// weights on AVX-512): its error is then ~2^-9 * sum_c |W[r, c] * X[t, c]| rather than F32 rounding.
// Tests and callers that compare against a reference pick their tolerance with it.
bool matmul_rounds_x_to_bf16(Isa isa, DType wt);

// Per-ISA entry points with the same contracts as matvec_rows / matmul_rows above. The
// dispatcher calls them; so may tests that pin one ISA. Calling avx2:: or avx512:: on a CPU
// without that ISA is undefined (illegal instruction): everything else goes through the
// dispatching functions.
namespace portable {
void matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                 int64_t r1);
void matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y, int64_t ldy,
                 int64_t cols, int64_t r0, int64_t r1);
}  // namespace portable
namespace avx2 {
void matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                 int64_t r1);
void matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y, int64_t ldy,
                 int64_t cols, int64_t r0, int64_t r1);
}  // namespace avx2
namespace avx512 {
void matvec_rows(const void* w, DType wt, const float* x, float* y, int64_t cols, int64_t r0,
                 int64_t r1);
void matmul_rows(const void* w, DType wt, const float* x, int64_t n_tokens, float* y, int64_t ldy,
                 int64_t cols, int64_t r0, int64_t r1);
}  // namespace avx512

}  // namespace ts::cpu
