#include "pocketllm_cpp/llama_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "layer_math.h"
#include "model_output.h"
#include "paged_attention.h"

namespace pocketllm {

// Every buffer of one forward pass, sized once.
struct LlamaModel::Batch {
    int64_t n;
    std::vector<int64_t> slice_of, position;
    std::vector<float> cos, sin;  // [n, head_dim / 2]: each token's RoPE rotation, shared by every layer
    std::vector<float> x, h, q, k, v, attn, out, gate, up;
};

LlamaModel::LlamaModel(LlamaConfig config, WeightView embedding, std::vector<LlamaLayer> layers,
                       std::vector<float> final_norm, WeightView lm_head, int64_t num_blocks, int64_t block_size,
                       int num_threads)
    : Model(config.vocab_size, config.hidden_size, num_blocks, block_size), config_(config), embedding_(embedding),
      lm_head_(lm_head), layers_(std::move(layers)), final_norm_(std::move(final_norm)), pool_(num_threads) {
    const LlamaConfig& c = config_;
    if (c.head_dim % 2 != 0 || c.num_kv_heads <= 0 || c.num_heads % c.num_kv_heads != 0) {
        throw std::invalid_argument("heads must split evenly into KV heads, with an even head size");
    }
    if (static_cast<int64_t>(layers_.size()) != c.num_layers || num_blocks <= 0 || block_size <= 0) {
        throw std::invalid_argument("layers, KV blocks and block size must match the config and be positive");
    }
    if (static_cast<int64_t>(c.inv_freq.size()) != c.head_dim / 2) {
        throw std::invalid_argument("inv_freq must hold head_dim / 2 frequencies");
    }
    kv_ = std::make_unique<PagedAttention>(c.num_layers, c.num_kv_heads, c.head_dim, c.kv_type, num_blocks,
                                           block_size);
}

LlamaModel::~LlamaModel() = default;

void LlamaModel::add_profile(Profile& into) const {
    into.forward += profile_.forward;
    into.matmul += profile_.matmul;
    into.lm_head += profile_.lm_head;
    into.attention += profile_.attention;
    into.wait += pool_.wait_seconds() - wait_at_reset_;
    into.regions += pool_.regions() - regions_at_reset_;
}

void LlamaModel::reset_profile() {
    profile_ = {};
    wait_at_reset_ = pool_.wait_seconds();
    regions_at_reset_ = pool_.regions();
}

std::vector<float> LlamaModel::forward(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices,
                                  std::vector<float>* pooled, const std::vector<StateCapture>* captures,
                                  std::vector<float>* hidden_out) {
    check(tokens, slices, captures);  // no state: any capture is refused
    Stopwatch total(profile_.forward);
    const LlamaConfig& c = config_;
    const int64_t n = static_cast<int64_t>(tokens.size()), hidden = c.hidden_size, half = c.head_dim / 2;
    Batch batch;
    batch.n = n;
    batch.slice_of.resize(static_cast<size_t>(n));
    batch.position.resize(static_cast<size_t>(n));
    for (int64_t s = 0, t = 0; s < static_cast<int64_t>(slices.size()); ++s) {
        for (int64_t i = 0; i < slices[s].num_tokens; ++i, ++t) {
            batch.slice_of[t] = s;
            batch.position[t] = slices[s].start + i;
        }
    }
    batch.cos.resize(static_cast<size_t>(n * half));
    batch.sin.resize(batch.cos.size());
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t i = 0; i < half; ++i) {
            const float angle = static_cast<float>(batch.position[t]) * c.inv_freq[static_cast<size_t>(i)];
            batch.cos[t * half + i] = std::cos(angle) * c.rope_attention_factor;
            batch.sin[t * half + i] = std::sin(angle) * c.rope_attention_factor;
        }
    }
    const auto size = [n](int64_t width) { return static_cast<size_t>(n * width); };
    batch.x.resize(size(hidden));
    batch.h.resize(size(hidden));
    batch.out.resize(size(hidden));
    batch.q.resize(size(c.num_heads * c.head_dim));
    batch.attn.resize(batch.q.size());
    batch.k.resize(size(c.num_kv_heads * c.head_dim));
    batch.v.resize(batch.k.size());
    batch.gate.resize(size(c.intermediate_size));
    batch.up.resize(batch.gate.size());
    for (int64_t t = 0; t < n; ++t) dequantize_row(embedding_, tokens[t], &batch.x[t * hidden]);

    for (int64_t l = 0; l < c.num_layers; ++l) {
        const LlamaLayer& L = layers_[static_cast<size_t>(l)];
        float* x = batch.x.data();
        float* h = batch.h.data();
        for_rows(pool_, n, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t) {
                // The previous layer's MLP output joins the residual stream here, in the same pass as the norm.
                if (l == 0) rms_norm(&x[t * hidden], L.input_norm.data(), hidden, c.rms_norm_eps, &h[t * hidden]);
                else add_rms_norm(&x[t * hidden], &batch.out[t * hidden], L.input_norm.data(), hidden, c.rms_norm_eps, &h[t * hidden]);
            }
        });
        attention_layer(l, batch, slices);
        {
            Stopwatch timed(profile_.matmul);
            matmul(L.o, batch.attn.data(), n, batch.out.data(), pool_, c.exact_activations);
        }
        for_rows(pool_, n, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t) {
                add_rms_norm(&x[t * hidden], &batch.out[t * hidden], L.post_attention_norm.data(), hidden,
                             c.rms_norm_eps, &h[t * hidden]);
            }
        });
        {
            Stopwatch timed(profile_.matmul);
            matmul_many({{&L.gate, batch.gate.data()}, {&L.up, batch.up.data()}}, h, n, pool_, c.exact_activations);
        }
        const int64_t inter = c.intermediate_size;
        for_rows(pool_, n, [&](int64_t begin, int64_t end) {
            silu_mul(&batch.gate[static_cast<size_t>(begin * inter)], &batch.up[static_cast<size_t>(begin * inter)],
                     (end - begin) * inter);
        });
        Stopwatch timed(profile_.matmul);
        matmul(L.down, batch.gate.data(), n, batch.out.data(), pool_, c.exact_activations);
    }

    // The last MLP output joins the residual stream: the final norm's input.
    for_rows(pool_, n, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin * hidden; i < end * hidden; ++i) batch.x[i] += batch.out[i];
    });
    Stopwatch timed(profile_.lm_head);
    return final_rows(batch.x.data(), slices, {final_norm_, c.rms_norm_eps, lm_head_, c.exact_activations}, pool_,
                      pooled, hidden_out);
}

