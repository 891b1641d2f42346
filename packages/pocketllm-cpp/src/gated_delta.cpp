#include "gated_delta.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "delta_rule.h"
#include "kernels.h"
#include "pocketllm_cpp/isa.h"

namespace pocketllm {
namespace {

float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // torch's threshold

}  // namespace

namespace kernels {
GatedDeltaKernels gated_delta_kernels() {
#ifdef POCKETLLM_HAVE_X86
    if (current_isa() != Isa::Scalar) return gated_delta_avx2();
#endif
    return gated_delta_scalar();
}
}  // namespace kernels

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

std::vector<float> conv_taps(const GatedDeltaShape& s, const std::vector<float>& conv) {
    const int64_t channels = s.channels(), kernel = s.kernel;
    std::vector<float> taps(conv.size());
    for (int64_t c = 0; c < channels; ++c) {
        for (int64_t k = 0; k < kernel; ++k) taps[static_cast<size_t>(k * channels + c)] = conv[static_cast<size_t>(c * kernel + k)];
    }
    return taps;
}

void conv_state_after(const GatedDeltaShape& s, const float* proj, int64_t tokens, const float* kept, float* out) {
    const int64_t channels = s.channels(), kernel = s.kernel;
    // Row r is input tokens - (kernel - 1) + r. Ascending r reads kept rows at or after r only: safe in place.
    for (int64_t r = 0; r < kernel - 1; ++r) {
        const int64_t at = tokens - (kernel - 1) + r;
        const float* input = at < 0 ? kept + (kernel - 1 + at) * channels : proj + at * s.proj_size();
        std::memmove(out + r * channels, input, static_cast<size_t>(channels) * sizeof(float));
    }
}

void gated_delta_conv(const GatedDeltaShape& s, const std::vector<float>& taps, const float* proj, int64_t first,
                      int64_t count, const float* kept, float* mixed) {
    const int64_t channels = s.channels(), hk = s.num_k_heads, dk = s.k_dim;
    const kernels::GatedDeltaKernels k = kernels::gated_delta_kernels();
    thread_local std::vector<float> before;  // the kernel - 1 inputs before `first`, per worker
    before.resize(static_cast<size_t>((s.kernel - 1) * channels));
    conv_state_after(s, proj, first, kept, before.data());
    float* rows = mixed + first * channels;
    k.conv(taps.data(), s.kernel, channels, proj + first * s.proj_size(), s.proj_size(), count, before.data(), rows,
           channels);
    silu(rows, count * channels);
    const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
    for (int64_t t = 0; t < count; ++t) {
        for (int64_t h = 0; h < 2 * hk; ++h) {  // q heads, then k heads
            float* x = rows + t * channels + h * dk;
            const float factor = (h < hk ? q_scale : 1.0f) / std::sqrt(k.dot(x, x, dk) + 1e-6f);
            for (int64_t i = 0; i < dk; ++i) x[i] *= factor;
        }
    }
}

void gated_delta_head(const GatedDeltaShape& s, const GatedDeltaWeights& w, float eps, const float* proj,
                      const float* mixed, int64_t n, int64_t h, const DeltaRun& run, float* state, float* out,
                      const float* next_state) {
    const int64_t channels = s.channels(), width = s.proj_size(), hk = s.num_k_heads, hv = s.num_v_heads;
    const int64_t dk = s.k_dim, dv = s.v_dim;
    const int64_t key_head = s.tiled_heads ? h % hk : h / (hv / hk);
    thread_local std::vector<float> g, beta, gate;  // per worker, reused call after call
    g.resize(static_cast<size_t>(n));
    beta.resize(g.size());
    gate.resize(static_cast<size_t>(s.v_dim));
    const float decay_rate = w.decay[static_cast<size_t>(h)], dt_bias = w.dt_bias[static_cast<size_t>(h)];
    for (int64_t t = 0; t < n; ++t) {
        const float* b_a = proj + t * width + channels + hv * dv;  // b then a, one per value head
        beta[static_cast<size_t>(t)] = 1.0f / (1.0f + std::exp(-b_a[h]));
        g[static_cast<size_t>(t)] = decay_rate * softplus(b_a[hv + h] + dt_bias);
    }
    const kernels::GatedDeltaKernels k = kernels::gated_delta_kernels();
    float* S = state + s.head_offset(h);
    const int64_t chunked_end = std::min(run.start + n, run.chunked_end);
    auto capture = run.captures.begin();
    for (int64_t t = 0; t < n;) {
        const int64_t at = run.start + t;
        const bool capture_inside = capture != run.captures.end() && capture->tokens < t + kDeltaChunk;
        const int64_t c = at % kDeltaChunk == 0 && at + kDeltaChunk <= chunked_end && !capture_inside ? kDeltaChunk : 1;
        const DeltaInputs in{mixed + t * channels + key_head * dk, mixed + t * channels + (hk + key_head) * dk,
                             channels, mixed + t * channels + 2 * hk * dk + h * dv, channels, &g[static_cast<size_t>(t)],
                             &beta[static_cast<size_t>(t)], dk, dv, t + c == n ? next_state : nullptr};
        k.delta_rule(in, c, S, out + t * hv * dv + h * dv, hv * dv);
        t += c;
        for (; capture != run.captures.end() && capture->tokens == t; ++capture) {
            std::copy_n(S, dk * dv, capture->layer_state + s.head_offset(h));
        }
    }
    // The gated RMSNorm: norm(o) * w * silu(z), per value head.
    for (int64_t t = 0; t < n; ++t) {
        float* o = out + t * hv * dv + h * dv;
        const float inverse = 1.0f / std::sqrt(k.dot(o, o, dv) / static_cast<float>(dv) + eps);
        for (int64_t j = 0; j < dv; ++j) o[j] *= inverse * w.norm[static_cast<size_t>(j)];
        std::copy_n(proj + t * width + channels + h * dv, dv, gate.begin());
        silu_mul(gate.data(), o, dv);
        std::copy(gate.begin(), gate.end(), o);
    }
}

}  // namespace pocketllm
