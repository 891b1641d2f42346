// What the files of the Python module pocketllm_cpp._native share: the kernels' pool, result arrays, and each
// area's bindings.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>

#include "pocketllm_cpp/thread_pool.h"

namespace pocketllm {

ThreadPool& default_pool();  // one per process, sized to available_cpus()

// An uninitialised float32 numpy array [rows, cols] that owns its memory.
nanobind::ndarray<nanobind::numpy, float, nanobind::ndim<2>> new_matrix(int64_t rows, int64_t cols);

void bind_moe(nanobind::module_& m);  // bindings_moe.cpp

}  // namespace pocketllm
