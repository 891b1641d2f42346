// The library from C++ alone: every ISA this CPU has gives the scalar path's results; bad shapes throw.
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <vector>

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
    std::printf("%s: isa %s, %d failures\n", failures ? "FAILED" : "ok", isa_name(best_isa()).c_str(), failures);
    return failures ? 1 : 0;
}
