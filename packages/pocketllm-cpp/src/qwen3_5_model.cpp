#include "pocketllm_cpp/qwen3_5_model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "delta_rule.h"
#include "gated_delta.h"
#include "layer_math.h"
#include "moe.h"
#include "model_output.h"
#include "paged_attention.h"

namespace pocketllm {
namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

void expect_shape(const WeightView& w, int64_t rows, int64_t cols, const std::string& what) {
    if (w.rows != rows || w.cols != cols) {
        throw std::invalid_argument(what + " is [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) +
                                    "], expected [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
    }
}

void expect_size(const std::vector<float>& v, int64_t size, const std::string& what) {
    if (static_cast<int64_t>(v.size()) != size) {
        throw std::invalid_argument(what + " has " + std::to_string(v.size()) + " values, expected " +
                                    std::to_string(size));
    }
}

GatedDeltaShape delta_shape(const Qwen3_5Config& c) {
    return {c.linear_num_k_heads, c.linear_num_v_heads, c.linear_k_dim, c.linear_v_dim, c.conv_kernel, c.tiled_heads};
}

}  // namespace

struct Qwen3_5Model::Batch {
    int64_t n = 0;
    std::vector<int64_t> slice_of, position, first;  // first: each slice's first token in the batch
    std::vector<float> cos, sin;                     // [n, rotary / 2]
    std::vector<float> x, h, out, proj, q, k, v, gate, attn, mixed, ff_gate, ff_up;
};

Qwen3_5Model::Qwen3_5Model(Qwen3_5Config config, WeightView embedding, std::vector<Qwen3_5Layer> layers,
                           std::vector<float> final_norm, WeightView lm_head, int64_t num_blocks, int64_t block_size,
                           int64_t num_state_slots, int num_threads, std::optional<Qwen3_5MTP> mtp)
    : Model(config.vocab_size, config.hidden_size, num_blocks, block_size), config_(std::move(config)),
      embedding_(embedding), lm_head_(lm_head), layers_(std::move(layers)), final_norm_(std::move(final_norm)),
      mtp_(std::move(mtp)), num_slots_(num_state_slots), pool_(num_threads) {
    const Qwen3_5Config& c = config_;
    const int64_t hidden = c.hidden_size;
    if (hidden <= 0 || c.vocab_size <= 0 || c.head_dim <= 0 || c.num_kv_heads <= 0 ||
        c.num_heads % c.num_kv_heads != 0) {
        throw std::invalid_argument("heads must split evenly into KV heads, with positive sizes");
    }
    if (c.rotary_dim < 0 || c.rotary_dim > c.head_dim || c.rotary_dim % 2 != 0 ||
        static_cast<int64_t>(c.inv_freq.size()) != c.rotary_dim / 2) {
        throw std::invalid_argument("rotary_dim must be even, at most head_dim, with rotary_dim / 2 frequencies");
    }
    if (static_cast<int64_t>(layers_.size()) != c.num_layers || num_blocks <= 0 || block_size <= 0 ||
        num_state_slots <= 0) {
        throw std::invalid_argument("layers, KV blocks, block size and state slots must match the config and be positive");
    }
    expect_shape(embedding_, c.vocab_size, hidden, "embedding");
    expect_shape(lm_head_, c.vocab_size, hidden, "lm_head");
    expect_size(final_norm_, hidden, "final_norm");
    const GatedDeltaShape shape = delta_shape(c);
    for (size_t i = 0; i < layers_.size(); ++i) {
        const Qwen3_5Layer& L = layers_[i];
        validate_layer(L, "layer " + std::to_string(i) + " ");
        if (L.kind == LayerKind::FullAttention) {
            conv_taps_.emplace_back();
            ++attention_layers_;
        } else {
            conv_taps_.push_back(conv_taps(shape, L.conv));
            if (__builtin_add_overflow(slot_floats_, shape.state_floats(), &slot_floats_)) {
                throw std::invalid_argument("state size overflows");
            }
        }
    }
    if (mtp_) {
        if (mtp_->layer.kind != LayerKind::FullAttention) {
            throw std::invalid_argument("the multi-token-prediction head's layer must be full attention");
        }
        validate_layer(mtp_->layer, "the multi-token-prediction head's layer ");
        expect_shape(mtp_->fc, hidden, 2 * hidden, "the multi-token-prediction head's fc");
        expect_size(mtp_->embedding_norm, hidden, "the multi-token-prediction head's embedding norm");
        expect_size(mtp_->hidden_norm, hidden, "the multi-token-prediction head's hidden norm");
        expect_size(mtp_->norm, hidden, "the multi-token-prediction head's norm");
    }
    size_t states = 0;
    if (__builtin_mul_overflow(static_cast<size_t>(num_slots_), static_cast<size_t>(slot_floats_), &states)) {
        throw std::invalid_argument("state slots overflow");
    }
    states_.assign(states, 0.0f);
    kv_ = std::make_unique<PagedAttention>(attention_layers_ + (mtp_ ? 1 : 0), c.num_kv_heads, c.head_dim, c.kv_type,
                                           num_blocks, block_size);
}

void Qwen3_5Model::validate_layer(const Qwen3_5Layer& L, const std::string& at) const {
    const Qwen3_5Config& c = config_;
    const int64_t hidden = c.hidden_size;
    expect_size(L.input_norm, hidden, at + "input_norm");
    expect_size(L.post_attention_norm, hidden, at + "post_attention_norm");
    if (L.kind == LayerKind::FullAttention) {
        expect_shape(L.q, 2 * c.num_heads * c.head_dim, hidden, at + "q_proj");
        expect_shape(L.k, c.num_kv_heads * c.head_dim, hidden, at + "k_proj");
        expect_shape(L.v, c.num_kv_heads * c.head_dim, hidden, at + "v_proj");
        expect_shape(L.o, hidden, c.num_heads * c.head_dim, at + "o_proj");
        expect_size(L.q_norm, c.head_dim, at + "q_norm");
        expect_size(L.k_norm, c.head_dim, at + "k_norm");
    } else {
        const GatedDeltaShape shape = delta_shape(c);
        validate(shape, {L.conv, L.decay, L.dt_bias, L.norm});
        const int64_t hv = c.linear_num_v_heads, dv = c.linear_v_dim;
        expect_shape(L.qkv, shape.channels(), hidden, at + "in_proj_qkv");
        expect_shape(L.z, hv * dv, hidden, at + "in_proj_z");
        expect_shape(L.b, hv, hidden, at + "in_proj_b");
        expect_shape(L.a, hv, hidden, at + "in_proj_a");
        expect_shape(L.out, hidden, hv * dv, at + "out_proj");
    }
    if (L.is_moe) {
        if (!L.moe) throw std::invalid_argument(at + "is MoE without experts");
        validate(*L.moe, hidden);
    } else {
        if (L.gate.rows != L.up.rows) throw std::invalid_argument(at + "gate and up differ in rows");
        expect_shape(L.gate, L.gate.rows, hidden, at + "gate_proj");
        expect_shape(L.up, L.gate.rows, hidden, at + "up_proj");
        expect_shape(L.down, hidden, L.gate.rows, at + "down_proj");
    }
}

Qwen3_5Model::~Qwen3_5Model() = default;

void Qwen3_5Model::save_state(int32_t slot, float* out) const {
    if (slot < 0 || slot >= num_slots_) throw std::invalid_argument("state slot " + std::to_string(slot) + " is out of range");
    std::copy_n(&states_[static_cast<size_t>(slot) * static_cast<size_t>(slot_floats_)], slot_floats_, out);
}

void Qwen3_5Model::load_state(int32_t slot, const float* in) {
    if (slot < 0 || slot >= num_slots_) throw std::invalid_argument("state slot " + std::to_string(slot) + " is out of range");
    std::copy_n(in, slot_floats_, &states_[static_cast<size_t>(slot) * static_cast<size_t>(slot_floats_)]);
}

int64_t Qwen3_5Model::chunk_alignment() const { return kDeltaChunk; }

void Qwen3_5Model::add_profile(Profile& into) const {
    into.forward += profile_.forward;
    into.matmul += profile_.matmul;
    into.lm_head += profile_.lm_head;
    into.attention += profile_.attention;
    into.recurrence += profile_.recurrence;
    into.wait += pool_.wait_seconds() - wait_at_reset_;
    into.regions += pool_.regions() - regions_at_reset_;
}

void Qwen3_5Model::reset_profile() {
    profile_ = {};
    wait_at_reset_ = pool_.wait_seconds();
    regions_at_reset_ = pool_.regions();
}

Qwen3_5Model::Batch Qwen3_5Model::batch_of(const std::vector<int32_t>& tokens,
                                           const std::vector<SequenceSlice>& slices) const {
    const Qwen3_5Config& c = config_;
    const int64_t n = static_cast<int64_t>(tokens.size()), hidden = c.hidden_size, half = c.rotary_dim / 2;
    Batch batch;
    batch.n = n;
    batch.slice_of.resize(static_cast<size_t>(n));
    batch.position.resize(static_cast<size_t>(n));
    for (int64_t s = 0, t = 0; s < static_cast<int64_t>(slices.size()); ++s) {
        batch.first.push_back(t);
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
    batch.x.resize(static_cast<size_t>(n * hidden));
    batch.h.resize(batch.x.size());
    batch.out.resize(batch.x.size());
    return batch;
}

std::vector<float> Qwen3_5Model::forward(const std::vector<int32_t>& tokens, const std::vector<SequenceSlice>& slices,
                                         std::vector<float>* pooled, const std::vector<StateCapture>* captures,
                                         std::vector<float>* hidden_out) {
    check(tokens, slices, captures);
    const std::vector<StateCapture> no_captures;
    Stopwatch total(profile_.forward);
    const Qwen3_5Config& c = config_;
    const int64_t n = static_cast<int64_t>(tokens.size()), hidden = c.hidden_size;
    Batch batch = batch_of(tokens, slices);
    for (const SequenceSlice& slice : slices) {  // a sequence's first slice starts from a zero state
        if (slice.start == 0) {
            std::fill_n(&states_[static_cast<size_t>(slice.state_slot) * static_cast<size_t>(slot_floats_)],
                        slot_floats_, 0.0f);
        }
    }
    for (int64_t t = 0; t < n; ++t) dequantize_row(embedding_, tokens[t], &batch.x[t * hidden]);

    const int64_t linear_state = delta_shape(c).state_floats();
    for (int64_t l = 0, attention = 0, offset = 0; l < c.num_layers; ++l) {
        const Qwen3_5Layer& L = layers_[static_cast<size_t>(l)];
        for_rows(pool_, n, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t) {
                rms_norm(&batch.x[t * hidden], L.input_norm.data(), hidden, c.rms_norm_eps, &batch.h[t * hidden]);
            }
        });
        if (L.kind == LayerKind::FullAttention) {
            attention_layer(L, attention++, batch, slices);
        } else {
            linear_layer(l, offset, batch, slices, captures ? *captures : no_captures);
            offset += linear_state;
        }
        add_and_norm(L, batch);
        feed_forward(L, batch);
        for (size_t i = 0; i < batch.x.size(); ++i) batch.x[i] += batch.out[i];
    }

