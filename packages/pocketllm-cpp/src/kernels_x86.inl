// The x86 kernels, written once for 256-bit vectors and compiled twice: kernels_avx2.cpp (AVX2 + FMA + F16C:
// maddubs + madd for 8-bit dot products) and kernels_avx512.cpp (adding AVX-512 VL/BW/VNNI: one vpdpbusd, 32
// vector registers, so larger tiles). Each file defines PLLM_VNNI, PLLM_GEMM and PLLM_TILE_ROWS, then includes
// this; isa.cpp calls one only after checking the CPU's features.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace pocketllm::kernels {
namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float half(uint16_t h) { return _cvtsh_ss(h); }

// hsum of each of 4 vectors, in one vector's lanes, by the same tree (so the same bits): the halves added, then
// lanes 0 + 2 and 1 + 3, then those two. A third of the ops of 4 hsums, and one store.
inline __m128 hsum4(const __m256 (&v)[4]) {
    const __m256 u01 = _mm256_add_ps(_mm256_permute2f128_ps(v[0], v[1], 0x20), _mm256_permute2f128_ps(v[0], v[1], 0x31));
    const __m256 u23 = _mm256_add_ps(_mm256_permute2f128_ps(v[2], v[3], 0x20), _mm256_permute2f128_ps(v[2], v[3], 0x31));
    // Per half: [u0 or u1 lanes 0 + 2, 1 + 3, u2 or u3 lanes 0 + 2, 1 + 3].
    const __m256 z = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(u01), _mm256_castps_pd(u23))),
                                   _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(u01), _mm256_castps_pd(u23))));
    const __m256 sums = _mm256_hadd_ps(z, z);  // per half: [v0 or v1, v2 or v3, ...]
    return _mm_unpacklo_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// _mm256_hadd_epi32's result: per 128-bit half [a0 + a1, a2 + a3, b0 + b1, b2 + b3]. vphaddd has no EVEX form, so
// in the AVX-512 build, whose kernels hold their sums in ymm16-31, each one cost moves into ymm0-15; two shuffles
// and an add take any register. Measured on a Zen 4 (one row against a matrix in cache, two threads): Q4_K
// 1024 x 1024 24.5 -> 21.7 us, Q8_0 1536 x 576 22.9 -> 19.2. Integer sums: the same bits either way.
inline __m256i hadd32(__m256i a, __m256i b) {
#if PLLM_VNNI
    const __m256 fa = _mm256_castsi256_ps(a), fb = _mm256_castsi256_ps(b);
    return _mm256_add_epi32(_mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0x88)), _mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0xDD)));
#else
    return _mm256_hadd_epi32(a, b);
#endif
}

// Bytes of `v` shifted right by `bits`, masked to `mask`: 16-bit shifts leak the neighbour byte's bits into the
// top of each byte, and the mask drops them.
inline __m256i bits(__m256i v, int shift, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(static_cast<char>(mask)));
}

// Codes are int8 (the codebook types' values too), and no offset term.
template <StorageType T>
constexpr bool kSigned = T == StorageType::Q8_0 || T == StorageType::IQ4_NL || T == StorageType::MXFP4 ||
                        T == StorageType::IQ4_XS;
template <StorageType T>
constexpr bool kOffset = !kSigned<T>;

// A 32-value sub-block decoded into registers: w = dw * code + mw, as decode_sub_block defines it (Q2_K, Q3_K and
// Q6_K, whose per-16 scales this form lacks, have their own kernels below).
struct Sub {
    __m256i codes;
    float dw, mw;
};

// The 32 codes of a 4-bit block in element order: bytes 0..15 the low nibbles, 16..31 the high ones.
inline __m256i nibbles(const uint8_t* qs) {
    // The 16 bytes in both halves (one broadcast load), the upper half shifted: one shift, blend and mask.
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    return _mm256_and_si256(_mm256_blend_epi32(both, _mm256_srli_epi16(both, 4), 0xF0), _mm256_set1_epi8(0x0F));
}

// Each bit of 4 bytes (little-endian) as a byte of 0x10 where it is set: Q5_0/Q5_1's 5th bits in element order.
inline __m256i fifth_bits(const uint8_t* qh) {
    uint32_t bits32;
    std::memcpy(&bits32, qh, 4);
    // Byte i of the result takes byte i / 8 of the word; its bit i % 8 is then tested by or-ing all other bits in.
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits32)),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// A codebook type's 32 values in element order, each nibble looked up in the 16-entry table.
inline __m256i looked_up(const uint8_t* qs, const int8_t* values) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
    return _mm256_shuffle_epi8(table, nibbles(qs));
}

// A codebook's values plus 128 (mod 256, the bytes `biased` makes of them): looked up so, a block skips that add.
struct BiasedCodebook {
    int8_t values[16];
    constexpr explicit BiasedCodebook(const int8_t (&from)[16]) : values() {
        for (int i = 0; i < 16; ++i) values[i] = static_cast<int8_t>(static_cast<uint8_t>(from[i] + 128));
    }
};
constexpr BiasedCodebook kIQ4NLBiased(kIQ4NLValues), kMXFP4Biased(kMXFP4Values);

template <StorageType T>
inline Sub decode(const uint8_t* row, int64_t b) {
    Sub s;
    s.mw = 0.0f;
    if constexpr (T == StorageType::Q5_0 || T == StorageType::Q5_1) {
        // Unsigned codes 0..31 with the offset term: Q5_0's (q - 16) d = q d - 16 d.
        const uint8_t* blk = row + b * static_cast<int64_t>(T == StorageType::Q5_0 ? sizeof(BlockQ5_0)
                                                                                     : sizeof(BlockQ5_1));
        const int head = T == StorageType::Q5_0 ? 2 : 4;
        s.codes = _mm256_or_si256(nibbles(blk + head + 4), fifth_bits(blk + head));
        uint16_t d;
        std::memcpy(&d, blk, 2);
        s.dw = half(d);
        if constexpr (T == StorageType::Q5_0) {
            s.mw = -16.0f * s.dw;
        } else {
            uint16_t m;
            std::memcpy(&m, blk + 2, 2);
            s.mw = half(m);
        }
    } else if constexpr (T == StorageType::IQ4_NL) {
        const BlockIQ4_NL& blk = reinterpret_cast<const BlockIQ4_NL*>(row)[b];
        s.codes = looked_up(blk.qs, kIQ4NLValues);
        s.dw = half(blk.d);
    } else if constexpr (T == StorageType::MXFP4) {
        const BlockMXFP4& blk = reinterpret_cast<const BlockMXFP4*>(row)[b];
        s.codes = looked_up(blk.qs, kMXFP4Values);
        s.dw = mxfp4_scale(blk.e);
    } else if constexpr (T == StorageType::Q4_0) {
        const BlockQ4_0& blk = reinterpret_cast<const BlockQ4_0*>(row)[b];
        s.codes = nibbles(blk.qs);  // unsigned, with the offset term: (q - 8) d = q d - 8 d
        s.dw = half(blk.d);
        s.mw = -8.0f * s.dw;
    } else if constexpr (T == StorageType::Q4_1) {
        const BlockQ4_1& blk = reinterpret_cast<const BlockQ4_1*>(row)[b];
        s.codes = nibbles(blk.qs);
        s.dw = half(blk.d);
        s.mw = half(blk.m);
    } else {
        static_assert(T == StorageType::Q8_0);
        const BlockQ8_0& blk = reinterpret_cast<const BlockQ8_0*>(row)[b];
        s.codes = load(blk.qs);
        s.dw = half(blk.d);
    }
    return s;
}

// Weights stream from memory once per step; the hardware prefetcher alone falls behind kernels that spend a few
// cycles per block, so each block asks for the bytes a fixed distance ahead (into the next rows at a row's end).
// Measured on the default model's shapes: 512-1024 bytes ahead doubles Q8_0's rate from DRAM; 4096 is too far.
constexpr int64_t kPrefetchBytes = 1024;

// Decode's distance: the same block 4 rows on (the next group's) where rows are wide, since 1 KB ahead stays inside
// the row being read. Measured on a Zen 4 (one row against a cold matrix, two threads, interleaved with the 1 KB
// build): Q4_K 1024 x 3584 17 -> 26 GB/s and 1024 x 2048 20 -> 25, Q6_K 1024 x 3584 21 -> 26 and its
// 16384 x 1024 30 -> 35; Q8_0 576 x 1536 42 -> 30 us, Q4_0 and Q5_0 576 x 1536 0.83-0.92x. Rows of under 768
// bytes (the default model's 576-wide rows) measured 1.0-1.05x slower so, and keep 1 KB.
inline int64_t decode_prefetch_distance(size_t stride) {
    return stride >= 768 ? 4 * static_cast<int64_t>(stride) : kPrefetchBytes;
}

// A block's bytes `distance` further on, asked for into L1.
template <typename Block>
inline void prefetch_ahead(const Block& blk, int64_t distance) {
    const char* ahead = reinterpret_cast<const char*>(&blk) + distance;
    for (size_t at = 0; at < sizeof(blk); at += 64) _mm_prefetch(ahead + at, _MM_HINT_T0);
}

template <StorageType T>
constexpr int64_t kStorageBytes = T == StorageType::Q4_0     ? sizeof(BlockQ4_0)
                                  : T == StorageType::Q4_1   ? sizeof(BlockQ4_1)
                                  : T == StorageType::Q5_0   ? sizeof(BlockQ5_0)
                                  : T == StorageType::Q5_1   ? sizeof(BlockQ5_1)
                                  : T == StorageType::IQ4_NL ? sizeof(BlockIQ4_NL)
                                  : T == StorageType::MXFP4  ? sizeof(BlockMXFP4)
                                                             : sizeof(BlockQ8_0);

