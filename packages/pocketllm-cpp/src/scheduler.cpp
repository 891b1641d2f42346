#include "pocketllm_cpp/scheduler.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace pocketllm {

Scheduler::Scheduler(Model& model, const SchedulerConfig& config)
    : model_(model), config_(config), blocks_(model.num_blocks(), model.block_size(), config.prefix_caching),
      stateful_(model.num_state_slots() > 0), snapshot_(stateful_ && config.prefix_caching),
      score_rows_(std::max(kMinScoredRows, kScoredLogitsBytes / (4 * std::max<int64_t>(model.vocab_size(), 1)))),
      snapshots_(snapshot_ ? config.snapshot_bytes : 0, model.state_bytes()) {
    if (config.max_num_seqs <= 0 || config.max_num_batched_tokens <= 0 || config.prefill_chunk_size <= 0) {
        throw std::invalid_argument("max_num_seqs, max_num_batched_tokens and prefill_chunk_size must be positive");
    }
    // Slots taken lowest first: a lone request always runs in slot 0.
    for (int32_t slot = static_cast<int32_t>(model.num_state_slots()) - 1; slot >= 0; --slot) {
        free_slots_.push_back(slot);
    }
}

void Scheduler::add(const SeqPtr& seq) {
    by_id_[seq->id] = seq;
    waiting_.push_back(seq);
}

SeqPtr Scheduler::find(const std::string& id) const {
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : it->second;
}

ScheduledBatch Scheduler::schedule() {
    ScheduledBatch batch;
    int64_t budget = config_.max_num_batched_tokens;
    // Verified rows whose states this step may copy (unbounded for a model without state layers).
    int64_t state_rows = stateful_ ? kVerifyStateBytes / std::max<int64_t>(model_.state_bytes(), 1) : budget;
    int64_t score_budget = score_rows_;
    // While a sequence decodes, the prompts of all others share one chunk's tokens a step, not the whole budget:
    // a step then lasts about a decode step plus one chunk, and a decoding stream keeps its pace while long
    // prompts arrive (with the budget's 2048 prompt tokens a CPU step takes seconds, and every stream waits).
    const bool decoding = std::any_of(running_.begin(), running_.end(),
                                      [](const SeqPtr& s) { return s->size() - s->computed == 1; });
    int64_t prefill_budget = decoding ? config_.prefill_chunk_size : budget;
    for (const SeqPtr& seq : std::vector<SeqPtr>(running_)) {
        if (budget == 0) break;
        if (std::find(running_.begin(), running_.end(), seq) == running_.end()) continue;  // preempted just now
        const bool prefills = seq->size() - seq->computed > 1;
        int64_t n = chunk(*seq, seq->computed, std::min({seq->size() - seq->computed, config_.prefill_chunk_size,
                                                         prefills ? prefill_budget : budget,
                                                         scoring_room(*seq, seq->computed, score_budget)}));
        if (n == 0) continue;
        if (reserve(seq, seq->computed + n, batch.seqs)) {
            if (prefills) prefill_budget -= n;
            score_budget -= seq->scored_rows(seq->computed, n);
            if (seq->computed + n == seq->size()) {
                const int64_t drafted = draft_room(*seq, std::min(budget - n, state_rows));
                state_rows -= drafted;
                n += drafted;
            }
            batch.seqs.push_back(seq);
            batch.counts.push_back(n);
            budget -= n;
        }
    }
    while (!waiting_.empty() && std::min(budget, prefill_budget) > 0 &&
           static_cast<int64_t>(running_.size()) < config_.max_num_seqs) {
        const SeqPtr seq = waiting_.front();
        int64_t n = 0;
        if (!admit(seq, std::min(budget, prefill_budget), score_budget, n)) break;
        prefill_budget -= n;
        waiting_.pop_front();
        running_.push_back(seq);
        batch.seqs.push_back(seq);
        batch.counts.push_back(n);
        budget -= n;
    }
    if (snapshot_) plan_captures(batch);
    return batch;
}

void Scheduler::plan_captures(ScheduledBatch& batch) {
    const int64_t size = model_.block_size(), every = std::lcm(size, kCaptureEvery);
    struct Point {
        size_t slice;
        int64_t at;
    };
    std::vector<Point> points;
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
        const Sequence& seq = *batch.seqs[i];
        const int64_t end = std::min(seq.computed + batch.counts[i], static_cast<int64_t>(seq.num_prompt) + 1);
        for (int64_t at = (seq.computed / every + 1) * every; at < end; at += every) points.push_back({i, at});
    }
    std::sort(points.begin(), points.end(), [](const Point& a, const Point& b) { return a.at > b.at; });
    for (const Point& point : points) {
        // Room for the saves where this step's chunks end, too (computed()).
        if (static_cast<int64_t>(batch.captures.size() + batch.seqs.size()) >= snapshots_.capacity()) break;
        const Sequence& seq = *batch.seqs[point.slice];
        const uint64_t key = blocks_.prefix_hash(seq.tokens, seq.chain, point.at / size);
        if (float* out = snapshots_.slot_for(key)) {
            batch.captures.push_back({point.slice, point.at - seq.computed, out});
            batch.capture_keys.push_back(key);
        }
    }
}

int64_t Scheduler::draft_room(Sequence& seq, int64_t budget) {
    int64_t room = std::min(static_cast<int64_t>(seq.draft.size()), budget);
    const int64_t size = model_.block_size();
    while (room > 0 && static_cast<int64_t>(seq.blocks.size()) * size < seq.size() + room) {
        const int32_t block = blocks_.allocate();
        if (block < 0) {
            room = static_cast<int64_t>(seq.blocks.size()) * size - seq.size();
            break;
        }
        seq.blocks.push_back(block);
    }
    seq.draft.resize(static_cast<size_t>(std::max<int64_t>(room, 0)));
    return static_cast<int64_t>(seq.draft.size());
}

