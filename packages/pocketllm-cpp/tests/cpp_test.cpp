// The library from C++ alone: every ISA this CPU has gives the scalar path's results; bad shapes throw.
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <vector>

#include "pocketllm_cpp/engine.h"
#include "pocketllm_cpp/isa.h"
#include "pocketllm_cpp/matmul.h"

using namespace pocketllm;

static int failures = 0;
#define CHECK(cond)                                                      \
    do {                                                                 \
        if (!(cond)) {                                                   \
            std::fprintf(stderr, "%s:%d: CHECK(%s)\n", __FILE__, __LINE__, #cond); \
            ++failures;                                                  \
        }                                                                \
    } while (0)

int main() {
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
    const WeightView w{weight.data(), QType::Q8_0, rows, cols};
    validate(w, static_cast<int64_t>(weight.size()));

    ThreadPool pool(2);
    std::vector<float> scalar(n * rows), best(n * rows);
    set_isa("scalar");
    matmul(w, x.data(), n, scalar.data(), pool);
    set_isa("auto");
    matmul(w, x.data(), n, best.data(), pool);
    for (int64_t i = 0; i < n * rows; ++i) CHECK(std::fabs(scalar[i] - best[i]) <= 1e-4f * (1.0f + std::fabs(scalar[i])));

    bool threw = false;
    try {
        validate(WeightView{weight.data(), QType::Q8_0, rows, cols + 32}, static_cast<int64_t>(weight.size()));
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
        return WeightView{reinterpret_cast<const uint8_t*>(storage.back().data()), QType::F32, r, c};
    };
    std::vector<LayerWeights> weights;
    for (int64_t l = 0; l < layers; ++l) {
        weights.push_back({matrix(heads * dim, hidden), matrix(kv_heads * dim, hidden), matrix(kv_heads * dim, hidden),
                           matrix(hidden, heads * dim), matrix(inter, hidden), matrix(inter, hidden),
                           matrix(hidden, inter), std::vector<float>(hidden, 1.0f), std::vector<float>(hidden, 1.0f),
                           {}, {}});
    }
    std::vector<float> inv_freq;
    for (int64_t i = 0; i < dim / 2; ++i) inv_freq.push_back(std::pow(10000.0f, -2.0f * i / dim));
    const ModelConfig config{vocab, hidden, inter, layers, heads, kv_heads, dim, 1e-5f, false, false, false,
                             inv_freq};
    auto model = std::make_shared<Model>(config, matrix(vocab, hidden), std::move(weights),
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

    std::printf("%s: isa %s, %d failures\n", failures ? "FAILED" : "ok", isa_name(best_isa()).c_str(), failures);
    return failures ? 1 : 0;
}
