// Which instruction set the kernels use, chosen at run time from the CPU's features.
#pragma once

#include <string>

namespace pocketllm {

// Amx: the AVX-512 kernels, with the batched products of most block types on AMX tiles (Intel, Sapphire Rapids on).
enum class Isa { Scalar, Avx2, Avx512, Amx, Neon };

// The best ISA this build and this CPU both support.
Isa best_isa();
// The ISA in use: POCKETLLM_CPP_ISA=scalar|avx2|avx512|amx|neon|auto at load, or set_isa(); defaults to best_isa().
Isa current_isa();
// Selects an ISA by name ("scalar", "avx2", "avx512", "amx", "neon", "auto"); throws std::invalid_argument for one this CPU or
// build lacks.
void set_isa(const std::string& name);
std::string isa_name(Isa isa);
// Every ISA this CPU and build can run, scalar first (tests run each).
std::string available_isas();

}  // namespace pocketllm
