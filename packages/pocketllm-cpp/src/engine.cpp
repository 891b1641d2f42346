#include "pocketllm_cpp/engine.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace pocketllm {

Engine::Engine(std::shared_ptr<Model> model, SchedulerConfig config)
    : model_(std::move(model)), config_(config), seeds_(config.seed),
      blocks_(model_->num_blocks(), model_->block_size(), config.prefix_caching) {
    if (config.max_num_seqs <= 0 || config.max_num_batched_tokens <= 0 || config.prefill_chunk_size <= 0) {
        throw std::invalid_argument("max_num_seqs, max_num_batched_tokens and prefill_chunk_size must be positive");
    }
}

void Engine::check_prompt(const std::string& id, const std::vector<int32_t>& prompt, int64_t longest) const {
    if (by_id_.count(id)) throw std::invalid_argument("request id '" + id + "' is already in use");
    const int64_t vocab = model_->vocab_size();
    if (prompt.empty() || !std::all_of(prompt.begin(), prompt.end(), [&](int32_t t) { return t >= 0 && t < vocab; })) {
        throw std::invalid_argument("request '" + id + "': empty prompt or token id out of range");
    }
    if ((longest + model_->block_size() - 1) / model_->block_size() > model_->num_blocks()) {
        throw std::invalid_argument("request '" + id + "' needs more KV blocks than the pool has");
    }
}

void Engine::add_request(const std::string& id, std::vector<int32_t> prompt, SamplingConfig sampling) {
    const int64_t vocab = model_->vocab_size();
    auto in_vocab = [&](int32_t t) { return t >= 0 && t < vocab; };
    if (!std::all_of(sampling.stop_ids.begin(), sampling.stop_ids.end(), in_vocab) ||
        !std::all_of(sampling.logit_bias.begin(), sampling.logit_bias.end(), [&](auto& b) { return in_vocab(b.first); }) ||
        sampling.max_tokens < 1) {
        throw std::invalid_argument("request '" + id + "': token id out of range, or max_tokens < 1");
    }
    check_prompt(id, prompt, static_cast<int64_t>(prompt.size()) + sampling.max_tokens);
    const uint64_t seed = sampling.has_seed ? sampling.seed : seeds_.next();
    const size_t num_prompt = prompt.size();
    auto seq = std::make_shared<Sequence>(Sequence{id, std::move(prompt), num_prompt, std::move(sampling), Rng(seed), 0, {}, {}, {}});
    by_id_[id] = seq;
    waiting_.push_back(seq);
}

void Engine::add_embedding_request(const std::string& id, std::vector<int32_t> prompt, Pooling pool, bool normalize) {
    if (pool == Pooling::None) throw std::invalid_argument("request '" + id + "': an embedding needs a pooling");
    check_prompt(id, prompt, static_cast<int64_t>(prompt.size()));
    const size_t num_prompt = prompt.size();
    auto seq = std::make_shared<Sequence>(Sequence{id, std::move(prompt), num_prompt, SamplingConfig{}, Rng(0), 0, {}, {}, {}});
    seq->pool = pool;
    seq->normalize = normalize;
    by_id_[id] = seq;
    waiting_.push_back(seq);
}

