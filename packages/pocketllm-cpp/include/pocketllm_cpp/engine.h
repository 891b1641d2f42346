// The request-level engine: requests in, deltas out; each `step` schedules (scheduler.h), runs the model and
// samples, one at a time, from one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pocketllm_cpp/model.h"
#include "pocketllm_cpp/sampler.h"
#include "pocketllm_cpp/scheduler.h"
#include "pocketllm_cpp/sequence.h"
#include "pocketllm_cpp/speculative.h"

namespace pocketllm {

enum class Finish { None, Stop, Length, Error };  // Error: nothing could be sampled (see Engine::set_allowed)

// What a step did for one request: the tokens it gained (one per step today; a step that verifies drafted tokens
// gains several), their logprobs where asked for (one per token), and how it finished.
struct Delta {
    std::string request_id;
    std::vector<int32_t> tokens;
    Finish finish = Finish::None;
    int32_t stop_token_id = -1;  // -1 unless a requested stop token ended the request
    std::vector<TokenLogprobs> logprobs;
    std::vector<float> embedding;  // an embedding request's result (it has no token)
    // With SamplingConfig::prompt_logprobs, on its first delta with a token: prompt tokens 1 .. P-1, each given the
    // tokens before it
    std::vector<TokenLogprobs> prompt_logprobs{};
};

struct EngineStats {
    int64_t running, waiting, blocks_total, blocks_used, preemptions, prefix_queries, prefix_hits;
    int64_t state_snapshots, state_snapshot_hits, state_snapshot_evictions;
    SpeculativeStats speculative;
};

class Engine {
public:
    // `draft`: the draft model of SpeculativeConfig::draft_model, with the model's vocabulary and KV blocks (the
    // same block tables index both pools) and no state layers; std::invalid_argument otherwise.
    Engine(std::shared_ptr<Model> model, SchedulerConfig config, SpeculativeConfig speculative = {},
           std::shared_ptr<Model> draft = nullptr);

    // Queues a request; throws std::invalid_argument for an id in use or a prompt the pool can never hold.
    // `drafts`: whether speculative decoding may draft for it (not for a grammar's: its mask follows each token).
    void add_request(const std::string& id, std::vector<int32_t> prompt, SamplingConfig sampling, bool drafts = true);
    // Queues a request for the pooled final hidden states of `prompt` (L2-normalized if `normalize`), reported in
    // one Delta with `embedding` set and Finish::Stop; throws as add_request.
    void add_embedding_request(const std::string& id, std::vector<int32_t> prompt, Pooling pool, bool normalize);
    std::vector<Delta> step();
    // The tokens a request may sample next (a grammar's bitmask of (vocab + 31) / 32 words; empty: any), kept
    // until replaced; throws std::invalid_argument for an unknown id or a wrong size.
    void set_allowed(const std::string& id, std::vector<uint32_t> words);
    void abort(const std::vector<std::string>& ids);  // frees their blocks before returning; unknown ids ignored
    bool has_unfinished() const { return scheduler_.has_unfinished(); }
    EngineStats stats() const;
    // Where the steps' time went since the last reset (schedule: the step's time outside forward and sampling).
    Profile profile() const;
    void reset_profile();

private:
    void check_prompt(const std::string& id, const std::vector<int32_t>& prompt, int64_t longest) const;
    // Before a step: the drafts of the running sequences that decode next (see speculative.h).
    void propose_drafts();
    // After scheduling, with the model's multi-token-prediction head: the drafts the scheduler held room for, each
    // drawn as its verification row will draw (the head run again on its own output for each one after the first).
    void draft_with_head(ScheduledBatch& batch);
    // After sampling: the head over every row the step kept of the sequences that go on, each with the token after
    // it, so that its keys and values cover their computed tokens and its output at the last is where they draft.
    void catch_up_head(const ScheduledBatch& batch, const std::vector<SequenceSlice>& slices,
                       const std::vector<float>& hidden, const std::vector<SeqPtr>& done);
    // The same with the draft model: run on each sequence's last token, then on each draft; after sampling, over
    // the computed tokens it has not seen (prompt chunks as they run, a cached prefix once).
    void draft_with_model(ScheduledBatch& batch);
    void catch_up_draft_model(const ScheduledBatch& batch, const std::vector<SequenceSlice>& slices,
                              const std::vector<SeqPtr>& done);
    // The logits [active, vocab] of draft j of the batch's sequences `active` (indices, in batch order).
    using DraftLogits = std::function<std::vector<float>(int64_t j, const std::vector<size_t>& active)>;
    // The drafts the scheduler held room for, draft j of each sequence that has one drawn from logits_of(j, ...);
    // a sequence for which nothing may be drawn keeps the drafts before it, and its count is cut to them.
    void fill_drafts(ScheduledBatch& batch, const DraftLogits& logits_of);
    // Draft j of a sequence from its drafting model's logits row, drawn as verification row j will draw (drafts
    // 0..j-1 in the context, the noise of output index + j); < 0 where nothing may be drawn.
    int32_t draw_draft(const Sequence& seq, const float* logits, int64_t j) const;
    // The model's slices for a step's batch, their new tokens (and drafts) appended to `tokens`.
    std::vector<SequenceSlice> slices_of(const ScheduledBatch& batch, std::vector<int32_t>& tokens) const;
    // The captures the forward pass takes: the batch's snapshots, and for a model with state layers the state
    // after each row but the last of every verification (into verify_states_), so the accepted one can be kept.
    std::vector<StateCapture> captures_of(const ScheduledBatch& batch, const std::vector<SequenceSlice>& slices);
    // What the step's logits and pooled rows yield: each sequence's tokens, each finished embedding; the finished
    // sequences go into `done`, and a verification's count is cut to the rows it kept.
    std::vector<Delta> deltas_of(ScheduledBatch& batch, const std::vector<SequenceSlice>& slices,
                                 const std::vector<float>& logits, const std::vector<float>& pooled,
                                 std::vector<SeqPtr>& done);
    // A sequence's rows (its last token's, then one per draft) into tokens: row 0's, then, while row j's token is
    // draft j, row j + 1's, up to what ends it; `kept` is the rows whose keys, values and states stay valid.
    Delta sample_rows(const SeqPtr& seq, const float* logits, int64_t rows, int64_t& kept);
    // After a verification that kept fewer rows than it ran: its state layers take the state after the last kept.
    void commit_states(const ScheduledBatch& batch, const std::vector<SequenceSlice>& slices);
    // Scores `rows` prompt tokens of a sequence from their positions' logits (see Sequence::scored_rows).
    void score_prompt(Sequence& seq, const float* logits, int64_t rows) const;
    // Folds in the pooling of a prompt chunk [start, end); true, with `delta` set, once its prompt is done.
    bool pool_chunk(const SeqPtr& seq, int64_t start, int64_t end, const float* part, Delta& delta);

    std::shared_ptr<Model> model_;
    std::shared_ptr<Model> draft_;  // speculative decoding's draft model, if it drafts
    Rng seeds_;
    Scheduler scheduler_;
    Drafter drafter_;
    std::vector<float> verify_states_;  // this step's verification captures, state_bytes / 4 floats each
    // sample_row's copy of a row that a processor changes: one buffer for every row, not a vocabulary-sized
    // allocation per token.
    std::vector<float> sample_row_;
    std::vector<int64_t> verify_rows_;  // this step's sampled rows per slice (captures_of), for commit_states
    Profile profile_;  // step, sample, steps and tokens; the model keeps its own share
};

}  // namespace pocketllm