template <StorageType T>
constexpr bool kBlock32 = T == StorageType::Q4_0 || T == StorageType::Q4_1 || T == StorageType::Q8_0 ||
                          T == StorageType::Q5_0 || T == StorageType::Q5_1 || T == StorageType::IQ4_NL ||
                          T == StorageType::MXFP4;

// The fp16 scales of 8 consecutive 32-value blocks (each block's first 4 bytes: d, and m for Q4_1 and Q5_1; MXFP4's
// first byte is its E8M0 exponent) as two float vectors in two conversions, instead of two scalar conversions per
// block. The heads are read by 8 scalar loads: a vpgatherdd cost more on Zen 4 (a 1536 x 576 matrix at one row,
// in L2: Q4_0 19.1 -> 17.6 us, IQ4_NL 22.4 -> 19.6, Q8_0 17.8 -> 15.6).
template <StorageType T>
inline void scales8(const uint8_t* row, int64_t b0, float* dw, float* mw) {
    // Loaded in pairs and the pairs unpacked, written out: from `_mm256_setr_epi32` of 8 ints, GCC made Q4_0 that
    // and Q4_1 8 stack stores read back as one vector, a store-forwarding stall per group (a 1536 x 576 matrix at
    // one row, in L2: Q4_1 28 -> 17 us, Q5_1 31 -> 24).
    const auto pair = [&](int k) {
        int32_t first, second;
        std::memcpy(&first, row + (b0 + k) * kStorageBytes<T>, 4);
        std::memcpy(&second, row + (b0 + k + 1) * kStorageBytes<T>, 4);
        return _mm_insert_epi32(_mm_cvtsi32_si128(first), second, 1);
    };
    const __m128i low = _mm_unpacklo_epi64(pair(0), pair(2)), high = _mm_unpacklo_epi64(pair(4), pair(6));
    const __m256i heads = _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);
    if constexpr (T == StorageType::MXFP4) {  // mxfp4_scale of each exponent: 2^(e - 128), subnormal below e = 2
        const __m256i e = _mm256_and_si256(heads, _mm256_set1_epi32(0xFF));
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
        _mm256_store_ps(dw, _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small)));
        return;
    }
    // Each 32-bit head's low (d) or high (m) 16 bits, packed into 8 halves in order.
    auto halves = [&](int high) {
        const __m256i pick = _mm256_setr_epi8(0 + high, 1 + high, 4 + high, 5 + high, 8 + high, 9 + high, 12 + high, 13 + high,
                                              -1, -1, -1, -1, -1, -1, -1, -1, 0 + high, 1 + high, 4 + high, 5 + high,
                                              8 + high, 9 + high, 12 + high, 13 + high, -1, -1, -1, -1, -1, -1, -1, -1);
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(heads, pick), _MM_SHUFFLE(3, 1, 2, 0));
        return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
    };
    const __m256 d = halves(0);
    _mm256_store_ps(dw, d);
    if constexpr (T == StorageType::Q4_1 || T == StorageType::Q5_1) _mm256_store_ps(mw, halves(2));
    if constexpr (T == StorageType::Q4_0) _mm256_store_ps(mw, _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)));  // (q - 8) d
    if constexpr (T == StorageType::Q5_0) _mm256_store_ps(mw, _mm256_mul_ps(d, _mm256_set1_ps(-16.0f)));
}

template <StorageType T>
inline void prefetch(const uint8_t* row, int64_t b, int64_t distance = kPrefetchBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(row + b * kStorageBytes<T> + distance), _MM_HINT_T0);
}

// acc + sum(w8 * x) of unsigned codes w8 and signed x, in 8 int32 lanes of 4 products each.
inline __m256i udot(__m256i w8, __m256i x, __m256i acc = _mm256_setzero_si256()) {
#if PLLM_VNNI
    return _mm256_dpbusd_epi32(acc, w8, x);
#else
    const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(w8, x), _mm256_set1_epi16(1));  // |pairs| <= 2 * 128 * 127
    return _mm256_add_epi32(acc, sums);
#endif
}

// sum(code * x) in 8 int32 lanes; `unsigned_codes` is |code| for the signed storage types, whose sign moves onto x.
template <StorageType T>
inline __m256i dot32(const Sub& s, __m256i unsigned_codes, __m256i x) {
    if constexpr (kSigned<T>) x = _mm256_sign_epi8(x, s.codes);
    return udot(unsigned_codes, x);
}

// rows[j] lane k becomes rows[k] lane j: an 8 x 8 transpose of 32-bit lanes.
inline void transpose8(__m256i (&rows)[8]) {
    __m256i t[8], u[8];
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_epi32(rows[j], rows[j + 1]);
        t[j + 1] = _mm256_unpackhi_epi32(rows[j], rows[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
        u[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);
        u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);
        u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]);
        u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]);
    }
    for (int j = 0; j < 4; ++j) {
        rows[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
        rows[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
    }
}

// Lane k: the sum of sums[k]'s 8 lanes (8 blocks' integer dot products), by one hadd tree.
inline __m256i block_sums(const __m256i (&sums)[8]) {
    const __m256i p01 = hadd32(sums[0], sums[1]), p23 = hadd32(sums[2], sums[3]);
    const __m256i p45 = hadd32(sums[4], sums[5]), p67 = hadd32(sums[6], sums[7]);
    // Blocks 0-3 and 4-7 in each 128-bit half, added across the halves.
    const __m256i low4 = hadd32(p01, p23), high4 = hadd32(p45, p67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(low4, high4, 0x20), _mm256_permute2x128_si256(low4, high4, 0x31));
}

// With VNNI, the signed types' integer dot products take w + 128 (0..255: vpdpbusd's products of those with 8-bit
// activations fit its int32 lanes, where maddubs' int16 pairs would not), and 128 times each block's activation sum
// comes off the block sums: one byte add per block instead of two sign moves (|w|, and w's sign onto x). The block
// sums are the same integers either way, so every path's results stay the same bits.
template <StorageType T>
constexpr bool kBiased = PLLM_VNNI && kSigned<T>;

inline __m256i biased(__m256i codes) { return _mm256_add_epi8(codes, _mm256_set1_epi8(static_cast<char>(-128))); }

// Block b's codes plus 128 (kBiased): the codebook types' looked up so.
template <StorageType T>
inline __m256i biased_codes(const uint8_t* row, int64_t b) {
    if constexpr (T == StorageType::IQ4_NL) {
        return looked_up(reinterpret_cast<const BlockIQ4_NL*>(row)[b].qs, kIQ4NLBiased.values);
    } else if constexpr (T == StorageType::MXFP4) {
        return looked_up(reinterpret_cast<const BlockMXFP4*>(row)[b].qs, kMXFP4Biased.values);
    } else {
        return biased(decode<T>(row, b).codes);
    }
}

// A block's codes as the batched paths' integer dot takes them: w + 128 (kBiased), |w| with its signs kept apart
// (the other signed types), or the unsigned codes themselves.
template <StorageType T>
inline __m256i dot_codes(__m256i codes) {
    if constexpr (kBiased<T>) return biased(codes);
    if constexpr (kSigned<T>) return _mm256_sign_epi8(codes, codes);
    return codes;
}

// Lane k: the sum of activation row r's codes in block b0 + k (from its per-16 sums), for the biased groups.
inline __m256i block_code_sums(const QuantizedRows& act, int64_t r, int64_t b0) {
    const __m256i sums16 = load(act.sums16.data() + r * (act.cols / 16) + 2 * b0);
    return _mm256_madd_epi16(sums16, _mm256_set1_epi16(1));
}

// The sum of v's 8 int32 lanes (exact).
inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

// A row's blocks after its last whole group of 8 are its tail (the last 2 of a 576-value row's 18). Each tail block
// adds its exact integer dot product times its scale, one fused multiply-add after another from zero, and the
// row's result is (groups + tail) + offsets. The decode path (tile) and the batched one (tail_rows) compute exactly
// that, each its own way, so that a row's results are the same bits in both.

// C weight rows from `row` against the one activation row, each decoded block used from registers: the decode path
// of the 32-value block types. Groups of 8 blocks: per weight row 8 integer dot products with the activation row
// summed across lanes by one hadd tree, converted and scaled as one vector of 8 block scales (instead of a
// conversion, a broadcast and a scalar offset per block); then the tail's blocks one by one.
template <StorageType T, int C>
void tile(const WeightView& w, size_t stride, int64_t row, const QuantizedRows& act, float* y) {
    const int64_t ahead = decode_prefetch_distance(stride);
    const uint8_t* base = w.data + row * static_cast<int64_t>(stride);
    __m256 acc[C];
    float tail[C], extra[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
        acc[c] = _mm256_setzero_ps();
        tail[c] = extra[c] = 0.0f;
    }
    const int64_t nb = w.cols / kBlock, full = nb / 8 * 8;
    for (int64_t b0 = 0; b0 < full; b0 += 8) {
        alignas(32) float dw[C][8], mw[C][8];
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) {
            scales8<T>(base + c * stride, b0, dw[c], mw[c]);
            __m256i sums[8];
            for (int k = 0; k < 8; ++k) {
                prefetch<T>(base + c * stride, b0 + k, ahead);
                __m256i x = load(act.codes(0, b0 + k));
                if constexpr (kBiased<T>) {
                    sums[k] = udot(biased_codes<T>(base + c * stride, b0 + k), x);
                    continue;
                }
                const Sub sub = decode<T>(base + c * stride, b0 + k);
                if constexpr (kSigned<T>) x = _mm256_sign_epi8(x, sub.codes);
                sums[k] = udot(kSigned<T> ? _mm256_sign_epi8(sub.codes, sub.codes) : sub.codes, x);
            }
            __m256i blocks = block_sums(sums);
            if constexpr (kBiased<T>) blocks = _mm256_sub_epi32(blocks, _mm256_slli_epi32(block_code_sums(act, 0, b0), 7));
            const __m256 scale = _mm256_mul_ps(_mm256_load_ps(dw[c]), _mm256_loadu_ps(act.d.data() + b0));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(blocks), scale, acc[c]);
            if constexpr (kOffset<T>) {
                acc[c] = _mm256_fmadd_ps(_mm256_load_ps(mw[c]), _mm256_loadu_ps(act.s.data() + b0), acc[c]);
            }
        }
    }
    __m128 tail4 = _mm_setzero_ps(), extra4 = _mm_setzero_ps();  // C = 4: the 4 rows' tails and offsets in lanes
    for (int64_t b = full; b < nb; ++b) {
        const __m256i xq = load(act.codes(0, b));
        const float dx = act.scale(0, b);
        const float sx = kOffset<T> ? act.offset(0, b) : 0.0f;
        __m256i dots[C];
        float dw[C], mw[C];
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) {
            prefetch<T>(base + c * stride, b, ahead);
            const Sub sub = decode<T>(base + c * stride, b);
            dots[c] = dot32<T>(sub, kSigned<T> ? _mm256_sign_epi8(sub.codes, sub.codes) : sub.codes, xq);
            dw[c] = sub.dw;
            mw[c] = sub.mw;
        }
        if constexpr (C == 4) {  // the 4 dot products' sums side by side (one hadd tree), then as the scalar steps
            const __m256i sums = hadd32(hadd32(dots[0], dots[1]), hadd32(dots[2], dots[3]));
            const __m128i lanes = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
            // Scales and offsets from registers: 4 scalar stores read back as one vector would miss store forwarding.
            const __m128 scales = _mm_mul_ps(_mm_setr_ps(dw[0], dw[1], dw[2], dw[3]), _mm_set1_ps(dx));
            tail4 = _mm_fmadd_ps(_mm_cvtepi32_ps(lanes), scales, tail4);
            if constexpr (kOffset<T>) extra4 = _mm_fmadd_ps(_mm_setr_ps(mw[0], mw[1], mw[2], mw[3]), _mm_set1_ps(sx), extra4);
        } else {
            for (int c = 0; c < C; ++c) {
                tail[c] = std::fma(static_cast<float>(hsum_epi32(dots[c])), dw[c] * dx, tail[c]);
                if constexpr (kOffset<T>) extra[c] = std::fma(mw[c], sx, extra[c]);
            }
        }
    }
    if constexpr (C == 4) {  // lane by lane, as the scalar sums below
        __m128 out = _mm_add_ps(hsum4(acc), tail4);
        if constexpr (kOffset<T>) out = _mm_add_ps(out, extra4);
        _mm_storeu_ps(y + row, out);
    } else {
        for (int c = 0; c < C; ++c) y[row + c] = kOffset<T> ? hsum(acc[c]) + tail[c] + extra[c] : hsum(acc[c]) + tail[c];
    }
}

