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

enum class Finish { None, Stop, Length, Error };  // Error: nothing could be sampled (see Engine::set_allowed)

struct Delta {
    std::string request_id;
    int32_t token;
    Finish finish;
    int32_t stop_token_id;  // -1 unless a requested stop token ended the request
    bool has_logprobs;
    TokenLogprobs logprobs;
    std::vector<float> embedding;  // an embedding request's result (it has no token)
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
    // Queues a request for the pooled final hidden states of `prompt` (L2-normalized if `normalize`), reported in
    // one Delta with `embedding` set and Finish::Stop; throws as add_request.
    void add_embedding_request(const std::string& id, std::vector<int32_t> prompt, Pooling pool, bool normalize);
    std::vector<Delta> step();
    // The tokens a request may sample next (a grammar's bitmask of (vocab + 31) / 32 words; empty: any), kept
    // until replaced; throws std::invalid_argument for an unknown id or a wrong size.
    void set_allowed(const std::string& id, std::vector<uint32_t> words);
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
        std::vector<uint32_t> allowed;  // the grammar's mask for its next token; empty: unconstrained
        Pooling pool = Pooling::None;  // an embedding request: nothing is sampled
        bool normalize = true;
        std::vector<float> pooled;  // its pooling over the prompt chunks run so far
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
    void check_prompt(const std::string& id, const std::vector<int32_t>& prompt, int64_t longest) const;
    // Folds in the pooling of a prompt chunk that started at `start`; true, with `delta` set (and the request
    // finished), once its prompt is done.
    bool pool_chunk(const SeqPtr& seq, int64_t start, const float* part, Delta& delta);

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
