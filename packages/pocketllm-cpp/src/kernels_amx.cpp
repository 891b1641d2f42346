// AMX (Intel's tile matrix unit, Sapphire Rapids on): the batched products of the 32-value block types and of
// Q4_K, Q5_K and IQ4_XS, 16 weight rows against 16 activation rows a block at a time. Everything else (decode's one
// row, the per-16-scale types, float weights, a few rows) is the AVX-512 build's. Compiled with AVX-512 VNNI and
// AMX-INT8 flags alone (CMakeLists.txt); called only after isa.cpp checked the CPU, and runs the tiles only once
// Linux granted this process their state (amx_tiles_granted).
//
// The tiles compute each block's exact integer dot products (signed activations against signed or unsigned codes:
// tdpbssd, tdpbsud), and the float steps after them are packed_tile's, in its order: per weight and activation row,
// lane k (0..7) accumulates blocks k, k + 8, ... as fma(sum, dw * dx) then fma(mw, sx), the lanes are added by
// hsum's tree, then the tail blocks' sums and offsets as tail_rows adds them. So a row's results are the same bits
// as the AVX-512 build's, batched or alone: a seed draws the same tokens whatever runs beside it and whichever path
// ran. Measured against the AVX-512 kernels: kernels.h (kAmxMinRows) and docs/quantization.md.
#define PLLM_VNNI 1
#define PLLM_TILE_ROWS 4
#define PLLM_TILE_ACT 4
#include "kernels_x86.inl"
#include "pocketllm_cpp/isa.h"

namespace pocketllm::kernels {
namespace {

// Weight rows per panel, activation rows per A tile, int32 columns per C tile.
constexpr int kTile = static_cast<int>(kAmxPanelRows);
static_assert(kTile == 16, "a tile holds 16 rows of 64 bytes");

// ldtilecfg's 64-byte operand, palette 1: tile i is rows[i] rows of colsb[i] bytes.
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};
// Tiles 0-3: two pairs of A and B (16 activation rows of one block's 32 codes; one block of 16 weight rows in the
// tiles' layout, row v holding bytes 4v..4v + 3 of each weight row). Tiles 4-6: three C tiles (the 16 x 16 int32
// block sums). Steps use them in turn, so that two blocks' products run while a third block's sums are scaled.
TileConfig tile_config() {
    TileConfig config;
    for (int pair = 0; pair < 2; ++pair) {
        config.rows[2 * pair] = kTile;
        config.colsb[2 * pair] = kBlock;
        config.rows[2 * pair + 1] = kBlock / 4;
        config.colsb[2 * pair + 1] = 4 * kTile;
    }
    for (int c = 4; c < 7; ++c) {
        config.rows[c] = kTile;
        config.colsb[c] = 4 * kTile;
    }
    return config;
}

struct alignas(64) TileBlock {
    uint8_t codes[kBlock / 4][kTile][4];  // [word][weight row]
};

// 16 weight rows' blocks, decoded once for every activation row: the codes as signed or unsigned bytes (never
// biased: the tiles take either sign), and each block's scales and offsets as 16 lanes.
struct Panel {
    std::vector<TileBlock> blocks;
    std::vector<float> dw, mw;  // [block][weight row]
};

// 16 rows' codes of one block (codes[c]: weight row c's 32) into its B tile: rows 0-7 and 8-15 transposed by words.
inline void store_tile_block(const __m256i (&codes)[kTile], TileBlock& out) {
    __m256i low[8], high[8];
    for (int c = 0; c < 8; ++c) {
        low[c] = codes[c];
        high[c] = codes[c + 8];
    }
    transpose8(low);
    transpose8(high);
    for (int v = 0; v < 8; ++v) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(out.codes[v][0]), low[v]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(out.codes[v][8]), high[v]);
    }
}

