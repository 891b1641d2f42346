// AVX2 + FMA + F16C kernels, compiled with those flags alone (see CMakeLists.txt) and called only after the
// CPU was checked (isa.cpp). Integer dot products: maddubs (u8 x s8 -> s16 pairs), madd (-> s32).
#define PLLM_VNNI 0
#define PLLM_GEMM gemm_avx2
#define PLLM_TILE_ROWS 2  // weight rows per batched tile: 2 x 4 sums fit in 16 vector registers beside the operands
#define PLLM_TILE_ACT 2  // activation rows per batched tile: 2 x 2 sums and accumulators stay in registers
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

// The 8 sums of 8 vectors' lanes, in order: a transpose by hadd, one vector op per input instead of a full
// horizontal sum each.
inline __m256 hsum8(const __m256* v) {
    const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    // Lanes: [v0..v3 low halves, v0..v3 high halves] and the same for v4..v7: add the halves across.
    const __m256 low = _mm256_permute2f128_ps(s0123, s4567, 0x20), high = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(low, high);
}

void scores(const float* q, int64_t nq, const float* keys, int64_t count, int64_t dim, float scale, float* out) {
    const __m256 factor = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < nq; ++i) {
        const float* qi = q + i * dim;
        int64_t k = 0;
        for (; k + 8 <= count; k += 8) {
            __m256 acc[8];
            for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
            for (int64_t j = 0; j < dim; j += 8) {
                const __m256 qv = _mm256_loadu_ps(qi + j);
#pragma GCC unroll 8
                for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + (k + r) * dim + j), acc[r]);
            }
            _mm256_storeu_ps(out + i * count + k, _mm256_mul_ps(hsum8(acc), factor));
        }
        for (; k < count; ++k) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t j = 0; j < dim; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + j), _mm256_loadu_ps(keys + k * dim + j), acc);
            out[i * count + k] = hsum(acc) * scale;
        }
    }
}

// out += sum_k weights[k] * values[k] with out in CHUNKS registers: one broadcast per key, not one per 8 values.
template <int CHUNKS>
void accumulate_in_registers(const float* weights, const float* values, int64_t count, float* out) {
    __m256 acc[CHUNKS];
    for (int j = 0; j < CHUNKS; ++j) acc[j] = _mm256_loadu_ps(out + 8 * j);
    for (int64_t k = 0; k < count; ++k) {
        const __m256 w = _mm256_broadcast_ss(weights + k);
#pragma GCC unroll 16
        for (int j = 0; j < CHUNKS; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values + k * 8 * CHUNKS + 8 * j), acc[j]);
    }
    for (int j = 0; j < CHUNKS; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

void accumulate(const float* weights, const float* values, int64_t count, int64_t dim, float* out) {
    if (dim == 64) return accumulate_in_registers<8>(weights, values, count, out);
    if (dim == 128) return accumulate_in_registers<16>(weights, values, count, out);
    for (int64_t j = 0; j < dim; j += 8) {
        __m256 acc = _mm256_loadu_ps(out + j);
        for (int64_t k = 0; k < count; ++k) acc = _mm256_fmadd_ps(_mm256_set1_ps(weights[k]), _mm256_loadu_ps(values + k * dim + j), acc);
        _mm256_storeu_ps(out + j, acc);
    }
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
    const Attention scalar = attention_scalar(kv);
    if (kv == KvType::F16) return {store_f16, load_f16, scores, accumulate, exp_shifted};
    return {scalar.store, scalar.load, scores, accumulate, exp_shifted};
}

}  // namespace pocketllm::kernels
