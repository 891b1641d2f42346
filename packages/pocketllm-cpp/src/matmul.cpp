#include "pocketllm_cpp/matmul.h"

#include <stdexcept>
#include <string>

#include "pocketllm_cpp/isa.h"

namespace pocketllm {

void validate(const WeightView& w, int64_t data_bytes) {
    if (w.rows <= 0 || w.cols <= 0) {
        throw std::invalid_argument("weight shape [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) +
                                    "] must be positive");
    }
    if (w.cols % kBlock != 0) {
        throw std::invalid_argument("input features " + std::to_string(w.cols) + " are not a multiple of " +
                                    std::to_string(kBlock));
    }
    const size_t per_row = row_bytes(w.type, w.cols);
    size_t expected = 0;
    if (__builtin_mul_overflow(per_row, static_cast<size_t>(w.rows), &expected) ||
        expected != static_cast<size_t>(data_bytes)) {
        throw std::invalid_argument("weight has " + std::to_string(data_bytes) + " bytes; its shape and type need " +
                                    std::to_string(per_row) + " per row for " + std::to_string(w.rows) + " rows");
    }
    // Block fields are 16-bit, F32 rows 32-bit: GGUF aligns tensors to 32 bytes, and so must any other caller.
    const size_t alignment = w.type == QType::F32 ? 4 : 2;
    if (reinterpret_cast<uintptr_t>(w.data) % alignment != 0) {
        throw std::invalid_argument("weight data is not " + std::to_string(alignment) + "-byte aligned");
    }
}

std::vector<BlockQ8Act> quantize_activations(const float* x, int64_t n, int64_t cols) {
    std::vector<BlockQ8Act> blocks(static_cast<size_t>(n * (cols / kBlock)));
    const bool avx2 = current_isa() == Isa::Avx2;
    for (int64_t r = 0; r < n; ++r) {
        BlockQ8Act* out = blocks.data() + r * (cols / kBlock);
#ifdef POCKETLLM_HAVE_AVX2
        if (avx2) {
            kernels::quantize_row_avx2(x + r * cols, cols, out);
            continue;
        }
#endif
        (void)avx2;
        kernels::quantize_row_scalar(x + r * cols, cols, out);
    }
    return blocks;
}

void matmul(const WeightView& w, const float* x, int64_t n, float* y, ThreadPool& pool, bool exact) {
    if (exact && is_block_type(w.type)) {
        pool.parallel_for(w.rows, [&](int64_t begin, int64_t end) {
            for (int64_t row = begin; row < end; ++row) kernels::dot_rows_exact(w, row, x, n, y + row, w.rows);
        });
        return;
    }
    std::vector<BlockQ8Act> act;
    if (is_block_type(w.type)) act = quantize_activations(x, n, w.cols);
    auto dot = kernels::dot_rows_scalar;
#ifdef POCKETLLM_HAVE_AVX2
    if (current_isa() == Isa::Avx2) dot = kernels::dot_rows_avx2;
#endif
    pool.parallel_for(w.rows, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) dot(w, row, act.data(), x, n, y + row, w.rows);
    });
}

void kernels::dot_rows_exact(const WeightView& w, int64_t row, const float* x, int64_t n, float* y,
                             int64_t y_stride) {
    std::vector<float> values(static_cast<size_t>(w.cols));
    dequantize(WeightView{w.data + row * static_cast<int64_t>(row_bytes(w.type, w.cols)), w.type, 1, w.cols},
               values.data());
    for (int64_t r = 0; r < n; ++r) {
        float sum = 0.0f;
        for (int64_t i = 0; i < w.cols; ++i) sum += values[static_cast<size_t>(i)] * x[r * w.cols + i];
        y[r * y_stride] = sum;
    }
}

void dequantize(const WeightView& w, float* out) {
    const int64_t nb = w.cols / kBlock;
    for (int64_t row = 0; row < w.rows; ++row) {
        const uint8_t* base = w.data + row * static_cast<int64_t>(row_bytes(w.type, w.cols));
        float* o = out + row * w.cols;
        for (int64_t b = 0; b < nb; ++b) {
            for (int j = 0; j < kBlock; ++j) {
                const int64_t i = b * kBlock + j;
                switch (w.type) {
                    case QType::F32: o[i] = reinterpret_cast<const float*>(base)[i]; break;
                    case QType::F16: o[i] = fp16_to_fp32(reinterpret_cast<const uint16_t*>(base)[i]); break;
                    case QType::Q4_0: {
                        const auto& blk = reinterpret_cast<const BlockQ4_0*>(base)[b];
                        const int q = j < 16 ? (blk.qs[j] & 0x0F) : (blk.qs[j - 16] >> 4);
                        o[i] = static_cast<float>(q - 8) * fp16_to_fp32(blk.d);
                        break;
                    }
                    case QType::Q4_1: {
                        const auto& blk = reinterpret_cast<const BlockQ4_1*>(base)[b];
                        const int q = j < 16 ? (blk.qs[j] & 0x0F) : (blk.qs[j - 16] >> 4);
                        o[i] = static_cast<float>(q) * fp16_to_fp32(blk.d) + fp16_to_fp32(blk.m);
                        break;
                    }
                    case QType::Q8_0: {
                        const auto& blk = reinterpret_cast<const BlockQ8_0*>(base)[b];
                        o[i] = static_cast<float>(blk.qs[j]) * fp16_to_fp32(blk.d);
                        break;
                    }
                }
            }
        }
    }
}

}  // namespace pocketllm
