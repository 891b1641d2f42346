// Gated DeltaNet's kernels with the build's baseline flags (every x86-64 or AArch64 CPU).
#define PLLM_GATED_DELTA gated_delta_scalar
#include "delta_rule.inl"
