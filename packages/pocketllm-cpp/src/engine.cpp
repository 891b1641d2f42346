#include "pocketllm_cpp/engine.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace pocketllm {

Engine::Engine(std::shared_ptr<Model> model, SchedulerConfig config, SpeculativeConfig speculative,
               std::shared_ptr<Model> draft)
    : model_(std::move(model)), draft_(std::move(draft)), seeds_(config.seed), scheduler_(*model_, config),
      drafter_(speculative) {
    if (drafter_.uses_head() && !model_->has_mtp()) {
        throw std::invalid_argument("speculative decoding with mtp needs a model with a multi-token-prediction head");
    }
    if (drafter_.uses_draft_model() != static_cast<bool>(draft_)) {
        throw std::invalid_argument("a draft model goes with speculative decoding's draft_model, and only with it");
    }
    if (draft_ && (draft_->vocab_size() != model_->vocab_size() || draft_->num_blocks() != model_->num_blocks() ||
                   draft_->block_size() != model_->block_size() || draft_->num_state_slots() != 0)) {
        throw std::invalid_argument("a draft model needs the model's vocabulary, KV blocks and block size, and no "
                                    "state layers");
    }
}

void Engine::check_prompt(const std::string& id, const std::vector<int32_t>& prompt, int64_t longest) const {
    if (scheduler_.find(id)) throw std::invalid_argument("request id '" + id + "' is already in use");
    const int64_t vocab = model_->vocab_size();
    if (prompt.empty() || !std::all_of(prompt.begin(), prompt.end(), [&](int32_t t) { return t >= 0 && t < vocab; })) {
        throw std::invalid_argument("request '" + id + "': empty prompt or token id out of range");
    }
    if ((longest + model_->block_size() - 1) / model_->block_size() > model_->num_blocks()) {
        throw std::invalid_argument("request '" + id + "' needs more KV blocks than the pool has");
    }
}

void Engine::add_request(const std::string& id, std::vector<int32_t> prompt, SamplingConfig sampling, bool drafts) {
    const int64_t vocab = model_->vocab_size();
    auto in_vocab = [&](int32_t t) { return t >= 0 && t < vocab; };
    if (!std::all_of(sampling.stop_ids.begin(), sampling.stop_ids.end(), in_vocab) ||
        !std::all_of(sampling.logit_bias.begin(), sampling.logit_bias.end(), [&](auto& b) { return in_vocab(b.first); }) ||
        sampling.max_tokens < 1) {
        throw std::invalid_argument("request '" + id + "': token id out of range, or max_tokens < 1");
    }
    check_prompt(id, prompt, static_cast<int64_t>(prompt.size()) + sampling.max_tokens);
    const uint64_t seed = sampling.seed ? static_cast<uint64_t>(*sampling.seed) : seeds_.next();  // two's complement
    const size_t num_prompt = prompt.size();
    auto seq = std::make_shared<Sequence>(Sequence{id, std::move(prompt), num_prompt, std::move(sampling), seed});
    if (drafts) seq->spec = drafter_.start();
    scheduler_.add(seq);
}

void Engine::add_embedding_request(const std::string& id, std::vector<int32_t> prompt, Pooling pool, bool normalize) {
    if (pool == Pooling::None) throw std::invalid_argument("request '" + id + "': an embedding needs a pooling");
    check_prompt(id, prompt, static_cast<int64_t>(prompt.size()));
    const size_t num_prompt = prompt.size();
    auto seq = std::make_shared<Sequence>(Sequence{id, std::move(prompt), num_prompt, SamplingConfig{}, 0});
    seq->pool = pool;
    seq->normalize = normalize;
    scheduler_.add(seq);
}

bool Engine::pool_chunk(const SeqPtr& seq, int64_t start, int64_t end, const float* part, Delta& delta) {
    const size_t hidden = static_cast<size_t>(model_->hidden_size());
    // A fresh pooling where the prompt starts (a preempted request pools its recomputed prompt again), and where its
    // first chunk starts after a cached prefix (Last alone reuses one).
    if (start == 0 || seq->pooled.size() != hidden) seq->pooled.assign(hidden, 0.0f);
    if (seq->pool == Pooling::Last) {
        std::copy(part, part + hidden, seq->pooled.begin());
    } else if (seq->pool == Pooling::Mean || start == 0) {  // Cls: the first chunk holds the first token
        for (size_t i = 0; i < hidden; ++i) seq->pooled[i] += part[i];
    }
    if (end < seq->size()) return false;
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
    delta = Delta{seq->id, {}, Finish::Stop, -1, {}, std::move(vector)};
    return true;
}

