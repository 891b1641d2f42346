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
// Linux's permission for this process to use AMX's tile data (8 KB more per thread's saved state), asked for once,
// by the first product that would run on the tiles rather than when the ISA is chosen: once granted, Linux refuses
// this process any signal stack too small for AMX's larger signal frame. Refused (such a stack exists already), the
// products run on the AVX-512 kernels, which give the same bits.
bool amx_tiles_granted();
// Every ISA this CPU and build can run, scalar first (tests run each).
std::string available_isas();
// Every ISA this build has kernels for, whatever the CPU (AMX only where the compiler knows its tiles, on Linux).
std::string built_isas();

}  // namespace pocketllm
