// The request-level engine: per-request state, a paged KV block pool, continuous batching with chunked prefill
// and preemption by recompute, and sampling; one `step` at a time, from one thread.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "pocketllm_cpp/block_manager.h"
#include "pocketllm_cpp/model.h"
#include "pocketllm_cpp/sampler.h"

namespace pocketllm {

enum class Finish { None, Stop, Length };

struct Delta {
    std::string request_id;
    int32_t token;
    Finish finish;
    int32_t stop_token_id;  // -1 unless a requested stop token ended the request
    bool has_logprobs;
    TokenLogprobs logprobs;
};

struct EngineStats {
    int64_t running, waiting, blocks_total, blocks_used, preemptions, prefix_queries, prefix_hits;
};

struct SchedulerConfig {
    int64_t max_num_seqs, max_num_batched_tokens, prefill_chunk_size;
    uint64_t seed;  // of the stream that seeds requests without a seed of their own
    bool prefix_caching = false;
};

class Engine {
public:
    Engine(std::shared_ptr<Model> model, SchedulerConfig config);

    // Queues a request; throws std::invalid_argument for an id in use or a prompt the pool can never hold.
    void add_request(const std::string& id, std::vector<int32_t> prompt, SamplingConfig sampling);
    std::vector<Delta> step();
    void abort(const std::vector<std::string>& ids);  // frees their blocks before returning; unknown ids ignored
    bool has_unfinished() const { return !waiting_.empty() || !running_.empty(); }
    EngineStats stats() const;
    // Where the steps' time went since the last reset (schedule: the step's time outside forward and sampling).
    Profile profile() const;
    void reset_profile();

private:
    struct Sequence {
        std::string id;
        std::vector<int32_t> tokens;  // the prompt, then the output so far
        size_t num_prompt;
        SamplingConfig sampling;
        Rng rng;
        int64_t computed = 0;  // tokens whose keys and values are in the cache; 0 again after preemption
        std::vector<int32_t> blocks;
        BlockManager::Chain chain;  // its full blocks registered for prefix caching
        int64_t size() const { return static_cast<int64_t>(tokens.size()); }
        int64_t num_output() const { return static_cast<int64_t>(tokens.size() - num_prompt); }
    };
    using SeqPtr = std::shared_ptr<Sequence>;

    bool reserve(const SeqPtr& seq, int64_t tokens, const std::vector<SeqPtr>& scheduled);
    bool admit(const SeqPtr& seq, int64_t budget, int64_t& count);
    void release(Sequence& seq);
    void preempt(const SeqPtr& seq);
    void finish(const SeqPtr& seq);
    Delta sample_next(const SeqPtr& seq, std::vector<float> logits);

    std::shared_ptr<Model> model_;
    SchedulerConfig config_;
    Rng seeds_;
    BlockManager blocks_;
    std::deque<SeqPtr> waiting_;
    std::vector<SeqPtr> running_;  // admission order: the newest is preempted first
    std::unordered_map<std::string, SeqPtr> by_id_;
    int64_t preemptions_ = 0;
    Profile profile_;  // step, sample, steps and tokens; the model keeps its own share
};

}  // namespace pocketllm
