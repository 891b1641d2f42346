// What runs in each step: running sequences first (decodes and prompts under way), then waiting ones while slots,
// the token budget and free KV blocks last; chunked prefill, preemption by recompute (newest first), prefix
// caching, and for models with state layers one state slot per running request and snapshots of the states at
// block boundaries (state_snapshots.h).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "pocketllm_cpp/block_manager.h"
#include "pocketllm_cpp/model.h"
#include "pocketllm_cpp/sequence.h"
#include "pocketllm_cpp/state_snapshots.h"

namespace pocketllm {

// Tokens between the snapshots taken inside a prompt chunk (the torch backend's interval): a resumed request
// recomputes at most this many of a cached prefix, and a long prompt does not fill the snapshot budget alone.
constexpr int64_t kCaptureEvery = 64;
// The most memory one step's verifications may hold in state copies (a model with state layers keeps its whole
// state after each verified row but the last: engine.h's captures_of). Drafts past it wait for a later step:
// 64 sequences drafting 16 tokens each of a state of 19 MB (Qwen3.5-0.8B) would otherwise ask for 19 GB.
constexpr int64_t kVerifyStateBytes = int64_t{256} << 20;
// The most memory one step's scored prompt rows (SamplingConfig::prompt_logprobs) may take in logits: a row is a
// whole vocabulary of floats (1 MB for Qwen3.5's 248k), and 2,048 of them a step would be 2 GB. Prompt chunks past
// it wait; at least kMinScoredRows a step, so that every chunk alignment fits.
constexpr int64_t kScoredLogitsBytes = int64_t{256} << 20;
constexpr int64_t kMinScoredRows = 256;

struct SchedulerConfig {
    int64_t max_num_seqs, max_num_batched_tokens, prefill_chunk_size;
    uint64_t seed;  // of the stream that seeds requests without a seed of their own
    bool prefix_caching = false;
    int64_t snapshot_bytes = 0;  // the state snapshots' budget (models with state layers, with prefix caching)
};

// One step's work: seqs[i] computes its next counts[i] tokens (a decoding sequence's last token and then its
// drafts, where it has any).
struct ScheduledBatch {
    std::vector<SeqPtr> seqs;
    std::vector<int64_t> counts;
    std::vector<StateCapture> captures;  // snapshots the forward pass takes inside prompt chunks
    std::vector<uint64_t> capture_keys;  // the prefix hash each of them is filed under
};

class Scheduler {
public:
    Scheduler(Model& model, const SchedulerConfig& config);

    void add(const SeqPtr& seq);  // waiting, in arrival order
    ScheduledBatch schedule();
    // After the step ran (counts cut, for a verification, to the rows it kept): the tokens computed, their full
    // blocks registered, the states at block boundaries kept, and blocks past a sequence's tokens (a rejected
    // draft's) freed.
    void computed(const ScheduledBatch& batch);
    // After a step whose forward pass threw: its captures were never written, so they are not kept.
    void failed(const ScheduledBatch& batch);
    void finish(const SeqPtr& seq);  // frees its blocks and state slot; it leaves the scheduler
    SeqPtr find(const std::string& id) const;
    bool has_unfinished() const { return !waiting_.empty() || !running_.empty(); }

    const std::vector<SeqPtr>& running() const { return running_; }
    int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
    int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
    int64_t preemptions() const { return preemptions_; }
    const BlockManager& blocks() const { return blocks_; }
    const SchedulerConfig& config() const { return config_; }
    const StateSnapshots& snapshots() const { return snapshots_; }

private:
    bool reserve(const SeqPtr& seq, int64_t tokens, const std::vector<SeqPtr>& scheduled);
    bool admit(const SeqPtr& seq, int64_t budget, int64_t& score_budget, int64_t& count);
    // The most tokens from `start` a sequence may run with `score_budget` scored prompt rows left this step.
    static int64_t scoring_room(const Sequence& seq, int64_t start, int64_t score_budget);
    // How many of a decoding sequence's drafts run with it: as many as the budget and the free blocks allow,
    // without preempting anyone (a draft is worth less than another sequence's progress); its drafts are cut to
    // those.
    int64_t draft_room(Sequence& seq, int64_t budget);
    // `n` cut so that a prompt chunk that is not the last ends on the model's chunk_alignment (so that the split
    // does not change a token's bits) and, with snapshots, at a block boundary, never past the prompt's last
    // full-block boundary: where snapshots are taken. 0: nothing aligned fits the budget left.
    int64_t chunk(const Sequence& seq, int64_t start, int64_t n) const;
    // Snapshots inside the batch's prompt chunks: at every kCaptureEvery-th token on a block boundary, deepest
    // first, fewer than fit (so that none evicts another of the same step), each filed now and written by the step.
    void plan_captures(ScheduledBatch& batch);
    void release(Sequence& seq);
    void preempt(const SeqPtr& seq);

    Model& model_;
    SchedulerConfig config_;
    BlockManager blocks_;
    bool stateful_;   // the model keeps a state per request
    bool snapshot_;   // and prefix caching keeps snapshots of it
    int64_t score_rows_;  // scored prompt rows a step may hold (kScoredLogitsBytes of logits)
    StateSnapshots snapshots_;
    std::vector<int32_t> free_slots_;
    std::deque<SeqPtr> waiting_;
    std::vector<SeqPtr> running_;  // admission order: the newest is preempted first
    std::unordered_map<std::string, SeqPtr> by_id_;
    int64_t preemptions_ = 0;
};

}  // namespace pocketllm
