// What the files of the Python module pocketllm_cpp._native share: the kernels' pool, result arrays, and each
// area's bindings.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pocketllm_cpp/matmul.h"
#include "pocketllm_cpp/model.h"
#include "pocketllm_cpp/thread_pool.h"

namespace pocketllm {

ThreadPool& default_pool();  // one per process, sized to available_cpus()

// An uninitialised float32 numpy array [rows, cols] that owns its memory.
nanobind::ndarray<nanobind::numpy, float, nanobind::ndim<2>> new_matrix(int64_t rows, int64_t cols);

using Bytes = nanobind::ndarray<const uint8_t, nanobind::ndim<1>, nanobind::c_contig, nanobind::device::cpu>;

// pocketllm_cpp._native.Model: the model plus the Python arrays its weight views point into, kept alive as long
// as it is.
struct PyModel {
    std::shared_ptr<Model> model;
    std::vector<nanobind::object> owners;
};

// A tensor as a file stores it: its bytes, storage type and row-major shape ([rows, cols], or [experts, rows, cols]
// for experts stacked along the first axis). pocketllm_cpp._native.MoeTensor.
struct MoeTensor {
    Bytes data;
    std::string storage_type;
    std::vector<int64_t> shape;
};

// The tensor's matrices, checked against its bytes: the matrix of a 2-D tensor, or one window per expert of a
// stacked 3-D one; std::invalid_argument naming `what` otherwise.
std::vector<WeightView> matrices(const MoeTensor& t, size_t dims, const std::string& what);

void bind_moe(nanobind::module_& m);      // bindings_moe.cpp
void bind_qwen3_5(nanobind::module_& m);  // bindings_qwen3_5.cpp

}  // namespace pocketllm