// The 8 sub-blocks' 6-bit scales and mins of a Q4_K/Q5_K block as float lanes, k_scale_min for all 8 at once:
// bytes 0-3 of the 12 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the
// mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble).
inline void k_scales8(const uint8_t* q, __m256& scales, __m256& mins) {
    uint32_t u[3];
    std::memcpy(u, q, sizeof(u));
    constexpr uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, low2 = 0x03030303;
    const uint64_t sc = (u[0] & low6) | static_cast<uint64_t>((u[2] & low4) | (((u[0] >> 6) & low2) << 4)) << 32;
    const uint64_t mn = (u[1] & low6) | static_cast<uint64_t>(((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4)) << 32;
    scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(sc))));
    mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(mn))));
}

template <StorageType T>
using KBlock = std::conditional_t<T == StorageType::Q4_K, BlockQ4_K,
                                  std::conditional_t<T == StorageType::Q5_K, BlockQ5_K, BlockIQ4_XS>>;

// A 256-value block's 8 sub-blocks of codes (Q4_K/Q5_K: unsigned, its nibbles unpacked with one mask and one shift
// per 64 values; IQ4_XS: the codebook's signed values, or with VNNI those plus 128 as the integer dots take them:
// kBiased) and their scales dw and offsets mw (w = dw * code + mw, decode_sub_block's form) as 8 float lanes.
template <StorageType T>
inline void k_block(const KBlock<T>& blk, __m256i (&codes)[8], __m256& dw, __m256& mw) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i high = _mm256_setzero_si256();
    if constexpr (T == StorageType::Q5_K) high = load(blk.qh);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // sub-blocks 2i (low nibbles) and 2i + 1 (high nibbles)
        const __m256i q = load(blk.qs + 32 * i);
        codes[2 * i] = _mm256_and_si256(q, low4);
        codes[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        if constexpr (T == StorageType::Q5_K) {  // sub-block j's 5th bits: bit j of qh's bytes
            codes[2 * i] = _mm256_or_si256(codes[2 * i], _mm256_slli_epi16(bits(high, 2 * i, 1), 4));
            codes[2 * i + 1] = _mm256_or_si256(codes[2 * i + 1], _mm256_slli_epi16(bits(high, 2 * i + 1, 1), 4));
        }
    }
    __m256 scales, mins;
    k_scales8(blk.scales, scales, mins);
    dw = _mm256_mul_ps(_mm256_set1_ps(half(blk.d)), scales);
    mw = _mm256_mul_ps(_mm256_set1_ps(-half(blk.dmin)), mins);
}

template <>
inline void k_block<StorageType::IQ4_XS>(const BlockIQ4_XS& blk, __m256i (&codes)[8], __m256& dw, __m256& mw) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
        codes[j] = looked_up(blk.qs + 16 * j, kBiased<StorageType::IQ4_XS> ? kIQ4NLBiased.values : kIQ4NLValues);
    }
    // iq4_xs_scale of the 8 sub-blocks in lanes: sub-block j's low 4 bits are bits 4j..4j + 3 of scales_l's word,
    // its high 2 bits bits 2j, 2j + 1 of scales_h. (8 scalar results stored and read back as one vector stalled
    // store forwarding: a 576 x 1536 matrix at one row, in L2, 20.0 -> 17.7 us; 2048 x 1536 64.9 -> 56.7 us.)
    uint32_t low;
    std::memcpy(&low, blk.scales_l, sizeof low);
    const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(low)),
                                                               _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                             _mm256_set1_epi32(0xF));
    const __m256i pairs = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(blk.scales_h),
                                                             _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                           _mm256_set1_epi32(3));
    const __m256i scales = _mm256_sub_epi32(_mm256_or_si256(nibbles, _mm256_slli_epi32(pairs, 4)), _mm256_set1_epi32(32));
    // d * (s - 32) rounded once per sub-block, as decode_sub_block (and gguf) compute it.
    dw = _mm256_mul_ps(_mm256_set1_ps(half(blk.d)), _mm256_cvtepi32_ps(scales));
    mw = _mm256_setzero_ps();
}

// Decode (one activation row) for Q4_K and Q5_K: C weight rows a 256-value block at a time (k_block), rather
// than sub-block by sub-block. The arithmetic is tile<T, C>'s groups of 8 blocks (a block is one group), so
// the results are those of the batched path's packed_tile bit for bit.
template <StorageType T, int C>
void k_rows(const WeightView& w, size_t stride, int64_t row, const QuantizedRows& act, float* y) {
    const int64_t ahead = decode_prefetch_distance(stride);
    const uint8_t* base = w.data + row * static_cast<int64_t>(stride);
    __m256 acc[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    const int64_t supers = w.cols / kSuper;
    for (int64_t k = 0; k < supers; ++k) {
        const int8_t* x = act.codes(0, 8 * k);
        const __m256 dx = _mm256_loadu_ps(act.d.data() + 8 * k), sx = _mm256_loadu_ps(act.s.data() + 8 * k);
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) {
            __m256i codes[8], sums[8];
            __m256 dw, mw;
            const KBlock<T>& blk = reinterpret_cast<const KBlock<T>*>(base + c * stride)[k];
            prefetch_ahead(blk, ahead);
            k_block<T>(blk, codes, dw, mw);
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) {
                const __m256i xj = load(x + j * kBlock);
                sums[j] = kBiased<T>   ? udot(codes[j], xj)  // k_block's codes are biased already
                          : kSigned<T> ? udot(_mm256_sign_epi8(codes[j], codes[j]), _mm256_sign_epi8(xj, codes[j]))
                                       : udot(codes[j], xj);
            }
            __m256i blocks = block_sums(sums);
            if constexpr (kBiased<T>) blocks = _mm256_sub_epi32(blocks, _mm256_slli_epi32(block_code_sums(act, 0, 8 * k), 7));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(blocks), _mm256_mul_ps(dw, dx), acc[c]);
            acc[c] = _mm256_fmadd_ps(mw, sx, acc[c]);
        }
    }
    if constexpr (C == 4) {
        _mm_storeu_ps(y + row, hsum4(acc));
    } else {
        for (int c = 0; c < C; ++c) y[row + c] = hsum(acc[c]);
    }
}