    Stopwatch timed(profile_.lm_head);
    return final_rows(batch.x.data(), slices, {final_norm_, c.rms_norm_eps, lm_head_, c.exact_activations}, pool_,
                      pooled, hidden_out);
}

void Qwen3_5Model::add_and_norm(const Qwen3_5Layer& L, Batch& batch) {
    const int64_t hidden = config_.hidden_size;
    for_rows(pool_, batch.n, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            float* x = &batch.x[t * hidden];
            for (int64_t i = 0; i < hidden; ++i) x[i] += batch.out[t * hidden + i];
            rms_norm(x, L.post_attention_norm.data(), hidden, config_.rms_norm_eps, &batch.h[t * hidden]);
        }
    });
}

std::vector<float> Qwen3_5Model::mtp_forward(const std::vector<int32_t>& tokens, const std::vector<float>& hidden_in,
                                             const std::vector<SequenceSlice>& slices) {
    if (!mtp_) return Model::mtp_forward(tokens, hidden_in, slices);
    check(tokens, slices);
    const Qwen3_5Config& c = config_;
    const int64_t n = static_cast<int64_t>(tokens.size()), hidden = c.hidden_size;
    for (const SequenceSlice& slice : slices) {
        if (slice.num_logits != 0 || slice.pool != Pooling::None) {
            throw std::invalid_argument("the multi-token-prediction head gives neither logits nor poolings");
        }
    }
    if (static_cast<int64_t>(hidden_in.size()) != n * hidden) {
        throw std::invalid_argument("the multi-token-prediction head needs a hidden state per token");
    }
    Stopwatch total(profile_.forward);
    const Qwen3_5MTP& head = *mtp_;
    Batch batch = batch_of(tokens, slices);
    // [normed embedding | normed hidden state] per row, then fc back to the hidden size.
    batch.mixed.resize(static_cast<size_t>(n * 2 * hidden));
    for_rows(pool_, n, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            float* both = &batch.mixed[t * 2 * hidden];
            dequantize_row(embedding_, tokens[t], &batch.h[t * hidden]);
            rms_norm(&batch.h[t * hidden], head.embedding_norm.data(), hidden, c.rms_norm_eps, both);
            rms_norm(&hidden_in[t * hidden], head.hidden_norm.data(), hidden, c.rms_norm_eps, both + hidden);
        }
    });
    {
        Stopwatch timed(profile_.matmul);
        matmul(head.fc, batch.mixed.data(), n, batch.x.data(), pool_, c.exact_activations);
    }
    const Qwen3_5Layer& L = head.layer;
    for_rows(pool_, n, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            rms_norm(&batch.x[t * hidden], L.input_norm.data(), hidden, c.rms_norm_eps, &batch.h[t * hidden]);
        }
    });
    attention_layer(L, attention_layers_, batch, slices);
    add_and_norm(L, batch);
    feed_forward(L, batch);
    std::vector<float> out(batch.x.size());
    for_rows(pool_, n, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            float* x = &batch.x[t * hidden];
            for (int64_t i = 0; i < hidden; ++i) x[i] += batch.out[t * hidden + i];
            rms_norm(x, head.norm.data(), hidden, c.rms_norm_eps, &out[t * hidden]);
        }
    });
    return out;
}