std::vector<Delta> Engine::step() {
    Stopwatch timed(profile_.step);
    propose_drafts();
    ScheduledBatch batch = scheduler_.schedule();
    if (batch.seqs.empty()) return {};
    std::vector<int32_t> tokens;
    std::vector<SequenceSlice> slices;
    std::vector<float> pooled, hidden, logits;
    try {
        draft_with_head(batch);
        draft_with_model(batch);
        slices = slices_of(batch, tokens);
        const std::vector<StateCapture> captures = captures_of(batch, slices);
        logits = model_->forward(tokens, slices, &pooled, &captures, &hidden);
    } catch (...) {
        scheduler_.failed(batch);
        for (const SeqPtr& seq : batch.seqs) seq->draft.clear();
        throw;
    }
    ++profile_.steps;
    profile_.tokens += static_cast<int64_t>(tokens.size());
    std::vector<SeqPtr> done;
    std::vector<Delta> deltas = deltas_of(batch, slices, logits, pooled, done);
    catch_up_head(batch, slices, hidden, done);
    catch_up_draft_model(batch, slices, done);
    scheduler_.computed(batch);
    commit_states(batch, slices);
    for (const SeqPtr& seq : done) scheduler_.finish(seq);
    return deltas;
}

void Engine::propose_drafts() {
    if (!drafter_.enabled()) return;
    const std::vector<SeqPtr>& running = scheduler_.running();
    for (const SeqPtr& seq : running) {
        if (seq->computed + 1 != seq->size() || !seq->draft.empty()) continue;  // not decoding next, or drafted
        // Tokens past max_tokens are never emitted: the last draft leaves room for the token its row gives.
        const int64_t room = seq->sampling.max_tokens - seq->num_output() - 1;
        seq->draft = drafter_.propose(seq->tokens, seq->spec, room, static_cast<int64_t>(running.size()));
    }
}

std::vector<SequenceSlice> Engine::slices_of(const ScheduledBatch& batch, std::vector<int32_t>& tokens) const {
    std::vector<SequenceSlice> slices;
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
        const Sequence& seq = *batch.seqs[i];
        const int64_t own = std::min(batch.counts[i], seq.size() - seq.computed), drafted = batch.counts[i] - own;
        const auto first = seq.tokens.begin() + seq.computed;
        tokens.insert(tokens.end(), first, first + own);
        tokens.insert(tokens.end(), seq.draft.begin(), seq.draft.begin() + drafted);
        const bool samples = seq.computed + own == seq.size() && seq.pool == Pooling::None;
        // Scored prompt rows run up to the prompt's last token, whose row samples: together they are the last rows.
        const int64_t logits = seq.scored_rows(seq.computed, own) + (samples ? 1 + drafted : 0);
        slices.push_back({seq.computed, batch.counts[i], seq.blocks, logits, seq.pool,
                          seq.state_slot, static_cast<int64_t>(seq.num_prompt),
                          // the head runs over every generation's rows: its blocks may be reused by one that drafts
                          drafter_.uses_head() && seq.pool == Pooling::None});
    }
    return slices;
}

void Engine::fill_drafts(ScheduledBatch& batch, const DraftLogits& logits_of) {
    std::vector<size_t> active;  // the batch's sequences with drafts to fill in
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
        if (batch.seqs[i]->computed + batch.counts[i] > batch.seqs[i]->size()) active.push_back(i);
    }
    const size_t vocab = static_cast<size_t>(model_->vocab_size());
    for (int64_t j = 0; !active.empty(); ++j) {
        const std::vector<float> logits = logits_of(j, active);
        std::vector<size_t> going;
        for (size_t k = 0; k < active.size(); ++k) {
            const SeqPtr& seq = batch.seqs[active[k]];
            const int32_t token = draw_draft(*seq, &logits[k * vocab], j);
            if (token < 0) {  // nothing to draw: the verification runs the drafts so far
                batch.counts[active[k]] -= static_cast<int64_t>(seq->draft.size()) - j;
                seq->draft.resize(static_cast<size_t>(j));
                continue;
            }
            seq->draft[static_cast<size_t>(j)] = token;
            if (static_cast<int64_t>(seq->draft.size()) > j + 1) going.push_back(active[k]);
        }
        active = std::move(going);
    }
}

