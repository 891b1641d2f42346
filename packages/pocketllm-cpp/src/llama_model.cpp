#include "pocketllm_cpp/llama_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>


namespace pocketllm {
namespace {

constexpr int64_t kQueryTile = 16;      // prompt tokens of one head that share each KV block read in attention
constexpr int64_t kParallelRows = 16;   // below this many tokens, per-token work runs on the calling thread
constexpr int64_t kPartPositions = 64;  // positions of an attention part (whole KV blocks, at least one): see attend

float rms_scale(const float* x, int64_t size, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < size; ++i) sum += static_cast<double>(x[i]) * x[i];
    return 1.0f / std::sqrt(static_cast<float>(sum / static_cast<double>(size)) + eps);
}

void rms_norm(const float* x, const float* weight, int64_t size, float eps, float* out) {
    const float scale = rms_scale(x, size, eps);
    for (int64_t i = 0; i < size; ++i) out[i] = x[i] * scale * weight[i];
}

// x += delta, then out = RMSNorm(x): the residual add and the next norm in one pass over x.
void add_rms_norm(float* x, const float* delta, const float* weight, int64_t size, float eps, float* out) {
    for (int64_t i = 0; i < size; ++i) x[i] += delta[i];
    rms_norm(x, weight, size, eps, out);
}

void rope(float* head, int64_t dim, const float* cos, const float* sin, bool pairs_adjacent) {
    for (int64_t i = 0; i < dim / 2; ++i) {
        float& a = pairs_adjacent ? head[2 * i] : head[i];
        float& b = pairs_adjacent ? head[2 * i + 1] : head[i + dim / 2];
        const float x0 = a, x1 = b;
        a = x0 * cos[i] - x1 * sin[i];
        b = x1 * cos[i] + x0 * sin[i];
    }
}

// Folds a part's softmax state (the weighted sum of its values, its maximum score and sum of weights) into a
// token's running one. Not inlined: one compiled copy, the same arithmetic wherever a part is folded.
[[gnu::noinline]] void fold(float* out, float& max, float& sum, const float* part_out, float part_max, float part_sum,
                            int64_t dim) {
    if (part_max == -INFINITY) return;  // the part holds no position of this token
    if (max == -INFINITY) {
        std::copy(part_out, part_out + dim, out);
        max = part_max;
        sum = part_sum;
        return;
    }
    const float best = std::max(max, part_max);
    const float mine = std::exp(max - best), theirs = std::exp(part_max - best);
    for (int64_t d = 0; d < dim; ++d) out[d] = out[d] * mine + part_out[d] * theirs;
    sum = sum * mine + part_sum * theirs;
    max = best;
}

[[gnu::noinline]] void normalize(float* out, float sum, int64_t dim) {
    const float inverse = 1.0f / sum;
    for (int64_t d = 0; d < dim; ++d) out[d] *= inverse;
}

void for_rows(ThreadPool& pool, int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    if (n < kParallelRows) return fn(0, n);
    pool.parallel_for(n, fn);
}

}  // namespace

// Every buffer of one forward pass, sized once.
struct LlamaModel::Batch {
    int64_t n;
    std::vector<int64_t> slice_of, position;
    std::vector<float> cos, sin;  // [n, head_dim / 2]: each token's RoPE rotation, shared by every layer
    std::vector<float> x, h, q, k, v, attn, out, gate, up;
    std::vector<float> part_out, part_max, part_sum;  // attention's stored part states (see attend)
};

LlamaModel::LlamaModel(LlamaConfig config, WeightView embedding, std::vector<LlamaLayer> layers,
                       std::vector<float> final_norm, WeightView lm_head, int64_t num_blocks, int64_t block_size,
                       int num_threads)
    : Model(config.vocab_size, config.hidden_size, num_blocks, block_size), config_(config), embedding_(embedding),
      lm_head_(lm_head), layers_(std::move(layers)), final_norm_(std::move(final_norm)),
      kv_element_(config.kv_type == KvType::F16 ? 2 : 4), pool_(num_threads) {
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
    size_t cache_size = 0;
    if (__builtin_mul_overflow(static_cast<size_t>(c.num_layers * 2 * c.num_kv_heads * c.head_dim) * kv_element_,
                               static_cast<size_t>(num_blocks * block_size), &cache_size)) {
        throw std::invalid_argument("KV cache size overflows");
    }
    // Left uninitialised: attention reads only positions already written, and untouched pages of a pool sized
    // for max_num_seqs full-length sequences cost no memory until used.
    cache_.reset(new uint8_t[cache_size]);
}