void LlamaModel::attention_layer(int64_t l, Batch& batch, const std::vector<SequenceSlice>& slices) {
    const LlamaConfig& c = config_;
    const LlamaLayer& L = layers_[static_cast<size_t>(l)];
    const int64_t n = batch.n, dim = c.head_dim, half = dim / 2;
    const int64_t q_size = c.num_heads * dim, kv_size = c.num_kv_heads * dim;
    {
        Stopwatch timed(profile_.matmul);
        matmul_many({{&L.q, batch.q.data()}, {&L.k, batch.k.data()}, {&L.v, batch.v.data()}}, batch.h.data(), n,
                    pool_, c.exact_activations);
    }
    Stopwatch timed(profile_.attention);
    // Per token, one pass: q/k head norms (Qwen3), RoPE, and the new keys and values into the cache.
    for_rows(pool_, n, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const float* cos = &batch.cos[t * half];
            const float* sin = &batch.sin[t * half];
            for (int64_t hd = 0; hd < c.num_heads; ++hd) {
                float* head = &batch.q[t * q_size + hd * dim];
                if (c.qk_norm) rms_norm(head, L.q_norm.data(), dim, c.rms_norm_eps, head);
                rope(head, dim, cos, sin, c.rope_pairs_adjacent);
            }
            for (int64_t hd = 0; hd < c.num_kv_heads; ++hd) {
                float* head = &batch.k[t * kv_size + hd * dim];
                if (c.qk_norm) rms_norm(head, L.k_norm.data(), dim, c.rms_norm_eps, head);
                rope(head, dim, cos, sin, c.rope_pairs_adjacent);
            }
            kv_->store(l, slices[batch.slice_of[t]], batch.position[t], &batch.k[t * kv_size], &batch.v[t * kv_size]);
        }
    });
    kv_->attend(l, c.num_heads, batch.q.data(), batch.attn.data(), {slices, batch.slice_of, batch.position}, pool_);
}

}  // namespace pocketllm
