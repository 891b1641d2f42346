// AVX2 + FMA + F16C kernels, compiled with those flags alone (see CMakeLists.txt) and called only after the
// CPU was checked (isa.cpp). Integer dot products: maddubs (u8 x s8 -> s16 pairs), madd (-> s32).
#define PLLM_VNNI 0
#define PLLM_GEMM gemm_avx2
#define PLLM_TILE_ROWS 2  // weight rows per batched tile: 2 x 4 sums fit in 16 vector registers beside the operands
#define PLLM_TILE_ACT 2  // activation rows per batched tile: 2 x 2 sums and accumulators stay in registers
#include "kernels_x86.inl"

#include <algorithm>
#include <cmath>

namespace pocketllm::kernels {

void quantize_row_avx2(const float* x, int64_t cols, int8_t* qs, float* d, float* s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < cols / kBlock; ++b) {
        const float* v = x + b * kBlock;
        __m256 vals[4];
        __m256 amax = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) {
            vals[k] = _mm256_loadu_ps(v + 8 * k);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, vals[k]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float scale = _mm_cvtss_f32(m) / 127.0f;
        const __m256 inverse = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
        __m256i q[4];
        for (int k = 0; k < 4; ++k) {
            q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(vals[k], inverse),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        // int32 -> int8 in element order: the packs interleave 128-bit lanes, and the permute undoes it.
        const __m256i packed16a = _mm256_packs_epi32(q[0], q[1]), packed16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(packed16a, packed16b),
                                                           _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + b * kBlock), packed);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
        d[b] = scale;
        s[b] = scale * static_cast<float>(_mm_cvtsi128_si32(t));
    }
}

namespace {

void store_f16(const float* values, int64_t dim, void* out) {
    for (int64_t j = 0; j < dim; j += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(values + j), _MM_FROUND_TO_NEAREST_INT));
    }
}

void load_f16(const void* rows, int64_t count, int64_t dim, float* out) {
    const uint16_t* in = static_cast<const uint16_t*>(rows);
    for (int64_t i = 0; i < count * dim; i += 8) {
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
    }
}

// 8 values of a cached row from value i on, as float32: the cache's element type converted in registers (the rows
// are read where they are stored, with no float32 copy to write and read back).
template <KvType K>
inline __m256 load8(const void* rows, int64_t i) {
    if constexpr (K == KvType::F16) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(rows) + i)));
    } else {
        return _mm256_loadu_ps(static_cast<const float*>(rows) + i);
    }
}

// The 4 sums of 4 vectors' lanes, in order: a transpose by hadd (pairs of lanes, then pairs of pairs, in each half),
// then the halves added: one vector op per input instead of a full horizontal sum each. (A cheaper tree than
// kernels_x86.inl's hsum4, which must be hsum's: the attention scores need only be the same wherever computed.)
inline __m128 hadd_sums4(const __m256* v) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// R query rows against keys [0, whole) (a multiple of 4), 4 keys at a time: 4R dot products in registers, each key
// vector loaded once for the R rows (one row at a time loaded each key vector once per row). Each dot product: 8
// lanes over the dimension, then hadd_sums4's tree.
template <KvType K, int R>
void scores_rows(const float* q, const void* keys, int64_t whole, int64_t dim, float scale, float* out,
                 int64_t stride) {
    const __m128 factor = _mm_set1_ps(scale);
    for (int64_t k = 0; k < whole; k += 4) {
        __m256 acc[R][4];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
        }
        for (int64_t j = 0; j < dim; j += 8) {
            __m256 qv[R];
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) qv[r] = _mm256_loadu_ps(q + r * dim + j);
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
                const __m256 kv = load8<K>(keys, (k + c) * dim + j);
#pragma GCC unroll 16
                for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(qv[r], kv, acc[r][c]);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) _mm_storeu_ps(out + r * stride + k, _mm_mul_ps(hadd_sums4(acc[r]), factor));
    }
}

template <KvType K>
void scores(const float* q, int64_t nq, const void* keys, int64_t count, int64_t dim, float scale, float* out,
            int64_t stride) {
    const int64_t whole = count / 4 * 4;  // keys by hadd_sums4's tree; the last few by hsum's
    int64_t i = 0;
    for (; i + 3 <= nq; i += 3) scores_rows<K, 3>(q + i * dim, keys, whole, dim, scale, out + i * stride, stride);
    if (nq - i == 2) scores_rows<K, 2>(q + i * dim, keys, whole, dim, scale, out + i * stride, stride);
    if (nq - i == 1) scores_rows<K, 1>(q + i * dim, keys, whole, dim, scale, out + i * stride, stride);
    for (i = 0; i < nq; ++i) {
        const float* qi = q + i * dim;
        for (int64_t k = whole; k < count; ++k) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t j = 0; j < dim; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + j), load8<K>(keys, k * dim + j), acc);
            out[i * stride + k] = hsum(acc) * scale;
        }
    }
}

