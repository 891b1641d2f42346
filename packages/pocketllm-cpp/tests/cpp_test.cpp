// The library from C++ alone: every ISA this CPU has gives the scalar path's results; bad shapes throw.
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <map>
#include <numeric>
#include <ctime>
#include <random>
#include <stdexcept>
#include <string>
#include <algorithm>
#include <thread>
#include <vector>

#include "pocketllm_cpp/block_manager.h"
#include "pocketllm_cpp/engine.h"
#include "pocketllm_cpp/llama_model.h"
#include "pocketllm_cpp/qwen3_5_model.h"
#include "pocketllm_cpp/state_snapshots.h"
#include "pocketllm_cpp/isa.h"
#include "kernels.h"
#include "../src/moe.h"

using namespace pocketllm;

static int failures = 0;
#define CHECK(cond)                                                      \
    do {                                                                 \
        if (!(cond)) {                                                   \
            std::fprintf(stderr, "%s:%d: CHECK(%s)\n", __FILE__, __LINE__, #cond); \
            ++failures;                                                  \
        }                                                                \
    } while (0)

// A model whose whole state is one number per slot, a running hash of every token it has seen, and whose greedy
// next token is that hash: a request that runs in another's slot, resumes from a wrong snapshot or starts from a
// stale state gives other tokens.
class HashStateModel final : public Model {
public:
    HashStateModel(int64_t slots, int64_t num_blocks)
        : Model(kVocab, 1, num_blocks, 4), state_(static_cast<size_t>(slots), 0.0f) {}
    static constexpr int64_t kVocab = 97;
    int64_t num_state_slots() const override { return static_cast<int64_t>(state_.size()); }
    int64_t state_bytes() const override { return 4; }
    void save_state(int32_t slot, float* out) const override { *out = state_[static_cast<size_t>(slot)]; }
    void load_state(int32_t slot, const float* in) override { state_[static_cast<size_t>(slot)] = *in; }
    bool fail_next = false;  // the next forward pass throws after its checks, as one that runs out of memory
    std::vector<size_t> step_tokens;  // each forward pass's tokens
    std::vector<float> forward(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices,
                               std::vector<float>*, const std::vector<StateCapture>* captures,
                               std::vector<float>*) override {
        check(tokens, slices, captures);
        step_tokens.push_back(tokens.size());
        if (fail_next) {
            fail_next = false;
            throw std::runtime_error("injected");
        }
        std::vector<float> logits;
        size_t t = 0;
        for (size_t index = 0; index < slices.size(); ++index) {
            const SequenceSlice& s = slices[index];
            float& h = state_[static_cast<size_t>(s.state_slot)];
            if (s.start == 0) h = 0.0f;
            for (int64_t i = 0; i < s.num_tokens; ++i, ++t) {
                for (const StateCapture& c : captures ? *captures : std::vector<StateCapture>{}) {
                    if (c.slice == index && c.tokens == i) *c.out = h;
                }
                h = std::fmod(h * 31.0f + static_cast<float>(tokens[t]) + 1.0f, static_cast<float>(kVocab));
                if (i >= s.num_tokens - s.num_logits) {
                    for (int64_t v = 0; v < kVocab; ++v) logits.push_back(v == static_cast<int64_t>(h) ? 1.0f : 0.0f);
                }
            }
        }
        return logits;
    }
    void add_profile(Profile&) const override {}
    void reset_profile() override {}

private:
    std::vector<float> state_;
};

// Runs requests (id -> prompt) to their end, greedy; their tokens, and the engine's stats at the end.
static std::map<std::string, std::vector<int32_t>> run_hashed(Engine& engine,
                                                              const std::map<std::string, std::vector<int32_t>>& prompts,
                                                              int64_t max_tokens = 6) {
    SamplingConfig greedy;
    greedy.temperature = 0.0f;
    greedy.max_tokens = max_tokens;
    for (const auto& [id, prompt] : prompts) engine.add_request(id, prompt, greedy);
    std::map<std::string, std::vector<int32_t>> out;
    while (engine.has_unfinished()) {
        for (const Delta& d : engine.step()) out[d.request_id].insert(out[d.request_id].end(), d.tokens.begin(), d.tokens.end());
    }
    return out;
}

// Prompt lookup: the latest of the longest earlier occurrences of the sequence's suffix, within ngram_min..max,
// its continuation cut to k and to the sequence's end (the same cases as tests/core/test_ngram_proposer.py).
static void speculative_tests() {
    using V = std::vector<int32_t>;
    CHECK((ngram_draft({1, 2, 3, 4, 5, 9, 1, 2, 3}, 1, 4, 3) == V{4, 5, 9}));
    CHECK((ngram_draft({1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 2, 3}, 1, 4, 3) == V{7, 8, 2}));
    CHECK(ngram_draft({1, 2, 3, 1, 2}, 3, 4, 2).empty());
    CHECK((ngram_draft({1, 2, 3, 1, 2}, 2, 4, 2) == V{3, 1}));
    CHECK((ngram_draft({5, 5, 5, 5}, 1, 4, 3) == V{5}));
    CHECK((ngram_draft({7, 1, 2, 8, 2, 9, 1, 2}, 1, 4, 2) == V{8, 2}));  // "1 2" beats the later "2"
    CHECK(ngram_draft({1, 2, 3}, 1, 4, 0).empty() && ngram_draft({4}, 1, 1, 2).empty());
    // Drafting pauses after misses and shrinks k to what was accepted; whole acceptances grow it back.
    Drafter drafter(SpeculativeConfig{4, 1, 4, 2});
    DraftState state = drafter.start();
    CHECK(state.on && state.k == 4);
    CHECK(drafter.propose({1, 2, 1}, state, 8, 3).empty());  // more running than max_batch
    drafter.verified(state, 4, 1);
    CHECK(state.k == 2 && state.pause == 0);
    drafter.verified(state, 2, 2);
    CHECK(state.k == 4);
    drafter.verified(state, 3, 0);
    drafter.verified(state, 1, 0);
    CHECK(state.k == 1 && state.pause == 2);
    CHECK(drafter.propose({1, 2, 1}, state, 8, 1).empty() && state.pause == 1);
    const SpeculativeStats& stats = drafter.stats();
    CHECK(stats.drafts == 4 && stats.draft_tokens == 10 && stats.accepted_tokens == 3);
    CHECK((stats.accepted_per_position == std::vector<int64_t>{2, 1, 0, 0}));
    // MTP: room for the head's drafts (pending until the engine fills them in), once the head has run over the
    // sequence; an engine whose model has no head refuses the method.
    SpeculativeConfig mtp{4, 1, 4, 8, true};
    Drafter head_drafter(mtp);
    DraftState fresh = head_drafter.start();
    CHECK(head_drafter.propose({1, 2, 3}, fresh, 8, 1).empty());
    fresh.head_state.assign(4, 0.5f);
    CHECK((head_drafter.propose({1, 2, 3}, fresh, 3, 1) == V(3, kPendingDraft)));
    const auto refused = [](SpeculativeConfig config, std::shared_ptr<Model> draft) {
        try {
            Engine engine(std::make_shared<HashStateModel>(1, 64), SchedulerConfig{1, 64, 64, 1}, config, draft);
        } catch (const std::invalid_argument&) {
            return true;
        }
        return false;
    };
    CHECK(refused(mtp, nullptr));
    // A draft model goes with the method, and keeps no state (its blocks are the model's, its slots would not be).
    const SpeculativeConfig with_draft{4, 1, 4, 8, false, true};
    CHECK(refused(with_draft, nullptr));
    CHECK(refused(with_draft, std::make_shared<HashStateModel>(1, 64)));
    CHECK(refused(SpeculativeConfig{}, std::make_shared<HashStateModel>(1, 64)));
}

static void state_slot_tests() {
    std::vector<int32_t> shared;
    for (int32_t i = 0; i < 21; ++i) shared.push_back((i * 7) % 90);
    const std::map<std::string, std::vector<int32_t>> prompts = {
        {"a", shared}, {"b", {3, 1, 4, 1, 5}}, {"c", {2, 7}}, {"d", std::vector<int32_t>(shared.begin(), shared.begin() + 17)}};
    std::map<std::string, std::vector<int32_t>> alone;
    for (const auto& [id, prompt] : prompts) {
        Engine engine(std::make_shared<HashStateModel>(1, 64), SchedulerConfig{1, 64, 64, 1});
        alone[id] = run_hashed(engine, {{id, prompt}})[id];
    }
    // Batched, chunked (5 tokens a chunk), over fewer slots than max_num_seqs (admission waits for a slot).
    {
        Engine engine(std::make_shared<HashStateModel>(2, 64), SchedulerConfig{4, 12, 5, 1});
        CHECK(run_hashed(engine, prompts) == alone);
        const EngineStats stats = engine.stats();
        CHECK(stats.running == 0 && stats.waiting == 0 && stats.blocks_used == 0);
    }
    // A pool too small for all at once: preempted requests recompute from a fresh state.
    {
        Engine engine(std::make_shared<HashStateModel>(4, 9), SchedulerConfig{4, 64, 64, 1});
        std::map<std::string, std::vector<int32_t>> longer;
        for (const auto& [id, prompt] : prompts) {
            Engine one(std::make_shared<HashStateModel>(1, 64), SchedulerConfig{1, 64, 64, 1});
            longer[id] = run_hashed(one, {{id, prompt}}, 12)[id];
        }
        CHECK(run_hashed(engine, prompts, 12) == longer);
        CHECK(engine.stats().preemptions > 0);
    }
    // Prefix caching: a request sharing 16 tokens (4 blocks) resumes from the snapshot at the deepest boundary,
    // with the cold run's tokens; a snapshot budget of 2 evicts the least recently used.
    {
        Engine engine(std::make_shared<HashStateModel>(2, 64), SchedulerConfig{2, 64, 8, 1, true, 8});
        CHECK(run_hashed(engine, {{"a", prompts.at("a")}})["a"] == alone["a"]);
        CHECK(engine.stats().state_snapshots == 2 && engine.stats().state_snapshot_evictions == 1);  // at 8, 16, 20
        CHECK(run_hashed(engine, {{"d", prompts.at("d")}})["d"] == alone["d"]);
        const EngineStats stats = engine.stats();
        CHECK(stats.state_snapshot_hits == 1 && stats.prefix_hits > 0);
    }
    // Snapshots inside a prompt chunk: a 150-token prompt in one chunk leaves its states at 64 and 128 (captured
    // inside the pass) and at 148 (its last boundary, where the chunk is cut); a request sharing its first 100
    // tokens resumes from the one at 64, with the tokens it gets cold.
    {
        std::vector<int32_t> long_prompt, sharing;
        for (int32_t i = 0; i < 150; ++i) long_prompt.push_back((i * 13 + 5) % 90);
        sharing.assign(long_prompt.begin(), long_prompt.begin() + 100);
        sharing.push_back(1);
        Engine cold(std::make_shared<HashStateModel>(1, 64), SchedulerConfig{1, 256, 256, 1});
        const std::vector<int32_t> expected = run_hashed(cold, {{"s", sharing}})["s"];
        Engine engine(std::make_shared<HashStateModel>(1, 64), SchedulerConfig{1, 256, 256, 1, true, 40});
        run_hashed(engine, {{"l", long_prompt}});
        CHECK(engine.stats().state_snapshots == 3);
        CHECK(run_hashed(engine, {{"s", sharing}})["s"] == expected);
        CHECK(engine.stats().state_snapshot_hits == 1);
        // A step that throws keeps none of the snapshots it planned (they were never written); the next one takes
        // them again.
        auto failing = std::make_shared<HashStateModel>(1, 64);
        Engine retried(failing, SchedulerConfig{1, 256, 256, 1, true, 40});
        SamplingConfig greedy;
        greedy.temperature = 0.0f;
        retried.add_request("l", long_prompt, greedy);
        failing->fail_next = true;
        bool threw = false;
        try {
            retried.step();
        } catch (const std::runtime_error&) {
            threw = true;
        }
        CHECK(threw && retried.stats().state_snapshots == 0);
        retried.step();
        CHECK(retried.stats().state_snapshots == 3);  // 64 and 128 inside the chunk, 144 where it ends
    }
    // While a sequence decodes, the prompts beside it share one chunk a step (8 tokens), and it gets a token every
    // step; alone, prompts take a chunk each (two 30-token prompts: 16 tokens a step).
    {
        auto model = std::make_shared<HashStateModel>(3, 64);
        Engine engine(model, SchedulerConfig{3, 64, 8, 1});
        SamplingConfig greedy;
        greedy.temperature = 0.0f;
        greedy.max_tokens = 40;
        engine.add_request("a", {1, 2, 3}, greedy);
        engine.step();
        engine.add_request("b", std::vector<int32_t>(30, 5), greedy);
        engine.add_request("c", std::vector<int32_t>(30, 6), greedy);
        model->step_tokens.clear();
        for (int step = 0; step < 8; ++step) {  // 60 prompt tokens, 8 a step
            const std::vector<Delta> deltas = engine.step();
            CHECK(std::any_of(deltas.begin(), deltas.end(), [](const Delta& d) { return d.request_id == "a"; }));
        }
        // a's token and 8 of the prompts' (b's last 6 and c's first 2 in the fourth); b decodes from the fifth.
        CHECK(model->step_tokens == (std::vector<size_t>{9, 9, 9, 9, 10, 10, 10, 6}));
        engine.abort({"a", "b", "c"});
        model->step_tokens.clear();
        engine.add_request("b", std::vector<int32_t>(30, 5), greedy);
        engine.add_request("c", std::vector<int32_t>(30, 6), greedy);
        engine.step();
        CHECK(model->step_tokens == std::vector<size_t>{16});
    }
    // Aborted and failed requests give their slot back: one slot serves request after request.
    {
        Engine engine(std::make_shared<HashStateModel>(1, 64), SchedulerConfig{2, 64, 64, 1});
        SamplingConfig greedy;
        greedy.temperature = 0.0f;
        engine.add_request("x", {1, 2, 3}, greedy);
        engine.step();
        engine.abort({"x"});
        engine.add_request("y", {4}, greedy);
        engine.set_allowed("y", std::vector<uint32_t>(static_cast<size_t>((HashStateModel::kVocab + 31) / 32), 0));
        std::vector<Delta> failed = engine.step();
        CHECK(failed.size() == 1 && failed[0].finish == Finish::Error && failed[0].tokens.empty());
        CHECK(run_hashed(engine, {{"b", prompts.at("b")}})["b"] == alone["b"]);
    }
}

// A tiny float32 Qwen3.5 (two Gated DeltaNet layers around a gated attention layer; value heads of 12, so that the
// delta rule's vector and scalar column paths both run): the chunked delta rule agrees with the token-by-token one,
// a prefix resumes from a snapshot taken inside a prompt chunk with the cold run's tokens, and inconsistent sizes
// or captures throw before any work.
// The snapshot store's eviction: a snapshot requests resumed from outlives any number of new ones filed after it,
// while new ones still get room.
static void snapshot_eviction_tests() {
    StateSnapshots snapshots(8 * 4, 4);  // room for 8 one-float states
    CHECK(snapshots.slot_for(1) != nullptr && snapshots.slot_for(2) != nullptr);
    snapshots.take(1);  // a shared prefix's snapshot, resumed from
    for (uint64_t key = 10; key < 40; ++key) CHECK(snapshots.slot_for(key) != nullptr);  // 30 one-off prompt ends
    CHECK(snapshots.contains(1) && !snapshots.contains(2) && snapshots.size() == 8);
    CHECK(snapshots.contains(39) && snapshots.evictions() == 24);
    for (uint64_t key = 1; key < 8; ++key) {  // resumed snapshots keep at most 6 of the 8 places
        if (!snapshots.contains(key)) CHECK(snapshots.slot_for(key) != nullptr);
        snapshots.take(key);
    }
    CHECK(snapshots.contains(1) && snapshots.size() == 8);  // the oldest resumed went back on probation, as its newest
    CHECK(snapshots.slot_for(50) != nullptr && snapshots.slot_for(51) != nullptr);  // evict 39, then 1
    CHECK(!snapshots.contains(1) && snapshots.contains(50) && snapshots.contains(51));
    for (uint64_t key = 2; key < 8; ++key) CHECK(snapshots.contains(key));
}

static void qwen3_5_tests() {
    std::mt19937 rng(11);
    std::normal_distribution<float> normal;
    std::vector<std::vector<float>> storage;
    auto values = [&](int64_t size, float scale) {
        std::vector<float> v(static_cast<size_t>(size));
        for (auto& x : v) x = scale * normal(rng);
        return v;
    };
    auto matrix = [&](int64_t r, int64_t c) {
        storage.push_back(values(r * c, 0.3f));
        return WeightView{reinterpret_cast<const uint8_t*>(storage.back().data()), StorageType::F32, r, c};
    };
    const int64_t vocab = 64, hidden = 32, heads = 2, dim = 16, hk = 2, hv = 8, dk = 16, dv = 12, kernel = 4;
    const int64_t channels = 2 * hk * dk + hv * dv, inter = 64;
    std::vector<float> inv_freq;
    for (int64_t i = 0; i < 4; ++i) inv_freq.push_back(std::pow(10000.0f, -2.0f * static_cast<float>(i) / 8.0f));
    const Qwen3_5Config config{vocab, hidden, 3, heads, 1, dim, 8, 1e-6f, inv_freq, 1.0f, hk, hv, dk, dv, kernel,
                               false, true, KvType::F32};
    auto layers = [&](int64_t conv_values) {
        std::vector<Qwen3_5Layer> out;
        for (int64_t l = 0; l < 3; ++l) {
            Qwen3_5Layer L{};
            L.kind = l == 1 ? LayerKind::FullAttention : LayerKind::LinearAttention;
            L.input_norm = L.post_attention_norm = std::vector<float>(static_cast<size_t>(hidden), 1.0f);
            if (L.kind == LayerKind::FullAttention) {
                L.q = matrix(2 * heads * dim, hidden);
                L.k = matrix(dim, hidden);
                L.v = matrix(dim, hidden);
                L.o = matrix(hidden, heads * dim);
                L.q_norm = L.k_norm = std::vector<float>(static_cast<size_t>(dim), 1.0f);
            } else {
                L.qkv = matrix(channels, hidden);
                L.z = matrix(hv * dv, hidden);
                L.b = matrix(hv, hidden);
                L.a = matrix(hv, hidden);
                L.out = matrix(hidden, hv * dv);
                L.conv = values(conv_values, 0.5f);
                L.decay = std::vector<float>(static_cast<size_t>(hv), -1.0f);
                L.dt_bias = values(hv, 1.0f);
                L.norm = std::vector<float>(static_cast<size_t>(dv), 1.0f);
            }
            L.gate = matrix(inter, hidden);
            L.up = matrix(inter, hidden);
            L.down = matrix(hidden, inter);
            out.push_back(std::move(L));
        }
        return out;
    };
    const WeightView embedding = matrix(vocab, hidden), lm_head = matrix(vocab, hidden);
    const std::vector<Qwen3_5Layer> weights = layers(channels * kernel);
    const std::vector<float> final_norm(static_cast<size_t>(hidden), 1.0f);
    auto build = [&](int64_t slots) {
        return std::make_shared<Qwen3_5Model>(config, embedding, weights, final_norm, lm_head, 64, 16, slots, 2);
    };

    std::vector<int32_t> prompt;
    for (int32_t i = 0; i < 150; ++i) prompt.push_back((i * 17 + 3) % static_cast<int32_t>(vocab));
    {
        auto model = build(2);
        std::vector<int32_t> table(16);
        for (int32_t b = 0; b < 16; ++b) table[static_cast<size_t>(b)] = b;
        const std::vector<int32_t> head(prompt.begin(), prompt.begin() + 40);
        const std::vector<float> chunked = model->forward(head, {{0, 40, table, 40, Pooling::None, 0, -1}});
        const std::vector<float> recurrent = model->forward(head, {{0, 40, table, 40, Pooling::None, 1, 0}});
        float worst = 0.0f;
        for (size_t i = 0; i < chunked.size(); ++i) worst = std::max(worst, std::fabs(chunked[i] - recurrent[i]));
        CHECK(worst < 1e-4f && chunked != recurrent);
        bool threw = false;
        try {
            std::vector<float> out(static_cast<size_t>(model->state_bytes() / 4));
            const std::vector<StateCapture> at_end{{0, 40, out.data()}};
            model->forward(head, {{0, 40, table, 1, Pooling::None, 0, -1}}, nullptr, &at_end);
        } catch (const std::invalid_argument&) {
            threw = true;
        }
        CHECK(threw);
    }
    {
        std::vector<int32_t> sharing(prompt.begin(), prompt.begin() + 100);
        sharing.push_back(5);
        Engine cold(build(1), SchedulerConfig{1, 256, 256, 1});
        const std::vector<int32_t> expected = run_hashed(cold, {{"s", sharing}})["s"];
        auto model = build(1);
        Engine engine(model, SchedulerConfig{1, 256, 256, 1, true, 8 * model->state_bytes()});
        run_hashed(engine, {{"l", prompt}});
        CHECK(engine.stats().state_snapshots == 3);  // at 64 and 128 inside the chunk, at its end 144
        CHECK(run_hashed(engine, {{"s", sharing}})["s"] == expected);
        CHECK(engine.stats().state_snapshot_hits == 1);
    }
    const auto refused = [&](const std::vector<Qwen3_5Layer>& bad, const Qwen3_5Config& c) {
        try {
            Qwen3_5Model(c, embedding, bad, final_norm, lm_head, 64, 16, 1, 1);
        } catch (const std::invalid_argument&) {
            return true;
        }
        return false;
    };
    CHECK(refused(layers(channels * kernel - 1), config));  // a conv1d of the wrong size
    Qwen3_5Config uneven = config;
    uneven.linear_num_k_heads = 3;  // value heads not a multiple of key heads
    CHECK(refused(weights, uneven));
    Qwen3_5Config wider = config;
    wider.linear_k_dim = 32;  // in_proj_qkv no longer has the rows the heads need
    CHECK(refused(weights, wider));
}

// Greedy picks the first maximum, as std::max_element (and torch's argmax) do, on every ISA: ties in one run of
// the vectorised search, across runs, at the ends, and a row of equal values.
static void greedy_tests() {
    SamplingConfig greedy;
    greedy.temperature = 0.0f;
    std::mt19937 rng(11);
    std::normal_distribution<float> normal;
    for (const char* isa : {"scalar", "auto"}) {
        set_isa(isa);
        for (const int64_t vocab : {1, 7, 64, 65, 1000}) {
            for (const std::vector<int64_t>& tied : std::vector<std::vector<int64_t>>{{0}, {vocab - 1}, {vocab / 2, vocab - 1},
                                                                                    {63 % vocab, 64 % vocab}, {}}) {
                std::vector<float> logits(static_cast<size_t>(vocab));
                for (float& v : logits) v = normal(rng);
                for (int64_t at : tied) logits[static_cast<size_t>(at)] = 9.0f;
                const int64_t expected = std::max_element(logits.begin(), logits.end()) - logits.begin();
                std::vector<float> scratch;
                Rng draw(1);
                CHECK(sample_row(logits.data(), vocab, scratch, greedy, {}, 0, draw, nullptr, {}) == expected);
                CHECK(scratch.empty());  // read in place
                // A processor (a bias that moves the maximum) runs on the copy and leaves the row as it was.
                SamplingConfig biased = greedy;
                biased.logit_bias = {{static_cast<int32_t>(vocab - 1), 100.0f}};
                const std::vector<float> before = logits;
                CHECK(sample_row(logits.data(), vocab, scratch, biased, {}, 0, draw, nullptr, {}) == vocab - 1);
                CHECK(logits == before);
                CHECK(sample(logits, greedy, {}, 0, draw, nullptr, {}) == expected);
            }
            std::vector<float> flat(static_cast<size_t>(vocab), -0.5f);
            Rng draw(1);
            CHECK(sample(flat, greedy, {}, 0, draw, nullptr, {}) == 0);
        }
    }
    set_isa("auto");
}

// truncate() finds the tokens a cut can keep from a histogram before it sorts them: its candidates are those of
// sorting the whole vocabulary, best logit first and ties by id, then top-k, min-p and top-p in turn.
static void truncate_tests() {
    std::mt19937 rng(5);
    std::normal_distribution<float> normal;
    for (const int64_t vocab : {1, 10, 1000, 50000}) {
        for (const float spread : {0.5f, 4.0f, 30.0f}) {  // flat to peaked
            std::vector<float> logits(static_cast<size_t>(vocab));
            for (float& v : logits) v = std::round(normal(rng) * spread * 8.0f) / 8.0f;  // with ties
            // A grammar's mask: most tokens -inf (their probabilities are the vector exp's clamp, ~1e-38, not 0).
            for (size_t i = 3; i < logits.size() && spread > 10.0f; i += 1 + i % 3) logits[i] = -INFINITY;
            for (const int top_k : {0, 1, 5, 50, static_cast<int>(vocab) - 1}) {
                for (const float top_p : {1.0f, 0.95f, 0.5f, 1e-9f}) {
                    for (const float min_p : {0.0f, 0.05f, 1.0f}) {
                        SamplingConfig c;
                        c.temperature = 0.7f;
                        c.top_k = top_k;
                        c.top_p = top_p;
                        c.min_p = min_p;
                        std::vector<float> p(logits.size());
                        for (size_t i = 0; i < p.size(); ++i) p[i] = logits[i] * (1.0f / c.temperature);
                        double everything = exp_shifted(p.data(), vocab, *std::max_element(p.begin(), p.end()));
                        std::vector<int32_t> order;  // the tokens that may be drawn: not a masked one, nor one
                        for (int32_t i = 0; i < static_cast<int32_t>(vocab); ++i) {  // whose exp underflowed to 0
                            if (std::isinf(logits[i])) {
                                everything -= p[i];
                                p[i] = 0.0f;
                            }
                            if (p[i] > 0.0f) order.push_back(i);
                        }
                        std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {  // by logit, as documented
                            return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                        });
                        int64_t keep = static_cast<int64_t>(order.size());
                        double total = everything;
                        if (top_k > 0 && top_k < vocab) {
                            keep = std::min<int64_t>(keep, top_k);
                            total = 0.0;
                            for (int64_t i = 0; i < keep; ++i) total += p[order[i]];
                        }
                        if (min_p > 0.0f) {
                            int64_t kept = 0;
                            while (kept < keep && p[order[kept]] >= min_p) ++kept;
                            keep = kept;
                        }
                        if (top_p < 1.0f) {
                            double above = 0.0;
                            int64_t end = 1;
                            for (; end < keep; ++end) {
                                above += static_cast<double>(p[order[end - 1]]) / total;
                                if (above >= top_p) break;
                            }
                            keep = std::min(keep, end);
                        }
                        const Candidates got = truncate(logits, c);
                        for (size_t i = 0; i < got.weights.size(); ++i) {  // the masked tokens' weights are 0
                            if (std::isinf(logits[got.id(i)])) CHECK(got.weights[i] == 0.0f);
                        }
                        const bool cut = (top_k > 0 && top_k < vocab) || top_p < 1.0f || min_p > 0.0f;
                        if (cut) {
                            CHECK(got.ids == std::vector<int32_t>(order.begin(), order.begin() + keep));
                            CHECK(got.weights.size() == got.ids.size());
                        } else {  // every token, in id order
                            CHECK(got.ids.empty() && static_cast<int64_t>(got.weights.size()) == vocab);
                            Candidates listed{std::vector<int32_t>(static_cast<size_t>(vocab)), got.weights};
                            std::iota(listed.ids.begin(), listed.ids.end(), 0);
                            for (uint64_t seed = 0; seed < 8; ++seed) {  // the same draws as from the ids listed
                                Rng a(seed), b(seed);
                                const int32_t token = draw(got, a);
                                CHECK(token == draw(listed, b) && !std::isinf(logits[token]));
                            }
                        }
                    }
                }
            }
        }
    }
}