bool Engine::pool_chunk(const SeqPtr& seq, int64_t start, const float* part, Delta& delta) {
    const size_t hidden = static_cast<size_t>(model_->hidden_size());
    // A fresh pooling where the prompt starts (a preempted request pools its recomputed prompt again), and where its
    // first chunk starts after a cached prefix (Last alone reuses one).
    if (start == 0 || seq->pooled.size() != hidden) seq->pooled.assign(hidden, 0.0f);
    if (seq->pool == Pooling::Last) {
        std::copy(part, part + hidden, seq->pooled.begin());
    } else if (seq->pool == Pooling::Mean || start == 0) {  // Cls: the first chunk holds the first token
        for (size_t i = 0; i < hidden; ++i) seq->pooled[i] += part[i];
    }
    if (seq->computed < seq->size()) return false;
    std::vector<float> vector = seq->pooled;
    if (seq->pool == Pooling::Mean) {
        for (float& v : vector) v /= static_cast<float>(seq->size());
    }
    if (seq->normalize) {
        double sum = 0.0;
        for (float v : vector) sum += static_cast<double>(v) * v;
        // As torch's F.normalize: a zero vector stays zero.
        const float scale = static_cast<float>(1.0 / std::max(std::sqrt(sum), 1e-12));
        for (float& v : vector) v *= scale;
    }
    delta = Delta{seq->id, 0, Finish::Stop, -1, false, {}, std::move(vector)};
    finish(seq);
    return true;
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
    // Pooling every prompt token (or the first) needs their hidden states: no cached prefix stands in for them.
    const bool pools_all = seq->pool == Pooling::Mean || seq->pool == Pooling::Cls;
    const std::vector<int32_t> cached = pools_all ? std::vector<int32_t>{} : blocks_.match(seq->tokens);
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
    bool pools = false;
    for (size_t i = 0; i < scheduled.size(); ++i) {
        const Sequence& seq = *scheduled[i];
        tokens.insert(tokens.end(), seq.tokens.begin() + seq.computed, seq.tokens.begin() + seq.computed + counts[i]);
        const bool ends = seq.computed + counts[i] == seq.size();
        slices.push_back({seq.computed, counts[i], seq.blocks, ends && seq.pool == Pooling::None ? 1 : 0, seq.pool});
        pools = pools || seq.pool != Pooling::None;
    }
    std::vector<float> pooled;
    const std::vector<float> logits = model_->forward(tokens, slices, pools ? &pooled : nullptr);
    ++profile_.steps;
    profile_.tokens += static_cast<int64_t>(tokens.size());
    const int64_t vocab = model_->vocab_size();
    std::vector<Delta> deltas;
    int64_t row = 0, pooled_row = 0;
    const int64_t hidden = model_->hidden_size();
    for (size_t i = 0; i < scheduled.size(); ++i) {
        const SeqPtr& seq = scheduled[i];
        const int64_t start = seq->computed;
        seq->computed += counts[i];
        blocks_.register_full(seq->tokens, seq->computed, seq->blocks, seq->chain);
        if (seq->pool != Pooling::None) {
            Delta delta;
            if (pool_chunk(seq, start, &pooled[static_cast<size_t>(pooled_row++ * hidden)], delta)) {
                deltas.push_back(std::move(delta));
            }
            continue;
        }
        if (slices[i].num_logits == 0) continue;  // a prompt chunk that does not reach the end yet
        Stopwatch sampling(profile_.sample);
        deltas.push_back(sample_next(seq, std::vector<float>(logits.begin() + row * vocab, logits.begin() + (row + 1) * vocab)));
        ++row;
    }
    return deltas;
}

Delta Engine::sample_next(const SeqPtr& seq, std::vector<float> logits) {
    Delta delta{seq->id, 0, Finish::None, -1, seq->sampling.logprobs >= 0, {}};
    delta.token = sample(logits, seq->sampling, seq->tokens, seq->num_prompt, seq->rng,
                         delta.has_logprobs ? &delta.logprobs : nullptr, seq->allowed);
    if (delta.token < 0) {  // the grammar and min_tokens left no token: this request fails, alone
        delta.token = 0;
        delta.has_logprobs = false;
        delta.finish = Finish::Error;
        finish(seq);
        return delta;
    }
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

void Engine::set_allowed(const std::string& id, std::vector<uint32_t> words) {
    auto it = by_id_.find(id);
    if (it == by_id_.end()) throw std::invalid_argument("set_allowed: unknown request '" + id + "'");
    const size_t expected = static_cast<size_t>((model_->vocab_size() + 31) / 32);
    if (!words.empty() && words.size() != expected) {
        throw std::invalid_argument("set_allowed: " + std::to_string(words.size()) + " mask words, expected " +
                                    std::to_string(expected));
    }
    it->second->allowed = std::move(words);
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
