// Gated DeltaNet (Qwen3.5's linear attention) after its input projection: the depthwise causal convolution with
// its state, L2-normalised q/k, the gated delta rule on a float32 state, and the gated RMSNorm. Private to the
// library; qwen3_5_model.cpp calls it per slice, delta_rule.h holds the per-ISA kernels.
#pragma once

#include <cstdint>
#include <vector>

namespace pocketllm {

struct GatedDeltaShape {
    int64_t num_k_heads, num_v_heads, k_dim, v_dim, kernel;
    // Value head h reads key head h % Hk (llama.cpp's GGUF order) instead of h / (Hv / Hk) (Hugging Face's).
    bool tiled_heads;

    int64_t channels() const { return 2 * num_k_heads * k_dim + num_v_heads * v_dim; }  // q, k, v
    int64_t proj_size() const { return channels() + num_v_heads * v_dim + 2 * num_v_heads; }  // + z, b, a
    int64_t conv_floats() const { return channels() * (kernel - 1); }
    int64_t recurrent_floats() const { return num_v_heads * k_dim * v_dim; }
    int64_t state_floats() const { return conv_floats() + recurrent_floats(); }
    // Where value head h's recurrent state [k_dim, v_dim] starts in a layer's state (state_floats of them).
    int64_t head_offset(int64_t h) const { return conv_floats() + h * k_dim * v_dim; }
};

// A layer's weights besides its projections, as the checkpoint has them.
struct GatedDeltaWeights {
    const std::vector<float>& conv;     // [channels, kernel]
    const std::vector<float>& decay;    // -exp(A_log) [Hv]
    const std::vector<float>& dt_bias;  // [Hv]
    const std::vector<float>& norm;     // [v_dim]: the gated RMSNorm's weight
};

// Throws std::invalid_argument when the sizes do not fit the shape (or Hv is not a multiple of Hk).
void validate(const GatedDeltaShape& s, const GatedDeltaWeights& w);

// The conv1d weight [channels, kernel] as the convolution reads it: tap-major [kernel, channels].
std::vector<float> conv_taps(const GatedDeltaShape& s, const std::vector<float>& conv);

// The conv's state after the first `tokens` of a call's inputs (proj rows, q k v first): the kernel-1 inputs
// before that point, oldest first, taken from the call's inputs or, before them, from `kept` (the state when the
// call began) [kernel-1, channels]. `out` may be `kept`: the state moving on in place.
void conv_state_after(const GatedDeltaShape& s, const float* proj, int64_t tokens, const float* kept, float* out);

// Where one sequence's tokens in a call sit: token 0 at position `start`. The delta rule runs a chunk of
// kDeltaChunk tokens at once where the chunk starts at a multiple of kDeltaChunk and ends inside both the call and
// `chunked_end` (the prompt's end), and other tokens one at a time. A token's bits then depend on its sequence
// alone when calls end on multiples of kDeltaChunk inside the prompt (the scheduler's chunk_alignment): tokens
// past the prompt run one at a time in a prompt chunk (a sequence recomputed after preemption) as in decode.
// A copy of the state after the call's first `tokens` tokens, into `layer_state` (this layer's state_floats: the
// head writes its part of the recurrent state).
struct DeltaCapture {
    int64_t tokens;
    float* layer_state;
};
struct DeltaRun {
    int64_t start, chunked_end;
    const std::vector<DeltaCapture>& captures;  // in token order; no chunk runs across one
};

// The two passes over one sequence's n tokens, proj [n, proj_size] (rows q k v | z | b | a) -> out
// [n, Hv * v_dim] before out_proj; `state` is state_floats: the conv's previous kernel-1 inputs [kernel-1,
// channels], oldest first, then the recurrent state [Hv, k_dim, v_dim].
//
// First the convolution with SiLU, q and k L2-normalised, q scaled by k_dim^-0.5, for tokens [first, first + count)
// of a call: rows of mixed [n, channels]. It reads the inputs before `first` from proj, or before the call from
// `kept` (the conv state, [kernel-1, channels], which it does not change), so that a long call's tokens run in
// parallel pieces; conv_state_after then moves the state on. `taps` from conv_taps.
void gated_delta_conv(const GatedDeltaShape& s, const std::vector<float>& taps, const float* proj, int64_t first,
                      int64_t count, const float* kept, float* mixed);
// Then value head h on its own (heads run in parallel): the delta rule on its [k_dim, v_dim] state and the gated
// RMSNorm norm(o) * w * silu(z), into out's head h columns. `next_state`: the recurrent state [k_dim, v_dim] of the
// head this thread runs next, to be asked for into the cache (DeltaInputs::next_state), or null.
void gated_delta_head(const GatedDeltaShape& s, const GatedDeltaWeights& w, float eps, const float* proj,
                      const float* mixed, int64_t n, int64_t h, const DeltaRun& run, float* state, float* out,
                      const float* next_state = nullptr);

}  // namespace pocketllm
