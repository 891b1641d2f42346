// pocketllm_cpp._native.Tensor, and the views every model's bindings take of such tensors.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"

namespace nb = nanobind;
using namespace pocketllm;

std::vector<WeightView> pocketllm::matrices(const Tensor& t, size_t dims, const std::string& what) {
    if (t.shape.size() != dims) {
        throw std::invalid_argument(what + " has " + std::to_string(t.shape.size()) + " dimensions, expected " +
                                    std::to_string(dims));
    }
    const int64_t count = dims == 3 ? t.shape[0] : 1, rows = t.shape[dims - 2], cols = t.shape[dims - 1];
    if (count <= 0) throw std::invalid_argument(what + " has " + std::to_string(count) + " experts");
    int64_t total = 0;
    if (__builtin_mul_overflow(count, rows, &total)) {
        throw std::invalid_argument(what + " has " + std::to_string(count) + " experts of " + std::to_string(rows) +
                                    " rows: past 64-bit sizes");
    }
    WeightView whole;
    try {
        whole = weight_view(t.data, parse_storage_type(t.storage_type), total, cols, t.scales);  // before `count`
    } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(what + ": " + e.what());
    }
    const int64_t bytes = rows * static_cast<int64_t>(row_bytes(whole.type, cols)), scales = rows * (cols / kBlock);
    std::vector<WeightView> out;
    for (int64_t e = 0; e < count; ++e) {
        out.push_back({whole.data + e * bytes, whole.type, rows, cols,
                       whole.scales != nullptr ? whole.scales + e * scales : nullptr});
    }
    return out;
}

WeightView TensorViews::matrix(const std::optional<Tensor>& t, const char* what) {
    if (!t) throw std::invalid_argument(at + "has no " + what);
    model.owners.push_back(nb::cast(*t));  // its bytes and scales
    return matrices(*t, 2, at + what)[0];
}

std::vector<WeightView> TensorViews::stacked(const std::optional<Tensor>& t, const char* what) {
    if (!t) throw std::invalid_argument(at + "has no " + what);
    model.owners.push_back(nb::cast(*t));
    return matrices(*t, 3, at + what);
}

std::vector<WeightView> TensorViews::experts(const std::vector<Tensor>& ts, const char* what) {
    if (ts.size() == 1 && ts[0].shape.size() == 3) return stacked(ts[0], what);
    std::vector<WeightView> out;
    for (const Tensor& t : ts) out.push_back(matrix(t, what));
    return out;
}

KvType pocketllm::parse_kv_type(const std::string& name) {
    if (name == "float16") return KvType::F16;
    if (name == "float32") return KvType::F32;
    throw std::invalid_argument("kv_cache_dtype must be float16 or float32, got '" + name + "'");
}

std::string pocketllm::kv_type_name(KvType type) { return type == KvType::F16 ? "float16" : "float32"; }

void pocketllm::bind_tensors(nb::module_& m) {
    nb::class_<Tensor>(m, "Tensor", "A tensor's raw bytes, storage type and shape, as the models and kernels read them.")
        .def(nb::init<Bytes, std::string, std::vector<int64_t>, std::optional<Floats>>(), nb::arg("data"),
             nb::arg("storage_type"), nb::arg("shape"), nb::arg("scales") = nb::none())
        .def_ro("data", &Tensor::data)
        .def_ro("storage_type", &Tensor::storage_type)
        .def_ro("shape", &Tensor::shape)
        .def_ro("scales", &Tensor::scales);
}