// Blocks [0, nb) of 16 weight rows from `base`: whole groups of 8 as the batched kernels decode them (scales8,
// k_block), and a 32-value type's tail blocks (after the last whole group) one by one, as tail_rows' TailBlocks.
template <StorageType T>
void pack_panel(const uint8_t* base, size_t stride, int64_t nb, Panel& panel) {
    const int64_t full = nb / 8 * 8;
    panel.blocks.resize(static_cast<size_t>(nb));
    panel.dw.resize(static_cast<size_t>(nb * kTile));
    panel.mw.resize(panel.dw.size());
    for (int64_t b0 = 0; b0 < full; b0 += 8) {
        __m256i codes[8][kTile];  // [block of the group][weight row]
        alignas(32) float dw[kTile][8], mw[kTile][8];
        for (int c = 0; c < kTile; ++c) {
            const uint8_t* row = base + c * static_cast<int64_t>(stride);
            __m256i block[8];
            if constexpr (!kBlock32<T>) {  // a group is one 256-value block
                __m256 d, m;
                const KBlock<T>& blk = reinterpret_cast<const KBlock<T>*>(row)[b0 / 8];
                prefetch_ahead(blk, kPrefetchBytes);
                k_block<T>(blk, block, d, m);
                _mm256_store_ps(dw[c], d);
                _mm256_store_ps(mw[c], m);
                if constexpr (kBiased<T>) {
                    for (__m256i& v : block) v = biased(v);  // w + 128 back to w
                }
            } else {
                scales8<T>(row, b0, dw[c], mw[c]);
                for (int k = 0; k < 8; ++k) {
                    prefetch<T>(row, b0 + k);
                    block[k] = decode<T>(row, b0 + k).codes;
                }
            }
            for (int k = 0; k < 8; ++k) codes[k][c] = block[k];
        }
        for (int k = 0; k < 8; ++k) {
            store_tile_block(codes[k], panel.blocks[static_cast<size_t>(b0 + k)]);
            for (int c = 0; c < kTile; ++c) {
                panel.dw[static_cast<size_t>((b0 + k) * kTile + c)] = dw[c][k];
                if constexpr (kOffset<T>) panel.mw[static_cast<size_t>((b0 + k) * kTile + c)] = mw[c][k];
            }
        }
    }
    if constexpr (kBlock32<T>) {  // the 256-value block types have no tail
        for (int64_t b = full; b < nb; ++b) {
            __m256i codes[kTile];
            for (int c = 0; c < kTile; ++c) {
                const Sub sub = decode<T>(base + c * static_cast<int64_t>(stride), b);
                codes[c] = sub.codes;
                panel.dw[static_cast<size_t>(b * kTile + c)] = sub.dw;
                panel.mw[static_cast<size_t>(b * kTile + c)] = sub.mw;
            }
            store_tile_block(codes, panel.blocks[static_cast<size_t>(b)]);
        }
    }
}

// Step i's integer sums begun: its A tile (tile i of the activation rows' plane, QuantizedRows::tiles) and the
// panel's block b loaded into pair i % 2, and their product into C tile i % 3, zeroed (signed codes: tdpbssd;
// unsigned: tdpbsud). GCC's tile intrinsics are macros that paste the tile's number into the instruction, so each
// of the 6 combinations is written out.
template <StorageType T>
inline void start_step(const Panel& panel, const int8_t* tiles, int64_t i, int64_t b) {
    const uint8_t* weights = panel.blocks[static_cast<size_t>(b)].codes[0][0];
    const int8_t* codes = tiles + i * kTile * kBlock;
#define PLLM_START_STEP(A, B, C)                       \
    _tile_loadd(A, codes, kBlock);                     \
    _tile_loadd(B, weights, 4 * kTile);                \
    _tile_zero(C);                                     \
    if constexpr (kOffset<T>) {                        \
        _tile_dpbsud(C, A, B);                         \
    } else {                                           \
        _tile_dpbssd(C, A, B);                         \
    }                                                  \
    break;
    switch (i % 6) {
        case 0: PLLM_START_STEP(0, 1, 4)
        case 1: PLLM_START_STEP(2, 3, 5)
        case 2: PLLM_START_STEP(0, 1, 6)
        case 3: PLLM_START_STEP(2, 3, 4)
        case 4: PLLM_START_STEP(0, 1, 5)
        default: PLLM_START_STEP(2, 3, 6)
    }
#undef PLLM_START_STEP
}

