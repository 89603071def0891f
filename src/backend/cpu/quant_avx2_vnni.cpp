// quant_avx2.cpp built a second time, as namespace avx2vnni: the same kernels with AVX-VNNI's
// vpdpbusd (ymm, VEX) for the int8 block dots. CMakeLists.txt gives this file
// -mavx2 -mfma -mf16c -mavxvnni; dispatch.cpp reaches it only when cpuid reports AVX-VNNI
// (Isa::kAvx2Vnni). The results are quant_avx2.cpp's bit for bit (quant.h's contract).
#define TS_QUANT_AVX2_VNNI 1
#include "backend/cpu/quant_avx2.cpp"  // NOLINT(bugprone-suspicious-include)
