// The Python module pocketllm_cpp._native: thin wrappers that check every argument, then release the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <stdexcept>
#include <thread>

#include "pocketllm_cpp/isa.h"
#include "pocketllm_cpp/matmul.h"

namespace nb = nanobind;
using namespace pocketllm;

namespace {

using Bytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Matrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

WeightView weight_view(const Bytes& data, const std::string& type, int64_t rows, int64_t cols) {
    WeightView w{data.data(), parse_qtype(type), rows, cols};
    validate(w, static_cast<int64_t>(data.size()));
    return w;
}

ThreadPool& default_pool() {
    static ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
    return pool;
}

nb::ndarray<nb::numpy, float, nb::ndim<2>> new_matrix(int64_t rows, int64_t cols) {
    auto* values = new float[static_cast<size_t>(rows * cols)];
    nb::capsule owner(values, [](void* p) noexcept { delete[] static_cast<float*>(p); });
    return nb::ndarray<nb::numpy, float, nb::ndim<2>>(values, {static_cast<size_t>(rows), static_cast<size_t>(cols)},
                                                     owner);
}

}  // namespace

NB_MODULE(_native, m) {
    m.doc() = "PocketLLM's native CPU kernels (see pocketllm_cpp.kernels).";
    m.def("isa", [] { return isa_name(current_isa()); }, "The instruction set the kernels use now.");
    m.def("best_isa", [] { return isa_name(best_isa()); }, "The best instruction set of this CPU and build.");
    m.def("set_isa", &set_isa, nb::arg("name"), "Use 'scalar', 'avx2' or 'auto'; ValueError if unavailable.");
    m.def("num_threads", [] { return default_pool().size(); }, "Threads of the kernels' pool.");
    m.def(
        "matmul",
        [](const Bytes& weight, const std::string& type, int64_t rows, int64_t cols, const Matrix& x) {
            const WeightView w = weight_view(weight, type, rows, cols);
            if (static_cast<int64_t>(x.shape(1)) != cols) {
                throw std::invalid_argument("x has " + std::to_string(x.shape(1)) + " columns; the weight takes " +
                                            std::to_string(cols));
            }
            const int64_t n = static_cast<int64_t>(x.shape(0));
            auto y = new_matrix(n, rows);
            {
                nb::gil_scoped_release released;
                matmul(w, x.data(), n, y.data(), default_pool());
            }
            return y;
        },
        nb::arg("weight"), nb::arg("type"), nb::arg("rows"), nb::arg("cols"), nb::arg("x"),
        "y = x @ W.T, W given as its raw bytes in storage type `type` with shape [rows, cols].");
    m.def(
        "dequantize",
        [](const Bytes& weight, const std::string& type, int64_t rows, int64_t cols) {
            const WeightView w = weight_view(weight, type, rows, cols);
            auto out = new_matrix(rows, cols);
            {
                nb::gil_scoped_release released;
                dequantize(w, out.data());
            }
            return out;
        },
        nb::arg("weight"), nb::arg("type"), nb::arg("rows"), nb::arg("cols"), "W as float32 [rows, cols].");
    m.def(
        "quantize_activations",
        [](const Matrix& x) {
            const int64_t n = static_cast<int64_t>(x.shape(0)), cols = static_cast<int64_t>(x.shape(1));
            if (cols % kBlock != 0) throw std::invalid_argument("columns must be a multiple of 32");
            std::vector<BlockQ8Act> blocks;
            {
                nb::gil_scoped_release released;
                blocks = quantize_activations(x.data(), n, cols);
            }
            // As (scale, sum-term, codes) arrays, for tests against a numpy reference.
            auto scales = new_matrix(n, cols / kBlock), sums = new_matrix(n, cols / kBlock);
            auto* codes = new int8_t[static_cast<size_t>(n * cols)];
            for (size_t i = 0; i < blocks.size(); ++i) {
                scales.data()[i] = blocks[i].d;
                sums.data()[i] = blocks[i].s;
                std::copy(blocks[i].qs, blocks[i].qs + kBlock, codes + i * kBlock);
            }
            nb::capsule owner(codes, [](void* p) noexcept { delete[] static_cast<int8_t*>(p); });
            auto code_array = nb::ndarray<nb::numpy, int8_t, nb::ndim<2>>(
                codes, {static_cast<size_t>(n), static_cast<size_t>(cols)}, owner);
            return nb::make_tuple(scales, sums, code_array);
        },
        nb::arg("x"), "The 8-bit blocks activations are quantized to: (scales, scale * code sums, codes).");
}