std::vector<float> Qwen3_5Model::mtp_logits(const std::vector<float>& hidden) {
    if (!mtp_) return Model::mtp_logits(hidden);
    const int64_t rows = static_cast<int64_t>(hidden.size()) / config_.hidden_size;
    if (rows * config_.hidden_size != static_cast<int64_t>(hidden.size())) {
        throw std::invalid_argument("hidden rows must be whole rows of hidden_size");
    }
    Stopwatch timed(profile_.lm_head);
    std::vector<float> logits(static_cast<size_t>(rows * config_.vocab_size));
    if (rows > 0) matmul(lm_head_, hidden.data(), rows, logits.data(), pool_, config_.exact_activations);
    return logits;
}

void Qwen3_5Model::attention_layer(const Qwen3_5Layer& L, int64_t index, Batch& batch,
                                   const std::vector<SequenceSlice>& slices) {
    const Qwen3_5Config& c = config_;
    const int64_t n = batch.n, dim = c.head_dim, heads = c.num_heads, q_size = heads * dim;
    const int64_t kv_size = c.num_kv_heads * dim, half = c.rotary_dim / 2;
    batch.proj.resize(static_cast<size_t>(n * 2 * q_size));
    batch.k.resize(static_cast<size_t>(n * kv_size));
    batch.v.resize(batch.k.size());
    batch.q.resize(static_cast<size_t>(n * q_size));
    batch.gate.resize(batch.q.size());
    batch.attn.resize(batch.q.size());
    {
        Stopwatch timed(profile_.matmul);
        matmul_many({{&L.q, batch.proj.data()}, {&L.k, batch.k.data()}, {&L.v, batch.v.data()}}, batch.h.data(), n,
                    pool_, c.exact_activations);
    }
    {
        Stopwatch timed(profile_.attention);
        // Per token: split query and gate, head norms, partial RoPE, and the new keys and values into the cache.
        for_rows(pool_, n, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t) {
                const float* cos = &batch.cos[t * half];
                const float* sin = &batch.sin[t * half];
                for (int64_t hd = 0; hd < heads; ++hd) {
                    const float* both = &batch.proj[t * 2 * q_size + hd * 2 * dim];
                    float* head = &batch.q[t * q_size + hd * dim];
                    rms_norm(both, L.q_norm.data(), dim, c.rms_norm_eps, head);
                    rope(head, c.rotary_dim, cos, sin, false);  // rotate-half on the first rotary_dim
                    std::copy(both + dim, both + 2 * dim, &batch.gate[t * q_size + hd * dim]);
                }
                for (int64_t hd = 0; hd < c.num_kv_heads; ++hd) {
                    float* head = &batch.k[t * kv_size + hd * dim];
                    rms_norm(head, L.k_norm.data(), dim, c.rms_norm_eps, head);
                    rope(head, c.rotary_dim, cos, sin, false);  // rotate-half on the first rotary_dim
                }
                kv_->store(index, slices[batch.slice_of[t]], batch.position[t], &batch.k[t * kv_size],
                           &batch.v[t * kv_size]);
            }
        });
        kv_->attend(index, heads, batch.q.data(), batch.attn.data(), {slices, batch.slice_of, batch.position}, pool_);
        for (size_t i = 0; i < batch.attn.size(); ++i) batch.attn[i] *= sigmoid(batch.gate[i]);
    }
    Stopwatch timed(profile_.matmul);
    matmul(L.o, batch.attn.data(), n, batch.out.data(), pool_, c.exact_activations);
}

