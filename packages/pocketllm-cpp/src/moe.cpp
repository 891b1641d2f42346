// The mixture-of-experts block (see moe.h): route each token, group the token-expert pairs by expert, run each
// chosen expert's SwiGLU once over all of its rows, then add up each token's weighted expert outputs in a fixed order.
#include "moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>

namespace pocketllm {
namespace {

std::string shape(int64_t rows, int64_t cols) { return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]"; }

// One weight: its shape, then validate(WeightView)'s checks (storage type, block multiple, alignment) on the bytes
// that shape needs, each error naming the weight.
void check(const WeightView& w, int64_t rows, int64_t cols, const std::string& what) {
    if (w.rows != rows || w.cols != cols) {
        throw std::invalid_argument("moe " + what + " has shape " + shape(w.rows, w.cols) + ", expected " +
                                    shape(rows, cols));
    }
    if (w.data == nullptr) throw std::invalid_argument("moe " + what + " has no data");
    int64_t bytes = 0;
    const bool whole = cols > 0 && cols % std::max<int64_t>(kBlock, block_values(w.type)) == 0;
    if (whole && __builtin_mul_overflow(static_cast<int64_t>(row_bytes(w.type, cols)), rows, &bytes)) {
        throw std::invalid_argument("moe " + what + " of shape " + shape(rows, cols) + " overflows 64-bit sizes");
    }
    try {
        validate(w, bytes);  // whole: exactly the bytes it needs; otherwise it rejects the shape first
    } catch (const std::invalid_argument& e) {
        throw std::invalid_argument("moe " + what + ": " + e.what());
    }
}

// The buffers of one call, kept per calling thread: a decode step calls the block once per MoE layer.
struct Scratch {
    std::vector<float> logits, probs;  // [n, experts]
    std::vector<int64_t> expert, order;  // [n * k]: token t's chosen experts at t * k, by ascending expert index
    std::vector<float> weight;           // [n * k]: their routing weights
    std::vector<int64_t> slot;           // [n * k]: the pair's row in the grouped buffers
    std::vector<int64_t> offset;         // [experts + 1]: each expert's first row in the grouped buffers
    std::vector<float> xs, gate, up, ys;  // grouped rows: inputs [n * k, hidden], SwiGLU [n * k, ff], outputs
    std::vector<float> shared_gate, shared_up, shared_out, shared_logit;
    std::vector<GroupedProduct> products;
};

template <class T>
T* sized(std::vector<T>& v, int64_t size) {
    v.resize(static_cast<size_t>(size));
    return v.data();
}

// The k most probable experts of one token, ties to the lower index (torch.topk leaves the order of ties
// unspecified: on CPU it returns [3, 5, 2] as the top 3 of [.1, .3, .3, .3, 0, .3]), and their weights.
void route(const float* logits, int64_t experts, int64_t k, bool renormalise, float* probs, int64_t* order,
           int64_t* expert, float* weight) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < experts; ++e) top = std::max(top, logits[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) sum += probs[e] = std::exp(logits[e] - top);
    for (int64_t e = 0; e < experts; ++e) probs[e] /= sum;
    // NaN (a diverged activation) sorts last: the comparison must stay a strict weak order.
    auto key = [&](int64_t e) { return std::isnan(probs[e]) ? -std::numeric_limits<float>::infinity() : probs[e]; };
    for (int64_t e = 0; e < experts; ++e) order[e] = e;
    std::partial_sort(order, order + k, order + experts, [&](int64_t a, int64_t b) {
        return key(a) > key(b) || (key(a) == key(b) && a < b);
    });
    float total = 0.0f;
    for (int64_t r = 0; r < k; ++r) total += probs[order[r]];  // in rank order, as the reference sums them
    std::sort(order, order + k);  // the grouping's order, and the fixed order of the token's sum
    for (int64_t r = 0; r < k; ++r) {
        expert[r] = order[r];
        weight[r] = renormalise ? probs[order[r]] / total : probs[order[r]];
    }
}

// fn(begin, end) over [0, n) tokens: split over the pool for a prompt's rows, inline for a few.
void over_tokens(int64_t n, ThreadPool& pool, const std::function<void(int64_t, int64_t)>& fn) {
    if (n >= 16) return pool.parallel_for(n, fn);
    fn(0, n);
}

}  // namespace

void validate(const MoeWeights& w, int64_t hidden) {
    if (hidden <= 0) throw std::invalid_argument("moe hidden size " + std::to_string(hidden) + " must be positive");
    const int64_t experts = w.router.rows;
    if (experts <= 0) throw std::invalid_argument("moe router has " + std::to_string(experts) + " experts");
    check(w.router, experts, hidden, "router");
    for (const auto* part : {&w.gate, &w.up, &w.down}) {
        if (static_cast<int64_t>(part->size()) != experts) {
            throw std::invalid_argument("moe has " + std::to_string(part->size()) + " " +
                                        (part == &w.gate ? "gate" : part == &w.up ? "up" : "down") +
                                        " windows for a router of " + std::to_string(experts) + " experts");
        }
    }
    const int64_t ff = w.gate[0].rows;
    for (int64_t e = 0; e < experts; ++e) {
        const std::string name = "expert " + std::to_string(e);
        check(w.gate[e], ff, hidden, name + " gate");
        check(w.up[e], ff, hidden, name + " up");
        check(w.down[e], hidden, ff, name + " down");
    }
    if (w.top_k < 1 || w.top_k > experts) {
        throw std::invalid_argument("moe top_k " + std::to_string(w.top_k) + " is not in 1.." +
                                    std::to_string(experts));
    }
    if (!w.has_shared) return;
    const int64_t shared_ff = w.shared_gate.rows;
    check(w.shared_gate, shared_ff, hidden, "shared expert gate");
    check(w.shared_up, shared_ff, hidden, "shared expert up");
    check(w.shared_down, hidden, shared_ff, "shared expert down");
    check(w.shared_expert_gate, 1, hidden, "shared expert's sigmoid gate");
}

