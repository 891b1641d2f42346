// The instruction set the native kernels use: AVX-512 or AVX2+FMA where the CPU has it (checked at run time, so
// one build runs on any x86-64), else portable scalar code. Tests switch between them (see kernel_isa). Only the
// grouped linear kernels have an AVX-512 path; the others run their AVX2 path under it.
#pragma once

#include <atomic>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define POCKETLLM_X86 1
#endif

namespace pocketllm {

enum class Isa { kScalar, kAvx2, kAvx512 };  // in order: each has the ones before it

inline bool cpu_has_avx2() {
#if defined(POCKETLLM_X86) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

inline bool cpu_has_avx512() {
#if defined(POCKETLLM_X86) && defined(__GNUC__)
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

inline std::atomic<Isa>& active_isa() {
  static std::atomic<Isa> isa{cpu_has_avx512() ? Isa::kAvx512 : cpu_has_avx2() ? Isa::kAvx2 : Isa::kScalar};
  return isa;
}

// Whether the kernels may use AVX2+FMA: under AVX2 or AVX-512.
inline bool uses_avx2() { return active_isa().load(std::memory_order_relaxed) >= Isa::kAvx2; }

}  // namespace pocketllm
