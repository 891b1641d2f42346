#include "pocketllm_cpp/model.h"

#include "pocketllm_cpp/isa.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace pocketllm {
namespace {

void rms_norm(const float* x, const float* weight, int64_t size, float eps, float* out) {
    double sum = 0.0;
    for (int64_t i = 0; i < size; ++i) sum += static_cast<double>(x[i]) * x[i];
    const float scale = 1.0f / std::sqrt(static_cast<float>(sum / static_cast<double>(size)) + eps);
    for (int64_t i = 0; i < size; ++i) out[i] = x[i] * scale * weight[i];
}

void rope(float* head, int64_t dim, int64_t position, const std::vector<float>& inv_freq, bool pairs_adjacent) {
    for (int64_t i = 0; i < dim / 2; ++i) {
        const float angle = static_cast<float>(position) * inv_freq[static_cast<size_t>(i)];
        const float c = std::cos(angle), s = std::sin(angle);
        float& a = pairs_adjacent ? head[2 * i] : head[i];
        float& b = pairs_adjacent ? head[2 * i + 1] : head[i + dim / 2];
        const float x0 = a, x1 = b;
        a = x0 * c - x1 * s;
        b = x1 * c + x0 * s;
    }
}

}  // namespace

void dequantize_row(const WeightView& w, int64_t row, float* out) {
    const WeightView one{w.data + row * static_cast<int64_t>(row_bytes(w.type, w.cols)), w.type, 1, w.cols};
    dequantize(one, out);
}

Model::Model(ModelConfig config, WeightView embedding, std::vector<LayerWeights> layers, std::vector<float> final_norm,
             WeightView lm_head, int64_t num_blocks, int64_t block_size, int num_threads)
    : config_(config), embedding_(embedding), lm_head_(lm_head), layers_(std::move(layers)),
      final_norm_(std::move(final_norm)), num_blocks_(num_blocks), block_size_(block_size), pool_(num_threads) {
    const ModelConfig& c = config_;
    if (c.head_dim % 2 != 0 || c.num_kv_heads <= 0 || c.num_heads % c.num_kv_heads != 0) {
        throw std::invalid_argument("heads must split evenly into KV heads, with an even head size");
    }
    if (static_cast<int64_t>(layers_.size()) != c.num_layers || num_blocks <= 0 || block_size <= 0) {
        throw std::invalid_argument("layers, KV blocks and block size must match the config and be positive");
    }
    if (static_cast<int64_t>(c.inv_freq.size()) != c.head_dim / 2) {
        throw std::invalid_argument("inv_freq must hold head_dim / 2 frequencies");
    }
    size_t cache_size = 0;
    if (__builtin_mul_overflow(static_cast<size_t>(c.num_layers * 2 * c.num_kv_heads * c.head_dim),
                               static_cast<size_t>(num_blocks * block_size), &cache_size)) {
        throw std::invalid_argument("KV cache size overflows");
    }
    // Left uninitialised: attention reads only positions already written, and untouched pages of a pool sized
    // for max_num_seqs full-length sequences cost no memory until used.
    cache_.reset(new float[cache_size]);
}

float* Model::kv(int64_t layer, int64_t block, int which) {
    const int64_t per_block = config_.num_kv_heads * block_size_ * config_.head_dim;
    return cache_.get() + ((layer * num_blocks_ + block) * 2 + which) * per_block;
}

void Model::check(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices) const {
    int64_t total = 0;
    for (const auto& s : slices) {
        if (s.start < 0 || s.num_tokens <= 0) throw std::invalid_argument("a slice needs a start >= 0 and tokens");
        const int64_t end = s.start + s.num_tokens;
        if (static_cast<int64_t>(s.block_table.size()) * block_size_ < end) {
            throw std::invalid_argument("a slice's block table is too short for position " + std::to_string(end - 1));
        }
        for (int64_t p = 0; p < (end + block_size_ - 1) / block_size_; ++p) {
            const int32_t block = s.block_table[static_cast<size_t>(p)];
            if (block < 0 || block >= num_blocks_) {
                throw std::invalid_argument("KV block " + std::to_string(block) + " is out of range");
            }
        }
        total += s.num_tokens;
    }
    if (total != static_cast<int64_t>(tokens.size())) {
        throw std::invalid_argument("slices cover " + std::to_string(total) + " tokens, got " +
                                    std::to_string(tokens.size()));
    }
    for (int32_t t : tokens) {
        if (t < 0 || t >= config_.vocab_size) throw std::invalid_argument("token id " + std::to_string(t) + " is out of range");
    }
}

