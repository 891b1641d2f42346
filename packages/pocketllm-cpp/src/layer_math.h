// The small per-row operations every decoder shares: RMSNorm, the residual add fused with it, RoPE, and running
// per-token work over a pool only when there are enough tokens. Private to the library.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>

#include "pocketllm_cpp/thread_pool.h"

namespace pocketllm {

constexpr int64_t kParallelRows = 16;  // below this many tokens, per-token work runs on the calling thread

inline float rms_scale(const float* x, int64_t size, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < size; ++i) sum += static_cast<double>(x[i]) * x[i];
    return 1.0f / std::sqrt(static_cast<float>(sum / static_cast<double>(size)) + eps);
}

inline void rms_norm(const float* x, const float* weight, int64_t size, float eps, float* out) {
    const float scale = rms_scale(x, size, eps);
    for (int64_t i = 0; i < size; ++i) out[i] = x[i] * scale * weight[i];
}

// x += delta, then out = RMSNorm(x): the residual add and the next norm in one pass over x.
inline void add_rms_norm(float* x, const float* delta, const float* weight, int64_t size, float eps, float* out) {
    for (int64_t i = 0; i < size; ++i) x[i] += delta[i];
    rms_norm(x, weight, size, eps, out);
}

// Rotates the first `dim` values of a head by each pair's angle: pairs (2i, 2i + 1) when `pairs_adjacent`
// (llama.cpp's Llama rows), else (i, i + dim / 2) (rotate-half).
inline void rope(float* head, int64_t dim, const float* cos, const float* sin, bool pairs_adjacent) {
    for (int64_t i = 0; i < dim / 2; ++i) {
        float& a = pairs_adjacent ? head[2 * i] : head[i];
        float& b = pairs_adjacent ? head[2 * i + 1] : head[i + dim / 2];
        const float x0 = a, x1 = b;
        a = x0 * cos[i] - x1 * sin[i];
        b = x1 * cos[i] + x0 * sin[i];
    }
}

inline void for_rows(ThreadPool& pool, int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    if (n < kParallelRows) return fn(0, n);
    pool.parallel_for(n, fn);
}

}  // namespace pocketllm
