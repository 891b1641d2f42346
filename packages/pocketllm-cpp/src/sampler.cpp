#include "pocketllm_cpp/sampler.h"

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

namespace pocketllm {

uint64_t Rng::next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint64_t draw_seed(uint64_t seed, int64_t index) {
    return Rng(seed + static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull).next();
}

// The vector maximum, then the first 64-value run holding it (a compare per value without a branch, which
// vectorises), then that run value by value. std::max_element's compare and branch per value took about 240 us of a
// 248,320-value row on a Zen 4. (Rows with NaNs, from a broken model, may give another position than it would.)
int32_t argmax(const float* x, int64_t n) {
    const float best = maximum(x, n);
    constexpr int64_t kRun = 64;
    for (int64_t start = 0; start < n; start += kRun) {
        const int64_t end = std::min(n, start + kRun);
        bool found = false;
        for (int64_t i = start; i < end; ++i) found |= x[i] == best;
        if (!found) continue;
        for (int64_t i = start; i < end; ++i) {
            if (x[i] == best) return static_cast<int32_t>(i);
        }
    }
    return 0;  // the maximum is a NaN
}

std::vector<double> log_softmax(const std::vector<float>& logits) {
    const float best = maximum(logits.data(), static_cast<int64_t>(logits.size()));
    double total = 0.0;
    for (float v : logits) total += std::exp(static_cast<double>(v) - best);
    const double log_total = std::log(total) + best;
    std::vector<double> out(logits.size());
    for (size_t i = 0; i < logits.size(); ++i) out[i] = logits[i] - log_total;
    return out;
}

namespace {

bool hides_stops(const SamplingConfig& c, const std::vector<int32_t>& tokens, size_t num_prompt) {
    return static_cast<int64_t>(tokens.size() - num_prompt) < c.min_tokens && !c.stop_ids.empty();
}

bool penalises(const SamplingConfig& c) {
    return c.repetition_penalty != 1.0f || c.presence_penalty != 0.0f || c.frequency_penalty != 0.0f;
}

}  // namespace

bool process_logits(std::vector<float>& logits, const SamplingConfig& c, const std::vector<int32_t>& tokens,
                    size_t num_prompt, const std::vector<uint32_t>& allowed) {
    const int64_t vocab = static_cast<int64_t>(logits.size());
    const float neg_inf = -std::numeric_limits<float>::infinity();
    if (hides_stops(c, tokens, num_prompt)) {
        for (int32_t id : c.stop_ids) logits[id] = neg_inf;
    }
    for (const auto& [id, bias] : c.logit_bias) logits[id] += bias;
    if (penalises(c)) {
        std::unordered_set<int32_t> seen(tokens.begin(), tokens.end());
        std::unordered_map<int32_t, int> counts;
        for (size_t i = num_prompt; i < tokens.size(); ++i) ++counts[tokens[i]];
        for (int32_t id : seen) {
            float& v = logits[id];
            v = v > 0 ? v / c.repetition_penalty : v * c.repetition_penalty;
        }
        for (const auto& [id, count] : counts) {
            logits[id] -= c.frequency_penalty * static_cast<float>(count) + c.presence_penalty;
        }
    }
    if (allowed.empty()) return true;
    bool any = false;  // a token both allowed and not already ruled out (min_tokens)
    for (int64_t word = 0, base = 0; base < vocab; ++word, base += 32) {
        const uint32_t bits = allowed[static_cast<size_t>(word)];
        const int64_t end = std::min<int64_t>(base + 32, vocab);
        if (bits == 0) {  // most words, deep in a grammar: nothing of theirs may come
            std::fill(logits.begin() + base, logits.begin() + end, neg_inf);
            continue;
        }
        for (int64_t t = base; t < end; ++t) {
            float& v = logits[static_cast<size_t>(t)];
            if (!((bits >> (t - base)) & 1u)) v = neg_inf;
            else any = any || v != neg_inf;
        }
    }
    return any;
}

namespace {

// Probabilities relative to the best token's (in (0, 1], or 0) are positive floats, whose bit patterns order as the
// values do: their top 16 bits (sign, exponent, 7 mantissa bits) make a histogram of 2^14 ordered buckets, 1.0 in
// the last. One pass over the vocabulary counts and sums each bucket; a walk down from the top finds the bucket
// where a cut falls, and every token it keeps is in that bucket or above.
constexpr int kBucketShift = 16;
constexpr int kBuckets = (0x3F800000 >> kBucketShift) + 1;

int bucket_of(float p) {  // a NaN (from an infinite logit) in bucket 0, which no cut keeps
    uint32_t bits;
    std::memcpy(&bits, &p, sizeof bits);
    const int bucket = static_cast<int>(bits >> kBucketShift);
    return bucket < kBuckets ? bucket : 0;
}

float lower_edge(int bucket) {
    const uint32_t bits = static_cast<uint32_t>(bucket) << kBucketShift;
    float p;
    std::memcpy(&p, &bits, sizeof p);
    return p;
}

// The lowest probability a token needs to be among the `count` best or, with `mass` > 0, among the best whose
// probabilities sum to `mass` (one bucket lower than where the histogram's sums reach it: the exact walk sums in
// another order, and may round across a bucket's edge).
float floor_for(const std::vector<float>& p, int64_t count, double mass) {
    thread_local std::vector<int64_t> counts;
    thread_local std::vector<double> sums;
    counts.assign(kBuckets, 0);
    sums.assign(kBuckets, 0.0);
    for (float v : p) {
        const int b = bucket_of(v);
        ++counts[static_cast<size_t>(b)];
        sums[static_cast<size_t>(b)] += v;
    }
    int64_t seen = 0;
    double reached = 0.0;
    for (int b = kBuckets - 1; b > 0; --b) {
        seen += counts[static_cast<size_t>(b)];
        reached += sums[static_cast<size_t>(b)];
        if (mass > 0.0 ? reached >= mass : seen >= count) return lower_edge(mass > 0.0 ? b - 1 : b);
    }
    return 0.0f;  // fewer tokens than `count` may be drawn at all: every one of them
}

}  // namespace

Candidates truncate(const std::vector<float>& logits, const SamplingConfig& c) {
    // Candidates best first (ties by id); top-k, min-p and top-p each keep a prefix of that order.
    // Only the tokens that a cut can keep are sorted: they are found from a histogram of the probabilities, where
    // sorting the vocabulary's order for every token (partially, again and again for top-p alone) took up to 70 ms
    // of a 248,320-token vocabulary. With no cut at all, the draw walks the vocabulary in id order.
    const int64_t vocab = static_cast<int64_t>(logits.size());
    // Probabilities relative to the best token's, once, with the ISA's vector exp.
    std::vector<float> relative(static_cast<size_t>(vocab));
    const float inverse_temperature = 1.0f / c.temperature;
    for (int64_t i = 0; i < vocab; ++i) relative[static_cast<size_t>(i)] = logits[static_cast<size_t>(i)] * inverse_temperature;
    double everything = exp_shifted(relative.data(), vocab, maximum(relative.data(), vocab));
    // A token ruled out (a grammar's mask, a min_tokens ban: its logit -inf) has probability 0, never drawn; the
    // vector exp leaves it ~1e-38 (its input clamp).
    for (int64_t i = 0; i < vocab; ++i) {
        float& v = relative[static_cast<size_t>(i)];
        if (logits[static_cast<size_t>(i)] == -std::numeric_limits<float>::infinity() && v != 0.0f) {
            everything -= v;
            v = 0.0f;
        }
    }
    auto prob = [&](int32_t id) { return static_cast<double>(relative[static_cast<size_t>(id)]); };
    const bool top_k = c.top_k > 0 && c.top_k < vocab;
    Candidates out;
    if (!top_k && c.top_p >= 1.0f && c.min_p <= 0.0f) {
        out.weights = std::move(relative);
        return out;
    }
    // Every token sorted has a probability above 0 (a cut keeps no token that cannot be drawn) and of at least
    // `floor`. With top-k: the k-th best's bucket's edge (the whole top-k set, whose mass is top-p's denominator).
    // Without: min_p (relative to the best, whose is 1), and where top-p's mass of the whole vocabulary is reached.
    float floor = 0.0f;
    if (top_k) {
        floor = floor_for(relative, c.top_k, 0.0);
    } else {
        if (c.min_p > 0.0f) floor = c.min_p;
        if (c.top_p < 1.0f) floor = std::max(floor, floor_for(relative, 0, c.top_p * everything));
    }
    // Best first (by logit: distinct logits can round to one probability), ties by id, as one integer per token:
    // the logit's bits made to order as its value (negatives' bits inverted, positives' sign bit set; -0 as 0), then
    // inverted for best first, then the id. Plain integers sort several times faster than ids compared through the
    // logits they index. With top-k the k best are selected first: the floor's bucket can hold many more.
    std::vector<uint64_t> keys;
    for (int64_t i = 0; i < vocab; ++i) {
        const float v = relative[static_cast<size_t>(i)];
        if (!(v >= floor && v > 0.0f)) continue;  // below the floor, ruled out, or a NaN
        const float logit = logits[static_cast<size_t>(i)] + 0.0f;
        uint32_t bits;
        std::memcpy(&bits, &logit, sizeof bits);
        const uint32_t ordered = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
        keys.push_back(static_cast<uint64_t>(~ordered) << 32 | static_cast<uint32_t>(i));
    }
    if (top_k && static_cast<int64_t>(keys.size()) > c.top_k) {
        std::nth_element(keys.begin(), keys.begin() + c.top_k, keys.end());
        keys.resize(static_cast<size_t>(c.top_k));
    }
    std::sort(keys.begin(), keys.end());
    std::vector<int32_t> order(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) order[i] = static_cast<int32_t>(keys[i] & 0xFFFFFFFFu);
    if (order.empty()) order.push_back(argmax(relative.data(), vocab));  // every probability a NaN
    int64_t keep = static_cast<int64_t>(order.size());
    double total = everything;  // top-p's denominator: the whole vocabulary's mass, or the top-k set's
    if (top_k) {  // `order` is the top-k set
        total = 0.0;
        for (int64_t i = 0; i < keep; ++i) total += prob(order[static_cast<size_t>(i)]);
    }
    if (c.min_p > 0.0f) {  // everything under min_p times the best probability goes, whatever its rank; not the best
        keep = std::max<int64_t>(1, std::find_if(order.begin(), order.begin() + keep,
                                                 [&](int32_t id) { return prob(id) < c.min_p; }) - order.begin());
    }
    if (c.top_p < 1.0f) {  // a token stays while those above it fall short of top_p; the first always stays
        double above = 0.0;
        int64_t end = 1;
        for (; end < keep; ++end) {
            above += prob(order[static_cast<size_t>(end - 1)]) / total;
            if (above >= c.top_p) break;
        }
        keep = std::min(keep, end);
    }
    out.ids.assign(order.begin(), order.begin() + keep);
    out.weights.resize(static_cast<size_t>(keep));
    for (int64_t i = 0; i < keep; ++i) out.weights[static_cast<size_t>(i)] = relative[static_cast<size_t>(order[static_cast<size_t>(i)])];
    return out;
}

int32_t draw(const Candidates& candidates, Rng& rng) {
    const std::vector<float>& weights = candidates.weights;
    double kept = 0.0;
    for (float w : weights) kept += w;
    double left = rng.uniform() * kept;
    size_t last = 0;  // the last candidate that may be drawn: where rounding leaves `left` after every weight
    for (size_t i = 0; i < weights.size(); ++i) {
        if ((left -= weights[i]) < 0.0) return candidates.id(i);
        if (weights[i] > 0.0f) last = i;
    }
    return candidates.id(last);
}

TokenLogprobs logprobs_of(const std::vector<double>& raw, int32_t token, int k) {
    TokenLogprobs out{token, static_cast<float>(raw[token]),
                      1 + std::count_if(raw.begin(), raw.end(), [&](double v) { return v > raw[token]; }), {}};
    std::vector<int32_t> ids(raw.size());
    std::iota(ids.begin(), ids.end(), 0);
    k = std::min<int>(k, static_cast<int>(raw.size()));
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
        return raw[a] > raw[b] || (raw[a] == raw[b] && a < b);
    });
    for (int i = 0; i < k; ++i) out.top.push_back({ids[i], static_cast<float>(raw[ids[i]])});
    return out;
}