// Batched products (prefill, several sequences decoding): C weight rows are decoded once for all n activation
// rows, not once per tile of them. Per group of 8 blocks: the codes as the integer dot takes them (|w| for the
// signed storage types, their signs apart) and the blocks' scales and offsets. A full group's codes are transposed by
// 4-byte words, as the activations' `grouped` plane is: vector v holds word v of each of the 8 blocks, so that
// 8 accumulating dot products leave each block's sum in its own lane. A last, partial group keeps block order.
//
// With VNNI, a full group of a signed type holds w + 128 instead (kBiased): no sign moves onto x per product, and
// pairs of rows take 512-bit vectors.

template <StorageType T, int C>
struct PackedGroup {
    alignas(64) uint8_t codes[8][C][kBlock];  // [word or block][weight row]: two rows' vectors side by side
    alignas(64) int8_t signs[8][kSigned<T> ? C : 1][kBlock];
    alignas(64) float dw[C][8], mw[C][8];
};

// The whole groups of blocks [0, full) of C weight rows.
template <StorageType T, int C>
void pack(const uint8_t* base, size_t stride, int64_t full, PackedGroup<T, C>* groups) {
    for (int64_t b0 = 0; b0 < full; b0 += 8) {
        PackedGroup<T, C>& p = groups[b0 / 8];
        for (int c = 0; c < C; ++c) {
            const uint8_t* row = base + c * stride;
            __m256i codes[8], signs[8];
            if constexpr (!kBlock32<T>) {  // a group is one whole 256-value block (cols are a multiple of 256)
                __m256 dw, mw;
                const KBlock<T>& blk = reinterpret_cast<const KBlock<T>*>(row)[b0 / 8];
                prefetch_ahead(blk, kPrefetchBytes);
                k_block<T>(blk, codes, dw, mw);
                _mm256_store_ps(p.dw[c], dw);
                _mm256_store_ps(p.mw[c], mw);
                for (int k = 0; k < 8; ++k) {
                    signs[k] = codes[k];
                    if constexpr (!kBiased<T>) codes[k] = dot_codes<T>(codes[k]);  // k_block biased them already
                }
            } else {
                scales8<T>(row, b0, p.dw[c], p.mw[c]);
                for (int64_t k = 0; k < 8; ++k) {
                    prefetch<T>(row, b0 + k);
                    const Sub sub = decode<T>(row, b0 + k);
                    codes[k] = dot_codes<T>(sub.codes);
                    signs[k] = sub.codes;
                }
            }
            transpose8(codes);
            if constexpr (kSigned<T>) transpose8(signs);
            for (int k = 0; k < 8; ++k) {
                _mm256_store_si256(reinterpret_cast<__m256i*>(p.codes[k][c]), codes[k]);
                if constexpr (kSigned<T>) _mm256_store_si256(reinterpret_cast<__m256i*>(p.signs[k][c]), signs[k]);
            }
        }
    }
}

#if PLLM_VNNI
// The batched tiles' 512-bit form: weight rows c and c + 1 side by side in one vector (lanes 0-7 and 8-15), the
// activations' 8 lanes in both halves. Each half does exactly what the 256-bit tile does to that row, so the bits
// are the same, with half the instructions (Zen 4 splits a 512-bit op into two 256-bit ones, so the win there is
// in issue, not in arithmetic).
inline __m512i both_halves(const void* p) { return _mm512_broadcast_i64x4(load(p)); }
inline __m512i both_halves(__m256i v) { return _mm512_broadcast_i64x4(v); }
inline __m512 both_halves(__m256 v) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v))); }
inline __m256 low_half(__m512 v) { return _mm512_castps512_ps256(v); }
inline __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
template <StorageType T, int C>
constexpr bool kPairs = C % 2 == 0 && (!kSigned<T> || kBiased<T>);  // vpsignb has no 512-bit form

// packed_tile's full groups, two weight rows a vector; acc receives the halves.
template <StorageType T, int R, int C>
void packed_pairs(const PackedGroup<T, C>* groups, int64_t full, const QuantizedRows& act, int64_t r0,
                  __m256 (&acc)[R][C]) {
    constexpr int P = C / 2;
    const int64_t nb = act.blocks_per_row();
    __m512 pairs[R][P];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
        for (int q = 0; q < P; ++q) pairs[i][q] = _mm512_setzero_ps();
    }
    for (int64_t b0 = 0; b0 < full; b0 += 8) {
        const PackedGroup<T, C>& p = groups[b0 / 8];
        __m512i sums[R][P];
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
            for (int q = 0; q < P; ++q) sums[i][q] = _mm512_setzero_si512();
        }
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) {
            __m512i wv[P];
#pragma GCC unroll 16
            for (int q = 0; q < P; ++q) wv[q] = _mm512_load_si512(p.codes[v][2 * q]);
#pragma GCC unroll 16
            for (int i = 0; i < R; ++i) {
                const __m512i x = both_halves(act.grouped.data() + (r0 + i) * act.cols + b0 * kBlock + v * kBlock);
#pragma GCC unroll 16
                for (int q = 0; q < P; ++q) sums[i][q] = _mm512_dpbusd_epi32(sums[i][q], wv[q], x);
            }
        }
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            const int64_t at = (r0 + i) * nb + b0;
            const __m512 dx = both_halves(_mm256_loadu_ps(act.d.data() + at));
            const __m512 sx = both_halves(_mm256_loadu_ps(act.s.data() + at));
            if constexpr (kBiased<T>) {  // the codes' 128 times each block's activation sum comes off
                const __m512i offset = both_halves(_mm256_slli_epi32(block_code_sums(act, r0 + i, b0), 7));
#pragma GCC unroll 16
                for (int q = 0; q < P; ++q) sums[i][q] = _mm512_sub_epi32(sums[i][q], offset);
            }
#pragma GCC unroll 16
            for (int q = 0; q < P; ++q) {
                const __m512 scale = _mm512_mul_ps(_mm512_load_ps(p.dw[2 * q]), dx);
                pairs[i][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i][q]), scale, pairs[i][q]);
                if constexpr (kOffset<T>) pairs[i][q] = _mm512_fmadd_ps(_mm512_load_ps(p.mw[2 * q]), sx, pairs[i][q]);
            }
        }
    }
    for (int i = 0; i < R; ++i) {
        for (int q = 0; q < P; ++q) {
            acc[i][2 * q] = low_half(pairs[i][q]);
            acc[i][2 * q + 1] = high_half(pairs[i][q]);
        }
    }
}
#endif

// R activation rows from `r0` against C packed weight rows' whole groups, each row with the arithmetic of
// tile<T, C> (the decode path): groups of 8 blocks as one vector of integer block sums (exact, however they are
// summed), scaled and offset as vectors; a tail is added after (tail_rows). A row's result is then the same bits
// whatever rows share its product, so that a request's logits, and its seeded samples, do not depend on what else
// runs in its step.
template <StorageType T, int R, int C>
void packed_tile(const PackedGroup<T, C>* groups, int64_t nb, const QuantizedRows& act, int64_t r0, float* y,
                 int64_t y_stride, int64_t row) {
    __m256 acc[R][C];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) acc[i][c] = _mm256_setzero_ps();
    }
    const int64_t full = nb / 8 * 8;
#if PLLM_VNNI
    if constexpr (kPairs<T, C>) packed_pairs<T, R, C>(groups, full, act, r0, acc);
    for (int64_t b0 = 0; b0 < (kPairs<T, C> ? 0 : full); b0 += 8) {
#else
    for (int64_t b0 = 0; b0 < full; b0 += 8) {
#endif
        const PackedGroup<T, C>& p = groups[b0 / 8];
        // Lane k of sums[i][c]: block k's dot product (both sides transposed). Word by word, each of the C weight
        // vectors and R activation vectors is loaded once for all R x C products, not once per product.
        __m256i sums[R][C];
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
            for (int c = 0; c < C; ++c) sums[i][c] = _mm256_setzero_si256();
        }
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) {
            __m256i wv[C];
#pragma GCC unroll 16
            for (int c = 0; c < C; ++c) wv[c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(p.codes[v][c]));
#pragma GCC unroll 16
            for (int i = 0; i < R; ++i) {
                const __m256i x = load(act.grouped.data() + (r0 + i) * act.cols + b0 * kBlock + v * kBlock);
#pragma GCC unroll 16
                for (int c = 0; c < C; ++c) {
                    constexpr bool sign = kSigned<T> && !kBiased<T>;
                    sums[i][c] = udot(wv[c], sign ? _mm256_sign_epi8(x, load(p.signs[v][c])) : x, sums[i][c]);
                }
            }
        }
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            const int64_t at = (r0 + i) * nb + b0;
            const __m256 dx = _mm256_loadu_ps(act.d.data() + at);
            if constexpr (kBiased<T>) {  // as packed_pairs
                const __m256i offset = _mm256_slli_epi32(block_code_sums(act, r0 + i, b0), 7);
#pragma GCC unroll 16
                for (int c = 0; c < C; ++c) sums[i][c] = _mm256_sub_epi32(sums[i][c], offset);
            }
#pragma GCC unroll 16
            for (int c = 0; c < C; ++c) {
                const __m256 scale = _mm256_mul_ps(_mm256_load_ps(p.dw[c]), dx);
                acc[i][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][c]), scale, acc[i][c]);
                if constexpr (kOffset<T>) {
                    acc[i][c] = _mm256_fmadd_ps(_mm256_load_ps(p.mw[c]), _mm256_loadu_ps(act.s.data() + at), acc[i][c]);
                }
            }
        }
    }
    for (int i = 0; i < R; ++i) {
        if constexpr (C == 4) {
            _mm_storeu_ps(y + (r0 + i) * y_stride + row, hsum4(acc[i]));
        } else {
            for (int c = 0; c < C; ++c) y[(r0 + i) * y_stride + row + c] = hsum(acc[i][c]);
        }
    }
}

