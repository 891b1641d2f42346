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
    const float* scales = nullptr;  // F8_E4M3 only: the scale of each 32 columns of each row, [rows, cols / 32]

    float scale(int64_t row, int64_t col) const { return scales[row * (cols / 32) + col / 32]; }
};

// Checks sizes and storage types; throws std::invalid_argument naming what is wrong.
void validate(const WeightView& w, int64_t data_bytes);

// The KV cache's element type: float32, or IEEE half (the default: half the bytes per attention read).
enum class KvType { F32, F16 };

}  // namespace pocketllm
