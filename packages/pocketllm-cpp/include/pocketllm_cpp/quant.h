// GGML block layouts the kernels read in place, and the 8-bit activation rows they multiply with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace pocketllm {

constexpr int kBlock = 32;   // values per activation block, and per sub-block of every quantized storage type
constexpr int kSuper = 256;  // values per K-quant super-block

// F8_E4M3: FP8 bytes (sign, 4 exponent bits of bias 7, 3 mantissa bits) times a float scale per 32 columns of each
// row (WeightView::scales), as published FP8 checkpoints store them (per 128 x 128 block, row or tensor).
enum class StorageType { F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL, MXFP4, IQ4_XS, Q2_K,
                         Q3_K, F8_E4M3 };

// One block as stored in a GGUF file (little-endian, packed); see llama.cpp's ggml-common.h.
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };              // w = (q - 8) * d
struct BlockQ4_1 { uint16_t d; uint16_t m; uint8_t qs[16]; };  // w = q * d + m
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };               // w = q * d
// Value i's 5th bit is bit i of qh (little-endian): w = (q - 16) * d, and q * d + m for Q5_1.
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct BlockQ5_1 { uint16_t d; uint16_t m; uint8_t qh[4]; uint8_t qs[16]; };
// 4-bit indexes into a 16-value codebook (kIQ4NLValues, kMXFP4Values): w = d * value[q]. MXFP4's scale is a power of
// two, E8M0 (mxfp4_scale).
struct BlockIQ4_NL { uint16_t d; uint8_t qs[16]; };
struct BlockMXFP4 { uint8_t e; uint8_t qs[16]; };
// 8 sub-blocks of 32 IQ4_NL codes, each with a 6-bit scale (4 bits in scales_l, 2 in scales_h): w = d * (s - 32) *
// value[q] (iq4_xs_scale).
struct BlockIQ4_XS { uint16_t d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };
// 8 sub-blocks of 32, each with a 6-bit scale and min (packed in `scales`): w = d * sc * q - dmin * m.
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };  // q has a 5th bit
// 16 sub-blocks of 16 with 8-bit scales: w = d * sc * (q - 32), q of 6 bits (4 in ql, 2 in qh).
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
// 16 sub-blocks of 16 with 6-bit scales (packed as q3_k_scales unpacks them): w = d * (sc - 32) * (q - 4), q of 3
// bits (2 in qs, the 3rd in hmask).
struct BlockQ3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
// 16 sub-blocks of 16, each with a 4-bit scale (low nibble) and min (high nibble): w = d * sc * q - dmin * m, q of
// 2 bits.
struct BlockQ2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34, "GGUF block sizes");
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24 && sizeof(BlockIQ4_NL) == 18 &&
              sizeof(BlockMXFP4) == 17 && sizeof(BlockIQ4_XS) == 136, "GGUF block sizes");

// The codebooks of the non-linear 4-bit types (ggml-common.h): IQ4_NL's, and MXFP4's E2M1 values doubled (its scale
// is halved to match).
constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An MXFP4 block's scale, 2^(e - 127), halved for the doubled codebook: 2^(e - 128) exactly, subnormal below e = 2.
inline float mxfp4_scale(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210 &&
              sizeof(BlockQ3_K) == 110 && sizeof(BlockQ2_K) == 84, "K-quant sizes");

// Activation rows quantized per block of 32 (x ~= q * d), stored as planes so that SIMD loads are contiguous:
// codes [rows, cols], and per block its scale d and s = d * sum(q) (the offset term of the unsigned-code storage
// types).
struct QuantizedRows {
    int64_t rows = 0, cols = 0;
    std::vector<int8_t> qs;
    std::vector<float> d, s;
    // The codes again, each full group of 8 blocks transposed by 4-byte words (vector v of a group: word v of each
    // of its blocks), for the x86 batched kernels; empty unless asked for.
    std::vector<int8_t> grouped;
    // Each 16 codes' sum, for the kernels whose weights carry an offset per 16 values (Q2_K, Q3_K, Q6_K); empty
    // unless asked for.
    std::vector<int16_t> sums16;
    // The blocks after a row's last whole group of 8 (its tail, fewer than 8) with 8 rows in a vector's lanes, for
    // the x86 batched kernels; filled with `grouped`. Per group of 8 rows and tail block: 8 vectors of 32 bytes
    // (vector v: each row's word v, row i in bytes 4i..4i + 3) in tail_codes, and 8 values (row i at i) in
    // tail_d, tail_s and tail_sums (the block's code sum); rows past the last are zero.
    std::vector<int8_t> tail_codes;
    std::vector<float> tail_d, tail_s;
    std::vector<int32_t> tail_sums;
    // The codes again, as AMX's A tiles load them (kernels_amx.cpp): per tile of 16 rows (rows past the last are
    // zero), each block's 16 rows of 32 codes in a row, 512 bytes, in the kernel's order of steps: a block b of the
    // whole groups of 8 at step (b % 8) * groups + b / 8, the tail's blocks after them in order; empty unless asked
    // for.
    std::vector<int8_t> tiles;
    int64_t blocks_per_row() const { return cols / kBlock; }
    const int8_t* codes(int64_t row, int64_t block) const { return qs.data() + row * cols + block * kBlock; }
    float scale(int64_t row, int64_t block) const { return d[static_cast<size_t>(row * blocks_per_row() + block)]; }
    float offset(int64_t row, int64_t block) const { return s[static_cast<size_t>(row * blocks_per_row() + block)]; }
};

