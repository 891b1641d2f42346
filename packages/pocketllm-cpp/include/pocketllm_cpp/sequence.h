// One request as the engine tracks it: its tokens, sampling state and what it holds of the caches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pocketllm_cpp/block_manager.h"
#include "pocketllm_cpp/model.h"
#include "pocketllm_cpp/sampler.h"
#include "pocketllm_cpp/speculative.h"

namespace pocketllm {

struct Sequence {
    std::string id;
    std::vector<int32_t> tokens;  // the prompt, then the output so far
    size_t num_prompt;
    SamplingConfig sampling;
    uint64_t seed;  // of its draws: draw_seed(seed, index) for output token `index`
    int64_t computed = 0;  // tokens whose keys, values and state are in the caches; 0 again after preemption
    std::vector<int32_t> blocks{};
    BlockManager::Chain chain{};  // its full blocks registered for prefix caching
    int32_t state_slot = -1;      // of a model with state layers, while running
    std::vector<uint32_t> allowed{};  // the grammar's mask for its next token; empty: unconstrained
    Pooling pool = Pooling::None;     // an embedding request: nothing is sampled
    bool normalize = true;
    std::vector<float> pooled{};  // its pooling over the prompt chunks run so far
    std::vector<int32_t> draft{};  // speculative decoding: tokens drafted after its last, verified by its next step
    DraftState spec{};
    // sampling.prompt_logprobs: prompt tokens 1, 2, ... scored so far (sent with the first token), and how many
    // (kept after they are sent, so that a prompt recomputed after preemption is not scored again)
    std::vector<TokenLogprobs> prompt_logprobs{};
    int64_t num_scored = 0;

    int64_t size() const { return static_cast<int64_t>(tokens.size()); }
    int64_t num_output() const { return static_cast<int64_t>(tokens.size() - num_prompt); }
    // Of the `count` tokens from `start` a step runs, how many at the end score prompt tokens: the rows of the
    // positions whose next token is a prompt token and is not scored yet (0 unless its prompt is scored).
    int64_t scored_rows(int64_t start, int64_t count) const {
        if (sampling.prompt_logprobs < 0) return 0;
        const int64_t first = std::max(start, num_scored), end = std::min(start + count, static_cast<int64_t>(num_prompt) - 1);
        return end > first ? end - first : 0;
    }
};
using SeqPtr = std::shared_ptr<Sequence>;

}  // namespace pocketllm