void Engine::draft_with_head(ScheduledBatch& batch) {
    if (!drafter_.uses_head()) return;
    const size_t width = static_cast<size_t>(model_->hidden_size());
    std::vector<size_t> last;  // the sequences of the head's last run, whose outputs `hidden` holds
    std::vector<float> hidden;
    fill_drafts(batch, [&](int64_t j, const std::vector<size_t>& active) {
        if (j == 0) {  // the head's output at each sequence's last computed position
            for (size_t i : active) {
                const std::vector<float>& state = batch.seqs[i]->spec.head_state;
                hidden.insert(hidden.end(), state.begin(), state.end());
            }
        } else {  // the head on its own output and draft j - 1, one position after where it last ran
            std::vector<int32_t> tokens;
            std::vector<float> rows;
            std::vector<SequenceSlice> slices;
            for (size_t i : active) {
                const Sequence& seq = *batch.seqs[i];
                const size_t k = static_cast<size_t>(std::find(last.begin(), last.end(), i) - last.begin());
                rows.insert(rows.end(), hidden.begin() + static_cast<int64_t>(k * width),
                            hidden.begin() + static_cast<int64_t>((k + 1) * width));
                tokens.push_back(seq.draft[static_cast<size_t>(j - 1)]);
                slices.push_back({seq.computed - 1 + j, 1, seq.blocks, 0, Pooling::None, seq.state_slot,
                                  static_cast<int64_t>(seq.num_prompt)});
            }
            hidden = model_->mtp_forward(tokens, rows, slices);
        }
        last = active;
        return model_->mtp_logits(hidden);
    });
}

void Engine::draft_with_model(ScheduledBatch& batch) {
    if (!drafter_.uses_draft_model()) return;
    fill_drafts(batch, [&](int64_t j, const std::vector<size_t>& active) {
        std::vector<int32_t> tokens;  // its last token, then draft j - 1, one position further on
        std::vector<SequenceSlice> slices;
        for (size_t i : active) {
            Sequence& seq = *batch.seqs[i];
            tokens.push_back(j == 0 ? seq.tokens.back() : seq.draft[static_cast<size_t>(j - 1)]);
            slices.push_back({seq.size() - 1 + j, 1, seq.blocks, 1});
            seq.spec.seen = seq.size();  // through its last token; the drafts' entries wait for the verification
        }
        return draft_->forward(tokens, slices);
    });
}

int32_t Engine::draw_draft(const Sequence& seq, const float* logits, int64_t j) const {
    std::vector<int32_t> context = seq.tokens;
    context.insert(context.end(), seq.draft.begin(), seq.draft.begin() + j);
    std::vector<float> scratch;
    Rng rng(draw_seed(seq.seed, seq.num_output() + j));
    return sample_row(logits, model_->vocab_size(), scratch, seq.sampling, context, seq.num_prompt, rng, nullptr,
                      seq.allowed);
}

void Engine::catch_up_draft_model(const ScheduledBatch& batch, const std::vector<SequenceSlice>& slices,
                                  const std::vector<SeqPtr>& done) {
    if (!drafter_.uses_draft_model()) return;
    // A chunk at a time, as the model's prefill runs (a cached prefix is the draft model's to run the first time).
    const int64_t chunk = scheduler_.config().prefill_chunk_size;
    for (bool more = true; more;) {
        std::vector<int32_t> tokens;
        std::vector<SequenceSlice> spans;
        for (size_t i = 0; i < slices.size(); ++i) {
            Sequence& seq = *batch.seqs[i];
            const int64_t end = slices[i].start + batch.counts[i];  // its computed tokens once this step counts
            if (!seq.spec.on || end <= seq.spec.seen ||
                std::find(done.begin(), done.end(), batch.seqs[i]) != done.end()) {
                continue;
            }
            const int64_t n = std::min(end - seq.spec.seen, chunk);
            tokens.insert(tokens.end(), seq.tokens.begin() + seq.spec.seen, seq.tokens.begin() + seq.spec.seen + n);
            spans.push_back({seq.spec.seen, n, seq.blocks, 0});
            seq.spec.seen += n;
        }
        more = !spans.empty();
        if (more) draft_->forward(tokens, spans);
    }
}

