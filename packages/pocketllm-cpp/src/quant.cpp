#include "pocketllm_cpp/quant.h"

#include <stdexcept>

namespace pocketllm {

QType parse_qtype(const std::string& name) {
    if (name == "F32") return QType::F32;
    if (name == "F16") return QType::F16;
    if (name == "Q4_0") return QType::Q4_0;
    if (name == "Q4_1") return QType::Q4_1;
    if (name == "Q8_0") return QType::Q8_0;
    throw std::invalid_argument("storage type '" + name + "' is not one of F32, F16, Q4_0, Q4_1, Q8_0");
}

bool is_block_type(QType type) { return type != QType::F32 && type != QType::F16; }

size_t row_bytes(QType type, int64_t cols) {
    switch (type) {
        case QType::F32: return static_cast<size_t>(cols) * 4;
        case QType::F16: return static_cast<size_t>(cols) * 2;
        case QType::Q4_0: return static_cast<size_t>(cols / kBlock) * sizeof(BlockQ4_0);
        case QType::Q4_1: return static_cast<size_t>(cols / kBlock) * sizeof(BlockQ4_1);
        case QType::Q8_0: return static_cast<size_t>(cols / kBlock) * sizeof(BlockQ8_0);
    }
    return 0;
}

}  // namespace pocketllm
