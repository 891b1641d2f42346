#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>

namespace pocketllm {
namespace {

constexpr int64_t kQueryTile = 16;      // prompt tokens of one head that share each KV block read in attention
constexpr int64_t kPartPositions = 64;  // positions of an attention part (whole KV blocks, at least one): see attend

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

void prefetch(const uint8_t* bytes, int64_t size) {
    for (int64_t at = 0; at < size; at += 64) __builtin_prefetch(bytes + at);
}

}  // namespace

PagedAttention::PagedAttention(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim, KvType kv_type,
                               int64_t num_blocks, int64_t block_size)
    : num_layers_(num_layers), num_kv_heads_(num_kv_heads), head_dim_(head_dim), kv_type_(kv_type),
      num_blocks_(num_blocks), block_size_(block_size), kv_element_(kv_type == KvType::F16 ? 2 : 4) {
    if (num_layers < 0 || num_kv_heads <= 0 || head_dim <= 0 || num_blocks <= 0 || block_size <= 0) {
        throw std::invalid_argument("the KV cache needs positive KV heads, head size, blocks and block size");
    }
    size_t per_position = 0, cache_size = 0;
    if (__builtin_mul_overflow(static_cast<size_t>(num_layers) * 2, static_cast<size_t>(num_kv_heads), &per_position) ||
        __builtin_mul_overflow(per_position, static_cast<size_t>(head_dim) * kv_element_, &per_position) ||
        __builtin_mul_overflow(per_position, static_cast<size_t>(num_blocks), &cache_size) ||
        __builtin_mul_overflow(cache_size, static_cast<size_t>(block_size), &cache_size)) {
        throw std::invalid_argument("KV cache size overflows");
    }
    // Left uninitialised: attention reads only positions already written, and untouched pages of a pool sized
    // for max_num_seqs full-length sequences cost no memory until used.
    cache_.reset(new uint8_t[std::max<size_t>(cache_size, 1)]);
}

uint8_t* PagedAttention::kv(int64_t layer, int64_t block, int which) {
    const int64_t per_block = num_kv_heads_ * block_size_ * head_dim_ * static_cast<int64_t>(kv_element_);
    return cache_.get() + ((layer * num_blocks_ + block) * 2 + which) * per_block;
}

void PagedAttention::store(int64_t layer, const SequenceSlice& slice, int64_t position, const float* keys,
                           const float* values) {
    const kernels::Attention ops = kernels::attention_for(kv_type_, head_dim_);
    const int64_t block = slice.block_table[static_cast<size_t>(position / block_size_)];
    const int64_t slot = position % block_size_, dim = head_dim_;
    for (int64_t hd = 0; hd < num_kv_heads_; ++hd) {
        const int64_t offset = (hd * block_size_ + slot) * dim * static_cast<int64_t>(kv_element_);
        ops.store(keys + hd * dim, dim, kv(layer, block, 0) + offset);
        ops.store(values + hd * dim, dim, kv(layer, block, 1) + offset);
    }
}

// Causal attention of each token and head over its sequence's positions 0..p, read through the block table. A job
// is one KV head over a tile of up to kQueryTile consecutive tokens of one slice: each KV block is read from memory
// once for every query head of its group and every token of the tile (a decode step's KV reads drop by the group
// size), then stays in cache for them.
//
// The positions split into parts of kPartPositions at fixed places (0, 64, 128, ...): each part's softmax is taken
// in one pass (largest score, sum of exponentials, weighted values), and a token's parts fold into its result in
// order. A token's arithmetic then depends on its own position alone, not on the tile it is in, how many jobs
// share the step, or the threads: a request's attention is the same bits alone or batched (chunked differently,
// beside others), so seeded sampling repeats. How parts are spread over threads is free: with few jobs (decoding
// one sequence) each part is a work item whose state is stored, and the item that finishes a job's last part folds
// them; else a job's item folds its parts as it goes.
void PagedAttention::attend(int64_t l, int64_t num_heads, const float* q, float* attn, const TokenPlaces& tokens,
                            ThreadPool& pool) {
    const std::vector<SequenceSlice>& slices = tokens.slices;
    const int64_t dim = head_dim_, q_size = num_heads * dim, group = num_heads / num_kv_heads_;
    const kernels::Attention ops = kernels::attention_for(kv_type_, dim);
    const kernels::Attention float_ops = kernels::attention_for(KvType::F32, dim);
    const int64_t part_blocks = std::max<int64_t>(1, kPartPositions / block_size_);
    // Tokens [first, first + count) of the batch; `state`: where its parts' states are stored (split items).
    struct Job { int64_t slice, kv_head, first, count, blocks, parts, state; };
    std::vector<Job> jobs;
    for (int64_t s = 0, first = 0; s < static_cast<int64_t>(slices.size()); first += slices[s].num_tokens, ++s) {
        for (int64_t t = 0; t < slices[s].num_tokens; t += kQueryTile) {
            const int64_t count = std::min(kQueryTile, slices[s].num_tokens - t);
            const int64_t blocks = tokens.position[first + t + count - 1] / block_size_ + 1;
            const int64_t parts = (blocks + part_blocks - 1) / part_blocks;
            for (int64_t kvh = 0; kvh < num_kv_heads_; ++kvh) {
                jobs.push_back({s, kvh, first + t, count, blocks, parts, 0});
            }
        }
    }
    const int64_t num_jobs = static_cast<int64_t>(jobs.size());
    const bool split = num_jobs < 2 * pool.size();
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
    if (part_max_.size() < static_cast<size_t>(stored)) {
        part_out_.resize(static_cast<size_t>(stored * dim));
        part_max_.resize(static_cast<size_t>(stored));
        part_sum_.resize(static_cast<size_t>(stored));
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
    const int64_t head_bytes = block_size_ * dim * static_cast<int64_t>(kv_element_);
    auto out = [&](const Job& job, int64_t g, int64_t i) {
        return &attn[(job.first + i) * q_size + (job.kv_head * group + g) * dim];
    };
    // Items by decreasing length (a prompt's later tiles read more blocks), taken dynamically: a static split of
    // a prefill's tiles left one thread with most of the work.
    auto blocks = [&](const Item& item) {
        return std::min(jobs[static_cast<size_t>(item.job)].blocks, item.end * part_blocks) - item.begin * part_blocks;
    };
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return blocks(a) > blocks(b); });
    // Split items: each (head, token) of a job gets the stored states of its parts folded in order, then divided by
    // the total, by whichever item finishes the job's last part (in the same region: no second one to wait for).
    std::unique_ptr<std::atomic<int64_t>[]> unfinished(split ? new std::atomic<int64_t>[num_jobs] : nullptr);
    for (int64_t j = 0; split && j < num_jobs; ++j) unfinished[j].store(jobs[static_cast<size_t>(j)].parts);
    auto fold_parts = [&](const Job& job) {
        const int64_t states = group * job.count;
        for (int64_t at = 0; at < states; ++at) {
            float* o = out(job, at / job.count, at % job.count);
            float total_max = -INFINITY, total_sum = 0.0f;
            for (int64_t part = 0; part < job.parts; ++part) {
                const size_t from = static_cast<size_t>(job.state + part * states + at);
                fold(o, total_max, total_sum, &part_out_[from * static_cast<size_t>(dim)], part_max_[from],
                     part_sum_[from], dim);
            }
            normalize(o, total_sum, dim);
        }
    };
    const int64_t part_positions = part_blocks * block_size_;
    pool.parallel_each(static_cast<int64_t>(items.size()), [&](int64_t index) {
        // The scores of the group's heads for one token over one part, a part's softmax states when they fold into
        // the result here, and a prefill tile's part as float32.
        thread_local std::vector<float> scores, fresh_out, fresh_max, fresh_sum, total_max, total_sum, keys, values;
        scores.resize(static_cast<size_t>(group * part_positions));
        const Item& item = items[static_cast<size_t>(index)];
        const Job& job = jobs[static_cast<size_t>(item.job)];
        const int64_t states = group * job.count;
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
            float* part_out = split ? &part_out_[static_cast<size_t>(base * dim)] : fresh_out.data();
            float* part_max = split ? &part_max_[static_cast<size_t>(base)] : fresh_max.data();
            float* part_sum = split ? &part_sum_[static_cast<size_t>(base)] : fresh_sum.data();
            std::fill(part_out, part_out + states * dim, 0.0f);
            std::fill(part_max, part_max + states, -INFINITY);
            std::fill(part_sum, part_sum + states, 0.0f);
            // The part's positions that its last token reads, every block's lines asked for before the first is
            // read: a decode step finds the cache in memory (the weights streamed since the last step evicted
            // it), and the block table's jumps stop the hardware prefetchers at each block's end.
            const int64_t first_block = part * part_blocks, end_block = std::min(job.blocks, first_block + part_blocks);
            const int64_t p0 = first_block * block_size_;
            for (int64_t b = first_block; b < end_block; ++b) {
                prefetch(kv(l, table[b], 0) + job.kv_head * head_bytes, head_bytes);
                prefetch(kv(l, table[b], 1) + job.kv_head * head_bytes, head_bytes);
            }
            // A decode step's one token reads the part block by block where the cache holds it. A prefill tile's
            // tokens read it from a float32 copy, made once, in one call each: a call per block per token cost a
            // 2,048-token prefill's attention 8 %. The bits are the same either way: each weighted sum is one chain
            // over the positions in order, and the scores' 4-key groups start at the same positions while blocks
            // hold a multiple of 4.
            const bool copied = job.count > 1 && block_size_ % 4 == 0;
            if (copied) {
                keys.resize(static_cast<size_t>(part_positions * dim));
                values.resize(keys.size());
                const int64_t last = tokens.position[job.first + job.count - 1];
                for (int64_t b = first_block; b < end_block; ++b) {
                    const int64_t p = b * block_size_, count = std::min(block_size_, last + 1 - p);
                    ops.load(kv(l, table[b], 0) + job.kv_head * head_bytes, count, dim, &keys[(p - p0) * dim]);
                    ops.load(kv(l, table[b], 1) + job.kv_head * head_bytes, count, dim, &values[(p - p0) * dim]);
                }
            }
            const kernels::Attention& use = copied ? float_ops : ops;
            const int64_t span = copied ? part_positions : block_size_;  // positions per call
            auto rows = [&](int64_t p, int which) -> const void* {
                if (copied) return &(which == 0 ? keys : values)[static_cast<size_t>((p - p0) * dim)];
                return kv(l, table[p / block_size_], which) + job.kv_head * head_bytes;
            };
            // Each token's softmax over the part in one pass: its largest score, the sum of exp(score - largest)
            // and the weighted sum of the values.
            for (int64_t i = 0; i < job.count; ++i) {
                const int64_t t = job.first + i, length = tokens.position[t] + 1;
                if (p0 >= length) continue;  // causal: this token ends before the part (its state stays empty)
                const int64_t count = std::min(part_positions, length - p0);
                const float* query = &q[t * q_size + job.kv_head * group * dim];
                for (int64_t p = p0; p < p0 + count; p += span) {
                    use.scores(query, group, rows(p, 0), std::min(span, p0 + count - p), dim, scale, &scores[p - p0],
                               count);
                }
                for (int64_t g = 0; g < group; ++g) {
                    float* sc = &scores[static_cast<size_t>(g * count)];
                    const int64_t at = g * job.count + i;
                    part_max[at] = ops.maximum(sc, count);
                    part_sum[at] = ops.exp_shifted(sc, count, part_max[at]);
                }
                // The group's heads at once: each value row is read once for all of them.
                for (int64_t p = p0; p < p0 + count; p += span) {
                    use.accumulate(&scores[p - p0], count, group, rows(p, 1), std::min(span, p0 + count - p), dim,
                                   part_out + i * dim, job.count * dim);
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
        if (split) {
            // acq_rel: the last finisher sees every other part's stored state.
            if (unfinished[item.job].fetch_sub(1, std::memory_order_acq_rel) == 1) fold_parts(job);
            return;
        }
        for (int64_t g = 0; g < group; ++g) {
            for (int64_t i = 0; i < job.count; ++i) normalize(out(job, g, i), total_sum[g * job.count + i], dim);
        }
    });
}

}  // namespace pocketllm
