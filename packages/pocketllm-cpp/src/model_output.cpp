#include "model_output.h"

#include "layer_math.h"

namespace pocketllm {

std::vector<float> final_rows(const float* x, const std::vector<SequenceSlice>& slices, const OutputHead& head,
                              ThreadPool& pool, std::vector<float>* pooled, std::vector<float>* wanted) {
    const int64_t hidden = static_cast<int64_t>(head.final_norm.size());
    for (int64_t s = 0, begin = 0; wanted != nullptr && s < static_cast<int64_t>(slices.size()); ++s) {
        if (slices[s].hidden) {
            const size_t at = wanted->size();
            wanted->resize(at + static_cast<size_t>(slices[s].num_tokens * hidden));
            for_rows(pool, slices[s].num_tokens, [&](int64_t first, int64_t end) {
                for (int64_t t = first; t < end; ++t) {
                    rms_norm(&x[(begin + t) * hidden], head.final_norm.data(), hidden, head.eps,
                             &(*wanted)[at + static_cast<size_t>(t * hidden)]);
                }
            });
        }
        begin += slices[s].num_tokens;
    }
    std::vector<float> normed(static_cast<size_t>(hidden));
    for (int64_t s = 0, begin = 0; pooled != nullptr && s < static_cast<int64_t>(slices.size()); ++s) {
        const SequenceSlice& slice = slices[s];
        const int64_t end = begin + slice.num_tokens;
        if (slice.pool != Pooling::None) {
            const size_t at = pooled->size();
            pooled->resize(at + static_cast<size_t>(hidden), 0.0f);
            // Mean sums every row; Cls takes the prompt's first row, Last the slice's last one.
            const int64_t first = slice.pool == Pooling::Last ? end - 1 : begin;
            const int64_t stop = slice.pool == Pooling::Mean ? end
                                 : (slice.pool == Pooling::Cls && slice.start > 0) ? first : first + 1;
            for (int64_t t = first; t < stop; ++t) {
                rms_norm(&x[t * hidden], head.final_norm.data(), hidden, head.eps, normed.data());
                for (int64_t i = 0; i < hidden; ++i) (*pooled)[at + static_cast<size_t>(i)] += normed[i];
            }
        }
        begin = end;
    }
    std::vector<float> last;  // the final norm of each wanted slice's last num_logits tokens
    for (int64_t s = 0, end = 0; s < static_cast<int64_t>(slices.size()); ++s) {
        end += slices[s].num_tokens;
        for (int64_t t = end - slices[s].num_logits; t < end; ++t) {
            last.resize(last.size() + static_cast<size_t>(hidden));
            rms_norm(&x[t * hidden], head.final_norm.data(), hidden, head.eps, &last[last.size() - hidden]);
        }
    }
    const int64_t rows = static_cast<int64_t>(last.size()) / hidden;
    std::vector<float> logits(static_cast<size_t>(rows * head.lm_head.rows));
    if (rows > 0) matmul(head.lm_head, last.data(), rows, logits.data(), pool, head.exact);
    return logits;
}

}  // namespace pocketllm
