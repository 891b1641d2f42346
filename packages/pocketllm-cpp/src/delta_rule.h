// Gated DeltaNet's kernels (private to the library), per ISA: the causal convolution over a run of tokens, and the
// gated delta rule on one value head's float32 state for up to kDeltaChunk tokens at once. delta_rule.inl holds the
// one implementation, written with vector extensions so that each ISA's file compiles it with that ISA's flags.
#pragma once

#include <cstdint>

namespace pocketllm {

// Tokens per chunk of the chunked delta rule: the state is read and written once per chunk rather than per token.
// A divisor of the default block size, so that chunks end on the block boundaries where snapshots are taken.
constexpr int64_t kDeltaChunk = 16;

// One value head's inputs for a run of tokens, token t at row t: q and k (dk values, L2-normalised, q scaled) share
// a stride, v (dv values) has its own; g (the log of the decay, <= 0) and beta are per token, contiguous.
struct DeltaInputs {
    const float* q;
    const float* k;
    int64_t qk_stride;
    const float* v;
    int64_t v_stride;
    const float* g;
    const float* beta;
    int64_t dk, dv;
    // The [dk, dv] state this thread runs next, or null: one token's update asks for it into the cache while it
    // rewrites this one, from L2, so that the next head's first sweep finds it there instead of waiting on memory.
    const float* next_state = nullptr;
};

namespace kernels {

struct GatedDeltaKernels {
    // c (1..kDeltaChunk) tokens of `in` on the state S [dk, dv], the same as c steps of the recurrence
    //   S <- exp(g) S + k (beta (v - exp(g) S^T k))^T,  o = S^T q
    // up to rounding: out row t (at out_stride) = o of token t. The chunk's pairwise decays and dot products make
    // the sequential updates one forward substitution; S is read c + 1 times from L1 and written once.
    void (*delta_rule)(const DeltaInputs& in, int64_t c, float* S, float* out, int64_t out_stride);
    // The depthwise causal convolution's sums (before SiLU) for n tokens of x (rows at x_stride, `channels` values):
    // out[t] = sum_k taps[k] * input(t - kernel + 1 + k), the inputs before the first read from `kept`
    // [kernel - 1, channels] (oldest first; not changed here: gated_delta.h's conv_state_after moves it on).
    // taps [kernel, channels].
    void (*conv)(const float* taps, int64_t kernel, int64_t channels, const float* x, int64_t x_stride, int64_t n,
                 const float* kept, float* out, int64_t out_stride);
    // The sum of a[i] * b[i].
    float (*dot)(const float* a, const float* b, int64_t n);
};
GatedDeltaKernels gated_delta_scalar();
GatedDeltaKernels gated_delta_avx2();
// The current ISA's.
GatedDeltaKernels gated_delta_kernels();

}  // namespace kernels
}  // namespace pocketllm