int main() {
    speculative_tests();
    truncate_tests();
    state_slot_tests();
    snapshot_eviction_tests();
    qwen3_5_tests();
    greedy_tests();
    const int64_t rows = 48, cols = 96, n = 3;
    std::mt19937 rng(7);
    std::uniform_int_distribution<int> byte(0, 255);
    std::vector<uint8_t> weight(rows * (cols / kBlock) * sizeof(BlockQ8_0));
    for (auto& b : weight) b = static_cast<uint8_t>(byte(rng));
    for (int64_t i = 0; i < rows * (cols / kBlock); ++i) {  // sane scales: small positive halves
        BlockQ8_0* blk = reinterpret_cast<BlockQ8_0*>(weight.data()) + i;
        blk->d = static_cast<uint16_t>(0x2000 + (i % 64));
    }
    std::normal_distribution<float> normal;
    std::vector<float> x(n * cols);
    for (auto& v : x) v = normal(rng);
    const WeightView w{weight.data(), StorageType::Q8_0, rows, cols};
    validate(w, static_cast<int64_t>(weight.size()));

    ThreadPool pool(2);
    std::vector<float> scalar(n * rows), best(n * rows);
    set_isa("scalar");
    matmul(w, x.data(), n, scalar.data(), pool);
    set_isa("auto");
    matmul(w, x.data(), n, best.data(), pool);
    for (int64_t i = 0; i < n * rows; ++i) CHECK(std::fabs(scalar[i] - best[i]) <= 1e-4f * (1.0f + std::fabs(scalar[i])));

    // Every quantized storage type on every ISA this CPU has: random blocks (sane scales) give the scalar path's
    // results, for one activation row (decode), two, and five (batched tiles); 19 blocks a row for the 32-value
    // storage types (a last partial group of 8 in the batched kernels).
    std::vector<std::string> isas;
    for (size_t at = 0; at <= available_isas().size();) {
        const size_t end = std::min(available_isas().find(' ', at), available_isas().size());
        if (available_isas().substr(at, end - at) != "scalar") isas.push_back(available_isas().substr(at, end - at));
        at = end + 1;
    }
    // Each ISA's product of `w` equals the scalar path's, for one, two, five and 70 activation rows (AMX's tiles take
    // 64 or more: 4 whole tiles of 16 and a partial one). Each row of a batched product is the bits of that row alone,
    // and AMX's are AVX-512's.
    const auto matches_scalar = [&](const WeightView& w) {
        std::vector<float> avx512;
        for (const int64_t kn : {1, 2, 5, 70}) {
            std::vector<float> kx(kn * w.cols), reference(kn * w.rows), got(kn * w.rows), alone(w.rows);
            for (auto& v : kx) v = normal(rng);
            set_isa("scalar");
            matmul(w, kx.data(), kn, reference.data(), pool);
            for (const std::string& isa : isas) {
                set_isa(isa);
                matmul(w, kx.data(), kn, got.data(), pool);
                for (int64_t i = 0; i < kn * w.rows; ++i) {
                    CHECK(std::fabs(reference[i] - got[i]) <= 1e-4f * (1.0f + std::fabs(reference[i])));
                }
                if (kn != 70) continue;
                for (int64_t r = 0; r < kn; ++r) {
                    matmul(w, &kx[r * w.cols], 1, alone.data(), pool);
                    CHECK(std::memcmp(alone.data(), &got[r * w.rows], alone.size() * sizeof(float)) == 0);
                }
                if (isa == "avx512") avx512 = got;
                if (isa == "amx") CHECK(std::memcmp(avx512.data(), got.data(), got.size() * sizeof(float)) == 0);
            }
        }
        set_isa("auto");
    };
    for (const char* name : {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4",
                             "IQ4_XS", "Q2_K", "Q3_K"}) {
        const StorageType type = parse_storage_type(name);
        for (const int64_t kcols : {512, 608}) {
            if (kcols % block_values(type) != 0) continue;
            const int64_t krows = 52;  // 3 of AMX's panels of 16 rows, and 4 rows that AVX-512 takes
            std::vector<uint8_t> raw(row_bytes(type, kcols) * krows);
            for (auto& b : raw) b = static_cast<uint8_t>(byte(rng));
            const size_t block_bytes = row_bytes(type, block_values(type));
            for (size_t at = 0; at < raw.size(); at += block_bytes) {  // the fp16 scales: small positive halves
                // d (and dmin) come last in Q2_K, Q3_K and Q6_K blocks, first in the others.
                const size_t offset = type == StorageType::Q6_K || type == StorageType::Q3_K ? block_bytes - 2
                                      : type == StorageType::Q2_K                          ? block_bytes - 4
                                                                                           : 0;
                if (type == StorageType::MXFP4) {  // its scale: an E8M0 exponent, here of weights near 1
                    raw[at] = static_cast<uint8_t>(122 + byte(rng) % 8);
                    continue;
                }
                const bool with_min = type == StorageType::Q4_1 || type == StorageType::Q4_K ||
                                      type == StorageType::Q5_K || type == StorageType::Q5_1 ||
                                      type == StorageType::Q2_K;  // a second fp16: the min
                const int fields = with_min ? 2 : 1;
                for (int f = 0; f < fields; ++f) {
                    const uint16_t half = static_cast<uint16_t>(0x1C00 + byte(rng));
                    std::memcpy(&raw[at + offset + 2 * f], &half, 2);
                }
            }
            const WeightView kw{raw.data(), type, krows, kcols};
            validate(kw, static_cast<int64_t>(raw.size()));
            matches_scalar(kw);
        }
    }

    // FP8 (E4M3) weights with a scale per 32 columns: every ISA against scalar, and dequantization against the byte
    // table (every finite byte), for one, two and five activation rows.
    {
        const int64_t fcols = 96;
        std::vector<uint8_t> raw(rows * fcols);
        for (auto& b : raw) {
            b = static_cast<uint8_t>(byte(rng));
            if ((b & 0x7F) == 0x7F) b ^= 1;  // NaN in E4M3
        }
        std::vector<float> scales(rows * (fcols / kBlock));
        for (auto& v : scales) v = 0.001f + 0.01f * std::fabs(normal(rng));
        WeightView fw{raw.data(), StorageType::F8_E4M3, rows, fcols, scales.data()};
        validate(fw, static_cast<int64_t>(raw.size()));
        std::vector<float> values(rows * fcols);
        dequantize(fw, values.data());
        for (int64_t i = 0; i < rows * fcols; ++i) {
            CHECK(values[i] == fp8_e4m3_to_fp32(raw[i]) * scales[i / kBlock]);
        }
        CHECK(fp8_e4m3_to_fp32(0x08) == 0.015625f && fp8_e4m3_to_fp32(0x01) == 0.001953125f &&
              fp8_e4m3_to_fp32(0x7E) == 448.0f && fp8_e4m3_to_fp32(0xC0) == -2.0f);
        matches_scalar(fw);
        fw.scales = nullptr;
        bool refused = false;
        try {
            validate(fw, static_cast<int64_t>(raw.size()));
        } catch (const std::invalid_argument&) {
            refused = true;
        }
        CHECK(refused);
    }

    // Attention kernels of every ISA against the scalar ones, on float32 and float16 cache rows: scores, weighted
    // sums (of 6 rows: a tile of 3, then 2 and 1), maxima. A row's weighted sum is the same bits with others as
    // alone, and the same in one call as over the rows split into two calls (the cache's blocks).
    for (const KvType kv : {KvType::F32, KvType::F16}) {
        const int64_t dim = 64, keys = 7, nq = 6, element = kv == KvType::F16 ? 2 : 4;
        std::vector<float> q(nq * dim), block(keys * dim);
        std::vector<uint8_t> stored(static_cast<size_t>(keys * dim * element));
        for (auto& v : q) v = normal(rng);
        for (auto& v : block) v = normal(rng);
        auto run = [&](const std::string& isa, std::vector<float>& scores, std::vector<float>& out) {
            set_isa(isa);
            const kernels::Attention ops = kernels::attention_for(kv, dim);
            for (int64_t k = 0; k < keys; ++k) ops.store(&block[k * dim], dim, stored.data() + k * dim * element);
            scores.assign(nq * keys, 0.0f);
            ops.scores(q.data(), nq, stored.data(), keys, dim, 0.125f, scores.data(), keys);
            std::vector<float> split(nq * keys, 0.0f);  // keys 0..3 by the 4-key tree, 4..6 one by one
            ops.scores(q.data(), nq, stored.data(), 4, dim, 0.125f, split.data(), keys);
            ops.scores(q.data(), nq, stored.data() + 4 * dim * element, keys - 4, dim, 0.125f, &split[4], keys);
            CHECK(split == scores);
            out.assign(nq * dim, 0.5f);
            ops.accumulate(scores.data(), keys, nq, stored.data(), keys, dim, out.data(), dim);
            // The rows loaded as float32 (a prefill tile's part) give the same bits through the float32 kernels.
            const kernels::Attention as_float = kernels::attention_for(KvType::F32, dim);
            std::vector<float> loaded(keys * dim), loaded_scores(nq * keys), loaded_out(nq * dim, 0.5f);
            ops.load(stored.data(), keys, dim, loaded.data());
            as_float.scores(q.data(), nq, loaded.data(), keys, dim, 0.125f, loaded_scores.data(), keys);
            as_float.accumulate(scores.data(), keys, nq, loaded.data(), keys, dim, loaded_out.data(), dim);
            CHECK(loaded_scores == scores);
            CHECK(loaded_out == out);
            for (int64_t r = 0; r < nq; ++r) {
                std::vector<float> alone(dim, 0.5f), halves(dim, 0.5f);
                ops.accumulate(&scores[r * keys], keys, 1, stored.data(), keys, dim, alone.data(), dim);
                CHECK(std::equal(alone.begin(), alone.end(), out.begin() + r * dim));
                ops.accumulate(&scores[r * keys], keys, 1, stored.data(), 3, dim, halves.data(), dim);
                ops.accumulate(&scores[r * keys + 3], keys, 1, stored.data() + 3 * dim * element, keys - 3, dim,
                               halves.data(), dim);
                CHECK(halves == alone);
                CHECK(ops.maximum(&scores[r * keys], keys) == *std::max_element(&scores[r * keys], &scores[(r + 1) * keys]));
            }
        };
        std::vector<float> want_scores, want_out, got_scores, got_out;
        run("scalar", want_scores, want_out);
        for (const std::string& isa : isas) {
            run(isa, got_scores, got_out);
            for (size_t i = 0; i < want_scores.size(); ++i) CHECK(std::fabs(want_scores[i] - got_scores[i]) <= 1e-4f);
            for (size_t i = 0; i < want_out.size(); ++i) CHECK(std::fabs(want_out[i] - got_out[i]) <= 1e-4f * (1.0f + std::fabs(want_out[i])));
        }
        set_isa("auto");
    }

    // Block accounting with prefix caching: a shared prefix is found, referenced and kept; freed blocks are
    // evicted least recently freed first, and an evicted block is no longer found.
    {
        BlockManager blocks(4, 2, true);
        std::vector<int32_t> first{blocks.allocate(), blocks.allocate()};
        const std::vector<int32_t> tokens{1, 2, 3, 4, 5};
        BlockManager::Chain chain;
        blocks.register_full(tokens, 4, first, chain);
        CHECK(chain.blocks == 2);
        CHECK(blocks.match(tokens) == first);                                // tokens 0..3: two full blocks
        CHECK(blocks.match({1, 2, 3, 4}).size() == 1);                       // never the last token's block
        CHECK(blocks.match({1, 2, 9, 9, 9}).size() == 1);                    // the chain stops at a difference
        CHECK(blocks.match({9, 9, 3, 4, 5}).empty());                        // equal block, other prefix
        std::vector<int32_t> second = blocks.match(tokens);
        blocks.share(second, 5);
        CHECK(blocks.num_free() == 2 && blocks.hits() == 4 && blocks.queries() == 5);
        blocks.release(first);
        CHECK(blocks.num_free() == 2);  // still held by the second sequence
        blocks.release(second);
        CHECK(blocks.num_free() == 4 && blocks.match(tokens).size() == 2);   // free, and still cached
        // The two never-used blocks go first; then the cached ones, the later block of the chain before its prefix.
        std::vector<int32_t> taken;
        for (int i = 0; i < 3; ++i) taken.push_back(blocks.allocate());
        CHECK(blocks.match(tokens).size() == 1 && blocks.allocate() >= 0 && blocks.match(tokens).empty());
        CHECK(blocks.allocate() == -1);
    }
    {  // Without a cached prefix, the most recently freed block is reused: the pool's pages stay untouched
       // beyond the blocks in use at the peak.
        BlockManager blocks(8, 2, false);
        std::vector<int32_t> held{blocks.allocate(), blocks.allocate()};
        CHECK(held[0] == 0 && held[1] == 1);
        blocks.release(held);
        for (int round = 0; round < 3; ++round) {
            std::vector<int32_t> again{blocks.allocate(), blocks.allocate()};
            CHECK((again == std::vector<int32_t>{0, 1}));
            blocks.release(again);
        }
    }

    // Waiting threads do not spin for long: while one range sleeps (on whichever thread claimed it), the other
    // threads, their ranges done at once, sleep too, and an idle pool sleeps; the process's CPU time stays far
    // below the time waited. A spinning caller burns all of it: on a busy host, the CPU time the others need.
    {
        ThreadPool waiting(4);
        waiting.parallel_for(4, [](int64_t, int64_t) {});
        const auto cpu_seconds = [] { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; };
        double start = cpu_seconds();
        waiting.parallel_for(4, [](int64_t begin, int64_t) {
            if (begin == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        });
        CHECK(cpu_seconds() - start < 0.05);
        start = cpu_seconds();
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        CHECK(cpu_seconds() - start < 0.05);
    }
    CHECK(available_cpus() >= 1);
    CHECK(available_cpus() <= static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));

    bool threw = false;
    try {
        validate(WeightView{weight.data(), StorageType::Q8_0, rows, cols + 32}, static_cast<int64_t>(weight.size()));
    } catch (const std::invalid_argument&) {
        threw = true;
    }
    CHECK(threw);

    // A tiny random float32 model through the engine: requests of every kind run to their end, an aborted one
    // frees its blocks, and a bad request is refused before it is queued.
    const int64_t vocab = 64, hidden = 32, inter = 64, heads = 4, kv_heads = 2, dim = 8, layers = 2;
    std::vector<std::vector<float>> storage;
    auto matrix = [&](int64_t r, int64_t c) {
        storage.emplace_back(r * c);
        for (auto& v : storage.back()) v = 0.3f * normal(rng);
        return WeightView{reinterpret_cast<const uint8_t*>(storage.back().data()), StorageType::F32, r, c};
    };
    std::vector<LlamaLayer> weights;
    for (int64_t l = 0; l < layers; ++l) {
        weights.push_back({matrix(heads * dim, hidden), matrix(kv_heads * dim, hidden), matrix(kv_heads * dim, hidden),
                           matrix(hidden, heads * dim), matrix(inter, hidden), matrix(inter, hidden),
                           matrix(hidden, inter), std::vector<float>(hidden, 1.0f), std::vector<float>(hidden, 1.0f),
                           {}, {}});
    }
    std::vector<float> inv_freq;
    for (int64_t i = 0; i < dim / 2; ++i) inv_freq.push_back(std::pow(10000.0f, -2.0f * i / dim));
    const LlamaConfig config{vocab, hidden, inter, layers, heads, kv_heads, dim, 1e-5f, false, false, false,
                             inv_freq, 1.0f, KvType::F16};
    auto model = std::make_shared<LlamaModel>(config, matrix(vocab, hidden), std::move(weights),
                                         std::vector<float>(hidden, 1.0f), matrix(vocab, hidden), 16, 4, 2);
    Engine engine(model, SchedulerConfig{2, 16, 8, 7});
    SamplingConfig greedy;
    greedy.temperature = 0.0f;
    greedy.max_tokens = 12;
    SamplingConfig sampled = greedy;
    sampled.temperature = 0.8f;
    sampled.top_k = 5;
    sampled.top_p = 0.9f;
    sampled.repetition_penalty = 1.2f;
    sampled.logprobs = 3;
    engine.add_request("a", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, greedy);
    engine.add_request("b", {5, 6}, sampled);
    engine.add_request("c", {7}, greedy);  // waits: two slots
    engine.add_request("d", {9, 9}, greedy);
    engine.abort({"d"});
    threw = false;
    try {
        engine.add_request("e", {vocab}, greedy);
    } catch (const std::invalid_argument&) {
        threw = true;
    }
    CHECK(threw);
    int tokens = 0;
    while (engine.has_unfinished()) tokens += static_cast<int>(engine.step().size());
    CHECK(tokens == 36);
    const EngineStats stats = engine.stats();
    CHECK(stats.running == 0 && stats.waiting == 0 && stats.blocks_used == 0);

    // matmul_grouped: products over their own inputs (one of no rows), in one region, give each row the bits
    // matmul gives it.
    {
        std::vector<float> xa(3 * cols), xb(cols), ya(3 * rows), yb(rows), ga(3 * rows), gb(rows);
        for (auto& v : xa) v = normal(rng);
        for (auto& v : xb) v = normal(rng);
        matmul(w, xa.data(), 3, ya.data(), pool);
        matmul(w, xb.data(), 1, yb.data(), pool);
        matmul_grouped({{&w, xa.data(), 3, ga.data()}, {&w, xb.data(), 0, nullptr}, {&w, xb.data(), 1, gb.data()}}, pool);
        CHECK(std::memcmp(ya.data(), ga.data(), ya.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(yb.data(), gb.data(), yb.size() * sizeof(float)) == 0);
    }

    // The MoE block on Q8_0 experts: a batch's rows are the bits each row gets alone, on every ISA; the ISAs agree
    // with the scalar path; inconsistent weights throw.
    {
        const int64_t hidden = 64, ff = 96, experts = 4, kn = 5;
        auto q8 = [&](int64_t r, int64_t c) {
            std::vector<uint8_t> raw(row_bytes(StorageType::Q8_0, c) * r);
            for (auto& b : raw) b = static_cast<uint8_t>(byte(rng));
            for (size_t at = 0; at < raw.size(); at += sizeof(BlockQ8_0)) {
                const uint16_t half = static_cast<uint16_t>(0x1C00 + byte(rng));
                std::memcpy(&raw[at], &half, 2);
            }
            return raw;
        };
        std::vector<float> router(experts * hidden), gate_of_shared(hidden), mx(kn * hidden);
        for (auto& v : router) v = normal(rng);
        for (auto& v : gate_of_shared) v = normal(rng);
        for (auto& v : mx) v = 0.1f * normal(rng);
        const auto gate = q8(experts * ff, hidden), up = q8(experts * ff, hidden), down = q8(experts * hidden, ff);
        const auto sgate = q8(ff, hidden), sup = q8(ff, hidden), sdown = q8(hidden, ff);
        MoeWeights mw{};
        mw.router = {reinterpret_cast<const uint8_t*>(router.data()), StorageType::F32, experts, hidden};
        const size_t in_bytes = row_bytes(StorageType::Q8_0, hidden) * ff, out_bytes = row_bytes(StorageType::Q8_0, ff) * hidden;
        for (int64_t e = 0; e < experts; ++e) {
            mw.gate.push_back({gate.data() + e * in_bytes, StorageType::Q8_0, ff, hidden});
            mw.up.push_back({up.data() + e * in_bytes, StorageType::Q8_0, ff, hidden});
            mw.down.push_back({down.data() + e * out_bytes, StorageType::Q8_0, hidden, ff});
        }
        mw.top_k = 2;
        mw.norm_topk_prob = true;
        mw.has_shared = true;
        mw.shared_gate = {sgate.data(), StorageType::Q8_0, ff, hidden};
        mw.shared_up = {sup.data(), StorageType::Q8_0, ff, hidden};
        mw.shared_down = {sdown.data(), StorageType::Q8_0, hidden, ff};
        mw.shared_expert_gate = {reinterpret_cast<const uint8_t*>(gate_of_shared.data()), StorageType::F32, 1, hidden};
        validate(mw, hidden);
        std::vector<float> scalar_out(kn * hidden);
        std::vector<std::string> every{"scalar"};
        every.insert(every.end(), isas.begin(), isas.end());
        for (const std::string& isa : every) {
            set_isa(isa);
            std::vector<float> batched(kn * hidden), alone(kn * hidden);
            moe_forward(mw, mx.data(), kn, hidden, batched.data(), pool, false);
            for (int64_t t = 0; t < kn; ++t) moe_forward(mw, &mx[t * hidden], 1, hidden, &alone[t * hidden], pool, false);
            CHECK(std::memcmp(batched.data(), alone.data(), batched.size() * sizeof(float)) == 0);
            if (isa == "scalar") scalar_out = batched;
            for (int64_t i = 0; i < kn * hidden; ++i) {
                CHECK(std::fabs(scalar_out[i] - batched[i]) <= 1e-4f * (1.0f + std::fabs(scalar_out[i])));
            }
        }
        set_isa("auto");
        auto rejects = [&](MoeWeights bad) {
            try {
                validate(bad, hidden);
            } catch (const std::invalid_argument&) {
                return true;
            }
            return false;
        };
        MoeWeights bad = mw;
        bad.top_k = experts + 1;
        CHECK(rejects(bad));
        bad = mw;
        bad.down[2].cols = hidden;
        CHECK(rejects(bad));
        bad = mw;
        bad.up.pop_back();
        CHECK(rejects(bad));
        CHECK(!rejects(mw));
    }

    std::printf("%s: isa %s, %d failures\n", failures ? "FAILED" : "ok", isa_name(best_isa()).c_str(), failures);
    return failures ? 1 : 0;
}
