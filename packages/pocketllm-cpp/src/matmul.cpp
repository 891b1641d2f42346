#include "kernels.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "pocketllm_cpp/isa.h"

namespace pocketllm {
namespace {

// Activation rows a product takes at once; more run a block at a time, each block its own product. A batched
// kernel packs a few weight rows and then sweeps every activation row: 256 rows of quantized activations (about
// 330 KB at 1,024 columns) stay in L2 across the sweeps, where 2,048 rows came from L3 for each. Measured on a
// Xeon (two threads, the Qwen3.5-0.8B file's matrices, pocketbench.gemm against an unblocked build): at 2,048
// rows the AVX-512 kernels 1.4-2.1x faster, AVX2's 1.2-1.6x, and at 512 rows up to 1.6x and 1.2x; on the AMX
// tiles Q4_K 1.0-1.07x. Blocks of 128 rows measured the same as 256, blocks of 512 0.85-0.95x of it.
constexpr int64_t kRowBlock = 256;

// Whether AMX's tiles run this product (see gemm_amx).
bool on_tiles(const GroupedProduct& p, bool exact) {
    return current_isa() == Isa::Amx && kernels::amx_takes(*p.w, p.n, exact);
}

// The largest tile of weight rows, which tasks never split: AMX's panels for a product its tiles run, else 4.
int64_t rows_per_task(const GroupedProduct& p, bool exact) { return on_tiles(p, exact) ? kernels::kAmxPanelRows : 4; }

kernels::Gemm gemm_for(StorageType type, bool exact) {
    if (exact && is_quantized(type)) return kernels::gemm_exact;
#ifdef POCKETLLM_HAVE_X86
    switch (current_isa()) {
#ifdef POCKETLLM_HAVE_AMX
        case Isa::Amx: return kernels::gemm_amx;
#else
        case Isa::Amx: break;  // never selected: isa.cpp reports it unavailable in this build
#endif
        case Isa::Avx512: return kernels::gemm_avx512;
        case Isa::Avx2: return kernels::gemm_avx2;
        case Isa::Scalar:
        case Isa::Neon: break;
    }
#endif
#ifdef POCKETLLM_HAVE_NEON
    if (current_isa() == Isa::Neon) return kernels::gemm_neon;
#endif
    return kernels::gemm_scalar;
}

}  // namespace

void validate(const WeightView& w, int64_t data_bytes) {
    if (w.rows <= 0 || w.cols <= 0) {
        throw std::invalid_argument("weight shape [" + std::to_string(w.rows) + ", " + std::to_string(w.cols) +
                                    "] must be positive");
    }
    const int64_t multiple = std::max<int64_t>(kBlock, block_values(w.type));
    if (w.cols % multiple != 0) {
        throw std::invalid_argument("input features " + std::to_string(w.cols) + " are not a multiple of " +
                                    std::to_string(multiple));
    }
    const size_t per_row = row_bytes(w.type, w.cols);
    size_t expected = 0;
    if (__builtin_mul_overflow(per_row, static_cast<size_t>(w.rows), &expected) ||
        expected != static_cast<size_t>(data_bytes)) {
        throw std::invalid_argument("weight has " + std::to_string(data_bytes) +
                                    " bytes; its shape and storage type need " + std::to_string(per_row) +
                                    " per row for " + std::to_string(w.rows) + " rows");
    }
    if ((w.type == StorageType::F8_E4M3) != (w.scales != nullptr)) {
        throw std::invalid_argument(w.type == StorageType::F8_E4M3 ? "an F8_E4M3 weight needs its scales"
                                                                    : "only F8_E4M3 weights take scales");
    }
    // Block fields are 16-bit, F32 rows 32-bit: GGUF aligns tensors to 32 bytes, and so must any other caller.
    const size_t alignment = w.type == StorageType::F32 ? 4 : w.type == StorageType::F8_E4M3 ? 1 : 2;
    if (reinterpret_cast<uintptr_t>(w.data) % alignment != 0) {
        throw std::invalid_argument("weight data is not " + std::to_string(alignment) + "-byte aligned");
    }
}

void quantize_activations(const float* x, int64_t n, int64_t cols, QuantizedRows& out, ThreadPool* pool,
                          ActivationPlanes planes) {
    const bool grouped = planes.grouped, sums16 = planes.sums16;
    out.rows = n;
    out.cols = cols;
    out.qs.resize(static_cast<size_t>(n * cols));
    out.d.resize(static_cast<size_t>(n * (cols / kBlock)));
    out.s.resize(out.d.size());
    out.grouped.resize(grouped ? out.qs.size() : 0);
    out.sums16.resize(sums16 ? out.qs.size() / 16 : 0);
    const int64_t nb = cols / kBlock, tail = grouped ? nb % 8 : 0, tails = (n + 7) / 8 * 8 * tail;  // rows x blocks
    out.tail_codes.assign(static_cast<size_t>(tails * kBlock), 0);
    out.tail_d.assign(static_cast<size_t>(tails), 0.0f);
    out.tail_s.assign(static_cast<size_t>(tails), 0.0f);
    out.tail_sums.assign(static_cast<size_t>(tails), 0);
    const int64_t groups = nb / 8, tile_bytes = 16 * kBlock;
    out.tiles.assign(planes.tiles ? static_cast<size_t>((n + 15) / 16 * nb * tile_bytes) : 0, 0);
    auto quantize = kernels::quantize_row_scalar;
#ifdef POCKETLLM_HAVE_X86
    if (current_isa() != Isa::Scalar) quantize = kernels::quantize_row_avx2;
#endif
#ifdef POCKETLLM_HAVE_NEON
    if (current_isa() == Isa::Neon) quantize = kernels::quantize_row_neon;
#endif
    auto rows = [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const int64_t b = r * (cols / kBlock);
            quantize(x + r * cols, cols, out.qs.data() + r * cols, out.d.data() + b, out.s.data() + b);
            const int8_t* from = out.qs.data() + r * cols;
            if (sums16) {
                int16_t* sums = out.sums16.data() + r * (cols / 16);
                for (int64_t g = 0; g < cols / 16; ++g) {
                    int sum = 0;
                    for (int k = 0; k < 16; ++k) sum += from[16 * g + k];
                    sums[g] = static_cast<int16_t>(sum);
                }
            }
            if (planes.tiles) {  // row r % 16 of its tile of each block
                int8_t* tile = out.tiles.data() + (r / 16) * nb * tile_bytes + (r % 16) * kBlock;
                for (int64_t b = 0; b < nb; ++b) {
                    const int64_t step = b < 8 * groups ? (b % 8) * groups + b / 8 : b;
                    std::memcpy(tile + step * tile_bytes, from + b * kBlock, kBlock);
                }
            }
            if (!grouped) continue;
            int8_t* to = out.grouped.data() + r * cols;
            for (int64_t g = 0; g + 8 * kBlock <= cols; g += 8 * kBlock) {
                for (int v = 0; v < 8; ++v) {
                    for (int k = 0; k < 8; ++k) std::memcpy(to + g + v * kBlock + 4 * k, from + g + k * kBlock + 4 * v, 4);
                }
            }
            // The tail plane: row r is lane r % 8 of its group of 8 rows, in each of the group's tail blocks.
            const int64_t lane = r % 8;
            for (int64_t k = 0; k < tail; ++k) {
                const int64_t block = nb - tail + k, first = ((r / 8) * tail + k) * 8;  // the group's block k
                const int8_t* codes = from + block * kBlock;
                for (int v = 0; v < 8; ++v) {
                    std::memcpy(&out.tail_codes[static_cast<size_t>((first + v) * kBlock + 4 * lane)], codes + 4 * v, 4);
                }
                int32_t sum = 0;
                for (int j = 0; j < kBlock; ++j) sum += codes[j];
                const size_t at = static_cast<size_t>(first + lane);
                out.tail_d[at] = out.d[static_cast<size_t>(r * nb + block)];
                out.tail_s[at] = out.s[static_cast<size_t>(r * nb + block)];
                out.tail_sums[at] = sum;
            }
        }
    };
    if (pool != nullptr && n >= 16) return pool->parallel_for(n, rows);  // a prompt's rows: worth a region
    rows(0, n);
}

