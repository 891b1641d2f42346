// GGML block layouts the kernels read in place, and the 8-bit activation blocks they multiply with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace pocketllm {

constexpr int kBlock = 32;  // values per block, for every type here

enum class QType { F32, F16, Q4_0, Q4_1, Q8_0 };

// One block as stored in a GGUF file (little-endian, packed).
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };              // w = (q - 8) * d
struct BlockQ4_1 { uint16_t d; uint16_t m; uint8_t qs[16]; };  // w = q * d + m
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };               // w = q * d
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34, "GGUF block sizes");

// Activations quantized per block of 32: x ~= q * d, with s = d * sum(q) for the offset of Q4_x weights.
struct BlockQ8Act { float d; float s; int8_t qs[32]; };

// Parses "F32", "F16", "Q4_0", "Q4_1", "Q8_0"; throws std::invalid_argument otherwise.
QType parse_qtype(const std::string& name);
// Bytes of one row of `cols` values (cols must be a multiple of kBlock for block types).
size_t row_bytes(QType type, int64_t cols);
bool is_block_type(QType type);

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

}  // namespace pocketllm
