// The instruction set the native kernels use: AVX2+FMA where the CPU has it (checked at run time, so one
// build runs on any x86-64), else portable scalar code. Tests switch between the two (see kernel_isa).
#pragma once

#include <atomic>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define POCKETLLM_X86 1
#endif

namespace pocketllm {

enum class Isa { kScalar, kAvx2 };

inline bool cpu_has_avx2() {
#if defined(POCKETLLM_X86) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

inline std::atomic<Isa>& active_isa() {
  static std::atomic<Isa> isa{cpu_has_avx2() ? Isa::kAvx2 : Isa::kScalar};
  return isa;
}

}  // namespace pocketllm
