// What a model is built from: a weight matrix read in place in its storage type, and the KV cache's element type.
#pragma once

#include <cstdint>

#include "pocketllm_cpp/quant.h"

namespace pocketllm {

struct WeightView {
    const uint8_t* data;  // rows * row_bytes(type, cols) bytes, e.g. a window of the memory-mapped file
    StorageType type;
    int64_t rows;  // output features
    int64_t cols;  // input features
};

// Checks sizes and storage types; throws std::invalid_argument naming what is wrong.
void validate(const WeightView& w, int64_t data_bytes);

// The KV cache's element type: float32, or IEEE half (the default: half the bytes per attention read).
enum class KvType { F32, F16 };

}  // namespace pocketllm
