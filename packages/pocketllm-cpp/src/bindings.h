// What the files of the Python module pocketllm_cpp._native share: the kernels' pool, result arrays, and each
// area's bindings.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels.h"
#include "pocketllm_cpp/model.h"
#include "pocketllm_cpp/thread_pool.h"

namespace pocketllm {

ThreadPool& default_pool();  // one per process, sized to available_cpus()

// An uninitialised float32 numpy array [rows, cols] that owns its memory.
nanobind::ndarray<nanobind::numpy, float, nanobind::ndim<2>> new_matrix(int64_t rows, int64_t cols);

using Bytes = nanobind::ndarray<const uint8_t, nanobind::ndim<1>, nanobind::c_contig, nanobind::device::cpu>;
using Floats = nanobind::ndarray<const float, nanobind::ndim<1>, nanobind::c_contig, nanobind::device::cpu>;

// pocketllm_cpp._native.Model: the model plus the Python arrays its weight views point into, kept alive as long
// as it is.
struct PyModel {
    std::shared_ptr<Model> model;
    std::vector<nanobind::object> owners;
};

// A tensor as a file stores it: its bytes, storage type and row-major shape ([rows, cols], or [experts, rows, cols]
// for experts stacked along the first axis), and an F8_E4M3 tensor's scales (one per 32 columns of each row, in
// row order). pocketllm_cpp._native.Tensor.
struct Tensor {
    Bytes data;
    std::string storage_type;
    std::vector<int64_t> shape;
    std::optional<Floats> scales;
};

// A weight's view of its bytes and scales, checked against them (validate), std::invalid_argument otherwise.
WeightView weight_view(const Bytes& data, StorageType type, int64_t rows, int64_t cols,
                       const std::optional<Floats>& scales);

// The tensor's matrices, checked against its bytes: the matrix of a 2-D tensor, or one window per expert of a
// stacked 3-D one; std::invalid_argument naming `what` otherwise.
std::vector<WeightView> matrices(const Tensor& t, size_t dims, const std::string& what);

// Views of a model's tensors, each kept alive by the model; std::invalid_argument naming `at` and the tensor for
// one that is missing or does not fit its bytes.
struct TensorViews {
    PyModel& model;
    std::string at;

    WeightView matrix(const std::optional<Tensor>& t, const char* what);
    WeightView matrix(const Tensor& t, const char* what) { return matrix(std::optional<Tensor>(t), what); }
    std::vector<WeightView> stacked(const std::optional<Tensor>& t, const char* what);
    // One stacked tensor, or one matrix per expert.
    std::vector<WeightView> experts(const std::vector<Tensor>& ts, const char* what);
};

KvType parse_kv_type(const std::string& name);  // "float16" or "float32"
std::string kv_type_name(KvType type);

void bind_tensors(nanobind::module_& m);  // bindings_tensors.cpp: Tensor
void bind_model(nanobind::module_& m);    // bindings_model.cpp: Model, SequenceSlice, the Llama model
void bind_engine(nanobind::module_& m);   // bindings_engine.cpp: Engine and what crosses its boundary
void bind_moe(nanobind::module_& m);      // bindings_moe.cpp
void bind_qwen3_5(nanobind::module_& m);  // bindings_qwen3_5.cpp

}  // namespace pocketllm