void Qwen3_5Model::linear_layer(int64_t l, int64_t offset, Batch& batch, const std::vector<SequenceSlice>& slices,
                                const std::vector<StateCapture>& captures) {
    const Qwen3_5Config& c = config_;
    const Qwen3_5Layer& L = layers_[static_cast<size_t>(l)];
    const GatedDeltaShape shape = delta_shape(c);
    const int64_t n = batch.n, width = shape.proj_size(), channels = shape.channels();
    const int64_t hv = c.linear_num_v_heads, dv = c.linear_v_dim;
    // The four projections into one row per token (q k v | z | b | a), then split apart by gated_delta.
    batch.q.resize(static_cast<size_t>(n * channels));
    batch.gate.resize(static_cast<size_t>(n * hv * dv));
    batch.k.resize(static_cast<size_t>(n * hv));
    batch.v.resize(static_cast<size_t>(n * hv));
    {
        Stopwatch timed(profile_.matmul);
        matmul_many({{&L.qkv, batch.q.data()}, {&L.z, batch.gate.data()}, {&L.b, batch.k.data()},
                     {&L.a, batch.v.data()}}, batch.h.data(), n, pool_, c.exact_activations);
    }
    batch.proj.resize(static_cast<size_t>(n * width));
    for (int64_t t = 0; t < n; ++t) {
        float* row = &batch.proj[t * width];
        std::copy_n(&batch.q[t * channels], channels, row);
        std::copy_n(&batch.gate[t * hv * dv], hv * dv, row + channels);
        std::copy_n(&batch.k[t * hv], hv, row + channels + hv * dv);
        std::copy_n(&batch.v[t * hv], hv, row + channels + hv * dv + hv);
    }
    batch.mixed.resize(static_cast<size_t>(n * hv * dv));
    batch.attn.resize(static_cast<size_t>(n * channels));  // the convolution's outputs
    const GatedDeltaWeights weights{L.conv, L.decay, L.dt_bias, L.norm};
    {
        Stopwatch timed(profile_.recurrence);
        // Each sequence's tokens in order, sequences side by side (then each value head apart): a sequence's bits
        // do not depend on the batch.
        const auto state = [&](int64_t s) {
            return &states_[static_cast<size_t>(slices[static_cast<size_t>(s)].state_slot) *
                                static_cast<size_t>(slot_floats_) + static_cast<size_t>(offset)];
        };
        const int64_t num_slices = static_cast<int64_t>(slices.size());
        const std::vector<float>& taps = conv_taps_[static_cast<size_t>(l)];
        const std::vector<std::vector<DeltaCapture>> captured = conv_captures(offset, batch, slices, captures);
        // The convolution in pieces of kConvTokens tokens (a prompt's over every worker), then each state moved on.
        constexpr int64_t kConvTokens = 32;
        std::vector<int64_t> pieces(static_cast<size_t>(num_slices + 1), 0);  // slice s: pieces [pieces[s], pieces[s + 1])
        for (int64_t s = 0; s < num_slices; ++s) {
            const int64_t tokens = slices[static_cast<size_t>(s)].num_tokens;
            pieces[static_cast<size_t>(s + 1)] = pieces[static_cast<size_t>(s)] + (tokens + kConvTokens - 1) / kConvTokens;
        }
        pool_.parallel_each(pieces.back(), [&](int64_t piece) {
            const int64_t s = std::upper_bound(pieces.begin(), pieces.end(), piece) - pieces.begin() - 1;
            const int64_t first = batch.first[static_cast<size_t>(s)];
            const int64_t from = (piece - pieces[static_cast<size_t>(s)]) * kConvTokens;
            const int64_t count = std::min(kConvTokens, slices[static_cast<size_t>(s)].num_tokens - from);
            gated_delta_conv(shape, taps, &batch.proj[first * width], from, count, state(s), &batch.attn[first * channels]);
        });
        for (int64_t s = 0; s < num_slices; ++s) {
            conv_state_after(shape, &batch.proj[batch.first[static_cast<size_t>(s)] * width],
                             slices[static_cast<size_t>(s)].num_tokens, state(s), state(s));
        }
        const auto head = [&](int64_t job, const float* next_state) {
            const int64_t s = job / hv, first = batch.first[static_cast<size_t>(s)];
            const SequenceSlice& slice = slices[static_cast<size_t>(s)];
            const DeltaRun run{slice.start, slice.prompt_end < 0 ? slice.start + slice.num_tokens : slice.prompt_end,
                               captured[static_cast<size_t>(s)]};
            gated_delta_head(shape, weights, c.rms_norm_eps, &batch.proj[first * width], &batch.attn[first * channels],
                             slice.num_tokens, job % hv, run, state(s), &batch.mixed[first * hv * dv], next_state);
        };
        // A decode step's heads each read their state from memory: they are claimed up to kHeadsPerClaim at a time
        // (at least two claims per thread, so that every thread has some and their ends stay together), each asking
        // for the next one's state while it finishes (gated_delta_head's next_state). Runs of uneven length are
        // claimed a head at a time.
        constexpr int64_t kHeadsPerClaim = 8;
        const int64_t jobs = num_slices * hv;
        if (n == num_slices) {
            const int64_t per_claim = std::clamp<int64_t>(jobs / (2 * pool_.size()), 1, kHeadsPerClaim);
            const auto head_state = [&](int64_t job) { return state(job / hv) + shape.head_offset(job % hv); };
            pool_.parallel_each((jobs + per_claim - 1) / per_claim, [&](int64_t claim) {
                const int64_t begin = claim * per_claim, end = std::min(jobs, begin + per_claim);
                for (int64_t job = begin; job < end; ++job) head(job, job + 1 < end ? head_state(job + 1) : nullptr);
            });
        } else {
            pool_.parallel_each(jobs, [&](int64_t job) { head(job, nullptr); });
        }
    }
    Stopwatch timed(profile_.matmul);
    matmul(L.out, batch.mixed.data(), n, batch.out.data(), pool_, c.exact_activations);
}

