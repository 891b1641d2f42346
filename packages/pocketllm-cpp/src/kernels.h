// The kernels (private to the library): y = x @ W.T with W read in its GGUF storage type, in place (rows of W are
// output features), activation quantization, and each ISA's gemm, attention and vector helpers.
#pragma once

#include <cstdint>
#include <vector>

#include "pocketllm_cpp/quant.h"
#include "pocketllm_cpp/weights.h"
#include "pocketllm_cpp/thread_pool.h"

namespace pocketllm {

// The planes of QuantizedRows beside the codes and scales that an ISA's kernels read.
struct ActivationPlanes {
    bool grouped = false;  // grouped and the tail planes (the x86 batched tiles)
    bool sums16 = false;   // sums16 (the x86 per-16-scale kernels)
    bool tiles = false;    // tiles (AMX)
};
// Quantizes each of n rows of x [n, cols] to 8-bit blocks (round half to even), as the integer kernels need, and
// fills the planes asked for; many rows are split over `pool` when one is given.
void quantize_activations(const float* x, int64_t n, int64_t cols, QuantizedRows& out, ThreadPool* pool = nullptr,
                          ActivationPlanes planes = {});

// One product of a batch that shares its input: y [n, w.rows] (row stride w.rows) = x @ w.T.
struct Product {
    const WeightView* w;
    float* y;
};

// y [n, rows] = x [n, cols] @ W.T. Quantized weights multiply 8-bit-quantized activations with integer dot
// products (llama.cpp's way) unless `exact`, where each block is dequantized and multiplies x in float32 (slower:
// the arithmetic of a float32 reference, for fidelity checks); F32/F16/BF16 weights multiply x as it is.
void matmul(const WeightView& w, const float* x, int64_t n, float* y, ThreadPool& pool, bool exact = false);
// Several weights over the same x (q/k/v, gate/up) in one parallel region, quantizing x once.
void matmul_many(const std::vector<Product>& products, const float* x, int64_t n, ThreadPool& pool,
                 bool exact = false);

// A product over its own input rows: y [n, w.rows] (row stride w.rows) = x [n, w.cols] @ w.T.
struct GroupedProduct {
    const WeightView* w;
    const float* x;
    int64_t n;
    float* y;
};
// Products over different inputs (a mixture of experts' chosen experts, each over the rows routed to it) in one
// parallel region: each input quantized once (products that follow each other with the same x, n and columns share
// it), each row's result the bits matmul gives it.
void matmul_grouped(const std::vector<GroupedProduct>& products, ThreadPool& pool, bool exact = false);

// W as float32 [rows, cols] (tests, and layers that need dense values).
void dequantize(const WeightView& w, float* out);
// A row of a weight (an embedding lookup) as float32.
void dequantize_row(const WeightView& w, int64_t row, float* out);

// x[i] = exp(x[i] - shift) with the current ISA's vector exp; returns their sum (softmax, sampling).
float exp_shifted(float* x, int64_t n, float shift);
// The largest of x[0..n) (n >= 1), with the ISA's vector max.
float maximum(const float* x, int64_t n);

// gate[i] = silu(gate[i]) * up[i] (SwiGLU) with the current ISA's vector exp.
void silu_mul(float* gate, const float* up, int64_t n);
// x[i] = silu(x[i]).
void silu(float* x, int64_t n);

namespace kernels {
// Value i of row `row` (at `base`) of a float or FP8 weight, as float32.
inline float dense_value(const WeightView& w, const uint8_t* base, int64_t row, int64_t i) {
    switch (w.type) {
        case StorageType::F16: return fp16_to_fp32(reinterpret_cast<const uint16_t*>(base)[i]);
        case StorageType::BF16: return bf16_to_fp32(reinterpret_cast<const uint16_t*>(base)[i]);
        case StorageType::F8_E4M3: return fp8_e4m3_to_fp32(base[i]) * w.scale(row, i);
        default: return reinterpret_cast<const float*>(base)[i];
    }
}

// Rows [row_begin, row_end) of W against every row of x: y[r * y_stride + row]. `act` is x quantized (read for
// quantized weights only). Per ISA; an ISA's kernel reuses each decoded weight block across several activation rows.
using Gemm = void (*)(const WeightView& w, int64_t row_begin, int64_t row_end, const QuantizedRows& act,
                      const float* x, int64_t n, float* y, int64_t y_stride);
void gemm_scalar(const WeightView&, int64_t, int64_t, const QuantizedRows&, const float*, int64_t, float*, int64_t);
void gemm_avx2(const WeightView&, int64_t, int64_t, const QuantizedRows&, const float*, int64_t, float*, int64_t);
void gemm_avx512(const WeightView&, int64_t, int64_t, const QuantizedRows&, const float*, int64_t, float*, int64_t);
void gemm_amx(const WeightView&, int64_t, int64_t, const QuantizedRows&, const float*, int64_t, float*, int64_t);
// gemm_amx's tiles take products of kAmxMinRows activation rows or more, a panel of kAmxPanelRows weight rows at a
// time; fewer rows run the AVX-512 kernels. Measured on a Xeon (Emerald Rapids, two threads, random blocks, against
// the AVX-512 kernels interleaved): at 64 rows Q8_0 1.24-1.34x and Q4_K 1.04-1.36x, at 32 Q4_1 0.77-0.93x, at 16
// Q4_K 0.67-0.79x (each panel's decoding and transposes then weigh more than the tiles save).
constexpr int64_t kAmxMinRows = 64, kAmxPanelRows = 16;
// Whether gemm_amx runs a product of `w` over n activation rows on its tiles: a 32-value block type or Q4_K, Q5_K or
// IQ4_XS, with a whole group of 8 blocks a row, over kAmxMinRows rows or more, and not `exact`.
inline bool amx_takes(const WeightView& w, int64_t n, bool exact) {
    switch (w.type) {
        case StorageType::Q4_0: case StorageType::Q4_1: case StorageType::Q5_0: case StorageType::Q5_1:
        case StorageType::Q8_0: case StorageType::IQ4_NL: case StorageType::MXFP4: case StorageType::Q4_K:
        case StorageType::Q5_K: case StorageType::IQ4_XS:
            return !exact && n >= kAmxMinRows && w.cols >= 8 * kBlock;
        default: return false;
    }
}
void gemm_neon(const WeightView&, int64_t, int64_t, const QuantizedRows&, const float*, int64_t, float*, int64_t);
void gemm_exact(const WeightView&, int64_t, int64_t, const QuantizedRows&, const float*, int64_t, float*, int64_t);

void quantize_row_scalar(const float* x, int64_t cols, int8_t* qs, float* d, float* s);
void silu_mul_scalar(float* gate, const float* up, int64_t n);
void silu_mul_avx2(float* gate, const float* up, int64_t n);
void silu_scalar(float* x, int64_t n);
void silu_avx2(float* x, int64_t n);
void quantize_row_avx2(const float* x, int64_t cols, int8_t* qs, float* d, float* s);
void quantize_row_neon(const float* x, int64_t cols, int8_t* qs, float* d, float* s);

// Attention over cached key and value rows, read where they are stored (the cache's element type converted to
// float32 in registers). Per ISA and KV type.
struct Attention {
    void (*store)(const float* values, int64_t dim, void* out);               // one row into the cache
    void (*load)(const void* rows, int64_t count, int64_t dim, float* out);   // cached rows as float32
    // scores[i * stride + k] = scale * q_i . keys[k] for nq query rows q_i = q + i * dim and count cached key rows.
    void (*scores)(const float* q, int64_t nq, const void* keys, int64_t count, int64_t dim, float scale,
                   float* scores, int64_t stride);
    // For each of `rows` rows r: out + r * out_stride += sum_k weights[r * weight_stride + k] * values[k] over
    // count cached value rows, each value in one fused multiply-add chain over k in order (so a row's result does
    // not depend on the rows beside it, nor on how the rows were split into calls).
    void (*accumulate)(const float* weights, int64_t weight_stride, int64_t rows, const void* values, int64_t count,
                       int64_t dim, float* out, int64_t out_stride);
    float (*maximum)(const float* x, int64_t count);  // of count >= 1 values
    // x[k] = exp(x[k] - shift); returns their sum
    float (*exp_shifted)(float* x, int64_t count, float shift);
};
Attention attention_scalar(KvType kv);
Attention attention_avx2(KvType kv);
Attention attention_neon(KvType kv);
// The current ISA's attention kernels for heads of `dim` values (scalar where the ISA's vectors do not divide it).
Attention attention_for(KvType kv, int64_t dim);
}  // namespace kernels

}  // namespace pocketllm
