// AVX2 + FMA + F16C kernels, compiled with those flags alone (see CMakeLists.txt) and called only after the
// CPU was checked (isa.cpp). Integer dot products: maddubs (u8 x s8 -> s16 pairs), madd (-> s32).
#include <immintrin.h>

#include <cmath>

#include "pocketllm_cpp/matmul.h"

namespace pocketllm::kernels {
namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float half(uint16_t h) { return _cvtsh_ss(h); }

// The 32 codes of a 4-bit block in element order: bytes 0..15 the low nibbles, 16..31 the high ones.
inline __m256i unpack_nibbles(const uint8_t* qs) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

inline __m256 sum_products(__m256i unsigned_w, __m256i signed_x) {
    const __m256i pairs = _mm256_maddubs_epi16(unsigned_w, signed_x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

}  // namespace

void quantize_row_avx2(const float* x, int64_t cols, BlockQ8Act* out) {
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
        const float d = _mm_cvtss_f32(m) / 127.0f;
        const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        int32_t q[kBlock];
        __m256i total = _mm256_setzero_si256();
        for (int k = 0; k < 4; ++k) {
            const __m256 scaled = _mm256_round_ps(_mm256_mul_ps(vals[k], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i qi = _mm256_cvtps_epi32(scaled);
            total = _mm256_add_epi32(total, qi);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * k), qi);
        }
        for (int j = 0; j < kBlock; ++j) out[b].qs[j] = static_cast<int8_t>(q[j]);
        int32_t sums[8];
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums), total);
        int sum = 0;
        for (int32_t s : sums) sum += s;
        out[b].d = d;
        out[b].s = d * static_cast<float>(sum);
    }
}

namespace {

// One weight row against up to 4 activation rows at once: each block of the weight is loaded and unpacked once
// for all of them, and the 4 accumulators stay in registers.
template <int R>
void dot_block_rows(const WeightView& w, const uint8_t* base, const BlockQ8Act* act, int64_t nb, int64_t r0,
                    float* y, int64_t y_stride) {
    __m256 acc[R];
    float extra[R];
    for (int i = 0; i < R; ++i) {
        acc[i] = _mm256_setzero_ps();
        extra[i] = 0.0f;
    }
    for (int64_t b = 0; b < nb; ++b) {
        __m256i wq;
        float dw, mw = 0.0f;
        bool is_signed = false;
        if (w.type == QType::Q4_0) {
            const BlockQ4_0& blk = reinterpret_cast<const BlockQ4_0*>(base)[b];
            wq = unpack_nibbles(blk.qs);
            dw = half(blk.d);
            mw = -8.0f * dw;  // (q - 8) * d = q * d - 8 * d
        } else if (w.type == QType::Q4_1) {
            const BlockQ4_1& blk = reinterpret_cast<const BlockQ4_1*>(base)[b];
            wq = unpack_nibbles(blk.qs);
            dw = half(blk.d);
            mw = half(blk.m);
        } else {
            const BlockQ8_0& blk = reinterpret_cast<const BlockQ8_0*>(base)[b];
            wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs));
            dw = half(blk.d);
            is_signed = true;
        }
        const __m256i wabs = is_signed ? _mm256_sign_epi8(wq, wq) : wq;
        for (int i = 0; i < R; ++i) {
            const BlockQ8Act& a = act[(r0 + i) * nb + b];
            __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs));
            // maddubs wants an unsigned operand: |w| times x with w's sign (activations stay in [-127, 127]).
            if (is_signed) xq = _mm256_sign_epi8(xq, wq);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d), sum_products(wabs, xq), acc[i]);
            extra[i] += mw * a.s;  // the per-block offset of the 4-bit types
        }
    }
    for (int i = 0; i < R; ++i) y[(r0 + i) * y_stride] = hsum(acc[i]) + extra[i];
}

}  // namespace

void dot_rows_avx2(const WeightView& w, int64_t row, const BlockQ8Act* act, const float* x, int64_t n, float* y,
                   int64_t y_stride) {
    const int64_t nb = w.cols / kBlock;
    const uint8_t* base = w.data + row * static_cast<int64_t>(row_bytes(w.type, w.cols));
    if (is_block_type(w.type)) {
        int64_t r = 0;
        for (; r + 4 <= n; r += 4) dot_block_rows<4>(w, base, act, nb, r, y, y_stride);
        for (; r < n; ++r) dot_block_rows<1>(w, base, act, nb, r, y, y_stride);
        return;
    }
    for (int64_t r = 0; r < n; ++r) {
        const float* xr = x + r * w.cols;
        __m256 acc = _mm256_setzero_ps();
        if (w.type == QType::F32) {
            const float* wr = reinterpret_cast<const float*>(base);
            for (int64_t i = 0; i < w.cols; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(wr + i), _mm256_loadu_ps(xr + i), acc);
        } else {
            const uint16_t* wr = reinterpret_cast<const uint16_t*>(base);
            for (int64_t i = 0; i < w.cols; i += 8) {
                const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + i)));
                acc = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr + i), acc);
            }
        }
        y[r * y_stride] = hsum(acc);
    }
}

void dot_many_avx2(const float* q, const float* keys, int64_t count, int64_t dim, float* scores) {
    if (dim % 8 != 0) return dot_many_scalar(q, keys, count, dim, scores);
    for (int64_t i = 0; i < count; ++i) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < dim; j += 8) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(keys + i * dim + j), acc);
        }
        scores[i] = hsum(acc);
    }
}

void axpy_many_avx2(const float* weights, const float* values, int64_t count, int64_t dim, float* out) {
    if (dim % 8 != 0) return axpy_many_scalar(weights, values, count, dim, out);
    for (int64_t j = 0; j < dim; j += 8) {
        __m256 acc = _mm256_loadu_ps(out + j);
        for (int64_t i = 0; i < count; ++i) {
            acc = _mm256_fmadd_ps(_mm256_set1_ps(weights[i]), _mm256_loadu_ps(values + i * dim + j), acc);
        }
        _mm256_storeu_ps(out + j, acc);
    }
}

}  // namespace pocketllm::kernels
