// The extension module: importing pocketllm_torch._C registers the torch.ops.pocketllm operators defined in
// the other files of csrc/, and kernel_isa, which reports or switches their instruction set.

#include <Python.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>

#include "isa.h"

namespace pocketllm {
namespace {

// "" only reports; "scalar" or "avx2" switches (tests run both paths).
std::string kernel_isa(const std::string& request) {
  if (request == "scalar") {
    active_isa() = Isa::kScalar;
  } else if (request == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), "kernel_isa: this CPU has no AVX2 and FMA");
    active_isa() = Isa::kAvx2;
  } else {
    TORCH_CHECK(request.empty(), "kernel_isa: unknown instruction set '", request, "' (scalar, avx2)");
  }
  return active_isa().load() == Isa::kAvx2 ? "avx2" : "scalar";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pocketllm, m) { m.def("kernel_isa(str request) -> str", kernel_isa); }

}  // namespace pocketllm

static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
