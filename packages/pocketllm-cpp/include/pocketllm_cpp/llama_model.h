// A Llama-family decoder (Llama, Qwen3) over weights read in place, with a paged KV cache it owns.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "pocketllm_cpp/weights.h"
#include "pocketllm_cpp/model.h"
#include "pocketllm_cpp/profile.h"
#include "pocketllm_cpp/thread_pool.h"

namespace pocketllm {

struct LlamaConfig {
    int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0,
            head_dim = 0;
    float rms_norm_eps = 1e-6f;
    bool rope_pairs_adjacent = false;  // llama.cpp's q/k row order (GGUF Llama): rotate (2i, 2i+1), else (i, i + D/2)
    bool qk_norm = false;              // Qwen3: RMSNorm over each head of q and k before RoPE
    bool exact_activations = false;    // float32 activations against block weights too (see matmul)
    std::vector<float> inv_freq;  // RoPE frequency of each of the head_dim / 2 pairs, scaling applied
    float rope_attention_factor = 1.0f;  // YaRN scales cos and sin by it
    KvType kv_type = KvType::F16;
};

struct LlamaLayer {
    WeightView q, k, v, o, gate, up, down;
    std::vector<float> input_norm, post_attention_norm, q_norm, k_norm;
};

class PagedAttention;

class LlamaModel final : public Model {
public:
    LlamaModel(LlamaConfig config, WeightView embedding, std::vector<LlamaLayer> layers, std::vector<float> final_norm,
          WeightView lm_head, int64_t num_blocks, int64_t block_size, int num_threads);
    ~LlamaModel() override;

    const LlamaConfig& config() const { return config_; }

    std::vector<float> forward(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices,
                               std::vector<float>* pooled = nullptr,
                               const std::vector<StateCapture>* captures = nullptr,
                               std::vector<float>* hidden = nullptr) override;
    void add_profile(Profile& into) const override;
    void reset_profile() override;

private:
    struct Batch;  // one forward's tokens, positions and work buffers

    void attention_layer(int64_t layer, Batch& batch, const std::vector<SequenceSlice>& slices);

    LlamaConfig config_;
    WeightView embedding_, lm_head_;
    std::vector<LlamaLayer> layers_;
    std::vector<float> final_norm_;
    std::unique_ptr<PagedAttention> kv_;  // every layer's KV cache
    ThreadPool pool_;
    Profile profile_;
    double wait_at_reset_ = 0;
    int64_t regions_at_reset_ = 0;
};

}  // namespace pocketllm
