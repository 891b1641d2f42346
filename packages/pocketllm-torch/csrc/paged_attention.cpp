// Decode attention (one query per sequence) read straight from the paged KV cache.
//
// The torch path gathers every sequence's context blocks into a padded batch and runs two matmuls: the
// context is read, written and read again. Here each (sequence, kv head) pair walks its block table once for
// the keys and once for the values, with the query heads that share the kv head, so a decode step reads
// each cached key and value once (from memory) and never materialises a copy.
//
// Inputs: q [B, H, D] float32; kv_cache [2, Hkv, slots, D] float32 (slot = block * block_size + offset);
// context_blocks [B, N] int64 (block ids, in order); context_lens [B] int64 (>= 1: the new token is cached
// first). Output [B, H * D] float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "isa.h"
#include "vec_math.h"

namespace pocketllm {
namespace {

struct Head {
  const float* q;  // [D]
  float* out;      // [D]
};

// One (sequence, kv head): its query heads over `len` cached positions, read block by block through the table.
// Loops over positions go block by block (`offset(i)`, then `block_size` rows of D floats) rather than through a
// per-position helper: a lambda or call per position is not inlined into the AVX2 functions (their target
// differs) and costs more than the arithmetic.
struct Task {
  const float* keys;    // [slots, D] of this kv head
  const float* values;  // [slots, D]
  const int64_t* blocks;
  int64_t block_size, len, dim;
  float scale;

  int64_t offset(int64_t i) const { return blocks[i] * block_size * dim; }  // of block i's first row
};

#define POCKETLLM_FOR_EACH_POSITION(task, cache, t, row, ...)                                   \
  for (int64_t start_ = 0, i_ = 0; start_ < (task).len; start_ += (task).block_size, ++i_) {    \
    const float* row = (cache) + (task).offset(i_);                                             \
    const int64_t end_ = std::min((task).len, start_ + (task).block_size);                      \
    for (int64_t t = start_; t < end_; ++t, row += (task).dim) __VA_ARGS__                      \
  }

void softmax_scalar(float* s, int64_t n) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) max = std::max(max, s[i]);
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (s[i] = std::exp(s[i] - max));
  for (int64_t i = 0; i < n; ++i) s[i] /= sum;
}

void head_scalar(const Task& task, const Head& head, float* scores) {
  POCKETLLM_FOR_EACH_POSITION(task, task.keys, t, k, {
    float dot = 0;
    for (int64_t d = 0; d < task.dim; ++d) dot += head.q[d] * k[d];
    scores[t] = dot * task.scale;
  })
  softmax_scalar(scores, task.len);
  for (int64_t d = 0; d < task.dim; ++d) head.out[d] = 0;
  POCKETLLM_FOR_EACH_POSITION(task, task.values, t, v, {
    for (int64_t d = 0; d < task.dim; ++d) head.out[d] += scores[t] * v[d];
  })
}

#ifdef POCKETLLM_X86
__attribute__((target("avx2,fma"))) void softmax_avx2(float* s, int64_t n) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) max = std::max(max, s[i]);
  const __m256 vmax = _mm256_set1_ps(max);
  __m256 vsum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmax));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - max));
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inv));
  for (; i < n; ++i) s[i] /= sum;
}

