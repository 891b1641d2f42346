#include "pocketllm_cpp/speculative.h"

#include <algorithm>
#include <stdexcept>

namespace pocketllm {

std::vector<int32_t> ngram_draft(const std::vector<int32_t>& tokens, int64_t ngram_min, int64_t ngram_max, int64_t k) {
    const int64_t end = static_cast<int64_t>(tokens.size());
    if (k <= 0 || end <= ngram_min) return {};
    // Latest first, so that among the longest matches the latest wins: only a longer one replaces it.
    int64_t best = -1, best_length = 0;
    for (int64_t i = end - 2; i >= 0 && best_length < ngram_max; --i) {
        int64_t length = 0;
        while (length < ngram_max && i - length >= 0 && tokens[i - length] == tokens[end - 1 - length]) ++length;
        if (length > best_length) best = i, best_length = length;
    }
    if (best_length < ngram_min) return {};
    const int64_t from = best + 1, to = std::min(end, from + k);
    return {tokens.begin() + from, tokens.begin() + to};
}

Drafter::Drafter(const SpeculativeConfig& config) : config_(config) {
    if (config.num_tokens < 0 || (config.num_tokens > 0 && (config.ngram_min < 1 || config.ngram_max < config.ngram_min ||
                                                            config.max_batch < 1))) {
        throw std::invalid_argument("speculative decoding: need num_tokens >= 0, 1 <= ngram_min <= ngram_max and "
                                    "max_batch >= 1");
    }
    stats_.accepted_per_position.assign(static_cast<size_t>(config.num_tokens), 0);
}

std::vector<int32_t> Drafter::propose(const std::vector<int32_t>& tokens, DraftState& state, int64_t room,
                                      int64_t running) const {
    if (!state.on || running > config_.max_batch) return {};
    if (state.pause > 0) {
        --state.pause;
        return {};
    }
    const int64_t k = std::min(state.k, room);
    if (config_.mtp || config_.draft_model) {  // room for a model's drafts (the head's, once it ran over the sequence)
        return (config_.mtp && state.head_state.empty()) || k <= 0
                   ? std::vector<int32_t>{}
                   : std::vector<int32_t>(static_cast<size_t>(k), kPendingDraft);
    }
    return ngram_draft(tokens, config_.ngram_min, config_.ngram_max, k);
}

void Drafter::verified(DraftState& state, int64_t drafted, int64_t accepted) {
    if (drafted == 0) return;
    state.seen += std::min(accepted, drafted - 1);  // draft model: the accepted drafts it ran (all but the last)
    ++stats_.drafts;
    stats_.draft_tokens += drafted;
    stats_.accepted_tokens += accepted;
    for (int64_t i = 0; i < accepted; ++i) ++stats_.accepted_per_position[static_cast<size_t>(i)];
    state.k = accepted == drafted ? std::min(config_.num_tokens, 2 * state.k) : accepted + 1;
    state.misses = accepted > 0 ? 0 : state.misses + 1;
    if (state.misses >= 2) state.pause = std::min<int64_t>(kMaxPause, int64_t{1} << std::min<int64_t>(state.misses - 1, 6));
}

}  // namespace pocketllm
