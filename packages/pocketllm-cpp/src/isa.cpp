#include "pocketllm_cpp/isa.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

namespace pocketllm {
namespace {

bool cpu_has_avx2() {
#if defined(POCKETLLM_HAVE_AVX2) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return false;
#endif
}

Isa parse(const std::string& name) {
    if (name == "auto" || name.empty()) return best_isa();
    if (name == "scalar") return Isa::Scalar;
    if (name == "avx2") {
        if (!cpu_has_avx2()) throw std::invalid_argument("ISA 'avx2' is not available: this CPU or build lacks it");
        return Isa::Avx2;
    }
    throw std::invalid_argument("unknown ISA '" + name + "'; expected scalar, avx2 or auto");
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

Isa best_isa() { return cpu_has_avx2() ? Isa::Avx2 : Isa::Scalar; }
Isa current_isa() { return selected().load(); }
void set_isa(const std::string& name) { selected().store(parse(name)); }
std::string isa_name(Isa isa) { return isa == Isa::Avx2 ? "avx2" : "scalar"; }

}  // namespace pocketllm