// The tail blocks (at most 7) of C weight rows, each as the dot product takes it: w + 128 for the biased types, |w|
// with w kept for its signs for the other signed ones.
template <StorageType T, int C>
struct TailBlocks {
    alignas(32) uint8_t codes[C][7][kBlock];
    alignas(32) int8_t signs[kSigned<T> ? C : 1][7][kBlock];
    float dw[C][7], mw[C][7];
};

// rows[i] = lane i of each of v[0..3]: a 4 x 8 transpose.
inline void transpose4x8(const __m256 (&v)[4], __m128 (&rows)[8]) {
    const __m256 lo01 = _mm256_unpacklo_ps(v[0], v[1]), hi01 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 lo23 = _mm256_unpacklo_ps(v[2], v[3]), hi23 = _mm256_unpackhi_ps(v[2], v[3]);
    // Rows (0, 4), (1, 5), (2, 6), (3, 7) in the low and high halves.
    const __m256 r04 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(lo01), _mm256_castps_pd(lo23)));
    const __m256 r15 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(lo01), _mm256_castps_pd(lo23)));
    const __m256 r26 = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(hi01), _mm256_castps_pd(hi23)));
    const __m256 r37 = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(hi01), _mm256_castps_pd(hi23)));
    const __m256 pairs[4] = {r04, r15, r26, r37};
    for (int i = 0; i < 4; ++i) {
        rows[i] = _mm256_castps256_ps128(pairs[i]);
        rows[i + 4] = _mm256_extractf128_ps(pairs[i], 1);
    }
}

inline __m256i broadcast_word(const void* p) {
    int32_t word;
    std::memcpy(&word, p, 4);
    return _mm256_set1_epi32(word);
}

// Adds the tail of C weight rows from `row` to y (which holds their groups' sums: packed_tile) for all n activation
// rows, 8 at a time in a vector's lanes (the activations' tail plane), each weight word broadcast to the 8: every
// product a useful one. Block by block, each activation and weight row's product took 8 lanes of a vector for
// 4 bytes of work: a quarter of a 576-value row's time went to 2 of its 18 blocks.
template <StorageType T, int C>
void tail_rows(const TailBlocks<T, C>& w, int64_t tail, const QuantizedRows& act, int64_t n, float* y,
               int64_t y_stride, int64_t row) {
    for (int64_t g = 0; 8 * g < n; ++g) {
        __m256 sums[C], extra[C];
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) sums[c] = extra[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < tail; ++b) {
            const int64_t at = (g * tail + b) * 8;  // the 8 rows' block b
            const int8_t* x = act.tail_codes.data() + at * kBlock;
            const __m256 dx = _mm256_loadu_ps(act.tail_d.data() + at);
#pragma GCC unroll 16
            for (int c = 0; c < C; ++c) {
                __m256i dot = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int v = 0; v < 8; ++v) {
                    __m256i xv = load(x + v * kBlock);
                    if constexpr (kSigned<T> && !kBiased<T>) xv = _mm256_sign_epi8(xv, broadcast_word(w.signs[c][b] + 4 * v));
                    dot = udot(broadcast_word(w.codes[c][b] + 4 * v), xv, dot);
                }
                if constexpr (kBiased<T>) {
                    dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(load(act.tail_sums.data() + at), 7));
                }
                sums[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_set1_ps(w.dw[c][b]), dx), sums[c]);
                if constexpr (kOffset<T>) {
                    extra[c] = _mm256_fmadd_ps(_mm256_set1_ps(w.mw[c][b]), _mm256_loadu_ps(act.tail_s.data() + at), extra[c]);
                }
            }
        }
        const int64_t rows = std::min<int64_t>(8, n - 8 * g);
        float* out = y + 8 * g * y_stride + row;
        if constexpr (C == 4) {  // 8 rows' 4 results at once: lane c of rows[i] is row i's result c
            __m128 tails[8], offsets[8];
            transpose4x8(sums, tails);
            if constexpr (kOffset<T>) transpose4x8(extra, offsets);
            for (int64_t i = 0; i < rows; ++i) {
                __m128 o = _mm_add_ps(_mm_loadu_ps(out + i * y_stride), tails[i]);
                if constexpr (kOffset<T>) o = _mm_add_ps(o, offsets[i]);
                _mm_storeu_ps(out + i * y_stride, o);
            }
        } else {
            alignas(32) float t[C][8], e[C][8];
            for (int c = 0; c < C; ++c) {
                _mm256_store_ps(t[c], sums[c]);
                _mm256_store_ps(e[c], extra[c]);
            }
            for (int64_t i = 0; i < rows; ++i) {
                for (int c = 0; c < C; ++c) {
                    out[i * y_stride + c] += t[c][i];
                    if constexpr (kOffset<T>) out[i * y_stride + c] += e[c][i];
                }
            }
        }
    }
}

// Weight rows [first, first + count) asked for into L2: the next group's, before this group's tiles run. With a
// few activation rows the tiles take about as long as the next rows take to arrive from memory, and decoding the
// next group would otherwise wait for them after the tiles instead of during them. (A prefetch past the weight's
// end does not fault.)
inline void prefetch_rows(const WeightView& w, size_t stride, int64_t first, int64_t count) {
    const char* from = reinterpret_cast<const char*>(w.data + first * static_cast<int64_t>(stride));
    const size_t bytes = static_cast<size_t>(count) * stride;
    for (size_t at = 0; at < bytes; at += 64) _mm_prefetch(from + at, _MM_HINT_T1);
}

// Decode's next weight rows for the 256-value block types: the window of kDecodeWindowBytes (at least 4 rows) after
// the rows being read is asked for into L2, the whole window as a range starts and then, each 4 rows in turn, the
// 4 rows that enter it. One core reads a cold matrix at memory speed only with several KB in flight; the next 4
// rows alone are too few when rows are short (840 bytes for a 1024-wide Q6_K row). Measured on a Zen 4
// (`pocketbench.gemm --rows 1`, two threads): the Qwen3.5-0.8B file's 1024- and 2048-wide Q4_K and Q6_K matrices
// 1.2-1.4x, the 3584-wide ones about even; a single-stream decode step 31.4 -> 24.8 ms. Asking for the whole window
// again every 4 rows, as this did first, cost the prefetches' issue: a 1024 x 1024 Q4_K matrix in cache 21.5 ->
// 18.3 us, Q6_K 27.4 -> 22.7, with the cold rates the same. The window runs on past the range's end, into the rows
// that the pool's next chunk reads: clamped to the range, the same matrices ran 0.6-0.9x. The 32-value block types
// ask for 4 rows two groups ahead instead (kDecodeAhead32): with the window the default model's small matrices lost
// 10 %.
constexpr int64_t kDecodeWindowBytes = 8192;
inline int64_t decode_ahead(size_t stride) {
    const auto bytes = static_cast<int64_t>(stride);
    return std::max<int64_t>(4, (kDecodeWindowBytes + bytes - 1) / bytes);
}

// The 32-value types' decode: each group of 4 rows asks for the 4 rows two groups on, not the next 4, which were
// asked for a group earlier and are on their way. Measured on a Zen 4 (`pocketbench.gemm --rows 1`, two threads,
// interleaved with the next-4 build): the default model re-quantized to Q8_0, its 576-wide matrices 1.18-1.26x and
// the 49152-row LM head 1.25-1.34x; the 4-bit types' small matrices within noise (0.94-1.08x); decode of that file
// 110-122 -> 127-139 tok/s, of the default model (Q4_1, a Q8_0 head) 155-168 -> 174-186. Four groups on measured
// the same as two.
constexpr int64_t kDecodeAhead32 = 8;

template <StorageType T, int C>
void packed_rows(const WeightView& w, size_t stride, int64_t row, const QuantizedRows& act, int64_t n, float* y,
                 int64_t y_stride) {
    const int64_t nb = w.cols / kBlock, full = nb / 8 * 8;
    const uint8_t* base = w.data + row * static_cast<int64_t>(stride);
    thread_local std::vector<PackedGroup<T, C>> groups;
    groups.resize(static_cast<size_t>(full / 8));
    pack<T, C>(base, stride, full, groups.data());
    thread_local TailBlocks<T, C> tail;
    if constexpr (kBlock32<T>) {  // the 256-value block types have no tail
        for (int c = 0; c < C; ++c) {
            for (int64_t b = 0; b < nb - full; ++b) {
                const Sub sub = decode<T>(base + c * static_cast<int64_t>(stride), full + b);
                _mm256_store_si256(reinterpret_cast<__m256i*>(tail.codes[c][b]), dot_codes<T>(sub.codes));
                if constexpr (kSigned<T>) _mm256_store_si256(reinterpret_cast<__m256i*>(tail.signs[c][b]), sub.codes);
                tail.dw[c][b] = sub.dw;
                tail.mw[c][b] = sub.mw;
            }
        }
    }
    prefetch_rows(w, stride, row + C, C);
    int64_t r = 0;
    for (; r + PLLM_TILE_ACT <= n; r += PLLM_TILE_ACT) packed_tile<T, PLLM_TILE_ACT, C>(groups.data(), nb, act, r, y, y_stride, row);
    for (; r + 2 <= n; r += 2) packed_tile<T, 2, C>(groups.data(), nb, act, r, y, y_stride, row);
    if (r < n) packed_tile<T, 1, C>(groups.data(), nb, act, r, y, y_stride, row);
    if (nb > full) tail_rows<T, C>(tail, nb - full, act, n, y, y_stride, row);
}

