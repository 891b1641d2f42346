// What a forward pass returns from its final residual stream: the final norm, pooled embeddings and the logits
// rows, the same for every model. Private to the library.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"
#include "pocketllm_cpp/model.h"
#include "pocketllm_cpp/thread_pool.h"

namespace pocketllm {

struct OutputHead {
    const std::vector<float>& final_norm;  // [hidden]
    float eps;
    const WeightView& lm_head;  // [vocab, hidden]
    bool exact;                 // as for matmul
};

// x [tokens, hidden]: the residual stream after the last layer, tokens in slice order. Returns the logits of each
// slice's last num_logits tokens, [rows, vocab]; with `pooled`, appends each pooling slice's embedding, with
// `hidden` the final hidden states of the slices that ask (see Model::forward).
std::vector<float> final_rows(const float* x, const std::vector<SequenceSlice>& slices, const OutputHead& head,
                              ThreadPool& pool, std::vector<float>* pooled, std::vector<float>* hidden);

}  // namespace pocketllm