void Engine::catch_up_head(const ScheduledBatch& batch, const std::vector<SequenceSlice>& slices,
                           const std::vector<float>& hidden, const std::vector<SeqPtr>& done) {
    if (!drafter_.uses_head()) return;
    const size_t width = static_cast<size_t>(model_->hidden_size());
    std::vector<int32_t> tokens;
    std::vector<float> rows;
    std::vector<SequenceSlice> spans;
    std::vector<Sequence*> whose;
    size_t at = 0;  // slice i's hidden rows follow those of the slices before it that asked
    for (size_t i = 0; i < slices.size(); ++i) {
        if (!slices[i].hidden) continue;
        Sequence& seq = *batch.seqs[i];
        const int64_t kept = batch.counts[i];  // a verification's rows cut to those it kept
        if (std::find(done.begin(), done.end(), batch.seqs[i]) == done.end()) {
            const auto next = seq.tokens.begin() + slices[i].start + 1;  // the token after each kept row
            tokens.insert(tokens.end(), next, next + kept);
            rows.insert(rows.end(), hidden.begin() + static_cast<int64_t>(at),
                        hidden.begin() + static_cast<int64_t>(at + static_cast<size_t>(kept) * width));
            spans.push_back({slices[i].start, kept, seq.blocks, 0, Pooling::None, seq.state_slot,
                             static_cast<int64_t>(seq.num_prompt)});
            whose.push_back(&seq);
        }
        at += static_cast<size_t>(slices[i].num_tokens) * width;
    }
    if (spans.empty()) return;
    const std::vector<float> out = model_->mtp_forward(tokens, rows, spans);
    size_t end = 0;
    for (size_t k = 0; k < spans.size(); ++k) {
        end += static_cast<size_t>(spans[k].num_tokens) * width;
        if (whose[k]->spec.on) {
            whose[k]->spec.head_state.assign(out.begin() + static_cast<int64_t>(end - width),
                                             out.begin() + static_cast<int64_t>(end));
        }
    }
}

std::vector<StateCapture> Engine::captures_of(const ScheduledBatch& batch, const std::vector<SequenceSlice>& slices) {
    std::vector<StateCapture> captures = batch.captures;
    if (model_->num_state_slots() == 0) return captures;
    const size_t floats = static_cast<size_t>(model_->state_bytes() / 4);
    // Each slice's sampled rows: its scored prompt rows (which never come with drafts) keep no states.
    verify_rows_.assign(slices.size(), 0);
    size_t rows = 0;
    for (size_t i = 0; i < slices.size(); ++i) {
        verify_rows_[i] = slices[i].num_logits - batch.seqs[i]->scored_rows(slices[i].start, slices[i].num_tokens);
        rows += static_cast<size_t>(std::max<int64_t>(verify_rows_[i] - 1, 0));
    }
    verify_states_.resize(rows * floats);
    size_t at = 0;
    for (size_t i = 0; i < slices.size(); ++i) {
        for (int64_t t = 1; t < verify_rows_[i]; ++t, ++at) captures.push_back({i, t, &verify_states_[at * floats]});
    }
    return captures;
}

std::vector<Delta> Engine::deltas_of(ScheduledBatch& batch, const std::vector<SequenceSlice>& slices,
                                     const std::vector<float>& logits, const std::vector<float>& pooled,
                                     std::vector<SeqPtr>& done) {
    const int64_t vocab = model_->vocab_size(), hidden = model_->hidden_size();
    std::vector<Delta> deltas;
    int64_t row = 0, pooled_row = 0;
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
        const SeqPtr& seq = batch.seqs[i];
        if (seq->pool != Pooling::None) {
            Delta delta;
            if (pool_chunk(seq, slices[i].start, slices[i].start + slices[i].num_tokens,
                           &pooled[static_cast<size_t>(pooled_row++ * hidden)], delta)) {
                deltas.push_back(std::move(delta));
                done.push_back(seq);
            }
            continue;
        }
        if (slices[i].num_logits == 0) continue;  // a prompt chunk that does not reach the end yet
        Stopwatch sampling(profile_.sample);
        const int64_t scored = seq->scored_rows(slices[i].start, slices[i].num_tokens);
        score_prompt(*seq, &logits[static_cast<size_t>(row * vocab)], scored);
        row += scored;
        const int64_t rows = slices[i].num_logits - scored;  // the sampled rows
        if (rows == 0) continue;
        int64_t kept = 0;
        deltas.push_back(sample_rows(seq, &logits[static_cast<size_t>(row * vocab)], rows, kept));
        if (rows > 1) batch.counts[i] = kept;
        if (deltas.back().finish != Finish::None) done.push_back(seq);
        row += rows;
    }
    return deltas;
}