uint8_t* LlamaModel::kv(int64_t layer, int64_t block, int which) {
    const int64_t per_block = config_.num_kv_heads * block_size() * config_.head_dim * static_cast<int64_t>(kv_element_);
    return cache_.get() + ((layer * num_blocks() + block) * 2 + which) * per_block;
}

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
                                  std::vector<float>* pooled) {
    check(tokens, slices);
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

    std::vector<float> normed(static_cast<size_t>(hidden));
    for (int64_t s = 0, begin = 0; pooled != nullptr && s < static_cast<int64_t>(slices.size()); ++s) {
        const SequenceSlice& slice = slices[s];
        const int64_t end = begin + slice.num_tokens;
        if (slice.pool != Pooling::None) {
            const size_t at = pooled->size();
            pooled->resize(at + static_cast<size_t>(hidden), 0.0f);
            // Mean sums every row; Cls takes the prompt's first row, Last the slice's last one.
            const int64_t first = slice.pool == Pooling::Last ? end - 1 : begin;
            const int64_t stop = slice.pool == Pooling::Mean ? end : (slice.pool == Pooling::Cls && slice.start > 0) ? first : first + 1;
            for (int64_t t = first; t < stop; ++t) {
                for (int64_t i = 0; i < hidden; ++i) normed[i] = batch.x[t * hidden + i] + batch.out[t * hidden + i];
                rms_norm(normed.data(), final_norm_.data(), hidden, c.rms_norm_eps, normed.data());
                for (int64_t i = 0; i < hidden; ++i) (*pooled)[at + static_cast<size_t>(i)] += normed[i];
            }
        }
        begin = end;
    }
    std::vector<float> last;  // the final norm of each wanted slice's last num_logits tokens
    for (int64_t s = 0, end = 0; s < static_cast<int64_t>(slices.size()); ++s) {
        end += slices[s].num_tokens;
        for (int64_t t = end - slices[s].num_logits; t < end; ++t) {
            for (int64_t i = 0; i < hidden; ++i) batch.x[t * hidden + i] += batch.out[t * hidden + i];
            last.resize(last.size() + static_cast<size_t>(hidden));
            rms_norm(&batch.x[t * hidden], final_norm_.data(), hidden, c.rms_norm_eps, &last[last.size() - hidden]);
        }
    }
    const int64_t rows = static_cast<int64_t>(last.size()) / hidden;
    std::vector<float> logits(static_cast<size_t>(rows * c.vocab_size));
    Stopwatch timed(profile_.lm_head);
    if (rows > 0) matmul(lm_head_, last.data(), rows, logits.data(), pool_, c.exact_activations);
    return logits;
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
    const kernels::Attention ops = kernels::attention_for(c.kv_type, dim);
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
            const auto& table = slices[batch.slice_of[t]].block_table;
            const int64_t position = batch.position[t];
            const int64_t block = table[position / block_size()], slot = position % block_size();
            for (int64_t hd = 0; hd < c.num_kv_heads; ++hd) {
                float* head = &batch.k[t * kv_size + hd * dim];
                if (c.qk_norm) rms_norm(head, L.k_norm.data(), dim, c.rms_norm_eps, head);
                rope(head, dim, cos, sin, c.rope_pairs_adjacent);
                const int64_t offset = (hd * block_size() + slot) * dim * static_cast<int64_t>(kv_element_);
                ops.store(head, dim, kv(l, block, 0) + offset);
                ops.store(&batch.v[t * kv_size + hd * dim], dim, kv(l, block, 1) + offset);
            }
        }
    });
    attend(l, batch, slices);
}

