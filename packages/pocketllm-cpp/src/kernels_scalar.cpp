// Portable kernels: the reference every other ISA is tested against, and the path on any other CPU.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace pocketllm::kernels {
namespace {

// sum(w * x) of one decoded sub-block against one 8-bit activation block (scales applied).
float sub_block_dot(const SubBlock& sub, const int8_t* x, float dx, float sx) {
    int halves[2] = {0, 0}, sums[2] = {0, 0};
    for (int j = 0; j < kBlock; ++j) {
        const int code = sub.is_signed ? static_cast<int8_t>(sub.code[j]) : sub.code[j];
        halves[j / 16] += code * x[j];
        sums[j / 16] += x[j];
    }
    const int dot = halves[0] * sub.mul[0] + halves[1] * sub.mul[1];
    const int mins = sums[0] * sub.min[0] + sums[1] * sub.min[1];
    return sub.dw * dx * static_cast<float>(dot) + sub.dm * dx * static_cast<float>(mins) + sub.mw * sx;
}

}  // namespace

void quantize_row_scalar(const float* x, int64_t cols, int8_t* qs, float* d, float* s) {
    for (int64_t b = 0; b < cols / kBlock; ++b) {
        const float* v = x + b * kBlock;
        float amax = 0.0f;
        for (int j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(v[j]));
        const float scale = amax / 127.0f;
        const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0;
        for (int j = 0; j < kBlock; ++j) {
            // nearbyint rounds half to even (the default rounding mode), as the AVX2 path and numpy's rint do.
            const int q = static_cast<int>(std::nearbyint(v[j] * inverse));
            qs[b * kBlock + j] = static_cast<int8_t>(q);
            sum += q;
        }
        d[b] = scale;
        s[b] = scale * static_cast<float>(sum);
    }
}

void silu_mul_scalar(float* gate, const float* up, int64_t n) {
    for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void silu_scalar(float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] / (1.0f + std::exp(-x[i]));
}

void gemm_scalar(const WeightView& w, int64_t row_begin, int64_t row_end, const QuantizedRows& act, const float* x,
                 int64_t n, float* y, int64_t y_stride) {
    const size_t stride = row_bytes(w.type, w.cols);
    for (int64_t row = row_begin; row < row_end; ++row) {
        const uint8_t* base = w.data + row * static_cast<int64_t>(stride);
        if (!is_quantized(w.type)) {
            for (int64_t r = 0; r < n; ++r) {
                float sum = 0.0f;
                for (int64_t i = 0; i < w.cols; ++i) sum += dense_value(w, base, row, i) * x[r * w.cols + i];
                y[r * y_stride + row] = sum;
            }
            continue;
        }
        for (int64_t r = 0; r < n; ++r) y[r * y_stride + row] = 0.0f;
        SubBlock sub;
        for (int64_t b = 0; b < w.cols / kBlock; ++b) {
            decode_sub_block(w.type, base, b, sub);
            for (int64_t r = 0; r < n; ++r) {
                y[r * y_stride + row] += sub_block_dot(sub, act.codes(r, b), act.scale(r, b), act.offset(r, b));
            }
        }
    }
}

void gemm_exact(const WeightView& w, int64_t row_begin, int64_t row_end, const QuantizedRows&, const float* x,
                int64_t n, float* y, int64_t y_stride) {
    std::vector<float> values(static_cast<size_t>(w.cols));
    for (int64_t row = row_begin; row < row_end; ++row) {
        dequantize_row(w, row, values.data());
        for (int64_t r = 0; r < n; ++r) {
            float sum = 0.0f;
            for (int64_t i = 0; i < w.cols; ++i) sum += values[static_cast<size_t>(i)] * x[r * w.cols + i];
            y[r * y_stride + row] = sum;
        }
    }
}

namespace {

void store_f32(const float* values, int64_t dim, void* out) {
    for (int64_t j = 0; j < dim; ++j) static_cast<float*>(out)[j] = values[j];
}

void store_f16(const float* values, int64_t dim, void* out) {
    for (int64_t j = 0; j < dim; ++j) static_cast<uint16_t*>(out)[j] = fp32_to_fp16(values[j]);
}

void load_f32(const void* rows, int64_t count, int64_t dim, float* out) {
    std::memcpy(out, rows, static_cast<size_t>(count * dim) * sizeof(float));
}

void load_f16(const void* rows, int64_t count, int64_t dim, float* out) {
    for (int64_t i = 0; i < count * dim; ++i) out[i] = fp16_to_fp32(static_cast<const uint16_t*>(rows)[i]);
}

template <KvType K>
float cached(const void* rows, int64_t i) {
    if constexpr (K == KvType::F16) return fp16_to_fp32(static_cast<const uint16_t*>(rows)[i]);
    else return static_cast<const float*>(rows)[i];
}

template <KvType K>
void scores(const float* q, int64_t nq, const void* keys, int64_t count, int64_t dim, float scale, float* out,
            int64_t stride) {
    for (int64_t i = 0; i < nq; ++i) {
        for (int64_t k = 0; k < count; ++k) {
            float dot = 0.0f;
            for (int64_t j = 0; j < dim; ++j) dot += q[i * dim + j] * cached<K>(keys, k * dim + j);
            out[i * stride + k] = dot * scale;
        }
    }
}

template <KvType K>
void accumulate(const float* weights, int64_t weight_stride, int64_t rows, const void* values, int64_t count,
                int64_t dim, float* out, int64_t out_stride) {
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t k = 0; k < count; ++k) {
            for (int64_t j = 0; j < dim; ++j) {
                out[r * out_stride + j] = std::fma(weights[r * weight_stride + k], cached<K>(values, k * dim + j),
                                                   out[r * out_stride + j]);
            }
        }
    }
}

float maximum(const float* x, int64_t count) { return *std::max_element(x, x + count); }

float exp_shifted(float* x, int64_t count, float shift) {
    float sum = 0.0f;
    for (int64_t k = 0; k < count; ++k) sum += (x[k] = std::exp(x[k] - shift));
    return sum;
}

}  // namespace

Attention attention_scalar(KvType kv) {
    if (kv == KvType::F16) {
        return {store_f16, load_f16, scores<KvType::F16>, accumulate<KvType::F16>, maximum, exp_shifted};
    }
    return {store_f32, load_f32, scores<KvType::F32>, accumulate<KvType::F32>, maximum, exp_shifted};
}

}  // namespace pocketllm::kernels
