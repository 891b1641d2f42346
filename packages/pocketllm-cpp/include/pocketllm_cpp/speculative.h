// Speculative decoding: ngram drafts (prompt lookup) for each sequence before a step, or room held for drafts of
// the model's multi-token-prediction head, how many tokens it drafts, and what verification accepted. The engine runs a sequence's last token and its drafts as one slice whose every
// row is sampled (engine.cpp): row j as if drafts 0..j-1 were the sequence's, with the noise of the token index it
// draws, so that its token is the one decoding without drafts would sample there. Draft j is accepted while row
// j's token equals it: for single-token proposals that is rejection sampling (a draft d kept with probability
// p(d), a rejected position a draw from p without d), and greedy and seeded outputs are those of plain decoding.
// The head's drafts are drawn as the target draws its token there (the same processing, the same noise), so they
// are kept where the two draws agree, often where the head is good, and outputs stay those of plain decoding.
#pragma once

#include <cstdint>
#include <vector>

namespace pocketllm {

struct SpeculativeConfig {
    int64_t num_tokens = 0;  // most tokens drafted per sequence and step; 0: no drafting
    int64_t ngram_min = 1, ngram_max = 4;
    int64_t max_batch = 0;  // nobody drafts while more sequences than this run
    // Drafts come from the model's multi-token-prediction head (Model::mtp_forward), or from a draft model (the
    // Engine's), not from the sequence: the scheduler holds room for them (kPendingDraft), and the engine fills
    // them in before the forward pass.
    bool mtp = false;
    bool draft_model = false;
};
constexpr int32_t kPendingDraft = -1;

// The drafts of one sequence: up to `k` tokens that followed the latest earlier occurrence of the longest suffix
// of `tokens` (ngram_min .. ngram_max long) that occurred before; none where none did. As
// pocketllm.ngram_proposer, which the torch backend uses.
std::vector<int32_t> ngram_draft(const std::vector<int32_t>& tokens, int64_t ngram_min, int64_t ngram_max, int64_t k);

// A drafting sequence's budget: k shrinks to what was last accepted (plus one) and doubles while whole drafts
// are accepted; drafts that keep missing pause it for 2, 4, ... steps (at most kMaxPause).
struct DraftState {
    bool on = false;  // grammar-constrained and embedding requests do not draft
    int64_t k = 0;
    int64_t pause = 0;   // steps left without drafting
    int64_t misses = 0;  // drafts in a row with nothing accepted
    // mtp: the head's output at the sequence's last computed position, where its next drafts start (empty: none
    // yet, so it does not draft).
    std::vector<float> head_state{};
    // draft model: positions whose keys and values it holds (past them, drafts it ran that were rejected)
    int64_t seen = 0;
};
constexpr int64_t kMaxPause = 64;

struct SpeculativeStats {
    int64_t drafts = 0, draft_tokens = 0, accepted_tokens = 0;
    std::vector<int64_t> accepted_per_position;  // index i: drafts whose token i was accepted
};

class Drafter {
public:
    explicit Drafter(const SpeculativeConfig& config);
    bool enabled() const { return config_.num_tokens > 0; }
    bool uses_head() const { return enabled() && config_.mtp; }
    bool uses_draft_model() const { return enabled() && config_.draft_model; }
    DraftState start() const { return {enabled(), config_.num_tokens, 0, 0, {}, 0}; }
    // Up to `room` drafts for a sequence whose next step decodes, given how many sequences run.
    std::vector<int32_t> propose(const std::vector<int32_t>& tokens, DraftState& state, int64_t room,
                                 int64_t running) const;
    // A verification of `drafted` tokens kept its first `accepted`.
    void verified(DraftState& state, int64_t drafted, int64_t accepted);
    const SpeculativeStats& stats() const { return stats_; }

private:
    SpeculativeConfig config_;
    SpeculativeStats stats_;
};

}  // namespace pocketllm