void matmul(const WeightView& w, const float* x, int64_t n, float* y, ThreadPool& pool, bool exact) {
    matmul_many({{&w, y}}, x, n, pool, exact);
}

void matmul_many(const std::vector<Product>& products, const float* x, int64_t n, ThreadPool& pool, bool exact) {
    std::vector<GroupedProduct> grouped;
    grouped.reserve(products.size());
    for (const Product& p : products) {
        if (p.w->cols != products[0].w->cols) throw std::invalid_argument("products of one input must take the same columns");
        grouped.push_back({p.w, x, n, p.y});
    }
    matmul_grouped(grouped, pool, exact);
}

void matmul_grouped(const std::vector<GroupedProduct>& products, ThreadPool& pool, bool exact) {
    int64_t most = 0;
    for (const GroupedProduct& p : products) most = std::max(most, p.n);
    if (most > kRowBlock) {  // a block of rows at a time, each its own product (rows are independent: same bits)
        for (int64_t r0 = 0; r0 < most; r0 += kRowBlock) {
            std::vector<GroupedProduct> block;
            for (const GroupedProduct& p : products) {
                if (p.n > r0) block.push_back({p.w, p.x + r0 * p.w->cols, std::min(kRowBlock, p.n - r0), p.y + r0 * p.w->rows});
            }
            matmul_grouped(block, pool, exact);
        }
        return;
    }
    // The distinct inputs: a product with its predecessor's x, n and columns shares its quantization.
    struct Input {
        const float* x;
        int64_t n, cols;
        bool quantized;  // some product of it multiplies blocks with 8-bit activations
        bool tiles;      // some product of it runs on AMX's tiles
    };
    std::vector<Input> inputs;
    std::vector<size_t> input(products.size());  // product i's input
    int64_t rows_to_quantize = 0;
    for (size_t i = 0; i < products.size(); ++i) {
        const GroupedProduct& p = products[i];
        const bool quantized = is_quantized(p.w->type) && !exact && p.n > 0;
        const Input* last = inputs.empty() ? nullptr : &inputs.back();
        if (last == nullptr || last->x != p.x || last->n != p.n || last->cols != p.w->cols) {
            inputs.push_back({p.x, p.n, p.w->cols, false, false});
        }
        input[i] = inputs.size() - 1;
        if (quantized && !inputs.back().quantized) rows_to_quantize += p.n;
        inputs.back().quantized |= quantized;
        inputs.back().tiles |= on_tiles(p, exact);
    }
    // The calling thread's buffers, reused: a decode step quantizes a few hundred small inputs. Workers read them
    // through this reference (a thread_local named in the task would be each worker's own, empty one).
    thread_local std::vector<QuantizedRows> buffer;
    if (buffer.size() < inputs.size()) buffer.resize(inputs.size());
    std::vector<QuantizedRows>& buffers = buffer;
    auto quantize = [&](size_t k, ThreadPool* rows_pool) {
        const Input& in = inputs[k];
        if (!in.quantized) return;
        // The x86 kernels' batched tiles read the codes grouped (see kernels_x86.inl's PackedGroup), and the
        // per-16-scale kernels (Q2_K, Q3_K, Q6_K) each 16 codes' sum.
        // AMX's tiles read theirs from a plane of their own.
        ActivationPlanes planes;
#ifdef POCKETLLM_HAVE_X86
        planes.sums16 = current_isa() != Isa::Scalar;
        planes.grouped = in.n > 1 && planes.sums16;
        planes.tiles = in.tiles;
#endif
        quantize_activations(in.x, in.n, in.cols, buffers[k], rows_pool, planes);
    };
    if (inputs.size() == 1) {
        quantize(0, &pool);  // its rows split over the pool when many
    } else if (rows_to_quantize >= 16) {  // inputs over the pool
        pool.parallel_each(static_cast<int64_t>(inputs.size()), [&](int64_t k) { quantize(static_cast<size_t>(k), nullptr); });
    } else {
        for (size_t k = 0; k < inputs.size(); ++k) quantize(k, nullptr);
    }
    // Tasks of rows_per_task weight rows over every product: first[i] is product i's first task.
    std::vector<int64_t> first(products.size() + 1, 0), task_rows(products.size());
    for (size_t i = 0; i < products.size(); ++i) {
        task_rows[i] = rows_per_task(products[i], exact);
        const int64_t tasks = products[i].n > 0 ? (products[i].w->rows + task_rows[i] - 1) / task_rows[i] : 0;
        first[i + 1] = first[i] + tasks;
    }
    if (first.back() == 0) return;
    pool.parallel_for(first.back(), [&](int64_t begin, int64_t end) {
        // The product holding task `begin`, then the ones after it.
        size_t i = static_cast<size_t>(std::upper_bound(first.begin(), first.end(), begin) - first.begin()) - 1;
        for (; i < products.size() && first[i] < end; ++i) {
            const int64_t lo = std::max(begin, first[i]), hi = std::min(end, first[i + 1]);
            if (lo >= hi) continue;
            const GroupedProduct& p = products[i];
            const WeightView& w = *p.w;
            const int64_t row_begin = (lo - first[i]) * task_rows[i];
            const int64_t row_end = std::min(w.rows, (hi - first[i]) * task_rows[i]);
            gemm_for(w.type, exact)(w, row_begin, row_end, buffers[input[i]], p.x, p.n, p.y, w.rows);
        }
    });
}