void moe_forward(const MoeWeights& w, const float* x, int64_t n, int64_t hidden, float* out, ThreadPool& pool,
                 bool exact) {
    if (n <= 0) return;
    // Workers read the caller's buffers through this reference (naming a thread_local in a task is the
    // worker's own).
    thread_local Scratch scratch;
    Scratch& s = scratch;
    const int64_t experts = w.router.rows, k = w.top_k, ff = w.gate[0].rows, pairs = n * k;

    // The router and the shared expert's input products read the same x: one parallel region, x quantized once.
    std::vector<Product> first{{&w.router, sized(s.logits, n * experts)}};
    const int64_t shared_ff = w.has_shared ? w.shared_gate.rows : 0;
    if (w.has_shared) {
        first.push_back({&w.shared_gate, sized(s.shared_gate, n * shared_ff)});
        first.push_back({&w.shared_up, sized(s.shared_up, n * shared_ff)});
        first.push_back({&w.shared_expert_gate, sized(s.shared_logit, n)});
    }
    matmul_many(first, x, n, pool, exact);

    // Routing, then each pair's row in the grouped buffers: by expert, and by token within an expert.
    sized(s.probs, experts);
    sized(s.order, experts);
    sized(s.expert, pairs);
    sized(s.weight, pairs);
    for (int64_t t = 0; t < n; ++t) {
        route(s.logits.data() + t * experts, experts, k, w.norm_topk_prob, s.probs.data(), s.order.data(),
              s.expert.data() + t * k, s.weight.data() + t * k);
    }
    s.offset.assign(static_cast<size_t>(experts + 1), 0);
    for (int64_t p = 0; p < pairs; ++p) ++s.offset[static_cast<size_t>(s.expert[p] + 1)];
    for (int64_t e = 0; e < experts; ++e) s.offset[e + 1] += s.offset[e];
    sized(s.slot, pairs);
    std::vector<int64_t> next(s.offset.begin(), s.offset.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) s.slot[p] = next[s.expert[p]]++;
    // One token's experts all read x itself; a batch's are gathered into rows by expert.
    float* xs = nullptr;
    if (n > 1) {
        xs = sized(s.xs, pairs * hidden);
        over_tokens(n, pool, [&](int64_t begin, int64_t end) {
            for (int64_t p = begin * k; p < end * k; ++p) {
                std::memcpy(xs + s.slot[p] * hidden, x + (p / k) * hidden, static_cast<size_t>(hidden) * sizeof(float));
            }
        });
    }

    // Each chosen expert's SwiGLU over its rows, its weights read once: the gate and up products of every expert in
    // one parallel region, the down products (and the shared expert's) in another. silu_mul over several rows at
    // once gives each row the bits it gets alone: ff is a multiple of 32 (validate), so every row starts a vector.
    float* gate = sized(s.gate, pairs * ff);
    float* up = sized(s.up, pairs * ff);
    float* ys = sized(s.ys, pairs * hidden);
    std::vector<GroupedProduct>& products = s.products;
    products.clear();
    for (int64_t e = 0; e < experts; ++e) {
        const int64_t row = s.offset[e], rows = s.offset[e + 1] - row;
        if (rows == 0) continue;
        const float* in = n > 1 ? xs + row * hidden : x;
        products.push_back({&w.gate[e], in, rows, gate + row * ff});
        products.push_back({&w.up[e], in, rows, up + row * ff});
    }
    matmul_grouped(products, pool, exact);
    silu_mul(gate, up, pairs * ff);
    products.clear();
    for (int64_t e = 0; e < experts; ++e) {
        const int64_t row = s.offset[e], rows = s.offset[e + 1] - row;
        if (rows > 0) products.push_back({&w.down[e], gate + row * ff, rows, ys + row * hidden});
    }
    if (w.has_shared) {
        silu_mul(s.shared_gate.data(), s.shared_up.data(), n * shared_ff);
        products.push_back({&w.shared_down, s.shared_gate.data(), n, sized(s.shared_out, n * hidden)});
    }
    matmul_grouped(products, pool, exact);

    // Each token's sum over its experts by ascending index (as transformers' index_add_ adds them), then the
    // shared expert: an order that depends on the token's own routing alone, not on the batch.
    over_tokens(n, pool, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            float* o = out + t * hidden;
            std::fill(o, o + hidden, 0.0f);
            for (int64_t r = 0; r < k; ++r) {
                const float weight = s.weight[t * k + r];
                const float* y = ys + s.slot[t * k + r] * hidden;
                for (int64_t i = 0; i < hidden; ++i) o[i] += weight * y[i];
            }
            if (!w.has_shared) continue;
            const float scale = 1.0f / (1.0f + std::exp(-s.shared_logit[t]));
            const float* y = s.shared_out.data() + t * hidden;
            for (int64_t i = 0; i < hidden; ++i) o[i] += scale * y[i];
        }
    });
}

}  // namespace pocketllm