// Step i's block sums (C tile i % 3) into `sums`.
inline void store_step(int64_t i, int32_t (*sums)[kTile]) {
    switch (i % 3) {
        case 0: _tile_stored(4, sums, 4 * kTile); break;
        case 1: _tile_stored(5, sums, 4 * kTile); break;
        default: _tile_stored(6, sums, 4 * kTile); break;
    }
}

// The first `rows` (1..16; Full: 16) activation rows of one tile of the A plane (`tiles`) against a panel:
// y[m * y_stride + c] for weight row c. dx and sx: the first row's block scales and offsets (row stride nb). Step
// i takes block order[i]: first the whole groups, lane k's blocks (k, k + 8, ...) steps k * groups on, then the tail
// blocks, in the order the plane holds their A tiles. Two steps' products run while a third step's sums are scaled.
// A row's result is packed_tile's and then tail_rows': the lanes by hsum's tree, plus the tail's sums, plus the
// tail's offsets.
template <StorageType T, bool Full>
void panel_tile(const Panel& panel, const std::vector<int32_t>& order, int64_t groups, const int8_t* tiles,
                const float* dx, const float* sx, int64_t nb, int rows, float* y, int64_t y_stride) {
    alignas(64) float lanes[8][kTile][kTile];  // [lane k][activation row][weight row]: all written (groups >= 1)
    alignas(64) int32_t sums[kTile][kTile];
    const int64_t full = 8 * groups;
    __m512 acc[kTile];
    start_step<T>(panel, tiles, 0, order[0]);
    if (nb > 1) start_step<T>(panel, tiles, 1, order[1]);
    for (int64_t i = 0, g = 0; i < nb; ++i) {
        const bool grouped = i < full;  // the tail's offsets are summed apart, after
        if ((grouped && g == 0) || i == full) {  // a lane's first block, or the tail's
#pragma GCC unroll 16
            for (int m = 0; m < kTile; ++m) acc[m] = _mm512_setzero_ps();
        }
        store_step(i, sums);
        if (i + 2 < nb) start_step<T>(panel, tiles, i + 2, order[static_cast<size_t>(i + 2)]);
        if (i + 4 < nb) {  // a later step's A tile (the next two are loading)
            _mm_prefetch(reinterpret_cast<const char*>(tiles + (i + 4) * kTile * kBlock), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(tiles + (i + 4) * kTile * kBlock + 256), _MM_HINT_T0);
        }
        const int64_t b = order[static_cast<size_t>(i)];
        const __m512 dw = _mm512_loadu_ps(panel.dw.data() + b * kTile);
        const __m512 mw = _mm512_loadu_ps(panel.mw.data() + b * kTile);
#pragma GCC unroll 16
        for (int m = 0; m < kTile; ++m) {
            if (!Full && m >= rows) break;
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[m * nb + b]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[m])), scale, acc[m]);
            if (kOffset<T> && grouped) acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[m * nb + b]), acc[m]);
        }
        if (grouped && ++g == groups) {
#pragma GCC unroll 16
            for (int m = 0; m < kTile; ++m) _mm512_store_ps(lanes[i / groups][m], acc[m]);
            g = 0;
        }
    }
    for (int m = 0; m < rows; ++m) {  // hsum's tree over the lanes: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
        const auto lane = [&](int k) { return _mm512_load_ps(lanes[k][m]); };
        const __m512 even = _mm512_add_ps(_mm512_add_ps(lane(0), lane(4)), _mm512_add_ps(lane(2), lane(6)));
        const __m512 odd = _mm512_add_ps(_mm512_add_ps(lane(1), lane(5)), _mm512_add_ps(lane(3), lane(7)));
        __m512 out = _mm512_add_ps(even, odd);
        if (nb > full) {
            out = _mm512_add_ps(out, acc[m]);  // the tail's sums
            if constexpr (kOffset<T>) {
                __m512 extra = _mm512_setzero_ps();
                for (int64_t b = full; b < nb; ++b) {
                    extra = _mm512_fmadd_ps(_mm512_loadu_ps(panel.mw.data() + b * kTile), _mm512_set1_ps(sx[m * nb + b]),
                                            extra);
                }
                out = _mm512_add_ps(out, extra);
            }
        }
        _mm512_storeu_ps(y + m * y_stride, out);
    }
}

