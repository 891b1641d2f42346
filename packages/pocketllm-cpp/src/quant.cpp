#include "pocketllm_cpp/quant.h"

#include <stdexcept>

namespace pocketllm {

StorageType parse_storage_type(const std::string& name) {
    static const std::pair<const char*, StorageType> names[] = {
        {"F32", StorageType::F32},   {"F16", StorageType::F16},   {"BF16", StorageType::BF16},
        {"Q4_0", StorageType::Q4_0}, {"Q4_1", StorageType::Q4_1}, {"Q8_0", StorageType::Q8_0},
        {"Q4_K", StorageType::Q4_K}, {"Q5_K", StorageType::Q5_K}, {"Q6_K", StorageType::Q6_K},
        {"Q5_0", StorageType::Q5_0}, {"Q5_1", StorageType::Q5_1}, {"IQ4_NL", StorageType::IQ4_NL},
        {"MXFP4", StorageType::MXFP4}, {"IQ4_XS", StorageType::IQ4_XS}, {"Q2_K", StorageType::Q2_K},
        {"Q3_K", StorageType::Q3_K}, {"F8_E4M3", StorageType::F8_E4M3}};
    for (const auto& [text, type] : names) {
        if (name == text) return type;
    }
    throw std::invalid_argument("storage type '" + name +
                                "' is not one of F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, "
                                "IQ4_NL, MXFP4, IQ4_XS, Q2_K, Q3_K, F8_E4M3");
}

bool is_quantized(StorageType type) {
    return type != StorageType::F32 && type != StorageType::F16 && type != StorageType::BF16 &&
           type != StorageType::F8_E4M3;
}

int64_t block_values(StorageType type) {
    switch (type) {
        case StorageType::F32: case StorageType::F16: case StorageType::BF16: case StorageType::F8_E4M3: return 1;
        case StorageType::Q4_0: case StorageType::Q4_1: case StorageType::Q8_0: case StorageType::Q5_0:
        case StorageType::Q5_1: case StorageType::IQ4_NL: case StorageType::MXFP4: return kBlock;
        case StorageType::Q4_K: case StorageType::Q5_K: case StorageType::Q6_K: case StorageType::IQ4_XS:
        case StorageType::Q2_K: case StorageType::Q3_K: return kSuper;
    }
    return 1;
}

size_t row_bytes(StorageType type, int64_t cols) {
    const auto blocks = static_cast<size_t>(cols / block_values(type));
    switch (type) {
        case StorageType::F32: return blocks * 4;
        case StorageType::F16: case StorageType::BF16: return blocks * 2;
        case StorageType::F8_E4M3: return blocks;
        case StorageType::Q4_0: return blocks * sizeof(BlockQ4_0);
        case StorageType::Q4_1: return blocks * sizeof(BlockQ4_1);
        case StorageType::Q8_0: return blocks * sizeof(BlockQ8_0);
        case StorageType::Q4_K: return blocks * sizeof(BlockQ4_K);
        case StorageType::Q5_K: return blocks * sizeof(BlockQ5_K);
        case StorageType::Q6_K: return blocks * sizeof(BlockQ6_K);
        case StorageType::Q5_0: return blocks * sizeof(BlockQ5_0);
        case StorageType::Q5_1: return blocks * sizeof(BlockQ5_1);
        case StorageType::IQ4_NL: return blocks * sizeof(BlockIQ4_NL);
        case StorageType::MXFP4: return blocks * sizeof(BlockMXFP4);
        case StorageType::IQ4_XS: return blocks * sizeof(BlockIQ4_XS);
        case StorageType::Q2_K: return blocks * sizeof(BlockQ2_K);
        case StorageType::Q3_K: return blocks * sizeof(BlockQ3_K);
    }
    return 0;
}

void decode_sub_block(StorageType type, const uint8_t* row, int64_t b, SubBlock& out) {
    out.mul[0] = out.mul[1] = 1;
    out.min[0] = out.min[1] = 0;
    out.dm = out.mw = 0.0f;
    out.is_signed = false;
    switch (type) {
        case StorageType::Q4_0: case StorageType::Q4_1: {
            const uint8_t* qs = type == StorageType::Q4_0 ? reinterpret_cast<const BlockQ4_0*>(row)[b].qs
                                                    : reinterpret_cast<const BlockQ4_1*>(row)[b].qs;
            const int bias = type == StorageType::Q4_0 ? 8 : 0;  // Q4_0's codes are signed: q - 8
            for (int j = 0; j < 16; ++j) {
                out.code[j] = static_cast<uint8_t>((qs[j] & 0x0F) - bias);
                out.code[j + 16] = static_cast<uint8_t>((qs[j] >> 4) - bias);
            }
            if (type == StorageType::Q4_0) {
                out.dw = fp16_to_fp32(reinterpret_cast<const BlockQ4_0*>(row)[b].d);
                out.is_signed = true;
            } else {
                out.dw = fp16_to_fp32(reinterpret_cast<const BlockQ4_1*>(row)[b].d);
                out.mw = fp16_to_fp32(reinterpret_cast<const BlockQ4_1*>(row)[b].m);
            }
            return;
        }
        case StorageType::Q8_0: {
            const BlockQ8_0& blk = reinterpret_cast<const BlockQ8_0*>(row)[b];
            std::memcpy(out.code, blk.qs, kBlock);
            out.dw = fp16_to_fp32(blk.d);
            out.is_signed = true;
            return;
        }
        case StorageType::Q4_K: case StorageType::Q5_K: {
            const int j = static_cast<int>(b % 8);
            const uint8_t *scales, *qs;
            uint16_t d, dmin;
            if (type == StorageType::Q4_K) {
                const BlockQ4_K& blk = reinterpret_cast<const BlockQ4_K*>(row)[b / 8];
                scales = blk.scales, qs = blk.qs, d = blk.d, dmin = blk.dmin;
            } else {
                const BlockQ5_K& blk = reinterpret_cast<const BlockQ5_K*>(row)[b / 8];
                scales = blk.scales, qs = blk.qs, d = blk.d, dmin = blk.dmin;
            }
            // Sub-blocks 2c and 2c + 1 are the low and high nibbles of the same 32 bytes.
            const uint8_t* q = qs + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int l = 0; l < kBlock; ++l) out.code[l] = (q[l] >> shift) & 0x0F;
            if (type == StorageType::Q5_K) {
                const uint8_t* qh = reinterpret_cast<const BlockQ5_K*>(row)[b / 8].qh;
                for (int l = 0; l < kBlock; ++l) out.code[l] |= ((qh[l] >> j) & 1) << 4;
            }
            int scale, min;
            k_scale_min(j, scales, scale, min);
            out.dw = fp16_to_fp32(d) * static_cast<float>(scale);
            out.mw = -fp16_to_fp32(dmin) * static_cast<float>(min);
            return;
        }
        case StorageType::Q6_K: {
            const BlockQ6_K& blk = reinterpret_cast<const BlockQ6_K*>(row)[b / 8];
            const int j = static_cast<int>(b % 8), half = j / 4, part = j % 4;
            const uint8_t* ql = blk.ql + 64 * half + 32 * (part & 1);
            const uint8_t* qh = blk.qh + 32 * half;
            const int shift = 4 * (part / 2);
            for (int l = 0; l < kBlock; ++l) {
                const int q = ((ql[l] >> shift) & 0x0F) | (((qh[l] >> (2 * part)) & 3) << 4);
                out.code[l] = static_cast<uint8_t>(static_cast<int8_t>(q - 32));
            }
            out.mul[0] = blk.scales[8 * half + 2 * part];
            out.mul[1] = blk.scales[8 * half + 2 * part + 1];
            out.dw = fp16_to_fp32(blk.d);
            out.is_signed = true;
            return;
        }
        case StorageType::Q5_0: case StorageType::Q5_1: {
            const bool offset = type == StorageType::Q5_1;
            const uint8_t* blk = row + b * (offset ? sizeof(BlockQ5_1) : sizeof(BlockQ5_0));
            uint16_t d, m;
            uint32_t qh;
            std::memcpy(&d, blk, 2);
            std::memcpy(&qh, blk + (offset ? 4 : 2), 4);
            const uint8_t* qs = blk + (offset ? 8 : 6);
            const int bias = offset ? 0 : 16;  // Q5_0's codes are signed: q - 16
            for (int j = 0; j < 16; ++j) {
                out.code[j] = static_cast<uint8_t>(((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - bias);
                out.code[j + 16] = static_cast<uint8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
            }
            out.dw = fp16_to_fp32(d);
            if (offset) {
                std::memcpy(&m, blk + 2, 2);
                out.mw = fp16_to_fp32(m);
            }
            out.is_signed = !offset;
            return;
        }
        case StorageType::IQ4_NL: case StorageType::MXFP4: {
            const bool mx = type == StorageType::MXFP4;
            const uint8_t* qs = mx ? reinterpret_cast<const BlockMXFP4*>(row)[b].qs
                                   : reinterpret_cast<const BlockIQ4_NL*>(row)[b].qs;
            const int8_t* values = mx ? kMXFP4Values : kIQ4NLValues;
            for (int j = 0; j < 16; ++j) {
                out.code[j] = static_cast<uint8_t>(values[qs[j] & 0x0F]);
                out.code[j + 16] = static_cast<uint8_t>(values[qs[j] >> 4]);
            }
            out.dw = mx ? mxfp4_scale(reinterpret_cast<const BlockMXFP4*>(row)[b].e)
                        : fp16_to_fp32(reinterpret_cast<const BlockIQ4_NL*>(row)[b].d);
            out.is_signed = true;
            return;
        }
        case StorageType::IQ4_XS: {
            const BlockIQ4_XS& blk = reinterpret_cast<const BlockIQ4_XS*>(row)[b / 8];
            const int j = static_cast<int>(b % 8);
            const uint8_t* qs = blk.qs + 16 * j;
            for (int l = 0; l < 16; ++l) {
                out.code[l] = static_cast<uint8_t>(kIQ4NLValues[qs[l] & 0x0F]);
                out.code[l + 16] = static_cast<uint8_t>(kIQ4NLValues[qs[l] >> 4]);
            }
            out.dw = fp16_to_fp32(blk.d) * static_cast<float>(iq4_xs_scale(blk, j));
            out.is_signed = true;
            return;
        }
        case StorageType::Q2_K: case StorageType::Q3_K: {
            // Sub-block j (0..7) of a super-block: bits 2 (j % 4) of its half's 32 bytes of qs (half j / 4).
            const int j = static_cast<int>(b % 8), shift = 2 * (j % 4);
            if (type == StorageType::Q2_K) {
                const BlockQ2_K& blk = reinterpret_cast<const BlockQ2_K*>(row)[b / 8];
                const uint8_t* qs = blk.qs + 32 * (j / 4);
                for (int l = 0; l < kBlock; ++l) out.code[l] = (qs[l] >> shift) & 3;
                for (int h = 0; h < 2; ++h) {
                    out.mul[h] = blk.scales[2 * j + h] & 0x0F;
                    out.min[h] = blk.scales[2 * j + h] >> 4;
                }
                out.dw = fp16_to_fp32(blk.d);
                out.dm = -fp16_to_fp32(blk.dmin);
                return;
            }
            const BlockQ3_K& blk = reinterpret_cast<const BlockQ3_K*>(row)[b / 8];
            const uint8_t* qs = blk.qs + 32 * (j / 4);
            for (int l = 0; l < kBlock; ++l) {  // the 3rd bit (bit j of hmask's bytes) set means no offset of -4
                const int q = ((qs[l] >> shift) & 3) | (((blk.hmask[l] >> j) & 1) << 2);
                out.code[l] = static_cast<uint8_t>(static_cast<int8_t>(q - 4));
            }
            int8_t scales[16];
            q3_k_scales(blk.scales, scales);
            out.mul[0] = scales[2 * j];
            out.mul[1] = scales[2 * j + 1];
            out.dw = fp16_to_fp32(blk.d);
            out.is_signed = true;
            return;
        }
        case StorageType::F32: case StorageType::F16: case StorageType::BF16: case StorageType::F8_E4M3: break;
    }
    throw std::invalid_argument("decode_sub_block takes quantized storage types only");
}

}  // namespace pocketllm
