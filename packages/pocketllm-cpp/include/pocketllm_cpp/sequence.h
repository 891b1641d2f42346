// One request as the engine tracks it: its tokens, sampling state and what it holds of the caches.
#pragma once

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

    int64_t size() const { return static_cast<int64_t>(tokens.size()); }
    int64_t num_output() const { return static_cast<int64_t>(tokens.size() - num_prompt); }
};
using SeqPtr = std::shared_ptr<Sequence>;

}  // namespace pocketllm
