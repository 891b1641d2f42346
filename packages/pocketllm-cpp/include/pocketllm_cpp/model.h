// What the engine needs of a model: a forward pass over slices of several sequences, with the caches its layers
// keep per request. Each architecture implements it (llama_model.h, ...).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "pocketllm_cpp/profile.h"

namespace pocketllm {

// Embeddings: how a slice's final hidden states (after the last norm) are pooled.
enum class Pooling { None, Last, Mean, Cls };

// One sequence's share of a batch: `num_tokens` new tokens from position `start`, its KV in `block_table`.
struct SequenceSlice {
    int64_t start;
    int64_t num_tokens;
    std::vector<int32_t> block_table;
    int64_t num_logits;  // the logits of its last num_logits tokens are wanted (0..num_tokens)
    Pooling pool = Pooling::None;
    // Its request's state slot, for models with layers that keep a fixed-size state (see num_state_slots); the
    // slot holds the state after `start` tokens, and a slice that starts at 0 starts from a zero state.
    int32_t state_slot = -1;
    // Its prompt's length, for state layers with a chunked form (-1: the slice's end): tokens past the prompt run
    // one at a time, as decode ran them, so that a sequence recomputed after preemption keeps its bits.
    int64_t prompt_end = -1;
    // Every row's final hidden state (after the last norm) is wanted too: the multi-token-prediction head reads them.
    bool hidden = false;
};

// A copy of one slice's whole state (state_bytes / 4 floats) into `out`, taken inside a forward pass after the
// slice's first `tokens` new tokens (0 < tokens < num_tokens): prefix caching's snapshots at the block boundaries
// that a prompt chunk passes.
struct StateCapture {
    size_t slice;
    int64_t tokens;
    float* out;
};

class Model {
public:
    Model(int64_t vocab_size, int64_t hidden_size, int64_t num_blocks, int64_t block_size)
        : vocab_size_(vocab_size), hidden_size_(hidden_size), num_blocks_(num_blocks), block_size_(block_size) {}
    virtual ~Model() = default;
    Model(const Model&) = delete;
    Model& operator=(const Model&) = delete;

    int64_t vocab_size() const { return vocab_size_; }
    int64_t hidden_size() const { return hidden_size_; }
    // The paged KV pool of its attention layers.
    int64_t num_blocks() const { return num_blocks_; }
    int64_t block_size() const { return block_size_; }
    // Fixed-size state slots (0: no layer keeps a state), one per running request, and one slot's bytes.
    virtual int64_t num_state_slots() const { return 0; }
    virtual int64_t state_bytes() const { return 0; }
    // Copies slot's whole state (state_bytes() / 4 floats) out, or in; std::logic_error for a model without one.
    virtual void save_state(int32_t slot, float* out) const;
    virtual void load_state(int32_t slot, const float* in);
    // Prompt slices that end on a multiple of this (or at the sequence's end) give each token the same bits however
    // the prompt is split: a state layer's chunk of tokens computed at once. 1 when any split does.
    virtual int64_t chunk_alignment() const { return 1; }

    // Runs every slice's new tokens (in slice order in `tokens`) through the model, writing their keys and
    // values to the cache; returns the logits [sum of num_logits, vocab]: each slice's last num_logits tokens, in order.
    // With `pooled`, appends [slices that pool, hidden] to it: the sum of the slice's final hidden states (Mean),
    // its first one (Cls; zeros unless the slice starts at 0) or its last one (Last).
    // With `captures` (models with state slots), copies states out inside the pass.
    // With `hidden`, appends [rows, hidden] to it: every row of each slice that asks (SequenceSlice::hidden), in order.
    // Throws std::invalid_argument for ids, positions, blocks, slots or captures out of range, before touching a cache.
    virtual std::vector<float> forward(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices,
                                       std::vector<float>* pooled = nullptr,
                                       const std::vector<StateCapture>* captures = nullptr,
                                       std::vector<float>* hidden = nullptr) = 0;

    // A multi-token-prediction head (speculative decoding's mtp), where the model has one: a layer with keys and
    // values of its own (in the same blocks) that reads, at each position, the token after it (`tokens`) and a
    // final hidden state there (`hidden`, [rows, hidden]: the model's from forward, or the head's own output);
    // returns its outputs, normed, [rows, hidden]. Rows in slice order; no slice asks for logits or pooling.
    // std::logic_error without a head; std::invalid_argument as forward.
    virtual bool has_mtp() const { return false; }
    virtual std::vector<float> mtp_forward(const std::vector<int32_t>& tokens, const std::vector<float>& hidden,
                                           const std::vector<SequenceSlice>& slices);
    // The lm_head's logits [rows, vocab] of normed hidden rows (the head's outputs).
    virtual std::vector<float> mtp_logits(const std::vector<float>& hidden);
    // Adds forward's share of the time (forward, matmul, lm_head, attention, wait, regions) to `into`.
    virtual void add_profile(Profile& into) const = 0;
    virtual void reset_profile() = 0;

protected:
    // The checks every model makes before a forward pass: token ids, slice sizes, block tables, state slots and
    // captures.
    void check(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices,
               const std::vector<StateCapture>* captures = nullptr) const;

private:
    int64_t vocab_size_, hidden_size_, num_blocks_, block_size_;
};

}  // namespace pocketllm
