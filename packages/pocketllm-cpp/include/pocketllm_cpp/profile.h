// Where a step's time goes, accumulated over steps: always on (a clock read costs tens of nanoseconds, a step
// has a few hundred of them), read by the bench's decode profile.
#pragma once

#include <chrono>
#include <cstdint>

namespace pocketllm {

struct Profile {
    // Wall time of the calling thread, in seconds.
    double step = 0;       // Engine::step in all
    double schedule = 0;   // choosing the batch and its blocks, registering prefix-cache hashes
    double forward = 0;    // Model::forward in all; the next five are parts of it
    double matmul = 0;     // the layers' weight products (q/k/v, o, gate/up, down)
    double lm_head = 0;    // the vocabulary projection of the sampled rows
    double attention = 0;  // q/k norms, RoPE, the KV-cache writes and attention itself
    double recurrence = 0;  // state layers between their projections: Gated DeltaNet's conv, delta rule and norm
    double wait = 0;       // the caller idle at the end of parallel regions: imbalance and synchronisation
    double sample = 0;     // the sampler, logprobs included
    int64_t steps = 0, tokens = 0, regions = 0;  // regions: parallel regions run
};

// Adds the time from construction to destruction to a counter.
class Stopwatch {
public:
    explicit Stopwatch(double& into) : into_(into), start_(std::chrono::steady_clock::now()) {}
    ~Stopwatch() { into_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
    Stopwatch(const Stopwatch&) = delete;
    Stopwatch& operator=(const Stopwatch&) = delete;

private:
    double& into_;
    std::chrono::steady_clock::time_point start_;
};

}  // namespace pocketllm