// Weight rows [row, row + 16) against all n activation rows.
template <StorageType T>
void panel_rows(const WeightView& w, size_t stride, int64_t row, const QuantizedRows& act, int64_t n, float* y,
                int64_t y_stride) {
    const int64_t nb = w.cols / kBlock, groups = nb / 8;
    const uint8_t* base = w.data + row * static_cast<int64_t>(stride);
    thread_local Panel panel;
    pack_panel<T>(base, stride, nb, panel);
    prefetch_rows(w, stride, row + kTile, kTile);
    thread_local std::vector<int32_t> order;  // step i's block (panel_tile)
    order.resize(static_cast<size_t>(nb));
    for (int64_t i = 0; i < nb; ++i) {
        order[static_cast<size_t>(i)] = static_cast<int32_t>(i < 8 * groups ? (i % groups) * 8 + i / groups : i);
    }
    for (int64_t r = 0; r < n; r += kTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kTile, n - r));
        const int8_t* tiles = act.tiles.data() + r * nb * kBlock;
        const float *dx = act.d.data() + r * nb, *sx = act.s.data() + r * nb;
        if (rows == kTile) {
            panel_tile<T, true>(panel, order, groups, tiles, dx, sx, nb, rows, y + r * y_stride + row, y_stride);
        } else {
            panel_tile<T, false>(panel, order, groups, tiles, dx, sx, nb, rows, y + r * y_stride + row, y_stride);
        }
    }
}

template <StorageType T>
void gemm_panels(const WeightView& w, int64_t row_begin, int64_t row_end, const QuantizedRows& act, const float* x,
                 int64_t n, float* y, int64_t y_stride) {
    const size_t stride = row_bytes(w.type, w.cols);
    const int64_t whole = (row_end - row_begin) / kTile * kTile;
    if (whole > 0) {
        static const TileConfig config = tile_config();
        _tile_loadconfig(&config);
        for (int64_t row = row_begin; row < row_begin + whole; row += kTile) {
            panel_rows<T>(w, stride, row, act, n, y, y_stride);
        }
        _tile_release();  // back to the initial state: a context switch then saves no tile data
    }
    if (row_begin + whole < row_end) gemm_avx512(w, row_begin + whole, row_end, act, x, n, y, y_stride);
}

}  // namespace

void gemm_amx(const WeightView& w, int64_t row_begin, int64_t row_end, const QuantizedRows& act, const float* x,
              int64_t n, float* y, int64_t y_stride) {
    if (amx_takes(w, n, false) && !act.tiles.empty() && amx_tiles_granted()) {
        switch (w.type) {
            case StorageType::Q4_0: return gemm_panels<StorageType::Q4_0>(w, row_begin, row_end, act, x, n, y, y_stride);
            case StorageType::Q4_1: return gemm_panels<StorageType::Q4_1>(w, row_begin, row_end, act, x, n, y, y_stride);
            case StorageType::Q5_0: return gemm_panels<StorageType::Q5_0>(w, row_begin, row_end, act, x, n, y, y_stride);
            case StorageType::Q5_1: return gemm_panels<StorageType::Q5_1>(w, row_begin, row_end, act, x, n, y, y_stride);
            case StorageType::Q8_0: return gemm_panels<StorageType::Q8_0>(w, row_begin, row_end, act, x, n, y, y_stride);
            case StorageType::IQ4_NL: return gemm_panels<StorageType::IQ4_NL>(w, row_begin, row_end, act, x, n, y, y_stride);
            case StorageType::MXFP4: return gemm_panels<StorageType::MXFP4>(w, row_begin, row_end, act, x, n, y, y_stride);
            case StorageType::Q4_K: return gemm_panels<StorageType::Q4_K>(w, row_begin, row_end, act, x, n, y, y_stride);
            case StorageType::Q5_K: return gemm_panels<StorageType::Q5_K>(w, row_begin, row_end, act, x, n, y, y_stride);
            case StorageType::IQ4_XS: return gemm_panels<StorageType::IQ4_XS>(w, row_begin, row_end, act, x, n, y, y_stride);
            default: break;
        }
    }
    gemm_avx512(w, row_begin, row_end, act, x, n, y, y_stride);
}

}  // namespace pocketllm::kernels
