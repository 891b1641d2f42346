// Gated DeltaNet's kernels with AVX2 and FMA (CMakeLists.txt), called only after the CPU was checked (isa.cpp).
#define PLLM_GATED_DELTA gated_delta_avx2
#include "delta_rule.inl"