// Parses a GGUF storage type name ("F32", "Q4_K", ...); throws std::invalid_argument for one not listed here.
StorageType parse_storage_type(const std::string& name);
// Values per block: 1 for the float storage types, 32 or 256 for the quantized ones (GGML blocks).
int64_t block_values(StorageType type);
// Bytes of one row of `cols` values (cols must be a multiple of block_values(type)).
size_t row_bytes(StorageType type, int64_t cols);
// A GGML quantized storage type (stored in blocks of 32 or 256 values, multiplied with 8-bit activations), not
// F32/F16/BF16/F8_E4M3 (whose values multiply float32 activations).
bool is_quantized(StorageType type);

// One 32-value sub-block of a quantized weight row in a common form:
// w[i] = dw * code[i] * mul[i / 16] + dm * min[i / 16] + mw.
// Codes are unsigned (0..31) for the storage types with an offset and signed for Q4_0, Q8_0, Q3_K and Q6_K
// (mw = 0). Every ISA's kernel decodes the same way, so the scalar path is the reference for the others.
struct SubBlock {
    uint8_t code[kBlock];  // reinterpret as int8_t when `is_signed`
    int16_t mul[2];        // the per-16 scales of Q2_K, Q3_K and Q6_K; 1 otherwise
    int16_t min[2];        // Q2_K's per-16 mins; 0 otherwise
    float dw, dm, mw;      // dm: Q2_K's -dmin
    bool is_signed;
};
void decode_sub_block(StorageType type, const uint8_t* row, int64_t b, SubBlock& out);

// Q4_K/Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes.
inline void k_scale_min(int j, const uint8_t* q, int& scale, int& min) {
    if (j < 4) {
        scale = q[j] & 63;
        min = q[j + 4] & 63;
    } else {
        scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q3_K: the 16 per-16 scales, less their offset of 32 (-32..31), from the 12 packed bytes: scale i's low 4 bits
// are byte i % 8's low (i < 8) or high nibble, its top 2 bits are bits 2 (i / 4) of byte 8 + i % 4.
inline void q3_k_scales(const uint8_t* packed, int8_t (&out)[16]) {
    uint32_t aux[4];
    std::memcpy(aux, packed, 12);
    constexpr uint32_t low4 = 0x0F0F0F0F, low2 = 0x03030303;
    const uint32_t high = aux[2];
    aux[2] = ((aux[0] >> 4) & low4) | (((high >> 4) & low2) << 4);
    aux[3] = ((aux[1] >> 4) & low4) | (((high >> 6) & low2) << 4);
    aux[0] = (aux[0] & low4) | ((high & low2) << 4);
    aux[1] = (aux[1] & low4) | (((high >> 2) & low2) << 4);
    uint8_t bytes[16];
    std::memcpy(bytes, aux, 16);
    for (int i = 0; i < 16; ++i) out[i] = static_cast<int8_t>(bytes[i] - 32);
}

// IQ4_XS: sub-block j's (0..7) scale, less its offset of 32: -32..31.
inline int iq4_xs_scale(const BlockIQ4_XS& blk, int j) {
    return (((blk.scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | (((blk.scales_h >> (2 * j)) & 3) << 4)) - 32;
}

// IEEE half -> float without F16C, for the scalar path (and tests).
inline float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1F;
    uint32_t mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exponent = 127 - 15 + 1;
            while ((mantissa & 0x400) == 0) { mantissa <<= 1; --exponent; }
            bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
        }
    } else if (exponent == 0x1F) {
        bits = sign | 0x7F800000 | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

// An E4M3 byte's value: its bits moved into an IEEE half (exponent bias 15 instead of 7: times 2^-8, subnormals
// included) and scaled back by 2^8. 0x7F and 0xFF (NaN in E4M3) read as 480 and -480.
inline float fp8_e4m3_to_fp32(uint8_t b) {
    const uint16_t half = static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
    return fp16_to_fp32(half) * 256.0f;
}

inline float bf16_to_fp32(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

// float -> IEEE half, round to nearest even (the f16 KV cache's scalar path).
inline uint16_t fp32_to_fp16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000;
    const uint32_t abs = x & 0x7FFFFFFF;
    if (abs >= 0x7F800000) return static_cast<uint16_t>(sign | 0x7C00 | (abs > 0x7F800000 ? 0x200 : 0));
    if (abs >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // rounds past the largest half
    if (abs < 0x38800000) {  // subnormal half (or zero): scale into the 10-bit field with rounding
        float magnitude;
        const uint32_t a = abs;
        std::memcpy(&magnitude, &a, sizeof magnitude);
        const float scaled = magnitude * 16777216.0f;  // 2^24: units of the smallest subnormal
        const uint32_t q = static_cast<uint32_t>(__builtin_nearbyintf(scaled));
        return static_cast<uint16_t>(sign | q);
    }
    const uint32_t rounded = abs + 0xFFF + ((abs >> 13) & 1);
    return static_cast<uint16_t>(sign | ((rounded - 0x38000000) >> 13));
}

}  // namespace pocketllm
