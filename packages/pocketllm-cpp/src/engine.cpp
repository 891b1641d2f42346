#include "pocketllm_cpp/engine.h"

#include <algorithm>
#include <stdexcept>

namespace pocketllm {

Engine::Engine(std::shared_ptr<Model> model, SchedulerConfig config)
    : model_(std::move(model)), config_(config), seeds_(config.seed),
      blocks_(model_->num_blocks(), model_->block_size(), config.prefix_caching) {
    if (config.max_num_seqs <= 0 || config.max_num_batched_tokens <= 0 || config.prefill_chunk_size <= 0) {
        throw std::invalid_argument("max_num_seqs, max_num_batched_tokens and prefill_chunk_size must be positive");
    }
}

void Engine::add_request(const std::string& id, std::vector<int32_t> prompt, SamplingConfig sampling) {
    if (by_id_.count(id)) throw std::invalid_argument("request id '" + id + "' is already in use");
    const int64_t vocab = model_->config().vocab_size;
    auto in_vocab = [&](int32_t t) { return t >= 0 && t < vocab; };
    if (prompt.empty() || !std::all_of(prompt.begin(), prompt.end(), in_vocab) ||
        !std::all_of(sampling.stop_ids.begin(), sampling.stop_ids.end(), in_vocab) ||
        !std::all_of(sampling.logit_bias.begin(), sampling.logit_bias.end(), [&](auto& b) { return in_vocab(b.first); }) ||
        sampling.max_tokens < 1) {
        throw std::invalid_argument("request '" + id + "': empty prompt, token id out of range, or max_tokens < 1");
    }
    const int64_t longest = static_cast<int64_t>(prompt.size()) + sampling.max_tokens;
    if ((longest + model_->block_size() - 1) / model_->block_size() > model_->num_blocks()) {
        throw std::invalid_argument("request '" + id + "' needs more KV blocks than the pool has");
    }
    const uint64_t seed = sampling.has_seed ? sampling.seed : seeds_.next();
    const size_t num_prompt = prompt.size();
    auto seq = std::make_shared<Sequence>(Sequence{id, std::move(prompt), num_prompt, std::move(sampling), Rng(seed), 0, {}, {}});
    by_id_[id] = seq;
    waiting_.push_back(seq);
}

bool Engine::reserve(const SeqPtr& seq, int64_t tokens, const std::vector<SeqPtr>& scheduled) {
    const int64_t needed = (tokens + model_->block_size() - 1) / model_->block_size();
    while (static_cast<int64_t>(seq->blocks.size()) < needed) {
        const int32_t block = blocks_.allocate();
        if (block >= 0) {
            seq->blocks.push_back(block);
            continue;
        }
        // Preempt the newest running sequence not in this step; if that is `seq` itself, it waits.
        auto victim = std::find_if(running_.rbegin(), running_.rend(), [&](const SeqPtr& s) {
            return std::find(scheduled.begin(), scheduled.end(), s) == scheduled.end();
        });
        if (victim == running_.rend()) return false;
        const SeqPtr chosen = *victim;
        preempt(chosen);
        if (chosen == seq) return false;
    }
    return true;
}

// Moves a waiting sequence to running if its cached prefix and first chunk fit the free blocks (admission never
// preempts); `count` is then the tokens it computes this step.
bool Engine::admit(const SeqPtr& seq, int64_t budget, int64_t& count) {
    const std::vector<int32_t> cached = blocks_.match(seq->tokens);
    const int64_t start = static_cast<int64_t>(cached.size()) * model_->block_size();
    count = std::min({seq->size() - start, config_.prefill_chunk_size, budget});
    const int64_t fresh = (start + count + model_->block_size() - 1) / model_->block_size() -
                          static_cast<int64_t>(cached.size());
    if (fresh + blocks_.idle_among(cached) > blocks_.num_free()) return false;
    seq->chain = blocks_.share(cached, seq->size());
    seq->blocks = cached;
    seq->computed = start;
    for (int64_t i = 0; i < fresh; ++i) seq->blocks.push_back(blocks_.allocate());
    return true;
}

void Engine::release(Sequence& seq) {
    blocks_.release(seq.blocks);
    seq.chain = {};
}

void Engine::preempt(const SeqPtr& seq) {
    running_.erase(std::find(running_.begin(), running_.end(), seq));
    release(*seq);
    seq->computed = 0;
    waiting_.push_front(seq);
    ++preemptions_;
}

void Engine::finish(const SeqPtr& seq) {
    auto it = std::find(running_.begin(), running_.end(), seq);
    if (it != running_.end()) running_.erase(it);
    auto w = std::find(waiting_.begin(), waiting_.end(), seq);
    if (w != waiting_.end()) waiting_.erase(w);
    release(*seq);
    by_id_.erase(seq->id);
}

std::vector<Delta> Engine::step() {
    Stopwatch timed(profile_.step);
    std::vector<SeqPtr> scheduled;
    std::vector<int64_t> counts;
    int64_t budget = config_.max_num_batched_tokens;
    // Running sequences first (decodes, and prompts under way), then waiting ones while slots and budget last.
    for (const SeqPtr& seq : std::vector<SeqPtr>(running_)) {
        if (budget == 0) break;
        if (std::find(running_.begin(), running_.end(), seq) == running_.end()) continue;  // preempted just now
        const int64_t n = std::min({seq->size() - seq->computed, config_.prefill_chunk_size, budget});
        if (reserve(seq, seq->computed + n, scheduled)) {
            scheduled.push_back(seq);
            counts.push_back(n);
            budget -= n;
        }
    }
    while (!waiting_.empty() && budget > 0 && static_cast<int64_t>(running_.size()) < config_.max_num_seqs) {
        const SeqPtr seq = waiting_.front();
        int64_t n = 0;
        if (!admit(seq, budget, n)) break;
        waiting_.pop_front();
        running_.push_back(seq);
        scheduled.push_back(seq);
        counts.push_back(n);
        budget -= n;
    }
    if (scheduled.empty()) return {};

    std::vector<int32_t> tokens;
    std::vector<SequenceSlice> slices;
    for (size_t i = 0; i < scheduled.size(); ++i) {
        const Sequence& seq = *scheduled[i];
        tokens.insert(tokens.end(), seq.tokens.begin() + seq.computed, seq.tokens.begin() + seq.computed + counts[i]);
        slices.push_back({seq.computed, counts[i], seq.blocks, seq.computed + counts[i] == seq.size()});
    }
    const std::vector<float> logits = model_->forward(tokens, slices);
    ++profile_.steps;
    profile_.tokens += static_cast<int64_t>(tokens.size());
    const int64_t vocab = model_->config().vocab_size;
    std::vector<Delta> deltas;
    int64_t row = 0;
    for (size_t i = 0; i < scheduled.size(); ++i) {
        const SeqPtr& seq = scheduled[i];
        seq->computed += counts[i];
        blocks_.register_full(seq->tokens, seq->computed, seq->blocks, seq->chain);
        if (!slices[i].logits) continue;  // a prompt chunk that does not reach the end yet
        Stopwatch sampling(profile_.sample);
        deltas.push_back(sample_next(seq, std::vector<float>(logits.begin() + row * vocab, logits.begin() + (row + 1) * vocab)));
        ++row;
    }
    return deltas;
}

Delta Engine::sample_next(const SeqPtr& seq, std::vector<float> logits) {
    Delta delta{seq->id, 0, Finish::None, -1, seq->sampling.logprobs >= 0, {}};
    delta.token = sample(logits, seq->sampling, seq->tokens, seq->num_prompt, seq->rng,
                         delta.has_logprobs ? &delta.logprobs : nullptr);
    seq->tokens.push_back(delta.token);
    const auto& stops = seq->sampling.stop_ids;
    const auto& own = seq->sampling.request_stop_ids;
    if (seq->num_output() > seq->sampling.min_tokens && std::find(stops.begin(), stops.end(), delta.token) != stops.end()) {
        delta.finish = Finish::Stop;
        if (std::find(own.begin(), own.end(), delta.token) != own.end()) delta.stop_token_id = delta.token;
    } else if (seq->num_output() >= seq->sampling.max_tokens) {
        delta.finish = Finish::Length;
    }
    if (delta.finish != Finish::None) finish(seq);
    return delta;
}

void Engine::abort(const std::vector<std::string>& ids) {
    for (const std::string& id : ids) {
        auto it = by_id_.find(id);
        if (it != by_id_.end()) finish(it->second);
    }
}

Profile Engine::profile() const {
    Profile p = profile_;
    model_->add_profile(p);
    p.schedule = p.step - p.forward - p.sample;
    return p;
}

void Engine::reset_profile() {
    profile_ = {};
    model_->reset_profile();
}

EngineStats Engine::stats() const {
    const int64_t total = blocks_.num_blocks();
    return {static_cast<int64_t>(running_.size()), static_cast<int64_t>(waiting_.size()), total,
            total - blocks_.num_free(), preemptions_, blocks_.queries(), blocks_.hits()};
}

}  // namespace pocketllm
