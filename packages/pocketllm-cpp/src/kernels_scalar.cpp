// Portable kernels: the reference every other ISA is tested against, and the path on any other CPU.
#include <cmath>

#include "pocketllm_cpp/matmul.h"

namespace pocketllm::kernels {
namespace {

// sum(code * x) over a 4-bit block: byte j holds element j (low nibble) and element j + 16 (high nibble).
int nibble_dot(const uint8_t* qs, const int8_t* x) {
    int dot = 0;
    for (int j = 0; j < 16; ++j) dot += (qs[j] & 0x0F) * x[j] + (qs[j] >> 4) * x[j + 16];
    return dot;
}

}  // namespace

void quantize_row_scalar(const float* x, int64_t cols, BlockQ8Act* out) {
    for (int64_t b = 0; b < cols / kBlock; ++b) {
        const float* v = x + b * kBlock;
        float amax = 0.0f;
        for (int j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(v[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < kBlock; ++j) {
            // nearbyint rounds half to even (the default rounding mode), as the AVX2 path and numpy's rint do.
            const int q = static_cast<int>(std::nearbyint(v[j] * id));
            out[b].qs[j] = static_cast<int8_t>(q);
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * static_cast<float>(sum);
    }
}

void dot_rows_scalar(const WeightView& w, int64_t row, const BlockQ8Act* act, const float* x, int64_t n, float* y,
                     int64_t y_stride) {
    const int64_t nb = w.cols / kBlock;
    const uint8_t* base = w.data + row * static_cast<int64_t>(row_bytes(w.type, w.cols));
    for (int64_t r = 0; r < n; ++r) {
        const BlockQ8Act* a = act + r * nb;
        float sum = 0.0f;
        switch (w.type) {
            case QType::F32: {
                const float* wr = reinterpret_cast<const float*>(base);
                for (int64_t i = 0; i < w.cols; ++i) sum += wr[i] * x[r * w.cols + i];
                break;
            }
            case QType::F16: {
                const uint16_t* wr = reinterpret_cast<const uint16_t*>(base);
                for (int64_t i = 0; i < w.cols; ++i) sum += fp16_to_fp32(wr[i]) * x[r * w.cols + i];
                break;
            }
            case QType::Q4_0: {
                const BlockQ4_0* blocks = reinterpret_cast<const BlockQ4_0*>(base);
                for (int64_t b = 0; b < nb; ++b) {
                    const int dot = nibble_dot(blocks[b].qs, a[b].qs);
                    // sum((q - 8) * d_w * q_x * d_x) = d_w * (d_x * sum(q q_x) - 8 * s_x)
                    sum += fp16_to_fp32(blocks[b].d) * (a[b].d * static_cast<float>(dot) - 8.0f * a[b].s);
                }
                break;
            }
            case QType::Q4_1: {
                const BlockQ4_1* blocks = reinterpret_cast<const BlockQ4_1*>(base);
                for (int64_t b = 0; b < nb; ++b) {
                    const int dot = nibble_dot(blocks[b].qs, a[b].qs);
                    sum += fp16_to_fp32(blocks[b].d) * a[b].d * static_cast<float>(dot) +
                           fp16_to_fp32(blocks[b].m) * a[b].s;
                }
                break;
            }
            case QType::Q8_0: {
                const BlockQ8_0* blocks = reinterpret_cast<const BlockQ8_0*>(base);
                for (int64_t b = 0; b < nb; ++b) {
                    int dot = 0;
                    for (int j = 0; j < kBlock; ++j) dot += blocks[b].qs[j] * a[b].qs[j];
                    sum += fp16_to_fp32(blocks[b].d) * a[b].d * static_cast<float>(dot);
                }
                break;
            }
        }
        y[r * y_stride] = sum;
    }
}

void dot_many_scalar(const float* q, const float* keys, int64_t count, int64_t dim, float* scores) {
    for (int64_t i = 0; i < count; ++i) {
        float dot = 0.0f;
        for (int64_t j = 0; j < dim; ++j) dot += q[j] * keys[i * dim + j];
        scores[i] = dot;
    }
}

void axpy_many_scalar(const float* weights, const float* values, int64_t count, int64_t dim, float* out) {
    for (int64_t i = 0; i < count; ++i) {
        for (int64_t j = 0; j < dim; ++j) out[j] += weights[i] * values[i * dim + j];
    }
}

}  // namespace pocketllm::kernels