// The super-block types with a scale per 16 values, a 256-value block at a time: Q6_K and Q3_K (signed codes,
// q - 32 and q - 4) and Q2_K (unsigned 2-bit codes with a min per 16 values: w = d * sc * q - dmin * m). The
// batched path packs C weight rows' blocks once for every activation row, as PackedGroup does: the unsigned codes
// (code + bias) transposed by 4-byte words like the activations' `grouped` plane, so that lane k of each product is
// sub-block k, and the per-16 scales as the lanes that multiply them (transposed words 4h..4h + 3 carry each
// sub-block's values 16h..16h + 15). With VNNI, words 0-3 and 4-7 are summed apart by vpdpbusd, as the 4-bit types
// are, and each half's int32 lanes times its scales (scale32[h]); without, maddubs' 16-bit pairs times mul[h],
// whose lanes 2k and 2k + 1 hold sub-block k's scale for that half. The bias comes back
// through the activations' per-16 sums: sum(code * s * x) = sum((code + bias) * s * x) - bias * sum(s * sums16),
// and Q2_K's mins the same way: sum(m * x) = sum(m * sums16). Each sub-block's integer sums are exact, so the
// result is the decode path's (k16_decode_rows) bit for bit, whatever R, C and n are.
template <StorageType T>
using Block16 = std::conditional_t<T == StorageType::Q6_K, BlockQ6_K,
                                   std::conditional_t<T == StorageType::Q3_K, BlockQ3_K, BlockQ2_K>>;
template <StorageType T>
constexpr int kBias16 = T == StorageType::Q6_K ? 32 : T == StorageType::Q3_K ? 4 : 0;
template <StorageType T>
constexpr int kBiasShift16 = T == StorageType::Q6_K ? 5 : 2;  // log2 of the bias
template <StorageType T>
constexpr bool kMins16 = T == StorageType::Q2_K;

template <StorageType T, int C>
struct Packed16 {
    alignas(64) uint8_t codes[8][C][kBlock];
#if PLLM_VNNI
    alignas(64) int32_t scale32[2][C][8];  // [h][c] lane k: sub-block k's scale for its values 16h..16h + 15
#else
    alignas(64) int16_t mul[2][C][16];
#endif
    alignas(64) int16_t offsets[C][16];  // per 16 values: the scales (Q6_K, Q3_K) or the mins (Q2_K)
    alignas(64) float d[C][8];           // d in 8 lanes
    alignas(64) float dmin[kMins16<T> ? C : 1][8];  // Q2_K's -dmin in 8 lanes
};

// A block's 16 scales as int8 lanes: Q6_K's as stored, Q3_K's unpacked less their offset, Q2_K's low nibbles.
template <StorageType T>
inline __m128i scales16(const Block16<T>& blk) {
    if constexpr (T == StorageType::Q6_K) {
        return _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales));
    } else if constexpr (T == StorageType::Q3_K) {  // q3_k_scales in four 32-bit words, kept in a register
        uint32_t aux[3];
        std::memcpy(aux, blk.scales, sizeof(aux));
        constexpr uint32_t low4 = 0x0F0F0F0F, low2 = 0x03030303;
        const __m128i unsigned_scales = _mm_setr_epi32(
            static_cast<int>((aux[0] & low4) | ((aux[2] & low2) << 4)),
            static_cast<int>((aux[1] & low4) | (((aux[2] >> 2) & low2) << 4)),
            static_cast<int>(((aux[0] >> 4) & low4) | (((aux[2] >> 4) & low2) << 4)),
            static_cast<int>(((aux[1] >> 4) & low4) | (((aux[2] >> 6) & low2) << 4)));
        return _mm_sub_epi8(unsigned_scales, _mm_set1_epi8(32));
    } else {
        return _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales)), _mm_set1_epi8(0x0F));
    }
}

// Q2_K's 16 mins (the scales' high nibbles) as int8 lanes.
inline __m128i q2_mins(const BlockQ2_K& blk) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales));
    return _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
}

// f(j, codes) for each sub-block j of a block: its 32 unsigned codes (code + kBias16).
template <StorageType T, class F>
inline void sub_blocks16(const Block16<T>& blk, F&& f) {
    if constexpr (T == StorageType::Q6_K) {
        const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {  // sub-blocks 4h + part: ql's low/high nibbles, qh's bit pair `part`
            const __m256i ql0 = load(blk.ql + 64 * h), ql1 = load(blk.ql + 64 * h + 32), qh = load(blk.qh + 32 * h);
            const __m256i low[4] = {_mm256_and_si256(ql0, low4), _mm256_and_si256(ql1, low4),
                                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4)};
            // Bit pair `part` of qh's bytes moved to bits 4-5 with one shift (the mask drops what crossed bytes).
            const __m256i high[4] = {_mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45),
                                     _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45), _mm256_and_si256(qh, bits45),
                                     _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45)};
#pragma GCC unroll 4
            for (int part = 0; part < 4; ++part) f(4 * h + part, _mm256_or_si256(low[part], high[part]));
        }
    } else {
        __m256i hmask = _mm256_setzero_si256();
        if constexpr (T == StorageType::Q3_K) hmask = load(blk.hmask);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {  // sub-blocks 4h + part: bits 2 part of the half's 32 bytes
            const __m256i qs = load(blk.qs + 32 * h);
#pragma GCC unroll 4
            for (int part = 0; part < 4; ++part) {
                const int j = 4 * h + part;
                __m256i codes = bits(qs, 2 * part, 3);
                // Q3_K's 3rd bit, bit j of hmask's bytes, set where the code has no offset of -4.
                if constexpr (T == StorageType::Q3_K) codes = _mm256_or_si256(codes, _mm256_slli_epi16(bits(hmask, j, 1), 2));
                f(j, codes);
            }
        }
    }
}

// Lane j: sum(code * x) over sub-block j, each half (values 0-15, 16-31) times its scale, from sums[j] of udot
// (lanes 0-3: the first half's products, 4-7: the second's) and the block's 16 scales (int8). Two hadd levels
// leave (sub-block, half) sums in lanes (j, h) of four sub-blocks a vector; the scales, laid out alike, multiply
// them as int32 (exact: |sum| < 2^17 per half, scales < 2^7), and the halves add.
inline __m256i scaled_halves(const __m256i (&sums)[8], __m128i scales) {
    const __m256i p01 = hadd32(sums[0], sums[1]), p23 = hadd32(sums[2], sums[3]);
    const __m256i p45 = hadd32(sums[4], sums[5]), p67 = hadd32(sums[6], sums[7]);
    // 128-bit halves: [sub-blocks 0-3, values 0-15] and [sub-blocks 0-3, values 16-31]; then 4-7 alike.
    const __m256i halves03 = hadd32(p01, p23), halves47 = hadd32(p45, p67);
    const __m128i split = _mm_shuffle_epi8(scales, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    const __m256i scaled03 = _mm256_mullo_epi32(halves03, _mm256_cvtepi8_epi32(split));
    const __m256i scaled47 = _mm256_mullo_epi32(halves47, _mm256_cvtepi8_epi32(_mm_srli_si128(split, 8)));
    return _mm256_add_epi32(_mm256_permute2x128_si256(scaled03, scaled47, 0x20),
                            _mm256_permute2x128_si256(scaled03, scaled47, 0x31));
}

template <StorageType T, int C>
void k16_pack(const uint8_t* base, size_t stride, int64_t supers, Packed16<T, C>* out) {
    for (int64_t k = 0; k < supers; ++k) {
        Packed16<T, C>& p = out[k];
        for (int c = 0; c < C; ++c) {
            const Block16<T>& blk = reinterpret_cast<const Block16<T>*>(base + c * stride)[k];
            prefetch_ahead(blk, kPrefetchBytes);
            __m256i codes[8];
            sub_blocks16<T>(blk, [&](int j, __m256i unsigned_codes) { codes[j] = unsigned_codes; });
            transpose8(codes);
            for (int v = 0; v < 8; ++v) _mm256_store_si256(reinterpret_cast<__m256i*>(p.codes[v][c]), codes[v]);
            const __m128i scales8 = scales16<T>(blk);
            const __m256i scales = _mm256_cvtepi8_epi16(scales8);
            __m256i offsets = scales;
            if constexpr (kMins16<T>) offsets = _mm256_cvtepi8_epi16(q2_mins(blk));
            _mm256_store_si256(reinterpret_cast<__m256i*>(p.offsets[c]), offsets);
#if PLLM_VNNI
            // scale32[h] lane k: scale 2k + h (the even scales, then the odd ones, widened to 32 bits).
            const __m128i split = _mm_shuffle_epi8(scales8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11,
                                                                         13, 15));
            _mm256_store_si256(reinterpret_cast<__m256i*>(p.scale32[0][c]), _mm256_cvtepi8_epi32(split));
            _mm256_store_si256(reinterpret_cast<__m256i*>(p.scale32[1][c]), _mm256_cvtepi8_epi32(_mm_srli_si128(split, 8)));
#else
            // mul[h]'s lanes 2k and 2k + 1: scale 2k + h, which sits in the same 128-bit half of `scales`.
            const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5,
                                                  8, 9, 8, 9, 12, 13, 12, 13);
            const __m256i odd = _mm256_add_epi8(even, _mm256_set1_epi8(2));
            _mm256_store_si256(reinterpret_cast<__m256i*>(p.mul[0][c]), _mm256_shuffle_epi8(scales, even));
            _mm256_store_si256(reinterpret_cast<__m256i*>(p.mul[1][c]), _mm256_shuffle_epi8(scales, odd));
#endif
            _mm256_store_ps(p.d[c], _mm256_set1_ps(half(blk.d)));
            if constexpr (kMins16<T>) _mm256_store_ps(p.dmin[c], _mm256_set1_ps(-half(blk.dmin)));
        }
    }
}