Delta Engine::sample_rows(const SeqPtr& seq, const float* logits, int64_t rows, int64_t& kept) {
    const int64_t vocab = model_->vocab_size();
    const std::vector<int32_t> drafts(seq->draft.begin(), seq->draft.begin() + (rows - 1));
    seq->draft.clear();
    Delta delta{seq->id, {}, Finish::None, -1, {}, {}};
    const bool wants_logprobs = seq->sampling.logprobs >= 0;
    const auto& stops = seq->sampling.stop_ids;
    const auto& own = seq->sampling.request_stop_ids;
    int64_t accepted = 0;
    for (int64_t j = 0; j < rows; ++j) {
        // Row j's context is the sequence with drafts 0..j-1 already in it: the rows before kept them.
        TokenLogprobs logprobs{};
        Rng rng(draw_seed(seq->seed, seq->num_output()));
        const int32_t token = sample_row(logits + j * vocab, vocab, sample_row_, seq->sampling, seq->tokens,
                                         seq->num_prompt, rng, wants_logprobs ? &logprobs : nullptr, seq->allowed);
        if (token < 0) {  // the grammar and min_tokens left no token: this request fails, alone
            delta.finish = Finish::Error;
            break;
        }
        const bool keeps = j < static_cast<int64_t>(drafts.size()) && token == drafts[static_cast<size_t>(j)];
        accepted += keeps ? 1 : 0;
        seq->tokens.push_back(token);
        delta.tokens.push_back(token);
        if (wants_logprobs) delta.logprobs.push_back(std::move(logprobs));
        if (seq->num_output() > seq->sampling.min_tokens && std::find(stops.begin(), stops.end(), token) != stops.end()) {
            delta.finish = Finish::Stop;
            if (std::find(own.begin(), own.end(), token) != own.end()) delta.stop_token_id = token;
        } else if (seq->num_output() >= seq->sampling.max_tokens) {
            delta.finish = Finish::Length;
        }
        if (delta.finish != Finish::None || !keeps) break;
    }
    drafter_.verified(seq->spec, static_cast<int64_t>(drafts.size()), accepted);
    kept = 1 + accepted;
    if (seq->sampling.prompt_logprobs >= 0 && seq->num_output() == static_cast<int64_t>(delta.tokens.size())) {
        delta.prompt_logprobs = std::move(seq->prompt_logprobs);  // the first token's delta carries them
        seq->prompt_logprobs.clear();
    }
    return delta;
}

void Engine::score_prompt(Sequence& seq, const float* logits, int64_t rows) const {
    const int64_t vocab = model_->vocab_size();
    for (int64_t r = 0; r < rows; ++r, ++seq.num_scored) {
        const std::vector<double> raw = log_softmax(std::vector<float>(logits + r * vocab, logits + (r + 1) * vocab));
        seq.prompt_logprobs.push_back(logprobs_of(raw, seq.tokens[static_cast<size_t>(seq.num_scored + 1)],
                                                  seq.sampling.prompt_logprobs));
    }
}

void Engine::commit_states(const ScheduledBatch& batch, const std::vector<SequenceSlice>& slices) {
    if (model_->num_state_slots() == 0) return;
    const size_t floats = static_cast<size_t>(model_->state_bytes() / 4);
    size_t at = 0;  // the captures of slice i follow those of the slices before it (captures_of)
    for (size_t i = 0; i < slices.size(); ++i) {
        const int64_t rows = verify_rows_[i];
        if (rows > 1 && batch.counts[i] < rows && batch.seqs[i]->state_slot >= 0) {
            model_->load_state(batch.seqs[i]->state_slot, &verify_states_[(at + static_cast<size_t>(batch.counts[i] - 1)) * floats]);
        }
        at += static_cast<size_t>(std::max<int64_t>(rows - 1, 0));
    }
}

void Engine::set_allowed(const std::string& id, std::vector<uint32_t> words) {
    const SeqPtr seq = scheduler_.find(id);
    if (!seq) throw std::invalid_argument("set_allowed: unknown request '" + id + "'");
    const size_t expected = static_cast<size_t>((model_->vocab_size() + 31) / 32);
    if (!words.empty() && words.size() != expected) {
        throw std::invalid_argument("set_allowed: " + std::to_string(words.size()) + " mask words, expected " +
                                    std::to_string(expected));
    }
    seq->allowed = std::move(words);
}

void Engine::abort(const std::vector<std::string>& ids) {
    for (const std::string& id : ids) {
        if (const SeqPtr seq = scheduler_.find(id)) scheduler_.finish(seq);
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
    const BlockManager& blocks = scheduler_.blocks();
    const StateSnapshots& snapshots = scheduler_.snapshots();
    return {scheduler_.num_running(), scheduler_.num_waiting(), blocks.num_blocks(),
            blocks.num_blocks() - blocks.num_free(), scheduler_.preemptions(), blocks.queries(), blocks.hits(),
            snapshots.size(), snapshots.hits(), snapshots.evictions(), drafter_.stats()};
}

}  // namespace pocketllm
