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

// A per-sequence random stream (splitmix64): the same seed draws the same numbers whatever else runs.
class Rng {
public:
    explicit Rng(uint64_t seed) : state_(seed) {}
    uint64_t next();
    double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
private:
    uint64_t state_;
};

// Chooses the next token from `logits` (vocab values, modified in place) for a sequence whose `tokens` are its
// `num_prompt` prompt tokens and then its output so far; fills `logprobs` when the config asks for them.
// `allowed`, when not empty, is a grammar's bitmask (bit t % 32 of word t / 32 for token t), applied after every
// other logits processor. Returns -1 when nothing may be sampled (every token masked).
int32_t sample(std::vector<float>& logits, const SamplingConfig& config, const std::vector<int32_t>& tokens,
               size_t num_prompt, Rng& rng, TokenLogprobs* logprobs, const std::vector<uint32_t>& allowed = {});

}  // namespace pocketllm
