// A Llama-family decoder (Llama, Qwen3) over weights read in place, with a paged KV cache it owns.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "pocketllm_cpp/matmul.h"
#include "pocketllm_cpp/profile.h"
#include "pocketllm_cpp/thread_pool.h"

namespace pocketllm {

struct ModelConfig {
    int64_t vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim;
    float rms_norm_eps;
    bool rope_pairs_adjacent;  // llama.cpp's q/k row order (GGUF Llama): rotate (2i, 2i+1), else (i, i + D/2)
    bool qk_norm;              // Qwen3: RMSNorm over each head of q and k before RoPE
    bool exact_activations;    // float32 activations against block weights too (see matmul)
    std::vector<float> inv_freq;  // RoPE frequency of each of the head_dim / 2 pairs, scaling applied
    float rope_attention_factor = 1.0f;  // YaRN scales cos and sin by it
    KvType kv_type = KvType::F16;
};

struct LayerWeights {
    WeightView q, k, v, o, gate, up, down;
    std::vector<float> input_norm, post_attention_norm, q_norm, k_norm;
};

// One sequence's share of a batch: `num_tokens` new tokens from position `start`, its KV in `block_table`.
// Embeddings: how a slice's final hidden states (after the last norm) are pooled.
enum class Pooling { None, Last, Mean, Cls };

struct SequenceSlice {
    int64_t start;
    int64_t num_tokens;
    std::vector<int32_t> block_table;
    bool logits;  // whether its last token's logits are wanted
    Pooling pool = Pooling::None;
};

class Model {
public:
    Model(ModelConfig config, WeightView embedding, std::vector<LayerWeights> layers, std::vector<float> final_norm,
          WeightView lm_head, int64_t num_blocks, int64_t block_size, int num_threads);

    const ModelConfig& config() const { return config_; }
    int64_t num_blocks() const { return num_blocks_; }
    int64_t block_size() const { return block_size_; }

    // Runs every slice's new tokens (in slice order in `tokens`) through the model, writing their keys and
    // values to the cache; returns the logits [slices with logits, vocab] of each wanted slice's last token.
    // With `pooled`, appends [slices that pool, hidden] to it: the sum of the slice's final hidden states (Mean),
    // its first one (Cls; zeros unless the slice starts at 0) or its last one (Last).
    // Throws std::invalid_argument for ids, positions or blocks out of range, before touching the cache.
    std::vector<float> forward(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices,
                               std::vector<float>* pooled = nullptr);
    // Adds forward's share of the time (forward, matmul, lm_head, attention, wait, regions) to `into`.
    void add_profile(Profile& into) const;
    void reset_profile();

private:
    struct Batch;  // one forward's tokens, positions and work buffers

    void check(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices) const;
    void attention_layer(int64_t layer, Batch& batch, const std::vector<SequenceSlice>& slices);
    void attend(int64_t layer, Batch& batch, const std::vector<SequenceSlice>& slices);
    // Keys (which 0) or values (1) of one layer's block: [kv_heads, block_size, head_dim] elements.
    uint8_t* kv(int64_t layer, int64_t block, int which);

    ModelConfig config_;
    WeightView embedding_, lm_head_;
    std::vector<LayerWeights> layers_;
    std::vector<float> final_norm_;
    int64_t num_blocks_, block_size_;
    size_t kv_element_;  // bytes per cached value
    std::unique_ptr<uint8_t[]> cache_;
    ThreadPool pool_;
    Profile profile_;
    double wait_at_reset_ = 0;
    int64_t regions_at_reset_ = 0;
};

}  // namespace pocketllm
