// The one implementation of delta_rule.h's kernels, included by delta_rule_<isa>.cpp after it defines
// PLLM_GATED_DELTA (the name of its table function). Written with GCC/Clang vector extensions, 8 floats a vector,
// which each file's flags lower to that ISA's registers: two SSE registers on baseline x86-64, one AVX register
// with AVX2, two NEON registers on AArch64. Columns of the state are independent, so every loop runs over 8 columns
// at a time (a chunk over blocks of them, one token over whole rows), with a scalar tail for sizes that are not a
// multiple of 8.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "delta_rule.h"

namespace pocketllm::kernels {
namespace {

using v8 = float __attribute__((vector_size(32)));

template <class V>
constexpr int64_t kLanes = static_cast<int64_t>(sizeof(V) / sizeof(float));

template <class V>
inline V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
template <class V>
inline void store(float* p, const V& v) {
    std::memcpy(p, &v, sizeof v);
}
inline float splat_of(float x, float*) { return x; }
inline v8 splat_of(float x, v8*) { return v8{x, x, x, x, x, x, x, x}; }  // one vbroadcastss
template <class V>
inline V splat(float x) {
    return splat_of(x, static_cast<V*>(nullptr));
}

// Values below kTiny in magnitude become zero: a decaying state passes through the subnormal range, where every
// operation on it takes a microcode assist (a tenth of the speed, and more); a term that small next to the O(1)
// terms the state holds changes nothing.
constexpr float kTiny = 1e-30f;
constexpr float kTinyLog = -69.0f;  // exp(kTinyLog) < kTiny

// A NaN stays (every comparison with it is false): a broken state must not turn into a plausible one.
inline float flush(float x) { return std::fabs(x) <= kTiny ? 0.0f : x; }
inline v8 flush(v8 x) {
    using v8i = int32_t __attribute__((vector_size(32)));
    const v8i tiny = (x <= splat<v8>(kTiny)) & (x >= splat<v8>(-kTiny));
    v8i bits;
    std::memcpy(&bits, &x, sizeof bits);
    bits &= ~tiny;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}
// exp(x) for x <= 0, zero where it would be below kTiny.
inline float decay_of(float x) { return x > kTinyLog ? std::exp(x) : 0.0f; }

inline float lanes_sum(const v8& v) {
    float sum = 0.0f;
    for (int l = 0; l < 8; ++l) sum += v[l];
    return sum;
}

float dot(const float* a, const float* b, int64_t n) {
    v8 acc{};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc += load<v8>(a + i) * load<v8>(b + i);
    float sum = lanes_sum(acc);
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

// What a chunk's tokens share, for every block of columns: the decays from the chunk's start (G, the cumulative log
// decay), and the pairwise terms of the forward substitution.
struct Coefficients {
    float decay[kDeltaChunk];   // exp(G_t): S_0's share in token t
    float tail[kDeltaChunk];    // exp(G_last - G_t): token t's share in the chunk's final state
    float last;                 // exp(G_last)
    float beta[kDeltaChunk];
    float keys[kDeltaChunk][kDeltaChunk];     // s < t: beta_t exp(G_t - G_s) k_t . k_s
    float queries[kDeltaChunk][kDeltaChunk];  // s <= t: exp(G_t - G_s) q_t . k_s
};

// kk[t][s] = k_t . k_s and qk[t][s] = q_t . k_s for s <= t, four s at a time: eight independent sums, so that the
// adds do not wait on each other (one dot at a time waits on its own sum's latency at every step).
void chunk_dots(const DeltaInputs& in, int64_t c, float (&kk)[kDeltaChunk][kDeltaChunk],
                float (&qk)[kDeltaChunk][kDeltaChunk]) {
    constexpr int kAtOnce = 4;
    for (int64_t t = 0; t < c; ++t) {
        const float* q = in.q + t * in.qk_stride;
        const float* k = in.k + t * in.qk_stride;
        for (int64_t s0 = 0; s0 <= t; s0 += kAtOnce) {
            const float* ks[kAtOnce];
            for (int j = 0; j < kAtOnce; ++j) ks[j] = in.k + std::min(s0 + j, t) * in.qk_stride;  // past t: unused
            v8 with_k[kAtOnce] = {}, with_q[kAtOnce] = {};
            int64_t i = 0;
            for (; i + 8 <= in.dk; i += 8) {
                const v8 kv = load<v8>(k + i), qv = load<v8>(q + i);
                for (int j = 0; j < kAtOnce; ++j) {
                    const v8 other = load<v8>(ks[j] + i);
                    with_k[j] += kv * other;
                    with_q[j] += qv * other;
                }
            }
            for (int j = 0; j < kAtOnce && s0 + j <= t; ++j) {
                float sk = lanes_sum(with_k[j]), sq = lanes_sum(with_q[j]);
                for (int64_t r = i; r < in.dk; ++r) {
                    sk += k[r] * ks[j][r];
                    sq += q[r] * ks[j][r];
                }
                kk[t][s0 + j] = sk;
                qk[t][s0 + j] = sq;
            }
        }
    }
}

void coefficients(const DeltaInputs& in, int64_t c, Coefficients& co) {
    float kk[kDeltaChunk][kDeltaChunk], qk[kDeltaChunk][kDeltaChunk];
    chunk_dots(in, c, kk, qk);
    float G[kDeltaChunk] = {};
    float running = 0.0f;
    for (int64_t t = 0; t < c; ++t) G[t] = running += in.g[t];
    co.last = decay_of(G[c - 1]);
    for (int64_t t = 0; t < c; ++t) {
        co.decay[t] = decay_of(G[t]);
        co.tail[t] = decay_of(G[c - 1] - G[t]);
        co.beta[t] = in.beta[t];
        for (int64_t s = 0; s <= t; ++s) {
            const float between = decay_of(G[t] - G[s]);
            co.queries[t][s] = between * qk[t][s];
            if (s < t) co.keys[t][s] = in.beta[t] * between * kk[t][s];
        }
    }
}

// Columns [j, j + B * lanes) of the chunk. With S_0 the state before it, token t's correction
//   u_t = beta_t (v_t - exp(G_t) S_0^T k_t) - sum_{s<t} keys[t][s] u_s
// (the recurrence's new value, as every earlier token of the chunk changed the state), its output
//   o_t = exp(G_t) S_0^T q_t + sum_{s<=t} queries[t][s] u_s
// and the final state exp(G_last) S_0 + sum_t tail_t k_t u_t^T.
template <class V, int B>
void columns(const DeltaInputs& in, int64_t c, const Coefficients& co, float* S, int64_t j, float* out,
             int64_t out_stride) {
    constexpr int64_t L = kLanes<V>;
    constexpr int64_t W = B * L;  // the block's columns
    // The block's columns of S_0 side by side: rows of S are dv floats apart, a power of two for every published
    // shape, so a block read in place maps to a few cache sets and leaves L1 between the tokens that reread it.
    thread_local std::vector<float> copy;
    copy.resize(static_cast<size_t>(in.dk * W));
    for (int64_t i = 0; i < in.dk; ++i) std::memcpy(&copy[i * W], S + i * in.dv + j, sizeof(float) * W);
    const float* block = copy.data();
    constexpr int64_t stride = W;
    V u[kDeltaChunk][B];
    for (int64_t t = 0; t < c; ++t) {
        const float* q = in.q + t * in.qk_stride;
        const float* k = in.k + t * in.qk_stride;
        V remembered[B] = {}, read[B] = {};  // S_0^T k_t, S_0^T q_t
        for (int64_t i = 0; i < in.dk; ++i) {
            const float* row = block + i * stride;
            const V ki = splat<V>(k[i]), qi = splat<V>(q[i]);
            for (int b = 0; b < B; ++b) {
                const V s = load<V>(row + b * L);
                remembered[b] += ki * s;
                read[b] += qi * s;
            }
        }
        const float* v = in.v + t * in.v_stride + j;
        float* o_row = out + t * out_stride + j;
        for (int b = 0; b < B; ++b) {
            V value = (load<V>(v + b * L) - remembered[b] * co.decay[t]) * co.beta[t];
            for (int64_t s = 0; s < t; ++s) value -= u[s][b] * co.keys[t][s];
            u[t][b] = value;
            V o = read[b] * co.decay[t];
            for (int64_t s = 0; s <= t; ++s) o += u[s][b] * co.queries[t][s];
            store(o_row + b * L, o);
        }
    }
    // Two rows of the state at a time: each u_t loaded once for both.
    int64_t i = 0;
    for (; i + 2 <= in.dk; i += 2) {
        float* row = S + i * in.dv + j;
        V state[2][B];
        for (int b = 0; b < B; ++b) {
            state[0][b] = load<V>(block + i * stride + b * L) * co.last;
            state[1][b] = load<V>(block + (i + 1) * stride + b * L) * co.last;
        }
        for (int64_t t = 0; t < c; ++t) {
            const float* k = in.k + t * in.qk_stride + i;
            const V first = splat<V>(co.tail[t] * k[0]), second = splat<V>(co.tail[t] * k[1]);
            for (int b = 0; b < B; ++b) {
                state[0][b] += first * u[t][b];
                state[1][b] += second * u[t][b];
            }
        }
        for (int b = 0; b < B; ++b) {
            store(row + b * L, flush(state[0][b]));
            store(row + in.dv + b * L, flush(state[1][b]));
        }
    }
    for (; i < in.dk; ++i) {
        float* row = S + i * in.dv + j;
        V state[B];
        for (int b = 0; b < B; ++b) state[b] = load<V>(block + i * stride + b * L) * co.last;
        for (int64_t t = 0; t < c; ++t) {
            const V weight = splat<V>(co.tail[t] * in.k[t * in.qk_stride + i]);
            for (int b = 0; b < B; ++b) state[b] += weight * u[t][b];
        }
        for (int b = 0; b < B; ++b) store(row + b * L, flush(state[b]));
    }
}

// One token (decode) in two sweeps of the state in row order: S^T k and S^T q, then the update. A decode step
// finds each head's state in memory (the weights streamed since the last step have evicted it), and the column
// blocks' order reads 32 of a row's dv floats, then jumps a row, which the hardware prefetchers do not follow as
// they follow a sweep. Both sweeps also ask for the next head's state (in.next_state), so that more of it is on
// its way at once, and while the second sweep works from L2 memory keeps working too. The arithmetic is columns()'
// with c = 1 (the compiler may fuse other multiply-adds, so the last bits can differ from it); decode and a
// prompt's unchunked tokens both run it, so a token's bits still depend on its position alone.
void recurrent(const DeltaInputs& in, const Coefficients& co, float* S, float* out) {
    const int64_t dk = in.dk, dv = in.dv, wide = dv / 8 * 8;
    thread_local std::vector<float> remembered, read;  // S^T k and S^T q; then remembered holds u
    remembered.assign(static_cast<size_t>(dv), 0.0f);
    read.assign(static_cast<size_t>(dv), 0.0f);
    float* r = remembered.data();
    float* q = read.data();
    // The next head's state rows (in.next_state) are asked for half in each sweep: rows [0, dk / 2) here, one every
    // second row, and the rest as the update reaches them.
    constexpr int64_t kLineFloats = 16;  // 64-byte cache lines
    const auto prefetch_next = [&](int64_t row) {
        for (int64_t j = 0; j < dv; j += kLineFloats) __builtin_prefetch(in.next_state + row * dv + j, 0, 3);
    };
    for (int64_t i = 0; i < dk; ++i) {
        const float* row = S + i * dv;
        if (in.next_state != nullptr && i % 2 == 0) prefetch_next(i / 2);
        const float k_i = in.k[i], q_i = in.q[i];
        const v8 kv = splat<v8>(k_i), qv = splat<v8>(q_i);
        for (int64_t j = 0; j < wide; j += 8) {
            const v8 s = load<v8>(row + j);
            store(r + j, load<v8>(r + j) + kv * s);
            store(q + j, load<v8>(q + j) + qv * s);
        }
        for (int64_t j = wide; j < dv; ++j) {
            r[j] += k_i * row[j];
            q[j] += q_i * row[j];
        }
    }
    const float decay = co.decay[0], beta = co.beta[0], both = co.queries[0][0];
    for (int64_t j = 0; j < wide; j += 8) {
        const v8 u = (load<v8>(in.v + j) - load<v8>(r + j) * decay) * beta;
        store(r + j, u);
        store(out + j, load<v8>(q + j) * decay + u * both);
    }
    for (int64_t j = wide; j < dv; ++j) {
        const float u = (in.v[j] - r[j] * decay) * beta;
        r[j] = u;
        out[j] = q[j] * decay + u * both;
    }
    for (int64_t i = 0; i < dk; ++i) {
        float* row = S + i * dv;
        if (in.next_state != nullptr && i >= dk / 2) prefetch_next(i);
        const float weight = co.tail[0] * in.k[i];
        const v8 wv = splat<v8>(weight);
        for (int64_t j = 0; j < wide; j += 8) store(row + j, flush(load<v8>(row + j) * co.last + wv * load<v8>(r + j)));
        for (int64_t j = wide; j < dv; ++j) row[j] = flush(row[j] * co.last + weight * r[j]);
    }
}

void delta_rule(const DeltaInputs& strided, int64_t c, float* S, float* out, int64_t out_stride) {
    // The chunk's q and k rows side by side: in place they are a whole projection row apart (a multiple of 4 KiB
    // in the published shapes), all in the same few cache sets.
    thread_local std::vector<float> qk;
    DeltaInputs in = strided;
    if (c > 1) {
        qk.resize(static_cast<size_t>(2 * c * strided.dk));
        for (int64_t t = 0; t < c; ++t) {
            std::memcpy(&qk[t * strided.dk], strided.q + t * strided.qk_stride, sizeof(float) * strided.dk);
            std::memcpy(&qk[(c + t) * strided.dk], strided.k + t * strided.qk_stride, sizeof(float) * strided.dk);
        }
        in.q = qk.data();
        in.k = qk.data() + c * strided.dk;
        in.qk_stride = strided.dk;
    }
    Coefficients co;
    coefficients(in, c, co);
    if (c == 1) return recurrent(in, co, S, out);
    int64_t j = 0;
    for (; j + 32 <= in.dv; j += 32) columns<v8, 4>(in, c, co, S, j, out, out_stride);
    for (; j + 8 <= in.dv; j += 8) columns<v8, 1>(in, c, co, S, j, out, out_stride);
    for (; j < in.dv; ++j) columns<float, 1>(in, c, co, S, j, out, out_stride);
}

template <class V>
void conv_columns(const float* taps, int64_t kernel, int64_t channels, const float* x, int64_t x_stride, int64_t t,
                  const float* kept, int64_t ch, float* out) {
    V sum{};
    for (int64_t k = 0; k < kernel; ++k) {
        const int64_t at = t - kernel + 1 + k;  // the input this tap reads
        const float* input = at < 0 ? kept + (kernel - 1 + at) * channels : x + at * x_stride;
        sum += load<V>(taps + k * channels + ch) * load<V>(input + ch);
    }
    store(out + ch, sum);
}

void conv(const float* taps, int64_t kernel, int64_t channels, const float* x, int64_t x_stride, int64_t n,
          const float* kept, float* out, int64_t out_stride) {
    for (int64_t t = 0; t < n; ++t) {
        int64_t ch = 0;
        for (; ch + 8 <= channels; ch += 8) conv_columns<v8>(taps, kernel, channels, x, x_stride, t, kept, ch, out + t * out_stride);
        for (; ch < channels; ++ch) conv_columns<float>(taps, kernel, channels, x, x_stride, t, kept, ch, out + t * out_stride);
    }
}

}  // namespace

GatedDeltaKernels PLLM_GATED_DELTA() { return {delta_rule, conv, dot}; }

}  // namespace pocketllm::kernels
