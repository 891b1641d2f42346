// Next-token choice for one sequence, with vLLM's semantics, and its logprobs from the raw logits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace pocketllm {

struct SamplingConfig {
    int64_t max_tokens = 16;  // resolved by the core: prompt + max_tokens <= max_model_len
    int64_t min_tokens = 0;
    float temperature = 1.0f, top_p = 1.0f, min_p = 0.0f;
    int64_t top_k = 0;  // 0: off
    float presence_penalty = 0.0f, frequency_penalty = 0.0f, repetition_penalty = 1.0f;
    std::optional<int64_t> seed;  // none: the engine's next seed
    std::vector<int32_t> stop_ids;     // EOS (unless ignore_eos) and the request's stop token ids
    std::vector<int32_t> request_stop_ids;  // the request's own: reported as stop_token_id
    std::map<int32_t, float> logit_bias;
    int logprobs = -1;  // -1: none; else the number of top alternatives
    // -1: none; else the prompt's tokens are scored (each given those before it, from the raw logits) with this
    // many top alternatives, and the cached prefix is not reused (it has no logits)
    int prompt_logprobs = -1;
    bool greedy() const { return temperature < 1e-5f; }
};

struct Alternative {  // one of the most likely tokens at a position, with its logprob
    int32_t token;
    float logprob;
};

struct TokenLogprobs {  // the chosen token's logprob and rank (1: the most likely), and the top alternatives
    int32_t token;
    float logprob;
    int64_t rank;
    std::vector<Alternative> top;
};

// A random stream (splitmix64): the same seed draws the same numbers whatever else runs.
class Rng {
public:
    explicit Rng(uint64_t seed) : state_(seed) {}
    uint64_t next();
    double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
private:
    uint64_t state_;
};

// The seed of the stream that draws output token `index` of a request seeded `seed`: a draw depends on these two
// alone, so neither the batch nor how many drafts a step accepted moves a request's draws.
uint64_t draw_seed(uint64_t seed, int64_t index);

// Sampling in parts, which sample() composes and speculative decoding will reuse (its acceptance test needs
// the processed, truncated distribution, not only a draw from it).
//
// The logits processors, in vLLM's order: min_tokens (the stop ids banned), logit_bias, the repetition, presence and
// frequency penalties, then `allowed`, a grammar's bitmask (bit t % 32 of word t / 32 for token t; empty: none).
// `tokens` are the sequence's `num_prompt` prompt tokens and then its output so far. false when the mask leaves no
// token that may be sampled.
bool process_logits(std::vector<float>& logits, const SamplingConfig& config, const std::vector<int32_t>& tokens,
                    size_t num_prompt, const std::vector<uint32_t>& allowed);

// What a sampled draw may choose after temperature, top-k, min-p and top-p: the ids, best first (ties by id), and
// their probabilities relative to the best token's. With no cut, `ids` is empty and every token is a candidate:
// weights[t] is token t's (the draw walks them in id order, with no vocabulary-sized list of ids to build).
struct Candidates {
    std::vector<int32_t> ids;
    std::vector<float> weights;
    int32_t id(size_t i) const { return ids.empty() ? static_cast<int32_t>(i) : ids[i]; }
};
Candidates truncate(const std::vector<float>& logits, const SamplingConfig& config);

// One token of `candidates`, in proportion to the weights, from one number of `rng`.
int32_t draw(const Candidates& candidates, Rng& rng);

// `raw`: the log-softmax of the model's own logits (before any processor). The token's logprob and rank (1: the
// most likely), and the top `k` alternatives.
std::vector<double> log_softmax(const std::vector<float>& logits);
TokenLogprobs logprobs_of(const std::vector<double>& raw, int32_t token, int k);

// The next token from `logits` (modified in place): processed, then the argmax when greedy, else a draw from the
// truncated candidates; fills `logprobs` when the config asks for them. -1 when nothing may be sampled.
int32_t sample(std::vector<float>& logits, const SamplingConfig& config, const std::vector<int32_t>& tokens,
               size_t num_prompt, Rng& rng, TokenLogprobs* logprobs, const std::vector<uint32_t>& allowed = {});

// sample() of the `vocab` logits at `logits`, which stay as they are: a plain greedy token (no processor, no
// logprobs) is their argmax, read in place; any other is sampled from a copy in `scratch`.
int32_t sample_row(const float* logits, int64_t vocab, std::vector<float>& scratch, const SamplingConfig& config,
                   const std::vector<int32_t>& tokens, size_t num_prompt, Rng& rng, TokenLogprobs* logprobs,
                   const std::vector<uint32_t>& allowed = {});

// The first position of the largest of x[0..n) (n >= 1), as std::max_element and torch's argmax find it.
int32_t argmax(const float* x, int64_t n);

}  // namespace pocketllm