// Decode (one activation row): k16_tile<T, 1, C>'s arithmetic, the blocks used from registers: unsigned codes
// against x, and the bias (or Q2_K's mins) through the activation row's per-16 sums.
template <StorageType T, int C>
void k16_decode_rows(const WeightView& w, size_t stride, int64_t row, const QuantizedRows& act, float* y) {
    const int64_t ahead = decode_prefetch_distance(stride);
    const uint8_t* base = w.data + row * static_cast<int64_t>(stride);
    __m256 acc[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    const int64_t supers = w.cols / kSuper;
    for (int64_t k = 0; k < supers; ++k) {
        const int8_t* x = act.codes(0, 8 * k);
        const __m256 dx = _mm256_loadu_ps(act.d.data() + 8 * k);
        const __m256i x16 = load(act.sums16.data() + 16 * k);
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) {
            const Block16<T>& blk = reinterpret_cast<const Block16<T>*>(base + c * stride)[k];
            prefetch_ahead(blk, ahead);
            __m256i sums[8];
            sub_blocks16<T>(blk, [&](int j, __m256i codes) { sums[j] = udot(codes, load(x + j * kBlock)); });
            const __m128i scales = scales16<T>(blk);
            const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(half(blk.d)), dx);
            __m256i blocks = scaled_halves(sums, scales);
            if constexpr (kMins16<T>) {
                const __m256i mins = _mm256_madd_epi16(x16, _mm256_cvtepi8_epi16(q2_mins(blk)));
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(blocks), scale, acc[c]);
                const __m256 dmin = _mm256_mul_ps(_mm256_set1_ps(-half(blk.dmin)), dx);
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), dmin, acc[c]);
            } else {
                const __m256i offset = _mm256_madd_epi16(x16, _mm256_cvtepi8_epi16(scales));
                blocks = _mm256_sub_epi32(blocks, _mm256_slli_epi32(offset, kBiasShift16<T>));
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(blocks), scale, acc[c]);
            }
        }
    }
    if constexpr (C == 4) {
        _mm_storeu_ps(y + row, hsum4(acc));
    } else {
        for (int c = 0; c < C; ++c) y[row + c] = hsum(acc[c]);
    }
}

#if PLLM_VNNI
// k16_tile's 512-bit form (packed_pairs' pairing of weight rows), the same bits.
template <StorageType T, int R, int C>
void k16_pairs(const Packed16<T, C>* blocks, int64_t supers, const QuantizedRows& act, int64_t r0,
               __m256 (&acc)[R][C]) {
    constexpr int P = C / 2;
    const int64_t nb = act.blocks_per_row(), groups16 = act.cols / 16;
    __m512 pairs[R][P];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
        for (int q = 0; q < P; ++q) pairs[i][q] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < supers; ++k) {
        const Packed16<T, C>& p = blocks[k];
        __m512i sums[R][P];
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {  // words 4h..4h + 3: each sub-block's values 16h..16h + 15, one scale
            __m512i half_sums[R][P];
#pragma GCC unroll 16
            for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
                for (int q = 0; q < P; ++q) half_sums[i][q] = _mm512_setzero_si512();
            }
#pragma GCC unroll 4
            for (int v = 4 * h; v < 4 * h + 4; ++v) {
                __m512i wv[P];
#pragma GCC unroll 16
                for (int q = 0; q < P; ++q) wv[q] = _mm512_load_si512(p.codes[v][2 * q]);
#pragma GCC unroll 16
                for (int i = 0; i < R; ++i) {
                    const __m512i x = both_halves(act.grouped.data() + (r0 + i) * act.cols + k * kSuper + v * kBlock);
#pragma GCC unroll 16
                    for (int q = 0; q < P; ++q) half_sums[i][q] = _mm512_dpbusd_epi32(half_sums[i][q], wv[q], x);
                }
            }
#pragma GCC unroll 16
            for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
                for (int q = 0; q < P; ++q) {
                    const __m512i scaled = _mm512_mullo_epi32(half_sums[i][q], _mm512_load_si512(p.scale32[h][2 * q]));
                    sums[i][q] = h == 0 ? scaled : _mm512_add_epi32(sums[i][q], scaled);
                }
            }
        }
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            const __m512i x16 = both_halves(act.sums16.data() + (r0 + i) * groups16 + 16 * k);
            const __m512 dx = both_halves(_mm256_loadu_ps(act.d.data() + (r0 + i) * nb + 8 * k));
#pragma GCC unroll 16
            for (int q = 0; q < P; ++q) {
                const __m512i offset = _mm512_madd_epi16(x16, _mm512_load_si512(p.offsets[2 * q]));
                const __m512 scale = _mm512_mul_ps(_mm512_load_ps(p.d[2 * q]), dx);
                if constexpr (kMins16<T>) {
                    pairs[i][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i][q]), scale, pairs[i][q]);
                    const __m512 dmin = _mm512_mul_ps(_mm512_load_ps(p.dmin[2 * q]), dx);
                    pairs[i][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(offset), dmin, pairs[i][q]);
                } else {
                    const __m512i biased = _mm512_sub_epi32(sums[i][q], _mm512_slli_epi32(offset, kBiasShift16<T>));
                    pairs[i][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(biased), scale, pairs[i][q]);
                }
            }
        }
    }
    for (int i = 0; i < R; ++i) {
        for (int q = 0; q < P; ++q) {
            acc[i][2 * q] = low_half(pairs[i][q]);
            acc[i][2 * q + 1] = high_half(pairs[i][q]);
        }
    }
}
#endif

template <StorageType T, int R, int C>
void k16_tile(const Packed16<T, C>* blocks, int64_t supers, const QuantizedRows& act, int64_t r0, float* y,
              int64_t y_stride, int64_t row) {
    __m256 acc[R][C];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) acc[i][c] = _mm256_setzero_ps();
    }
    const int64_t nb = act.blocks_per_row(), groups16 = act.cols / 16;
#if PLLM_VNNI
    if constexpr (C % 2 == 0) k16_pairs<T, R, C>(blocks, supers, act, r0, acc);
    for (int64_t k = 0; k < (C % 2 == 0 ? 0 : supers); ++k) {
#else
    for (int64_t k = 0; k < supers; ++k) {
#endif
        const Packed16<T, C>& p = blocks[k];
        __m256i sums[R][C];
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
            for (int c = 0; c < C; ++c) sums[i][c] = _mm256_setzero_si256();
        }
#if PLLM_VNNI
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {  // as k16_pairs
            __m256i half_sums[R][C];
#pragma GCC unroll 16
            for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
                for (int c = 0; c < C; ++c) half_sums[i][c] = _mm256_setzero_si256();
            }
#pragma GCC unroll 4
            for (int v = 4 * h; v < 4 * h + 4; ++v) {
                __m256i wv[C];
#pragma GCC unroll 16
                for (int c = 0; c < C; ++c) wv[c] = load(p.codes[v][c]);
#pragma GCC unroll 16
                for (int i = 0; i < R; ++i) {
                    const __m256i x = load(act.grouped.data() + (r0 + i) * act.cols + k * kSuper + v * kBlock);
#pragma GCC unroll 16
                    for (int c = 0; c < C; ++c) half_sums[i][c] = _mm256_dpbusd_epi32(half_sums[i][c], wv[c], x);
                }
            }
#pragma GCC unroll 16
            for (int i = 0; i < R; ++i) {
#pragma GCC unroll 16
                for (int c = 0; c < C; ++c) {
                    sums[i][c] = _mm256_add_epi32(sums[i][c], _mm256_mullo_epi32(half_sums[i][c], load(p.scale32[h][c])));
                }
            }
        }
#else
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) {
            __m256i wv[C];
#pragma GCC unroll 16
            for (int c = 0; c < C; ++c) wv[c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(p.codes[v][c]));
#pragma GCC unroll 16
            for (int i = 0; i < R; ++i) {
                const __m256i x = load(act.grouped.data() + (r0 + i) * act.cols + k * kSuper + v * kBlock);
#pragma GCC unroll 16
                for (int c = 0; c < C; ++c) {
                    // |pairs| <= 2 * 63 * 127: the codes are 0..63, the activations -127..127
                    const __m256i pairs = _mm256_maddubs_epi16(wv[c], x);
                    sums[i][c] = _mm256_add_epi32(sums[i][c], _mm256_madd_epi16(pairs, load(p.mul[v / 4][c])));
                }
            }
        }
#endif
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            const __m256i x16 = load(act.sums16.data() + (r0 + i) * groups16 + 16 * k);
            const __m256 dx = _mm256_loadu_ps(act.d.data() + (r0 + i) * nb + 8 * k);