std::vector<std::vector<DeltaCapture>> Qwen3_5Model::conv_captures(int64_t offset, const Batch& batch,
                                                                    const std::vector<SequenceSlice>& slices,
                                                                    const std::vector<StateCapture>& captures) {
    const GatedDeltaShape shape = delta_shape(config_);
    std::vector<std::vector<DeltaCapture>> captured(slices.size());
    for (const StateCapture& capture : captures) {
        float* layer = capture.out + offset;
        captured[capture.slice].push_back({capture.tokens, layer});
        const float* kept = &states_[static_cast<size_t>(slices[capture.slice].state_slot) *
                                         static_cast<size_t>(slot_floats_) + static_cast<size_t>(offset)];
        conv_state_after(shape, &batch.proj[batch.first[capture.slice] * shape.proj_size()], capture.tokens, kept,
                         layer);
    }
    for (auto& list : captured) {
        std::sort(list.begin(), list.end(), [](const DeltaCapture& a, const DeltaCapture& b) { return a.tokens < b.tokens; });
    }
    return captured;
}

void Qwen3_5Model::feed_forward(const Qwen3_5Layer& L, Batch& batch) {
    const Qwen3_5Config& c = config_;
    const int64_t n = batch.n;
    Stopwatch timed(profile_.matmul);
    if (L.is_moe) {
        moe_forward(*L.moe, batch.h.data(), n, c.hidden_size, batch.out.data(), pool_, c.exact_activations);
        return;
    }
    const int64_t inter = L.gate.rows;
    batch.ff_gate.resize(static_cast<size_t>(n * inter));
    batch.ff_up.resize(batch.ff_gate.size());
    matmul_many({{&L.gate, batch.ff_gate.data()}, {&L.up, batch.ff_up.data()}}, batch.h.data(), n, pool_,
                c.exact_activations);
    silu_mul(batch.ff_gate.data(), batch.ff_up.data(), n * inter);
    matmul(L.down, batch.ff_gate.data(), n, batch.out.data(), pool_, c.exact_activations);
}

}  // namespace pocketllm