float exp_shifted(float* x, int64_t n, float shift) {
    return kernels::attention_for(KvType::F32, 8).exp_shifted(x, n, shift);
}

float maximum(const float* x, int64_t n) { return kernels::attention_for(KvType::F32, 8).maximum(x, n); }

kernels::Attention kernels::attention_for(KvType kv, int64_t dim) {
#ifdef POCKETLLM_HAVE_X86
    if (current_isa() != Isa::Scalar && dim % 8 == 0) return attention_avx2(kv);
#endif
#ifdef POCKETLLM_HAVE_NEON
    if (current_isa() == Isa::Neon && dim % 4 == 0) return attention_neon(kv);
#endif
    (void)dim;
    return attention_scalar(kv);
}

void silu_mul(float* gate, const float* up, int64_t n) {
#ifdef POCKETLLM_HAVE_X86
    if (current_isa() != Isa::Scalar) return kernels::silu_mul_avx2(gate, up, n);
#endif
    kernels::silu_mul_scalar(gate, up, n);
}

void silu(float* x, int64_t n) {
#ifdef POCKETLLM_HAVE_X86
    if (current_isa() != Isa::Scalar) return kernels::silu_avx2(x, n);
#endif
    kernels::silu_scalar(x, n);
}

void dequantize(const WeightView& w, float* out) {
    for (int64_t row = 0; row < w.rows; ++row) dequantize_row(w, row, out + row * w.cols);
}

void dequantize_row(const WeightView& w, int64_t row, float* out) {
    const uint8_t* base = w.data + row * static_cast<int64_t>(row_bytes(w.type, w.cols));
    if (!is_quantized(w.type)) {
        for (int64_t i = 0; i < w.cols; ++i) out[i] = kernels::dense_value(w, base, row, i);
        return;
    }
    SubBlock sub;
    for (int64_t b = 0; b < w.cols / kBlock; ++b) {
        decode_sub_block(w.type, base, b, sub);
        for (int j = 0; j < kBlock; ++j) {
            const int code = sub.is_signed ? static_cast<int8_t>(sub.code[j]) : sub.code[j];
            // The order of gguf's dequantizers: (d * scale) * q, minus (dmin * min).
            const float scaled = sub.dw * static_cast<float>(sub.mul[j / 16]) * static_cast<float>(code);
            out[b * kBlock + j] = scaled + sub.dm * static_cast<float>(sub.min[j / 16]) + sub.mw;
        }
    }
}

}  // namespace pocketllm