// Needs dim % 8 == 0 (checked by the caller).
__attribute__((target("avx2,fma"))) void head_avx2(const Task& task, const Head& head, float* scores) {
  const int64_t dim = task.dim;
  POCKETLLM_FOR_EACH_POSITION(task, task.keys, t, k, {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;  // two chains: half the FMA latency per position
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(head.q + d), _mm256_loadu_ps(k + d), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(head.q + d + 8), _mm256_loadu_ps(k + d + 8), acc1);
    }
    if (d < dim) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(head.q + d), _mm256_loadu_ps(k + d), acc0);
    scores[t] = hsum(_mm256_add_ps(acc0, acc1)) * task.scale;
  })
  softmax_avx2(scores, task.len);
  // 32 outputs at a time accumulate over all positions in four registers: four independent FMA chains.
  int64_t d = 0;
  for (; d + 32 <= dim; d += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    POCKETLLM_FOR_EACH_POSITION(task, task.values, t, v, {
      const __m256 p = _mm256_set1_ps(scores[t]);
      a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + d), a0);
      a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + d + 8), a1);
      a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + d + 16), a2);
      a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + d + 24), a3);
    })
    _mm256_storeu_ps(head.out + d, a0);
    _mm256_storeu_ps(head.out + d + 8, a1);
    _mm256_storeu_ps(head.out + d + 16, a2);
    _mm256_storeu_ps(head.out + d + 24, a3);
  }
  for (; d < dim; d += 8) {
    __m256 a = _mm256_setzero_ps();
    POCKETLLM_FOR_EACH_POSITION(task, task.values, t, v, {
      a = _mm256_fmadd_ps(_mm256_set1_ps(scores[t]), _mm256_loadu_ps(v + d), a);
    })
    _mm256_storeu_ps(head.out + d, a);
  }
}
#endif

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& context_blocks,
                                  const at::Tensor& context_lens, int64_t block_size, double scale) {
  const char* op = "paged_decode_attention";
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu() && context_blocks.device().is_cpu() &&
                  context_lens.device().is_cpu(),
              op, ": tensors must be on the CPU");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(), op,
              ": q must be a contiguous float32 [B, H, D] tensor");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat && kv_cache.dim() == 4 && kv_cache.size(0) == 2 &&
                  kv_cache.is_contiguous(),
              op, ": kv_cache must be a contiguous float32 [2, Hkv, slots, D] tensor");
  TORCH_CHECK(context_blocks.scalar_type() == at::kLong && context_blocks.dim() == 2 &&
                  context_blocks.is_contiguous(),
              op, ": context_blocks must be a contiguous int64 [B, N] tensor");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 && context_lens.is_contiguous(),
              op, ": context_lens must be a contiguous int64 [B] tensor");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv_cache.size(1), slots = kv_cache.size(2), max_blocks = context_blocks.size(1);
  TORCH_CHECK(kv_cache.size(3) == dim, op, ": head dims differ (q ", dim, ", cache ", kv_cache.size(3), ")");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, op, ": ", heads, " query heads do not share ", kv_heads,
              " kv heads evenly");
  TORCH_CHECK(context_blocks.size(0) == batch && context_lens.size(0) == batch, op, ": batch sizes differ");
  TORCH_CHECK(block_size > 0 && slots % block_size == 0, op, ": block_size ", block_size, " does not divide ",
              slots, " slots");
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  const int64_t* tables = context_blocks.const_data_ptr<int64_t>();
  // Every position read must lie in a block of the cache: a bad table is an error, never a stray read.
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, op, ": sequence ", b, " has context length ",
                lens[b], ", its table holds ", max_blocks * block_size, " positions");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int64_t block = tables[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < slots / block_size, op, ": block id ", block, " is outside the cache");
    }
    longest = std::max(longest, lens[b]);
  }
  at::Tensor out = at::empty({batch, heads * dim}, q.options());
  const float* qp = q.const_data_ptr<float>();
  const float* cache = kv_cache.const_data_ptr<float>();
  float* op_out = out.mutable_data_ptr<float>();
  const int64_t group = heads / kv_heads;
  const bool avx2 = uses_avx2() && dim % 8 == 0;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(longest);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads;
      const Task task{cache + h * slots * dim, cache + (kv_heads + h) * slots * dim, tables + b * max_blocks,
                      block_size, lens[b], dim, static_cast<float>(scale)};
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = h * group + g;  // query heads h * group .. share kv head h
        const Head hd{qp + (b * heads + head) * dim, op_out + (b * heads + head) * dim};
#ifdef POCKETLLM_X86
        if (avx2) {
          head_avx2(task, hd, scores.data());
          continue;
        }
#endif
        head_scalar(task, hd, scores.data());
      }
    }
  });
  return out;
}

#undef POCKETLLM_FOR_EACH_POSITION

}  // namespace

TORCH_LIBRARY_FRAGMENT(pocketllm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor context_blocks, Tensor context_lens, "
        "int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pocketllm, CPU, m) { m.impl("paged_decode_attention", paged_decode_attention); }

}  // namespace pocketllm