std::vector<float> Model::forward(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices) {
    check(tokens, slices);
    const ModelConfig& c = config_;
    const int64_t n = static_cast<int64_t>(tokens.size()), hidden = c.hidden_size, dim = c.head_dim;
    const int64_t q_size = c.num_heads * dim, kv_size = c.num_kv_heads * dim, group = c.num_heads / c.num_kv_heads;
    // Each token's slice and absolute position.
    std::vector<int64_t> slice_of(static_cast<size_t>(n)), position(static_cast<size_t>(n));
    for (int64_t s = 0, t = 0; s < static_cast<int64_t>(slices.size()); ++s) {
        for (int64_t i = 0; i < slices[s].num_tokens; ++i, ++t) {
            slice_of[t] = s;
            position[t] = slices[s].start + i;
        }
    }
    std::vector<float> x(static_cast<size_t>(n * hidden)), h(x.size()), q(static_cast<size_t>(n * q_size)),
        k(static_cast<size_t>(n * kv_size)), v(k.size()), attn(q.size()), out(x.size()),
        gate(static_cast<size_t>(n * c.intermediate_size)), up(gate.size());
    for (int64_t t = 0; t < n; ++t) dequantize_row(embedding_, tokens[t], x.data() + t * hidden);

    for (int64_t l = 0; l < c.num_layers; ++l) {
        const LayerWeights& L = layers_[static_cast<size_t>(l)];
        for (int64_t t = 0; t < n; ++t) rms_norm(&x[t * hidden], L.input_norm.data(), hidden, c.rms_norm_eps, &h[t * hidden]);
        matmul(L.q, h.data(), n, q.data(), pool_, c.exact_activations);
        matmul(L.k, h.data(), n, k.data(), pool_, c.exact_activations);
        matmul(L.v, h.data(), n, v.data(), pool_, c.exact_activations);
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t hd = 0; hd < c.num_heads; ++hd) {
                float* head = &q[t * q_size + hd * dim];
                if (c.qk_norm) rms_norm(head, L.q_norm.data(), dim, c.rms_norm_eps, head);
                rope(head, dim, position[t], c.inv_freq, c.rope_pairs_adjacent);
            }
            for (int64_t hd = 0; hd < c.num_kv_heads; ++hd) {
                float* head = &k[t * kv_size + hd * dim];
                if (c.qk_norm) rms_norm(head, L.k_norm.data(), dim, c.rms_norm_eps, head);
                rope(head, dim, position[t], c.inv_freq, c.rope_pairs_adjacent);
                // Into the cache: block table entry of the position, slot within the block.
                const auto& table = slices[slice_of[t]].block_table;
                const int64_t block = table[position[t] / block_size_], slot = position[t] % block_size_;
                std::copy(head, head + dim, kv(l, block, 0) + (hd * block_size_ + slot) * dim);
                std::copy(&v[t * kv_size + hd * dim], &v[t * kv_size + hd * dim] + dim,
                          kv(l, block, 1) + (hd * block_size_ + slot) * dim);
            }
        }
        // Causal attention of each (token, head) over its sequence's positions 0..p, read through the block table.
        const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
        auto dot_many = kernels::dot_many_scalar;
        auto axpy_many = kernels::axpy_many_scalar;
#ifdef POCKETLLM_HAVE_AVX2
        if (current_isa() == Isa::Avx2) {
            dot_many = kernels::dot_many_avx2;
            axpy_many = kernels::axpy_many_avx2;
        }
#endif
        pool_.parallel_for(n * c.num_heads, [&](int64_t begin, int64_t end) {
            std::vector<float> scores;
            for (int64_t job = begin; job < end; ++job) {
                const int64_t t = job / c.num_heads, hd = job % c.num_heads, kvh = hd / group;
                const auto& table = slices[slice_of[t]].block_table;
                const float* qh = &q[t * q_size + hd * dim];
                const int64_t length = position[t] + 1;
                scores.resize(static_cast<size_t>(length));
                // Block by block: a block's keys (and values) of one KV head are contiguous rows.
                for (int64_t p = 0; p < length; p += block_size_) {
                    const int64_t count = std::min(block_size_, length - p);
                    dot_many(qh, kv(l, table[p / block_size_], 0) + kvh * block_size_ * dim, count, dim, &scores[p]);
                }
                float best = -INFINITY;
                for (float& s : scores) best = std::max(best, s *= scale);
                float total = 0.0f;
                for (float& s : scores) total += (s = std::exp(s - best));
                for (float& s : scores) s /= total;
                float* o = &attn[t * q_size + hd * dim];
                std::fill(o, o + dim, 0.0f);
                for (int64_t p = 0; p < length; p += block_size_) {
                    const int64_t count = std::min(block_size_, length - p);
                    axpy_many(&scores[p], kv(l, table[p / block_size_], 1) + kvh * block_size_ * dim, count, dim, o);
                }
            }
        });
        matmul(L.o, attn.data(), n, out.data(), pool_, c.exact_activations);
        for (size_t i = 0; i < x.size(); ++i) x[i] += out[i];
        for (int64_t t = 0; t < n; ++t) {
            rms_norm(&x[t * hidden], L.post_attention_norm.data(), hidden, c.rms_norm_eps, &h[t * hidden]);
        }
        matmul(L.gate, h.data(), n, gate.data(), pool_, c.exact_activations);
        matmul(L.up, h.data(), n, up.data(), pool_, c.exact_activations);
        for (size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
        matmul(L.down, gate.data(), n, out.data(), pool_, c.exact_activations);
        for (size_t i = 0; i < x.size(); ++i) x[i] += out[i];
    }

    std::vector<float> last;  // the final norm of each wanted slice's last token
    for (int64_t s = 0, end = 0; s < static_cast<int64_t>(slices.size()); ++s) {
        end += slices[s].num_tokens;
        if (!slices[s].logits) continue;
        last.resize(last.size() + static_cast<size_t>(hidden));
        rms_norm(&x[(end - 1) * hidden], final_norm_.data(), hidden, c.rms_norm_eps, &last[last.size() - hidden]);
    }
    const int64_t rows = static_cast<int64_t>(last.size()) / hidden;
    std::vector<float> logits(static_cast<size_t>(rows * c.vocab_size));
    if (rows > 0) matmul(lm_head_, last.data(), rows, logits.data(), pool_, c.exact_activations);
    return logits;
}

}  // namespace pocketllm
