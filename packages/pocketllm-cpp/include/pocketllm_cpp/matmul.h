// y = x @ W.T with W read in its GGUF storage type, in place: rows of W are output features.
#pragma once

#include <cstdint>
#include <vector>

#include "pocketllm_cpp/quant.h"
#include "pocketllm_cpp/thread_pool.h"

namespace pocketllm {

struct WeightView {
    const uint8_t* data;  // rows * row_bytes(type, cols) bytes, e.g. a window of the memory-mapped file
    QType type;
    int64_t rows;  // output features
    int64_t cols;  // input features
};

// Checks sizes and types; throws std::invalid_argument naming what is wrong.
void validate(const WeightView& w, int64_t data_bytes);

// Quantizes each of n rows of x [n, cols] to 8-bit blocks (round half to even), as the integer kernels need.
std::vector<BlockQ8Act> quantize_activations(const float* x, int64_t n, int64_t cols);

// y [n, rows] = x [n, cols] @ W.T. Block-type weights multiply 8-bit-quantized activations with integer dot
// products (llama.cpp's way) unless `exact`, where each block is dequantized and multiplies x in float32 (slower:
// the arithmetic of a float32 reference, for fidelity checks); F32/F16 weights always multiply x as it is.
// Work is split over output rows.
void matmul(const WeightView& w, const float* x, int64_t n, float* y, ThreadPool& pool, bool exact = false);

// W as float32 [rows, cols] (tests, and layers that need dense values).
void dequantize(const WeightView& w, float* out);

namespace kernels {
// One output row against n activation rows; `act` holds n * (cols / kBlock) blocks. Per ISA.
void dot_rows_scalar(const WeightView& w, int64_t row, const BlockQ8Act* act, const float* x, int64_t n, float* y,
                     int64_t y_stride);
void dot_rows_avx2(const WeightView& w, int64_t row, const BlockQ8Act* act, const float* x, int64_t n, float* y,
                   int64_t y_stride);
void dot_rows_exact(const WeightView& w, int64_t row, const float* x, int64_t n, float* y, int64_t y_stride);
void quantize_row_scalar(const float* x, int64_t cols, BlockQ8Act* out);
// Attention over one KV block: scores[i] = q . keys[i] (count rows of `dim` floats), and o += sum w[i] values[i].
void dot_many_scalar(const float* q, const float* keys, int64_t count, int64_t dim, float* scores);
void dot_many_avx2(const float* q, const float* keys, int64_t count, int64_t dim, float* scores);
void axpy_many_scalar(const float* weights, const float* values, int64_t count, int64_t dim, float* out);
void axpy_many_avx2(const float* weights, const float* values, int64_t count, int64_t dim, float* out);
void quantize_row_avx2(const float* x, int64_t cols, BlockQ8Act* out);
}  // namespace kernels

}  // namespace pocketllm