// Causal attention of each token and head over its sequence's positions 0..p, read block by block through the
// block table with an online softmax. A job is one KV head over a tile of up to kQueryTile consecutive tokens of
// one slice: each KV block is read from memory once for every query head of its group and every token of the
// tile (a decode step's KV reads drop by the group size), then stays in L1 for them.
//
// The positions split into parts of kPartPositions at fixed places (0, 64, 128, ...): each part's softmax state
// starts afresh, and a token's parts fold into its result in order. A token's arithmetic then depends on its own
// position alone, not on the tile it is in, how many jobs share the step, or the threads: a request's attention
// is the same bits alone or batched (chunked differently, beside others), so seeded sampling repeats. How parts
// are spread over threads is free: with few jobs (decoding one sequence) each part is a work item whose state is
// stored and folded at the end, else a job's item folds its parts as it goes.
void LlamaModel::attend(int64_t l, Batch& batch, const std::vector<SequenceSlice>& slices) {
    const LlamaConfig& c = config_;
    const int64_t dim = c.head_dim, q_size = c.num_heads * dim, group = c.num_heads / c.num_kv_heads;
    const kernels::Attention ops = kernels::attention_for(c.kv_type, dim);
    const int64_t part_blocks = std::max<int64_t>(1, kPartPositions / block_size());
    // Tokens [first, first + count) of the batch; `state`: where its parts' states are stored (split items).
    struct Job { int64_t slice, kv_head, first, count, blocks, parts, state; };
    std::vector<Job> jobs;
    for (int64_t s = 0, first = 0; s < static_cast<int64_t>(slices.size()); first += slices[s].num_tokens, ++s) {
        for (int64_t t = 0; t < slices[s].num_tokens; t += kQueryTile) {
            const int64_t count = std::min(kQueryTile, slices[s].num_tokens - t);
            const int64_t blocks = batch.position[first + t + count - 1] / block_size() + 1;
            const int64_t parts = (blocks + part_blocks - 1) / part_blocks;
            for (int64_t kvh = 0; kvh < c.num_kv_heads; ++kvh) {
                jobs.push_back({s, kvh, first + t, count, blocks, parts, 0});
            }
        }
    }
    const int64_t num_jobs = static_cast<int64_t>(jobs.size());
    const bool split = num_jobs < 2 * pool_.size();
    struct Item { int64_t job, begin, end; };  // parts [begin, end) of a job
    std::vector<Item> items;
    int64_t stored = 0;  // part states kept for the fold at the end, one per (part, head of the group, token)
    for (int64_t j = 0; j < num_jobs; ++j) {
        Job& job = jobs[static_cast<size_t>(j)];
        if (!split) {
            items.push_back({j, 0, job.parts});
            continue;
        }
        job.state = stored;
        stored += job.parts * group * job.count;
        for (int64_t part = 0; part < job.parts; ++part) items.push_back({j, part, part + 1});
    }
    if (batch.part_max.size() < static_cast<size_t>(stored)) {
        batch.part_out.resize(static_cast<size_t>(stored * dim));
        batch.part_max.resize(static_cast<size_t>(stored));
        batch.part_sum.resize(static_cast<size_t>(stored));
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
    const int64_t head_bytes = block_size() * dim * static_cast<int64_t>(kv_element_);
    auto out = [&](const Job& job, int64_t g, int64_t i) {
        return &batch.attn[(job.first + i) * q_size + (job.kv_head * group + g) * dim];
    };
    // Items by decreasing length (a prompt's later tiles read more blocks), taken dynamically: a static split of
    // a prefill's tiles left one thread with most of the work.
    auto blocks = [&](const Item& item) {
        return std::min(jobs[static_cast<size_t>(item.job)].blocks, item.end * part_blocks) - item.begin * part_blocks;
    };
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return blocks(a) > blocks(b); });
    pool_.parallel_each(static_cast<int64_t>(items.size()), [&](int64_t index) {
        // One block's keys and values as float32, the scores of the group's heads for one token, and a part's
        // softmax states when they fold into the result here.
        thread_local std::vector<float> keys, values, scores, fresh_out, fresh_max, fresh_sum, total_max, total_sum;
        keys.resize(static_cast<size_t>(block_size() * dim));
        values.resize(keys.size());
        scores.resize(static_cast<size_t>(group * block_size()));
        const Item& item = items[static_cast<size_t>(index)];
        const Job& job = jobs[static_cast<size_t>(item.job)];
        const int64_t last = batch.position[job.first + job.count - 1], states = group * job.count;
        const auto& table = slices[job.slice].block_table;
        if (!split) {
            fresh_out.resize(static_cast<size_t>(states * dim));
            fresh_max.resize(static_cast<size_t>(states));
            fresh_sum.resize(fresh_max.size());
            total_max.assign(fresh_max.size(), -INFINITY);
            total_sum.assign(fresh_max.size(), 0.0f);
        }
        for (int64_t part = item.begin; part < item.end; ++part) {
            // State (g, i) of this part: its slot among the stored ones, or this thread's.
            const int64_t base = split ? job.state + part * states : 0;
            float* part_out = split ? &batch.part_out[static_cast<size_t>(base * dim)] : fresh_out.data();
            float* part_max = split ? &batch.part_max[static_cast<size_t>(base)] : fresh_max.data();
            float* part_sum = split ? &batch.part_sum[static_cast<size_t>(base)] : fresh_sum.data();
            std::fill(part_out, part_out + states * dim, 0.0f);
            std::fill(part_max, part_max + states, -INFINITY);
            std::fill(part_sum, part_sum + states, 0.0f);
            for (int64_t b = part * part_blocks; b < std::min(job.blocks, (part + 1) * part_blocks); ++b) {
                const int64_t p = b * block_size(), rows = std::min(block_size(), last + 1 - p);
                ops.load(kv(l, table[b], 0) + job.kv_head * head_bytes, rows, dim, keys.data());
                ops.load(kv(l, table[b], 1) + job.kv_head * head_bytes, rows, dim, values.data());
                for (int64_t i = 0; i < job.count; ++i) {
                    const int64_t t = job.first + i, length = batch.position[t] + 1;
                    if (p >= length) continue;  // causal: this token ends before the block, later ones may not
                    const int64_t count = std::min(block_size(), length - p);
                    ops.scores(&batch.q[t * q_size + job.kv_head * group * dim], group, keys.data(), count, dim, scale,
                               scores.data());
                    for (int64_t g = 0; g < group; ++g) {
                        float* s = &scores[static_cast<size_t>(g * count)];
                        const int64_t at = g * job.count + i;
                        const float best = std::max(part_max[at], *std::max_element(s, s + count));
                        // Rescale what was summed under the old maximum, then add this block's terms.
                        const float correction = std::exp(part_max[at] - best);
                        float* o = part_out + at * dim;
                        if (correction != 1.0f) {
                            for (int64_t d = 0; d < dim; ++d) o[d] *= correction;
                        }
                        part_sum[at] = part_sum[at] * correction + ops.exp_shifted(s, count, best);
                        part_max[at] = best;
                        ops.accumulate(s, values.data(), count, dim, o);
                    }
                }
            }
            if (split) continue;
            for (int64_t g = 0; g < group; ++g) {
                for (int64_t i = 0; i < job.count; ++i) {
                    const int64_t at = g * job.count + i;
                    fold(out(job, g, i), total_max[at], total_sum[at], part_out + at * dim, part_max[at], part_sum[at],
                         dim);
                }
            }
        }
        if (split) return;
        for (int64_t g = 0; g < group; ++g) {
            for (int64_t i = 0; i < job.count; ++i) normalize(out(job, g, i), total_sum[g * job.count + i], dim);
        }
    });
    if (!split) return;
    // Each (head, token): the stored states of its parts folded in order, then divided by the total.
    pool_.parallel_each(num_jobs, [&](int64_t j) {
        const Job& job = jobs[static_cast<size_t>(j)];
        const int64_t states = group * job.count;
        for (int64_t at = 0; at < states; ++at) {
            float* o = out(job, at / job.count, at % job.count);
            float total_max = -INFINITY, total_sum = 0.0f;
            for (int64_t part = 0; part < job.parts; ++part) {
                const size_t from = static_cast<size_t>(job.state + part * states + at);
                fold(o, total_max, total_sum, &batch.part_out[from * static_cast<size_t>(dim)], batch.part_max[from],
                     batch.part_sum[from], dim);
            }
            normalize(o, total_sum, dim);
        }
    });
}

}  // namespace pocketllm
