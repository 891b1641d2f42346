// The request-level engine: requests in, deltas out; each `step` schedules (scheduler.h), runs the model and
// samples, one at a time, from one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pocketllm_cpp/model.h"
#include "pocketllm_cpp/sampler.h"
#include "pocketllm_cpp/scheduler.h"
#include "pocketllm_cpp/sequence.h"

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
};

struct EngineStats {
    int64_t running, waiting, blocks_total, blocks_used, preemptions, prefix_queries, prefix_hits;
    int64_t state_snapshots, state_snapshot_hits, state_snapshot_evictions;
};

class Engine {
public:
    Engine(std::shared_ptr<Model> model, SchedulerConfig config);

    // Queues a request; throws std::invalid_argument for an id in use or a prompt the pool can never hold.
    void add_request(const std::string& id, std::vector<int32_t> prompt, SamplingConfig sampling);
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
    // The model's slices for a step's batch, their new tokens appended to `tokens`.
    std::vector<SequenceSlice> slices_of(const ScheduledBatch& batch, std::vector<int32_t>& tokens) const;
    // What the step's logits and pooled rows yield: each sampled token, each finished embedding.
    std::vector<Delta> deltas_of(const ScheduledBatch& batch, const std::vector<SequenceSlice>& slices,
                                 const std::vector<float>& logits, const std::vector<float>& pooled);
    Delta sample_next(const SeqPtr& seq, std::vector<float> logits);
    // Folds in the pooling of a prompt chunk that started at `start`; true, with `delta` set (and the request
    // finished), once its prompt is done.
    bool pool_chunk(const SeqPtr& seq, int64_t start, const float* part, Delta& delta);

    std::shared_ptr<Model> model_;
    Rng seeds_;
    Scheduler scheduler_;
    Profile profile_;  // step, sample, steps and tokens; the model keeps its own share
};

}  // namespace pocketllm