int64_t Scheduler::scoring_room(const Sequence& seq, int64_t start, int64_t score_budget) {
    const int64_t first = std::max(start, seq.num_scored), last = static_cast<int64_t>(seq.num_prompt) - 1;
    if (seq.sampling.prompt_logprobs < 0 || first >= last) return std::numeric_limits<int64_t>::max();
    return first - start + std::max<int64_t>(score_budget, 0);
}

int64_t Scheduler::chunk(const Sequence& seq, int64_t start, int64_t n) const {
    const int64_t end = start + n, size = model_.block_size();
    if (snapshot_) {
        const int64_t last_boundary = (static_cast<int64_t>(seq.num_prompt) - 1) / size * size;
        if (start < last_boundary && last_boundary < end) return last_boundary - start;
    }
    if (end == seq.size()) return n;
    const int64_t align = snapshot_ ? std::lcm(size, model_.chunk_alignment()) : model_.chunk_alignment();
    const int64_t aligned = end / align * align;
    if (aligned > start) return aligned - start;
    // Nothing aligned fits: a step's most (a prefill chunk size or budget below the alignment) is the user's
    // choice, but a budget that other sequences used up waits for the next step rather than change the split.
    return n >= std::min(config_.prefill_chunk_size, config_.max_num_batched_tokens) ? n : 0;
}

bool Scheduler::reserve(const SeqPtr& seq, int64_t tokens, const std::vector<SeqPtr>& scheduled) {
    const int64_t needed = (tokens + model_.block_size() - 1) / model_.block_size();
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
// preempts) and, for a model with state layers, a state slot is free; `count` is then the tokens it computes now.
bool Scheduler::admit(const SeqPtr& seq, int64_t budget, int64_t& score_budget, int64_t& count) {
    if (stateful_ && free_slots_.empty()) return false;
    // Pooling every prompt token (or the first) needs their hidden states, and scoring the prompt its logits: no
    // cached prefix stands in for them.
    const bool pools_all = seq->pool == Pooling::Mean || seq->pool == Pooling::Cls;
    const bool uncached = pools_all || seq->sampling.prompt_logprobs >= 0;
    std::vector<int32_t> cached = uncached ? std::vector<int32_t>{} : blocks_.match(seq->tokens);
    // State layers resume only where their state was kept.
    while (stateful_ && !cached.empty() && !snapshots_.contains(blocks_.hash(cached.back()))) cached.pop_back();
    const int64_t start = static_cast<int64_t>(cached.size()) * model_.block_size();
    count = chunk(*seq, start, std::min({seq->size() - start, config_.prefill_chunk_size, budget,
                                         scoring_room(*seq, start, score_budget)}));
    if (count == 0) return false;
    const int64_t fresh = (start + count + model_.block_size() - 1) / model_.block_size() -
                          static_cast<int64_t>(cached.size());
    if (fresh + blocks_.idle_among(cached) > blocks_.num_free()) return false;
    seq->chain = blocks_.share(cached, seq->size());
    seq->blocks = cached;
    seq->computed = start;
    score_budget -= seq->scored_rows(start, count);
    for (int64_t i = 0; i < fresh; ++i) seq->blocks.push_back(blocks_.allocate());
    if (stateful_) {
        seq->state_slot = free_slots_.back();
        free_slots_.pop_back();
        if (start > 0) model_.load_state(seq->state_slot, snapshots_.take(blocks_.hash(cached.back())));
    }
    return true;
}

void Scheduler::computed(const ScheduledBatch& batch) {
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
        Sequence& seq = *batch.seqs[i];
        seq.computed += batch.counts[i];
        blocks_.register_full(seq.tokens, seq.computed, seq.blocks, seq.chain);
        const size_t needed = static_cast<size_t>((seq.size() + model_.block_size() - 1) / model_.block_size());
        if (seq.blocks.size() > needed) {
            std::vector<int32_t> past(seq.blocks.begin() + static_cast<std::ptrdiff_t>(needed), seq.blocks.end());
            blocks_.release(past);
            seq.blocks.resize(needed);
        }
        const bool at_boundary = seq.computed % model_.block_size() == 0 &&
                                 seq.chain.blocks * model_.block_size() == seq.computed;
        if (snapshot_ && at_boundary && seq.computed <= static_cast<int64_t>(seq.num_prompt)) {
            if (float* out = snapshots_.slot_for(seq.chain.hash)) model_.save_state(seq.state_slot, out);
        }
    }
}

void Scheduler::failed(const ScheduledBatch& batch) {
    for (uint64_t key : batch.capture_keys) snapshots_.erase(key);
}

void Scheduler::release(Sequence& seq) {
    blocks_.release(seq.blocks);
    seq.chain = {};
    if (seq.state_slot >= 0) free_slots_.push_back(seq.state_slot);
    seq.state_slot = -1;
}

void Scheduler::preempt(const SeqPtr& seq) {
    running_.erase(std::find(running_.begin(), running_.end(), seq));
    release(*seq);
    seq->computed = 0;
    seq->draft.clear();
    seq->spec.head_state.clear();  // the MTP head drafts again once it has run over the recomputed tokens
    seq->spec.seen = 0;            // and a draft model runs over them again
    waiting_.push_front(seq);
    ++preemptions_;
}

void Scheduler::finish(const SeqPtr& seq) {
    auto it = std::find(running_.begin(), running_.end(), seq);
    if (it != running_.end()) running_.erase(it);
    auto w = std::find(waiting_.begin(), waiting_.end(), seq);
    if (w != waiting_.end()) waiting_.erase(w);
    release(*seq);
    by_id_.erase(seq->id);
}

}  // namespace pocketllm