// R rows against 32 values of each value row (4 vectors) from column j: 4R sums in registers, each value vector
// loaded once for the R rows (one row at a time loaded it once per row, and its 8 chains of 4-cycle fused
// multiply-adds waited on each other).
template <KvType K, int R>
void accumulate_rows(const float* weights, int64_t weight_stride, const void* values, int64_t count, int64_t dim,
                     int64_t j, float* out, int64_t out_stride) {
    __m256 acc[R][4];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_loadu_ps(out + r * out_stride + j + 8 * c);
    }
    for (int64_t k = 0; k < count; ++k) {
        __m256 w[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) w[r] = _mm256_broadcast_ss(weights + r * weight_stride + k);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const __m256 v = load8<K>(values, k * dim + j + 8 * c);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(w[r], v, acc[r][c]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + r * out_stride + j + 8 * c, acc[r][c]);
    }
}

template <KvType K>
void accumulate(const float* weights, int64_t weight_stride, int64_t rows, const void* values, int64_t count,
                int64_t dim, float* out, int64_t out_stride) {
    int64_t j = 0;
    for (; j + 32 <= dim; j += 32) {
        int64_t r = 0;
        for (; r + 3 <= rows; r += 3) {
            accumulate_rows<K, 3>(weights + r * weight_stride, weight_stride, values, count, dim, j,
                                  out + r * out_stride, out_stride);
        }
        if (rows - r == 2) {
            accumulate_rows<K, 2>(weights + r * weight_stride, weight_stride, values, count, dim, j,
                                  out + r * out_stride, out_stride);
        }
        if (rows - r == 1) {
            accumulate_rows<K, 1>(weights + r * weight_stride, weight_stride, values, count, dim, j,
                                  out + r * out_stride, out_stride);
        }
    }
    for (; j < dim; j += 8) {  // dim is a multiple of 8
        for (int64_t r = 0; r < rows; ++r) {
            __m256 acc = _mm256_loadu_ps(out + r * out_stride + j);
            for (int64_t k = 0; k < count; ++k) {
                acc = _mm256_fmadd_ps(_mm256_set1_ps(weights[r * weight_stride + k]), load8<K>(values, k * dim + j), acc);
            }
            _mm256_storeu_ps(out + r * out_stride + j, acc);
        }
    }
}

float maximum(const float* x, int64_t count) {
    int64_t k = 0;
    float best = x[0];
    if (count >= 8) {
        __m256 m = _mm256_loadu_ps(x);
        for (k = 8; k + 8 <= count; k += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + k));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        best = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
    for (; k < count; ++k) best = std::max(best, x[k]);
    return best;
}

// exp over 8 lanes (Cephes' expf: 2^n times a degree-6 polynomial on [-ln2/2, ln2/2]; relative error ~1e-7).
inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365478515625f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    }
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

float exp_shifted(float* x, int64_t count, float shift) {
    __m256 total = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= count; k += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + k), _mm256_set1_ps(shift)));
        _mm256_storeu_ps(x + k, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = hsum(total);
    for (; k < count; ++k) sum += (x[k] = std::exp(x[k] - shift));
    return sum;
}

}  // namespace

namespace {
inline __m256 silu8(__m256 g) {
    const __m256 sigmoid = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                         _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    return _mm256_mul_ps(g, sigmoid);
}
}  // namespace

void silu_mul_avx2(float* gate, const float* up, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
    }
    silu_mul_scalar(gate + i, up + i, n - i);
}

void silu_avx2(float* x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, silu8(_mm256_loadu_ps(x + i)));
    silu_scalar(x + i, n - i);
}

Attention attention_avx2(KvType kv) {
    if (kv == KvType::F16) {
        return {store_f16, load_f16, scores<KvType::F16>, accumulate<KvType::F16>, maximum, exp_shifted};
    }
    const Attention scalar = attention_scalar(kv);
    return {scalar.store, scalar.load, scores<KvType::F32>, accumulate<KvType::F32>, maximum, exp_shifted};
}

}  // namespace pocketllm::kernels
