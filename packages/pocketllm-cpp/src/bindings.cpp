// The Python module pocketllm_cpp._native: thin wrappers that check every argument, then release the GIL. This
// file holds the module, the ISA controls and the kernels; each area's bindings are in their own file (bindings.h).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "bindings.h"
#include "pocketllm_cpp/isa.h"
#include "kernels.h"

namespace nb = nanobind;
using namespace pocketllm;

namespace {

using Matrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

}  // namespace

WeightView pocketllm::weight_view(const Bytes& data, StorageType type, int64_t rows, int64_t cols,
                                  const std::optional<Floats>& scales) {
    WeightView w{data.data(), type, rows, cols, scales ? scales->data() : nullptr};
    validate(w, static_cast<int64_t>(data.size()));  // sizes before the scales' count is computed from them
    const int64_t expected = rows * (cols / kBlock);
    if (scales && static_cast<int64_t>(scales->shape(0)) != expected) {
        throw std::invalid_argument("weight has " + std::to_string(scales->shape(0)) + " scales; its shape needs " +
                                    std::to_string(expected) + " (one per 32 columns of each row)");
    }
    return w;
}

ThreadPool& pocketllm::default_pool() {
    static ThreadPool pool(available_cpus());
    return pool;
}

nb::ndarray<nb::numpy, float, nb::ndim<2>> pocketllm::new_matrix(int64_t rows, int64_t cols) {
    auto* values = new float[static_cast<size_t>(rows * cols)];
    nb::capsule owner(values, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    return nb::ndarray<nb::numpy, float, nb::ndim<2>>(values, {static_cast<size_t>(rows), static_cast<size_t>(cols)},
                                                     owner);
}

NB_MODULE(_native, m) {
    m.doc() = "PocketLLM's native CPU kernels (see pocketllm_cpp.kernels).";
    m.def("isa", [] { return isa_name(current_isa()); }, "The instruction set the kernels use now.");
    m.def("best_isa", [] { return isa_name(best_isa()); }, "The best instruction set of this CPU and build.");
    m.def("set_isa", &set_isa, nb::arg("name"), "Use 'scalar', 'avx2', 'avx512', 'amx', 'neon' or 'auto'; ValueError if unavailable.");
    m.def("available_isas", [] { return available_isas(); }, "Every ISA this CPU and build can run, scalar first.");
    m.def("built_isas", [] { return built_isas(); }, "Every ISA this build has kernels for, whatever the CPU.");
    m.def("num_threads", [] { return default_pool().size(); }, "Threads of the kernels' pool.");
    m.def("available_cpus", &available_cpus,
          "The CPUs this process may use: its affinity mask, capped by its cgroup CPU quota (rounded up); at least 1.");
    m.def("cgroup_cpu_quota", &cgroup_cpu_quota, nb::arg("root") = "",
          "The cgroup CPU quota in CPUs (v2 cpu.max, v1 cfs quota over period, the smallest up the hierarchy), 0 for "
          "none; `root` prefixes the /proc and cgroup paths read (tests).");
    m.def(
        "matmul",
        [](const Bytes& weight, const std::string& storage_type, int64_t rows, int64_t cols, const Matrix& x,
           bool exact, const std::optional<Floats>& scales) {
            const WeightView w = weight_view(weight, parse_storage_type(storage_type), rows, cols, scales);
            if (static_cast<int64_t>(x.shape(1)) != cols) {
                throw std::invalid_argument("x has " + std::to_string(x.shape(1)) + " columns; the weight takes " +
                                            std::to_string(cols));
            }
            const int64_t n = static_cast<int64_t>(x.shape(0));
            auto y = new_matrix(n, rows);
            {
                nb::gil_scoped_release released;
                matmul(w, x.data(), n, y.data(), default_pool(), exact);
            }
            return y;
        },
        nb::arg("weight"), nb::arg("storage_type"), nb::arg("rows"), nb::arg("cols"), nb::arg("x"),
        nb::arg("exact") = false, nb::arg("scales") = nb::none(),
        "y = x @ W.T, W given as its raw bytes in `storage_type` with shape [rows, cols]; `exact`: float32 "
        "activations against blocks too; `scales`: F8_E4M3's, one per 32 columns of each row.");
    m.def(
        "dequantize",
        [](const Bytes& weight, const std::string& storage_type, int64_t rows, int64_t cols,
           const std::optional<Floats>& scales) {
            const WeightView w = weight_view(weight, parse_storage_type(storage_type), rows, cols, scales);
            auto out = new_matrix(rows, cols);
            {
                nb::gil_scoped_release released;
                dequantize(w, out.data());
            }
            return out;
        },
        nb::arg("weight"), nb::arg("storage_type"), nb::arg("rows"), nb::arg("cols"), nb::arg("scales") = nb::none(),
        "W as float32 [rows, cols].");
    m.def(
        "quantize_activations",
        [](const Matrix& x) {
            const int64_t n = static_cast<int64_t>(x.shape(0)), cols = static_cast<int64_t>(x.shape(1));
            if (cols % kBlock != 0) throw std::invalid_argument("columns must be a multiple of 32");
            QuantizedRows act;
            {
                nb::gil_scoped_release released;
                quantize_activations(x.data(), n, cols, act);
            }
            // As (scale, sum-term, codes) arrays, for tests against a numpy reference.
            auto scales = new_matrix(n, cols / kBlock), sums = new_matrix(n, cols / kBlock);
            std::copy(act.d.begin(), act.d.end(), scales.data());
            std::copy(act.s.begin(), act.s.end(), sums.data());
            auto* codes = new int8_t[act.qs.size()];
            std::copy(act.qs.begin(), act.qs.end(), codes);
            nb::capsule owner(codes, [](void* p) noexcept { delete[] static_cast<int8_t*>(p); });
            auto code_array = nb::ndarray<nb::numpy, int8_t, nb::ndim<2>>(
                codes, {static_cast<size_t>(n), static_cast<size_t>(cols)}, owner);
            return nb::make_tuple(scales, sums, code_array);
        },
        nb::arg("x"), "The 8-bit blocks activations are quantized to: (scales, scale * code sums, codes).");
    bind_tensors(m);
    bind_model(m);
    bind_engine(m);
    bind_moe(m);
    bind_qwen3_5(m);
}
