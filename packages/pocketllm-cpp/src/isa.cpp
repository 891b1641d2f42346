#include "pocketllm_cpp/isa.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#if defined(POCKETLLM_HAVE_AMX) && defined(__linux__)  // the tiles need Linux's permission (below)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pocketllm {
namespace {

#if defined(POCKETLLM_HAVE_AMX) && defined(__linux__)  // the tiles need Linux's permission (amx_tiles_granted)
// AMX-TILE and AMX-INT8 in CPUID, and their state enabled by the OS (XCR0 bits 17 and 18).
bool cpu_has_amx() {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !((ecx >> 27) & 1)) return false;  // OSXSAVE: xgetbv works
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1) || !((edx >> 25) & 1)) return false;
    unsigned low, high;
    __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
    return ((low >> 17) & 3) == 3;
}
#endif

bool cpu_has(Isa isa) {
#if defined(POCKETLLM_HAVE_X86) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    if (isa == Isa::Avx2) return avx2;
    if (isa == Isa::Avx512) {
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    }
#if defined(POCKETLLM_HAVE_AMX) && defined(__linux__)  // the tiles need Linux's permission (below)
    if (isa == Isa::Amx) return cpu_has(Isa::Avx512) && cpu_has_amx();
#endif
#endif
#ifdef POCKETLLM_HAVE_NEON
    if (isa == Isa::Neon) return true;  // Advanced SIMD is part of every AArch64 CPU
#endif
    return isa == Isa::Scalar;
}

constexpr Isa kAll[] = {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Amx, Isa::Neon};

Isa parse(const std::string& name) {
    if (name == "auto" || name.empty()) return best_isa();
    for (Isa isa : kAll) {
        if (name != isa_name(isa)) continue;
        if (!cpu_has(isa)) throw std::invalid_argument("ISA '" + name + "' is not available: this CPU or build lacks it");
        return isa;
    }
    throw std::invalid_argument("unknown ISA '" + name + "'; expected scalar, avx2, avx512, amx, neon or auto");
}

std::atomic<Isa>& selected() {
    static std::atomic<Isa> isa{[] {
        const char* env = std::getenv("POCKETLLM_CPP_ISA");
        try {
            return parse(env ? env : "auto");
        } catch (const std::invalid_argument&) {
            return best_isa();  // a bad variable must not make the module unloadable; set_isa reports it
        }
    }()};
    return isa;
}

}  // namespace

Isa best_isa() {
    for (Isa isa : {Isa::Amx, Isa::Avx512, Isa::Avx2, Isa::Neon}) {
        if (cpu_has(isa)) return isa;
    }
    return Isa::Scalar;
}
Isa current_isa() { return selected().load(); }

bool amx_tiles_granted() {
#if defined(POCKETLLM_HAVE_AMX) && defined(__linux__)
    static const bool granted = [] {
        constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
        return cpu_has(Isa::Amx) && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
    }();
    return granted;
#else
    return false;
#endif
}
void set_isa(const std::string& name) { selected().store(parse(name)); }

std::string isa_name(Isa isa) {
    switch (isa) {
        case Isa::Avx2: return "avx2";
        case Isa::Avx512: return "avx512";
        case Isa::Amx: return "amx";
        case Isa::Neon: return "neon";
        case Isa::Scalar: break;
    }
    return "scalar";
}

std::string built_isas() {
    std::string names = "scalar";
#if defined(POCKETLLM_HAVE_X86)
    names += " avx2 avx512";
#endif
#if defined(POCKETLLM_HAVE_AMX) && defined(__linux__)
    names += " amx";
#endif
#ifdef POCKETLLM_HAVE_NEON
    names += " neon";
#endif
    return names;
}

std::string available_isas() {
    std::string names;
    for (Isa isa : kAll) {
        if (cpu_has(isa)) names += (names.empty() ? "" : " ") + isa_name(isa);
    }
    return names;
}

}  // namespace pocketllm
