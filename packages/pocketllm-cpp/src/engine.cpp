#include "pocketllm_cpp/engine.h"

#include <algorithm>
#include <stdexcept>

namespace pocketllm {

Engine::Engine(std::shared_ptr<Model> model, SchedulerConfig config)
    : model_(std::move(model)), config_(config), seeds_(config.seed) {
    if (config.max_num_seqs <= 0 || config.max_num_batched_tokens <= 0 || config.prefill_chunk_size <= 0) {
        throw std::invalid_argument("max_num_seqs, max_num_batched_tokens and prefill_chunk_size must be positive");
    }
    for (int64_t b = model_->num_blocks() - 1; b >= 0; --b) free_blocks_.push_back(static_cast<int32_t>(b));
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
    auto seq = std::make_shared<Sequence>(Sequence{id, std::move(prompt), {}, std::move(sampling), Rng(seed), 0, {}});
    by_id_[id] = seq;
    waiting_.push_back(seq);
}

bool Engine::reserve(const SeqPtr& seq, int64_t tokens, const std::vector<SeqPtr>& scheduled) {
    const int64_t needed = (tokens + model_->block_size() - 1) / model_->block_size();
    while (static_cast<int64_t>(seq->blocks.size()) < needed) {
        if (free_blocks_.empty()) {
            // Preempt the newest running sequence not in this step; if that is `seq` itself, it waits.
            auto victim = std::find_if(running_.rbegin(), running_.rend(), [&](const SeqPtr& s) {
                return std::find(scheduled.begin(), scheduled.end(), s) == scheduled.end();
            });
            if (victim == running_.rend()) return false;
            const SeqPtr chosen = *victim;
            preempt(chosen);
            if (chosen == seq) return false;
            continue;
        }
        seq->blocks.push_back(free_blocks_.back());
        free_blocks_.pop_back();
    }
    return true;
}

void Engine::release(Sequence& seq) {
    free_blocks_.insert(free_blocks_.end(), seq.blocks.rbegin(), seq.blocks.rend());
    seq.blocks.clear();
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
        const int64_t n = std::min({seq->size(), config_.prefill_chunk_size, budget});
        const int64_t needed = (n + model_->block_size() - 1) / model_->block_size();
        if (needed > static_cast<int64_t>(free_blocks_.size())) break;  // admission never preempts
        waiting_.pop_front();
        running_.push_back(seq);
        reserve(seq, n, scheduled);
        scheduled.push_back(seq);
        counts.push_back(n);
        budget -= n;
    }
    if (scheduled.empty()) return {};

    std::vector<int32_t> tokens;
    std::vector<SequenceSlice> slices;
    for (size_t i = 0; i < scheduled.size(); ++i) {
        const SeqPtr& seq = scheduled[i];
        for (int64_t p = seq->computed; p < seq->computed + counts[i]; ++p) tokens.push_back(seq->token(p));
        slices.push_back({seq->computed, counts[i], seq->blocks, seq->computed + counts[i] == seq->size()});
    }
    const std::vector<float> logits = model_->forward(tokens, slices);
    const int64_t vocab = model_->config().vocab_size;
    std::vector<Delta> deltas;
    int64_t row = 0;
    for (size_t i = 0; i < scheduled.size(); ++i) {
        const SeqPtr& seq = scheduled[i];
        seq->computed += counts[i];
        if (!slices[i].logits) continue;  // a prompt chunk that does not reach the end yet
        std::vector<float> values(logits.begin() + row * vocab, logits.begin() + (row + 1) * vocab);
        ++row;
        Delta delta{seq->id, 0, Finish::None, -1, seq->sampling.logprobs >= 0, {}};
        delta.token = sample(values, seq->sampling, seq->prompt, seq->output, seq->rng,
                             delta.has_logprobs ? &delta.logprobs : nullptr);
        seq->output.push_back(delta.token);
        const auto& stops = seq->sampling.stop_ids;
        const auto& own = seq->sampling.request_stop_ids;
        if (static_cast<int64_t>(seq->output.size()) > seq->sampling.min_tokens &&
            std::find(stops.begin(), stops.end(), delta.token) != stops.end()) {
            delta.finish = Finish::Stop;
            if (std::find(own.begin(), own.end(), delta.token) != own.end()) delta.stop_token_id = delta.token;
        } else if (static_cast<int64_t>(seq->output.size()) >= seq->sampling.max_tokens) {
            delta.finish = Finish::Length;
        }
        if (delta.finish != Finish::None) finish(seq);
        deltas.push_back(std::move(delta));
    }
    return deltas;
}

void Engine::abort(const std::vector<std::string>& ids) {
    for (const std::string& id : ids) {
        auto it = by_id_.find(id);
        if (it != by_id_.end()) finish(it->second);
    }
}

EngineStats Engine::stats() const {
    const int64_t total = model_->num_blocks();
    return {static_cast<int64_t>(running_.size()), static_cast<int64_t>(waiting_.size()), total,
            total - static_cast<int64_t>(free_blocks_.size()), preemptions_};
}

}  // namespace pocketllm
