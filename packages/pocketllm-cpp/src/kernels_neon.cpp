// AArch64 NEON kernels (Advanced SIMD is part of every AArch64 CPU, so no run-time check is needed beyond the
// build's target; isa.cpp offers "neon" only in an AArch64 build). Integer dot products with the base
// instruction set (vmull/vmlal of 8-bit lanes into 16-bit ones, pairwise-added into 32-bit ones), so any ARMv8-A
// runs them; tested against the scalar path under qemu-aarch64 (tests/cpp/test_kernels.py).
#include <arm_neon.h>

#include <cstring>

#include "kernels.h"

namespace pocketllm::kernels {
namespace {

// A 32-value sub-block's codes as two 16-lane vectors, with its scales: w = dw * code * mul + dm * min + mw. Q4_0,
// Q4_1 and Q8_0 (the common GGUF storage types) are decoded in registers; the others through the shared scalar
// decoder.
struct Codes {
    int8x16_t lo, hi;
    int16_t mul[2], min[2];
    float dw, dm, mw;
};

inline Codes decode(StorageType type, const uint8_t* row, int64_t b) {
    Codes c;
    c.mul[0] = c.mul[1] = 1;
    c.min[0] = c.min[1] = 0;
    c.dm = c.mw = 0.0f;
    switch (type) {
        case StorageType::Q4_0:
        case StorageType::Q4_1: {
            const bool offset = type == StorageType::Q4_1;
            const uint8_t* blk = row + b * (offset ? sizeof(BlockQ4_1) : sizeof(BlockQ4_0));
            uint16_t d, m;
            std::memcpy(&d, blk, 2);
            const uint8x16_t qs = vld1q_u8(blk + (offset ? 4 : 2));
            int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(qs, vdupq_n_u8(0x0F)));
            int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(qs, 4));
            c.dw = fp16_to_fp32(d);
            if (offset) {
                std::memcpy(&m, blk + 2, 2);
                c.mw = fp16_to_fp32(m);
            } else {  // (q - 8) d: signed codes, no offset term
                lo = vsubq_s8(lo, vdupq_n_s8(8));
                hi = vsubq_s8(hi, vdupq_n_s8(8));
            }
            c.lo = lo;
            c.hi = hi;
            return c;
        }
        case StorageType::Q8_0: {
            const uint8_t* blk = row + b * sizeof(BlockQ8_0);
            uint16_t d;
            std::memcpy(&d, blk, 2);
            c.dw = fp16_to_fp32(d);
            c.lo = vld1q_s8(reinterpret_cast<const int8_t*>(blk + 2));
            c.hi = vld1q_s8(reinterpret_cast<const int8_t*>(blk + 18));
            return c;
        }
        default: {
            SubBlock sub;
            decode_sub_block(type, row, b, sub);  // codes 0..31 or -32..31: all fit int8
            c.lo = vld1q_s8(reinterpret_cast<const int8_t*>(sub.code));
            c.hi = vld1q_s8(reinterpret_cast<const int8_t*>(sub.code + 16));
            c.mul[0] = sub.mul[0];
            c.mul[1] = sub.mul[1];
            c.min[0] = sub.min[0];
            c.min[1] = sub.min[1];
            c.dm = sub.dm;
            c.dw = sub.dw;
            c.mw = sub.mw;
            return c;
        }
    }
}

// sum(code * x) over 16 lanes: |code| <= 128 and |x| <= 127, so two products sum within int16.
inline int32_t dot16(int8x16_t w, const int8_t* x) {
    const int8x16_t v = vld1q_s8(x);
    const int16x8_t pairs = vmlal_s8(vmull_s8(vget_low_s8(w), vget_low_s8(v)), vget_high_s8(w), vget_high_s8(v));
    return vaddvq_s32(vpaddlq_s16(pairs));
}

void gemm_blocks(const WeightView& w, int64_t row_begin, int64_t row_end, const QuantizedRows& act, int64_t n,
                 float* y, int64_t y_stride) {
    const size_t stride = row_bytes(w.type, w.cols);
    const int64_t nb = w.cols / kBlock;
    for (int64_t row = row_begin; row < row_end; ++row) {
        const uint8_t* base = w.data + row * static_cast<int64_t>(stride);
        for (int64_t r = 0; r < n; ++r) y[r * y_stride + row] = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const Codes c = decode(w.type, base, b);  // once for every activation row
            for (int64_t r = 0; r < n; ++r) {
                const int8_t* x = act.codes(r, b);
                const float dx = act.scale(r, b);
                const int32_t dot = dot16(c.lo, x) * c.mul[0] + dot16(c.hi, x + 16) * c.mul[1];
                float sum = c.dw * dx * static_cast<float>(dot) + c.mw * act.offset(r, b);
                if (c.min[0] != 0 || c.min[1] != 0) {  // Q2_K's per-16 mins, against each 16 codes' sum
                    const int32_t mins = vaddlvq_s8(vld1q_s8(x)) * c.min[0] + vaddlvq_s8(vld1q_s8(x + 16)) * c.min[1];
                    sum += c.dm * dx * static_cast<float>(mins);
                }
                y[r * y_stride + row] += sum;
            }
        }
    }
}

