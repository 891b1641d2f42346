// A mixture-of-experts feed-forward block (Qwen3.5 MoE, Qwen3 MoE): softmax top-k routing, the routed experts read
// in place in their storage type, and an optional shared expert scaled by a sigmoid gate. Private to the library.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"
#include "pocketllm_cpp/thread_pool.h"

namespace pocketllm {

struct MoeWeights {
    WeightView router;  // [num_experts, hidden]
    // Per expert, windows of the stacked [num_experts, ...] tensors (the file's bytes, not copies):
    std::vector<WeightView> gate, up;  // [expert_ff, hidden]
    std::vector<WeightView> down;      // [hidden, expert_ff]
    int64_t top_k;
    bool norm_topk_prob;  // renormalise the k chosen probabilities to sum to 1 (Qwen3.5's default)
    bool has_shared;      // the fields below are set
    WeightView shared_gate, shared_up;  // [shared_ff, hidden]
    WeightView shared_down;             // [hidden, shared_ff]
    WeightView shared_expert_gate;      // [1, hidden]: out += sigmoid(x . g) * shared(x)
};

// Throws std::invalid_argument naming what is inconsistent (counts, shapes, top_k out of 1..num_experts).
void validate(const MoeWeights& w, int64_t hidden);

// out [n, hidden] = the block applied to each row of x [n, hidden]. A batch groups its tokens by expert, so that
// each chosen expert's weights are read once per call; a token's result does not depend on the rest of the batch.
// Routing: softmax of the router's logits in float32, the top_k experts (ties to the lower index), their weights
// renormalised when norm_topk_prob; a token's expert outputs are added by ascending expert index, then the shared
// expert's. `w` must have passed validate(w, hidden); `exact` as for matmul.
void moe_forward(const MoeWeights& w, const float* x, int64_t n, int64_t hidden, float* out, ThreadPool& pool,
                 bool exact);

}  // namespace pocketllm