#pragma GCC unroll 16
            for (int c = 0; c < C; ++c) {
                const __m256i offset = _mm256_madd_epi16(x16, load(p.offsets[c]));
                const __m256 scale = _mm256_mul_ps(_mm256_load_ps(p.d[c]), dx);
                if constexpr (kMins16<T>) {
                    acc[i][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i][c]), scale, acc[i][c]);
                    const __m256 dmin = _mm256_mul_ps(_mm256_load_ps(p.dmin[c]), dx);
                    acc[i][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offset), dmin, acc[i][c]);
                } else {
                    const __m256i biased = _mm256_sub_epi32(sums[i][c], _mm256_slli_epi32(offset, kBiasShift16<T>));
                    acc[i][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(biased), scale, acc[i][c]);
                }
            }
        }
    }
    for (int i = 0; i < R; ++i) {
        if constexpr (C == 4) {
            _mm_storeu_ps(y + (r0 + i) * y_stride + row, hsum4(acc[i]));
        } else {
            for (int c = 0; c < C; ++c) y[(r0 + i) * y_stride + row + c] = hsum(acc[i][c]);
        }
    }
}

template <StorageType T, int C>
void k16_rows(const WeightView& w, size_t stride, int64_t row, const QuantizedRows& act, int64_t n, float* y,
              int64_t y_stride) {
    const int64_t supers = w.cols / kSuper;
    thread_local std::vector<Packed16<T, C>> packed;
    packed.resize(static_cast<size_t>(supers));
    k16_pack<T, C>(w.data + row * static_cast<int64_t>(stride), stride, supers, packed.data());
    prefetch_rows(w, stride, row + C, C);
    int64_t r = 0;
    for (; r + PLLM_TILE_ACT <= n; r += PLLM_TILE_ACT) k16_tile<T, PLLM_TILE_ACT, C>(packed.data(), supers, act, r, y, y_stride, row);
    for (; r + 2 <= n; r += 2) k16_tile<T, 2, C>(packed.data(), supers, act, r, y, y_stride, row);
    if (r < n) k16_tile<T, 1, C>(packed.data(), supers, act, r, y, y_stride, row);
}

template <StorageType T>
void gemm_k16(const WeightView& w, int64_t row_begin, int64_t row_end, const QuantizedRows& act, int64_t n,
              float* y, int64_t y_stride) {
    const size_t stride = row_bytes(w.type, w.cols);
    int64_t row = row_begin;
    if (n == 1) {
        const int64_t ahead = decode_ahead(stride);
        prefetch_rows(w, stride, row, ahead);
        for (; row + 4 <= row_end; row += 4) {
            prefetch_rows(w, stride, row + ahead, 4);
            k16_decode_rows<T, 4>(w, stride, row, act, y);
        }
        for (; row < row_end; ++row) k16_decode_rows<T, 1>(w, stride, row, act, y);
        return;
    }
    for (; row + PLLM_TILE_ROWS <= row_end; row += PLLM_TILE_ROWS) {
        k16_rows<T, PLLM_TILE_ROWS>(w, stride, row, act, n, y, y_stride);
    }
    for (; row < row_end; ++row) k16_rows<T, 1>(w, stride, row, act, n, y, y_stride);
}

template <StorageType T>
void gemm_blocks(const WeightView& w, int64_t row_begin, int64_t row_end, const QuantizedRows& act, int64_t n,
                 float* y, int64_t y_stride) {
    const size_t stride = row_bytes(w.type, w.cols);
    int64_t row = row_begin;
    if (n == 1) {  // decode: 4 weight rows in flight, whose blocks stream from memory
        if constexpr (!kBlock32<T>) {  // Q4_K, Q5_K, IQ4_XS
            const int64_t ahead = decode_ahead(stride);
            prefetch_rows(w, stride, row, ahead);
            for (; row + 4 <= row_end; row += 4) {
                prefetch_rows(w, stride, row + ahead, 4);
                k_rows<T, 4>(w, stride, row, act, y);
            }
            for (; row < row_end; ++row) k_rows<T, 1>(w, stride, row, act, y);
        } else {
            for (; row + 4 <= row_end; row += 4) {
                prefetch_rows(w, stride, row + kDecodeAhead32, 4);
                tile<T, 4>(w, stride, row, act, y);
            }
            for (; row < row_end; ++row) tile<T, 1>(w, stride, row, act, y);
        }
        return;
    }
    if (n == 2) {  // 2 x 4 sums: as many weight rows in flight as decode has
        for (; row + 4 <= row_end; row += 4) packed_rows<T, 4>(w, stride, row, act, n, y, y_stride);
    }
    for (; row + PLLM_TILE_ROWS <= row_end; row += PLLM_TILE_ROWS) {
        packed_rows<T, PLLM_TILE_ROWS>(w, stride, row, act, n, y, y_stride);
    }
    for (; row < row_end; ++row) packed_rows<T, 1>(w, stride, row, act, n, y, y_stride);
}

template <StorageType T>
inline __m256 dense8(const uint8_t* row, int64_t i) {
    if constexpr (T == StorageType::F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
    if constexpr (T == StorageType::F8_E4M3) {  // fp8_e4m3_to_fp32's half, 8 at a time; the 2^8 is in the scale
        const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
        const __m128i sign = _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8);
        return _mm256_cvtph_ps(_mm_or_si128(sign, _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x7F)), 7)));
    }
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(row) + i));
    if constexpr (T == StorageType::F16) return _mm256_cvtph_ps(halves);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));  // bf16: the top half of f32
}

template <StorageType T, int R>
void dense_tile(const WeightView& w, const uint8_t* base, const float* x, int64_t r0, float* y, int64_t y_stride,
                int64_t row) {
    const int64_t cols = w.cols;
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    __m256 scale = _mm256_set1_ps(1.0f);
    for (int64_t k = 0; k < cols; k += 8) {
        __m256 wv = dense8<T>(base, k);
        if constexpr (T == StorageType::F8_E4M3) {
            // (fp8 / 2^8) * 2^8 is exact, so times s it rounds as fp8 * s does (2^8 * s could overflow).
            if (k % kBlock == 0) scale = _mm256_set1_ps(w.scale(row, k));
            wv = _mm256_mul_ps(_mm256_mul_ps(wv, _mm256_set1_ps(256.0f)), scale);
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (r0 + i) * cols + k), acc[i]);
    }
    for (int i = 0; i < R; ++i) y[(r0 + i) * y_stride + row] = hsum(acc[i]);
}

template <StorageType T>
void gemm_dense(const WeightView& w, int64_t row_begin, int64_t row_end, const float* x, int64_t n, float* y,
                int64_t y_stride) {
    const size_t stride = row_bytes(w.type, w.cols);
    for (int64_t row = row_begin; row < row_end; ++row) {
        const uint8_t* base = w.data + row * static_cast<int64_t>(stride);
        int64_t r = 0;
        for (; r + 4 <= n; r += 4) dense_tile<T, 4>(w, base, x, r, y, y_stride, row);
        for (; r < n; ++r) dense_tile<T, 1>(w, base, x, r, y, y_stride, row);
    }
}

}  // namespace

#ifdef PLLM_GEMM  // kernels_amx.cpp includes this file for its helpers alone
void PLLM_GEMM(const WeightView& w, int64_t row_begin, int64_t row_end, const QuantizedRows& act, const float* x,
               int64_t n, float* y, int64_t y_stride) {
    switch (w.type) {
        case StorageType::F32: return gemm_dense<StorageType::F32>(w, row_begin, row_end, x, n, y, y_stride);
        case StorageType::F16: return gemm_dense<StorageType::F16>(w, row_begin, row_end, x, n, y, y_stride);
        case StorageType::BF16: return gemm_dense<StorageType::BF16>(w, row_begin, row_end, x, n, y, y_stride);
        case StorageType::F8_E4M3: return gemm_dense<StorageType::F8_E4M3>(w, row_begin, row_end, x, n, y, y_stride);
        case StorageType::Q4_0: return gemm_blocks<StorageType::Q4_0>(w, row_begin, row_end, act, n, y, y_stride);
        case StorageType::Q4_1: return gemm_blocks<StorageType::Q4_1>(w, row_begin, row_end, act, n, y, y_stride);
        case StorageType::Q8_0: return gemm_blocks<StorageType::Q8_0>(w, row_begin, row_end, act, n, y, y_stride);
        case StorageType::Q4_K: return gemm_blocks<StorageType::Q4_K>(w, row_begin, row_end, act, n, y, y_stride);
        case StorageType::Q5_K: return gemm_blocks<StorageType::Q5_K>(w, row_begin, row_end, act, n, y, y_stride);
        case StorageType::Q6_K: return gemm_k16<StorageType::Q6_K>(w, row_begin, row_end, act, n, y, y_stride);
        case StorageType::Q5_0: return gemm_blocks<StorageType::Q5_0>(w, row_begin, row_end, act, n, y, y_stride);
        case StorageType::Q5_1: return gemm_blocks<StorageType::Q5_1>(w, row_begin, row_end, act, n, y, y_stride);
        case StorageType::IQ4_NL: return gemm_blocks<StorageType::IQ4_NL>(w, row_begin, row_end, act, n, y, y_stride);
        case StorageType::MXFP4: return gemm_blocks<StorageType::MXFP4>(w, row_begin, row_end, act, n, y, y_stride);
        case StorageType::IQ4_XS: return gemm_blocks<StorageType::IQ4_XS>(w, row_begin, row_end, act, n, y, y_stride);
        case StorageType::Q2_K: return gemm_k16<StorageType::Q2_K>(w, row_begin, row_end, act, n, y, y_stride);
        case StorageType::Q3_K: return gemm_k16<StorageType::Q3_K>(w, row_begin, row_end, act, n, y, y_stride);
    }
}

#endif

}  // namespace pocketllm::kernels
