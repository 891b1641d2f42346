// AVX2 + FMA + F16C kernels, compiled with those flags alone (see CMakeLists.txt) and called only after the
// CPU was checked (isa.cpp). Integer dot products: maddubs (u8 x s8 -> s16 pairs), madd (-> s32).
#define PLLM_VNNI 0
#define PLLM_GEMM gemm_avx2
#define PLLM_TILE_ROWS 2  // weight rows per tile: 2 x 4 sums fit in 16 vector registers beside the operands
#include "kernels_x86.inl"

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

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <typename T>
void dot_many(const float* q, const void* keys, int64_t count, int64_t dim, float* scores) {
    const T* k = static_cast<const T*>(keys);
    for (int64_t i = 0; i < count; ++i) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < dim; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k + i * dim + j), acc);
        scores[i] = hsum(acc);
    }
}

template <typename T>
void axpy_many(const float* weights, const void* values, int64_t count, int64_t dim, float* out) {
    const T* v = static_cast<const T*>(values);
    for (int64_t j = 0; j < dim; j += 8) {
        __m256 acc = _mm256_loadu_ps(out + j);
        for (int64_t i = 0; i < count; ++i) acc = _mm256_fmadd_ps(_mm256_set1_ps(weights[i]), load8(v + i * dim + j), acc);
        _mm256_storeu_ps(out + j, acc);
    }
}

void store_f16(const float* values, int64_t dim, void* out) {
    for (int64_t j = 0; j < dim; j += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(values + j), _MM_FROUND_TO_NEAREST_INT));
    }
}

}  // namespace

Attention attention_avx2(KvType kv) {
    const Attention scalar = attention_scalar(kv);
    if (kv == KvType::F16) return {dot_many<uint16_t>, axpy_many<uint16_t>, store_f16};
    return {dot_many<float>, axpy_many<float>, scalar.store};
}

}  // namespace pocketllm::kernels