inline float32x4_t dense4(StorageType type, const uint8_t* row, int64_t i) {
    if (type == StorageType::F32) return vld1q_f32(reinterpret_cast<const float*>(row) + i);
    const uint16x4_t halves = vld1_u16(reinterpret_cast<const uint16_t*>(row) + i);
    if (type == StorageType::F16) return vcvt_f32_f16(vreinterpret_f16_u16(halves));
    return vreinterpretq_f32_u32(vshll_n_u16(halves, 16));  // bf16: the top half of f32
}

void gemm_dense(const WeightView& w, int64_t row_begin, int64_t row_end, const float* x, int64_t n, float* y,
                int64_t y_stride) {
    const size_t stride = row_bytes(w.type, w.cols);
    for (int64_t row = row_begin; row < row_end; ++row) {
        const uint8_t* base = w.data + row * static_cast<int64_t>(stride);
        for (int64_t r = 0; r < n; ++r) {
            float32x4_t acc = vdupq_n_f32(0.0f);
            for (int64_t k = 0; k < w.cols; k += 4) acc = vfmaq_f32(acc, dense4(w.type, base, k), vld1q_f32(x + r * w.cols + k));
            y[r * y_stride + row] = vaddvq_f32(acc);
        }
    }
}

void store_f16(const float* values, int64_t dim, void* out) {
    for (int64_t j = 0; j < dim; j += 4) {
        vst1_u16(static_cast<uint16_t*>(out) + j, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(values + j))));
    }
}

void load_f16(const void* rows, int64_t count, int64_t dim, float* out) {
    const uint16_t* in = static_cast<const uint16_t*>(rows);
    for (int64_t i = 0; i < count * dim; i += 4) vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(in + i))));
}

// 4 values of a cached row from value i on, as float32 (converted in registers).
template <KvType K>
inline float32x4_t load4(const void* rows, int64_t i) {
    if constexpr (K == KvType::F16) {
        return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(static_cast<const uint16_t*>(rows) + i)));
    } else {
        return vld1q_f32(static_cast<const float*>(rows) + i);
    }
}

template <KvType K>
void scores(const float* q, int64_t nq, const void* keys, int64_t count, int64_t dim, float scale, float* out,
            int64_t stride) {
    for (int64_t i = 0; i < nq; ++i) {
        for (int64_t k = 0; k < count; ++k) {
            float32x4_t acc = vdupq_n_f32(0.0f);
            for (int64_t j = 0; j < dim; j += 4) acc = vfmaq_f32(acc, vld1q_f32(q + i * dim + j), load4<K>(keys, k * dim + j));
            out[i * stride + k] = vaddvq_f32(acc) * scale;
        }
    }
}

template <KvType K>
void accumulate(const float* weights, int64_t weight_stride, int64_t rows, const void* values, int64_t count,
                int64_t dim, float* out, int64_t out_stride) {
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < dim; j += 4) {
            float32x4_t acc = vld1q_f32(out + r * out_stride + j);
            for (int64_t k = 0; k < count; ++k) {
                acc = vfmaq_n_f32(acc, load4<K>(values, k * dim + j), weights[r * weight_stride + k]);
            }
            vst1q_f32(out + r * out_stride + j, acc);
        }
    }
}

}  // namespace

void gemm_neon(const WeightView& w, int64_t row_begin, int64_t row_end, const QuantizedRows& act, const float* x,
               int64_t n, float* y, int64_t y_stride) {
    if (is_quantized(w.type)) return gemm_blocks(w, row_begin, row_end, act, n, y, y_stride);
    if (w.type == StorageType::F8_E4M3) return gemm_scalar(w, row_begin, row_end, act, x, n, y, y_stride);
    gemm_dense(w, row_begin, row_end, x, n, y, y_stride);
}

void quantize_row_neon(const float* x, int64_t cols, int8_t* qs, float* d, float* s) {
    for (int64_t b = 0; b < cols / kBlock; ++b) {
        const float* v = x + b * kBlock;
        float32x4_t vals[8];
        float32x4_t amax = vdupq_n_f32(0.0f);
        for (int k = 0; k < 8; ++k) {
            vals[k] = vld1q_f32(v + 4 * k);
            amax = vmaxq_f32(amax, vabsq_f32(vals[k]));
        }
        const float scale = vmaxvq_f32(amax) / 127.0f;
        const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        int32x4_t total = vdupq_n_s32(0);
        for (int k = 0; k < 8; k += 2) {
            // vcvtn rounds half to even, as the scalar path's nearbyint does.
            const int32x4_t q0 = vcvtnq_s32_f32(vmulq_n_f32(vals[k], inverse));
            const int32x4_t q1 = vcvtnq_s32_f32(vmulq_n_f32(vals[k + 1], inverse));
            total = vaddq_s32(total, vaddq_s32(q0, q1));
            const int16x8_t q16 = vcombine_s16(vqmovn_s32(q0), vqmovn_s32(q1));
            vst1_s8(qs + b * kBlock + 4 * k, vqmovn_s16(q16));
        }
        d[b] = scale;
        s[b] = scale * static_cast<float>(vaddvq_s32(total));
    }
}

Attention attention_neon(KvType kv) {
    const Attention scalar = attention_scalar(kv);
    if (kv == KvType::F16) {
        return {store_f16, load_f16, scores<KvType::F16>, accumulate<KvType::F16>, scalar.maximum,
                scalar.exp_shifted};
    }
    return {scalar.store, scalar.load, scores<KvType::F32>, accumulate<KvType::F32>, scalar.maximum,
            scalar.exp_shifted};
}

}  // namespace pocketllm::kernels