int32_t sample(std::vector<float>& logits, const SamplingConfig& c, const std::vector<int32_t>& tokens,
               size_t num_prompt, Rng& rng, TokenLogprobs* logprobs, const std::vector<uint32_t>& allowed) {
    std::vector<double> raw;
    if (logprobs != nullptr) raw = log_softmax(logits);  // from the model's own logits, before any processing
    if (!process_logits(logits, c, tokens, num_prompt, allowed)) return -1;
    const int32_t token = c.greedy() ? argmax(logits.data(), static_cast<int64_t>(logits.size()))
                                     : draw(truncate(logits, c), rng);
    if (logprobs != nullptr) *logprobs = logprobs_of(raw, token, c.logprobs);
    return token;
}

int32_t sample_row(const float* logits, int64_t vocab, std::vector<float>& scratch, const SamplingConfig& c,
                   const std::vector<int32_t>& tokens, size_t num_prompt, Rng& rng, TokenLogprobs* logprobs,
                   const std::vector<uint32_t>& allowed) {
    // What process_logits would change, and logprobs (from the unprocessed row, but kept beside it), need the copy.
    const bool plain = c.greedy() && logprobs == nullptr && allowed.empty() && c.logit_bias.empty() && !penalises(c) &&
                       !hides_stops(c, tokens, num_prompt);
    if (plain) return argmax(logits, vocab);
    scratch.assign(logits, logits + vocab);
    return sample(scratch, c, tokens, num_prompt, rng, logprobs, allowed);
}

}  // namespace pocketllm
