#include "gated_delta.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace pocketllm {
namespace {

float silu(float x) { return x / (1.0f + std::exp(-x)); }
float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

void l2_normalize(float* x, int64_t size, float scale) {
    float sum = 0.0f;
    for (int64_t i = 0; i < size; ++i) sum += x[i] * x[i];
    const float factor = scale / std::sqrt(sum + 1e-6f);
    for (int64_t i = 0; i < size; ++i) x[i] *= factor;
}

}  // namespace

void validate(const GatedDeltaShape& s, const GatedDeltaWeights& w) {
    if (s.num_k_heads <= 0 || s.num_v_heads <= 0 || s.k_dim <= 0 || s.v_dim <= 0 || s.kernel <= 0 ||
        s.num_v_heads % s.num_k_heads != 0) {
        throw std::invalid_argument("linear attention needs positive sizes, value heads a multiple of key heads");
    }
    if (s.num_v_heads > (int64_t{1} << 20) || s.k_dim > (int64_t{1} << 16) || s.v_dim > (int64_t{1} << 16) ||
        s.num_k_heads > (int64_t{1} << 20) || s.kernel > 1024) {
        throw std::invalid_argument("linear attention sizes are implausibly large");
    }
    const auto expect = [](const std::vector<float>& v, int64_t size, const char* what) {
        if (static_cast<int64_t>(v.size()) != size) {
            throw std::invalid_argument(std::string("linear attention ") + what + " has " + std::to_string(v.size()) +
                                        " values, expected " + std::to_string(size));
        }
    };
    expect(w.conv, s.channels() * s.kernel, "conv1d");
    expect(w.decay, s.num_v_heads, "A_log");
    expect(w.dt_bias, s.num_v_heads, "dt_bias");
    expect(w.norm, s.v_dim, "norm");
}

void gated_delta_conv(const GatedDeltaShape& s, const GatedDeltaWeights& w, const float* proj, int64_t n, float* state,
                      float* mixed) {
    const int64_t channels = s.channels(), kernel = s.kernel, hk = s.num_k_heads, dk = s.k_dim;
    const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
    for (int64_t t = 0; t < n; ++t) {
        const float* row = proj + t * s.proj_size();
        float* m = mixed + t * channels;
        // The convolution over the kept kernel-1 inputs and this one; the window then moves on by one.
        for (int64_t c = 0; c < channels; ++c) {
            float* kept = state + c * (kernel - 1);
            const float* weight = &w.conv[static_cast<size_t>(c * kernel)];
            float sum = weight[kernel - 1] * row[c];
            for (int64_t k = 0; k < kernel - 1; ++k) sum += weight[k] * kept[k];
            for (int64_t k = 0; k + 1 < kernel - 1; ++k) kept[k] = kept[k + 1];
            if (kernel > 1) kept[kernel - 2] = row[c];
            m[c] = silu(sum);
        }
        for (int64_t h = 0; h < hk; ++h) {
            l2_normalize(m + h * dk, dk, q_scale);
            l2_normalize(m + (hk + h) * dk, dk, 1.0f);
        }
    }
}

void gated_delta_head(const GatedDeltaShape& s, const GatedDeltaWeights& w, float eps, const float* proj,
                      const float* mixed, int64_t n, int64_t h, float* state, float* out) {
    const int64_t channels = s.channels(), hk = s.num_k_heads, hv = s.num_v_heads, dk = s.k_dim, dv = s.v_dim;
    const int64_t key_head = s.tiled_heads ? h % hk : h / (hv / hk);
    float* S = state + s.conv_floats() + h * dk * dv;  // [dk, dv]
    std::vector<float> remembered(static_cast<size_t>(dv));
    const float decay_rate = w.decay[static_cast<size_t>(h)], dt_bias = w.dt_bias[static_cast<size_t>(h)];
    for (int64_t t = 0; t < n; ++t) {
        const float* row = proj + t * s.proj_size();
        const float* zh = row + channels + h * dv;
        const float b = row[channels + hv * dv + h], a = row[channels + hv * dv + hv + h];
        const float* qh = mixed + t * channels + key_head * dk;
        const float* kh = mixed + t * channels + (hk + key_head) * dk;
        const float* vh = mixed + t * channels + 2 * hk * dk + h * dv;
        const float beta = sigmoid(b);
        const float decay = std::exp(decay_rate * softplus(a + dt_bias));
        std::fill(remembered.begin(), remembered.end(), 0.0f);
        for (int64_t i = 0; i < dk; ++i) {
            float* Si = S + i * dv;
            for (int64_t j = 0; j < dv; ++j) {
                Si[j] *= decay;
                remembered[static_cast<size_t>(j)] += kh[i] * Si[j];
            }
        }
        for (int64_t j = 0; j < dv; ++j) {
            remembered[static_cast<size_t>(j)] = (vh[j] - remembered[static_cast<size_t>(j)]) * beta;
        }
        float* oh = out + t * hv * dv + h * dv;
        std::fill(oh, oh + dv, 0.0f);
        for (int64_t i = 0; i < dk; ++i) {
            float* Si = S + i * dv;
            for (int64_t j = 0; j < dv; ++j) {
                Si[j] += kh[i] * remembered[static_cast<size_t>(j)];
                oh[j] += qh[i] * Si[j];
            }
        }
        // The gated RMSNorm: norm(o) * w * silu(z), per value head.
        float sum = 0.0f;
        for (int64_t j = 0; j < dv; ++j) sum += oh[j] * oh[j];
        const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(dv) + eps);
        for (int64_t j = 0; j < dv; ++j) oh[j] = oh[j] * inverse * w.norm[static_cast<size_t>(j)] * silu(zh[j]);
    }
}

}  // namespace pocketllm
