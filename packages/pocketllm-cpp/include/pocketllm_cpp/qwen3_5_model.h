// Qwen3.5, dense and MoE: a hybrid of Gated DeltaNet layers (a fixed-size state per request, in the model's state
// slots) and gated full-attention layers (the paged KV cache), over weights read in place.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pocketllm_cpp/weights.h"
#include "pocketllm_cpp/model.h"
#include "pocketllm_cpp/profile.h"
#include "pocketllm_cpp/thread_pool.h"

namespace pocketllm {

struct Qwen3_5Config {
    int64_t vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim;
    int64_t rotary_dim;  // RoPE (rotate-half) on the first rotary_dim values of each head
    float rms_norm_eps;
    std::vector<float> inv_freq;  // rotary_dim / 2 frequencies, scaling applied
    float rope_attention_factor = 1.0f;
    // Gated DeltaNet
    int64_t linear_num_k_heads, linear_num_v_heads, linear_k_dim, linear_v_dim, conv_kernel;
    bool tiled_heads;  // llama.cpp's GGUF value-head order (see gated_delta.h)
    bool exact_activations;
    KvType kv_type = KvType::F16;
};

struct MoeWeights;    // moe.h
struct DeltaCapture;  // gated_delta.h

// What a layer keeps per request: KV in the paged cache, or a fixed-size state in a slot.
enum class LayerKind { FullAttention, LinearAttention };

struct Qwen3_5Layer {
    LayerKind kind;
    std::vector<float> input_norm, post_attention_norm;  // zero-centred norms: 1 + w already added
    // FullAttention: q rows are per head its query then its output gate.
    WeightView q, k, v, o;
    std::vector<float> q_norm, k_norm;
    // LinearAttention: in_proj rows q k v | z | b | a as four matrices, out_proj.
    WeightView qkv, z, b, a, out;
    std::vector<float> conv, decay, dt_bias, norm;  // conv [channels, kernel], -exp(A_log), dt_bias, norm [v_dim]
    // Feed-forward: a dense SwiGLU (gate, up, down), or experts (moe.h's MoeWeights, kept opaque here).
    WeightView gate, up, down;
    bool is_moe = false;
    std::shared_ptr<const MoeWeights> moe;
};

// The multi-token-prediction head (speculative decoding's mtp): at position i, the normed embedding of token i + 1
// and the normed final hidden state at i, concatenated in that order and projected back (fc [hidden, 2 * hidden]),
// through one full-attention layer of the model's kind, then a norm; the model's lm_head reads its output.
struct Qwen3_5MTP {
    std::vector<float> embedding_norm, hidden_norm, norm;  // zero-centred norms: 1 + w already added
    WeightView fc;
    Qwen3_5Layer layer;
};

class PagedAttention;

class Qwen3_5Model final : public Model {
public:
    // `num_state_slots`: requests that may run at once (max_num_seqs). Throws std::invalid_argument for sizes that do
    // not match the config or overflow.
    // `mtp`: the head, if speculative decoding drafts with it (its layer's keys and values join the KV cache).
    Qwen3_5Model(Qwen3_5Config config, WeightView embedding, std::vector<Qwen3_5Layer> layers,
                 std::vector<float> final_norm, WeightView lm_head, int64_t num_blocks, int64_t block_size,
                 int64_t num_state_slots, int num_threads, std::optional<Qwen3_5MTP> mtp = std::nullopt);
    ~Qwen3_5Model() override;

    const Qwen3_5Config& config() const { return config_; }
    int64_t num_state_slots() const override { return num_slots_; }
    int64_t state_bytes() const override { return slot_floats_ * 4; }
    void save_state(int32_t slot, float* out) const override;
    void load_state(int32_t slot, const float* in) override;
    int64_t chunk_alignment() const override;

    std::vector<float> forward(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices,
                               std::vector<float>* pooled = nullptr,
                               const std::vector<StateCapture>* captures = nullptr,
                               std::vector<float>* hidden = nullptr) override;
    bool has_mtp() const override { return mtp_.has_value(); }
    std::vector<float> mtp_forward(const std::vector<int32_t>& tokens, const std::vector<float>& hidden,
                                   const std::vector<SequenceSlice>& slices) override;
    std::vector<float> mtp_logits(const std::vector<float>& hidden) override;
    void add_profile(Profile& into) const override;
    void reset_profile() override;

private:
    struct Batch;

    // A batch's positions and RoPE tables, its buffers sized for `tokens`.
    Batch batch_of(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices) const;
    // The checks of a layer's sizes against the config (std::invalid_argument naming it).
    void validate_layer(const Qwen3_5Layer& layer, const std::string& at) const;
    // Layer `L`'s attention over the KV cache's layer `attention_index`.
    void attention_layer(const Qwen3_5Layer& L, int64_t attention_index, Batch& batch,
                         const std::vector<SequenceSlice>& slices);
    void linear_layer(int64_t layer, int64_t state_offset, Batch& batch, const std::vector<SequenceSlice>& slices,
                      const std::vector<StateCapture>& captures);
    // Each slice's captures of the linear layer at `state_offset` in its state, in token order, with the conv
    // state at each capture point copied out already (before the convolution moves the slot's state on).
    std::vector<std::vector<DeltaCapture>> conv_captures(int64_t state_offset, const Batch& batch,
                                                                const std::vector<SequenceSlice>& slices,
                                                                const std::vector<StateCapture>& captures);
    // The residual add of a mixer's output, and the post-attention norm of the sum.
    void add_and_norm(const Qwen3_5Layer& L, Batch& batch);
    void feed_forward(const Qwen3_5Layer& L, Batch& batch);

    Qwen3_5Config config_;
    WeightView embedding_, lm_head_;
    std::vector<Qwen3_5Layer> layers_;
    std::vector<float> final_norm_;
    std::optional<Qwen3_5MTP> mtp_;
    int64_t attention_layers_ = 0;  // the model's; the head's layer is the KV cache's next
    std::vector<std::vector<float>> conv_taps_;  // per layer (empty for attention layers): gated_delta.h's conv_taps
    std::unique_ptr<PagedAttention> kv_;  // the attention layers' KV cache
    int64_t num_slots_, slot_floats_ = 0;
    std::vector<float> states_;  // [slots, slot_floats]: per slot each linear layer's conv then recurrent state
    ThreadPool pool_;
    Profile profile_;
    double wait_at_reset_ = 0;
    int64_t regions_at_reset_ = 0;
};

}  // namespace pocketllm
