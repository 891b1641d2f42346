// The extension module: importing pocketllm_torch._C registers the torch.ops.pocketllm operators defined in
// the other files of csrc/, and kernel_isa, which reports or switches their instruction set.

#include <Python.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>

#include "isa.h"

namespace pocketllm {
namespace {

// "" only reports; "scalar", "avx2" or "avx512" switches (tests run every path).
std::string kernel_isa(const std::string& request) {
  if (request == "scalar") {
    active_isa() = Isa::kScalar;
  } else if (request == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), "kernel_isa: this CPU has no AVX2 and FMA");
    active_isa() = Isa::kAvx2;
  } else if (request == "avx512") {
    TORCH_CHECK(cpu_has_avx512(), "kernel_isa: this CPU has no AVX-512");
    active_isa() = Isa::kAvx512;
  } else {
    TORCH_CHECK(request.empty(), "kernel_isa: unknown instruction set '", request, "' (scalar, avx2, avx512)");
  }
  switch (active_isa().load()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pocketllm, m) { m.def("kernel_isa(str request) -> str", kernel_isa); }

}  // namespace pocketllm

static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
