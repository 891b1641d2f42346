// The paged KV cache of a model's attention layers and causal attention over it, shared by every model with
// attention layers (llama_model.cpp, qwen3_5_model.cpp). Private to the library.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels.h"
#include "pocketllm_cpp/model.h"
#include "pocketllm_cpp/thread_pool.h"

namespace pocketllm {

// Where each of a forward pass's tokens belongs: token t is at position[t] of slices[slice_of[t]], tokens in
// slice order.
struct TokenPlaces {
    const std::vector<SequenceSlice>& slices;
    const std::vector<int64_t>& slice_of;
    const std::vector<int64_t>& position;
};

class PagedAttention {
public:
    // Keys and values of `num_layers` attention layers, [kv_heads, block_size, head_dim] per block and layer.
    // Throws std::invalid_argument for sizes that are not positive or overflow.
    PagedAttention(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim, KvType kv_type, int64_t num_blocks,
                   int64_t block_size);

    int64_t num_kv_heads() const { return num_kv_heads_; }
    int64_t head_dim() const { return head_dim_; }
    KvType kv_type() const { return kv_type_; }

    // One token's keys and values ([num_kv_heads * head_dim] each) into `layer`'s cache at `position` of `slice`.
    void store(int64_t layer, const SequenceSlice& slice, int64_t position, const float* keys, const float* values);
    // out [n, num_heads * head_dim] = each token's causal attention over its sequence's positions 0..p of
    // `layer`, for queries q [n, num_heads * head_dim]; num_heads a multiple of the KV heads. The slices' keys
    // and values must be stored first. A token's result is the same bits whatever else the batch holds.
    void attend(int64_t layer, int64_t num_heads, const float* q, float* out, const TokenPlaces& tokens,
                ThreadPool& pool);

private:
    // Keys (which 0) or values (1) of one layer's block: [kv_heads, block_size, head_dim] elements.
    uint8_t* kv(int64_t layer, int64_t block, int which);

    int64_t num_layers_, num_kv_heads_, head_dim_;
    KvType kv_type_;
    int64_t num_blocks_, block_size_;
    size_t kv_element_;  // bytes per cached value
    std::unique_ptr<uint8_t[]> cache_;
    std::vector<float> part_out_, part_max_, part_sum_;  // stored part states (see attend)
};

}  // namespace pocketllm
