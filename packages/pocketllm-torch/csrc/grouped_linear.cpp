// y = x @ W.T for W kept in 4-bit groups (w = scale * code + offset per 32 inputs) or 8-bit ones
// (w = scale * code), x and y float32.
//
// torch's own int4 CPU kernel takes bf16 activations and dequantizes each weight block again for every four
// rows, so a decode batch of 8 costs four times a single row. This kernel never dequantizes: per group it
// accumulates x . codes for four rows in registers and applies the group's scale and offset once (measured in
// one process against dequantizing into registers: 10-14% faster at 4 and 8 rows, equal at 1). Activations
// stay float32, and every row is computed with the same sequence of operations whatever the batch: a
// sequence's logits do not depend on what it is batched with.
//
// Packed layout (see pocketllm_torch.native): [N / 16, K / 32, block bytes]. Block (n, g) holds the 16 outputs
// n*16.. and the 32 inputs g*32.. (the formats below say how), so a thread streams its outputs' blocks in order.
//
// The kernel serves every batch, prefill included: a row's numbers must not depend on how many rows share its
// step (a seeded request samples the same tokens alone and on a busy server). Up to 4 rows (decode) run as
// above; from 5 rows the kernel goes group by group, as a GEMM does (see below), at about the speed of oneDNN's
// float32 GEMM over the dequantized weights (measured on one Xeon core, 512 rows of a 3072 x 576 Q4 matrix:
// 59 against 64 GMAC/s with AVX-512, 29 against 33 with AVX2). Every path does the same float32 operations on
// each output, in the same order, so they all give the same bits. The vector paths are chosen at run time;
// the scalar path runs on any x86-64 and is tested against them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "isa.h"

namespace pocketllm {
namespace {

constexpr int64_t kOut = 16;    // outputs per block
constexpr int64_t kGroup = 32;  // inputs per block
constexpr int kMaxRows = 4;  // AVX2 rows computed together: 8 accumulators + dequantized weights fit in 16 registers
constexpr int64_t kMinRowsGroupMajor = 5;  // from this many rows, group by group (see below)
constexpr int64_t kTileRows = 128;  // rows whose activations a thread keeps in L2 while it streams weights

// 4-bit codes: per input, 8 bytes (output j in the low nibble of byte j, output j + 8 in its high nibble);
// then 16 float32 scales and 16 float32 offsets.
struct Int4 {
  static constexpr int64_t kCodeBytes = kGroup * kOut / 2;
  static constexpr int64_t kBlockBytes = kCodeBytes + 2 * kOut * sizeof(float);
  static constexpr bool kOffset = true;
  static float code(const uint8_t* codes, int64_t k, int j) {
    const uint8_t byte = codes[k * (kOut / 2) + j % (kOut / 2)];
    return static_cast<float>(j < kOut / 2 ? byte & 0xF : byte >> 4);
  }
#ifdef POCKETLLM_X86
  __attribute__((target("avx2,fma"))) static void codes_avx2(const uint8_t* codes, int64_t k, __m256& q0,
                                                              __m256& q1) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k * 8)));
    q0 = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF)));
    q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
  __attribute__((target("avx512f"))) static __m512 codes_avx512(const uint8_t* codes, int64_t k) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k * 8));
    const __m128i low = _mm_set1_epi8(0xF);
    // Outputs 0-7 from the low nibbles, 8-15 from the high ones.
    const __m128i nibbles = _mm_unpacklo_epi64(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles));
  }
#endif
};

// 8-bit codes (signed): per input, 16 bytes, one per output; then 16 float32 scales.
struct Int8 {
  static constexpr int64_t kCodeBytes = kGroup * kOut;
  static constexpr int64_t kBlockBytes = kCodeBytes + kOut * sizeof(float);
  static constexpr bool kOffset = false;
  static float code(const uint8_t* codes, int64_t k, int j) {
    return static_cast<float>(static_cast<int8_t>(codes[k * kOut + j]));
  }
#ifdef POCKETLLM_X86
  __attribute__((target("avx2,fma"))) static void codes_avx2(const uint8_t* codes, int64_t k, __m256& q0,
                                                              __m256& q1) {
    const auto* p = reinterpret_cast<const __m128i*>(codes + k * kOut);
    q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p)));
    q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
        codes + k * kOut + 8))));
  }
  __attribute__((target("avx512f"))) static __m512 codes_avx512(const uint8_t* codes, int64_t k) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
        codes + k * kOut))));
  }
#endif
};

// One block column (16 outputs, all K inputs) for R rows of x. Per group, the codes' dot products with x are
// accumulated first and scaled once: y += scale * (x . codes) + offset * sum(x), so that no weight is ever
// dequantized (the offsets' sums of x come precomputed, `xsum` [rows, groups]).
template <class F, int R>
void columns_scalar(const float* x, int64_t ldx, const float* xsum, int64_t groups, const uint8_t* blocks, float* y,
                    int64_t ldy) {
  float out[R][kOut] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* codes = blocks + g * F::kBlockBytes;
    float scale[kOut], offset[kOut] = {};
    std::memcpy(scale, codes + F::kCodeBytes, sizeof(scale));
    if constexpr (F::kOffset) std::memcpy(offset, codes + F::kCodeBytes + sizeof(scale), sizeof(offset));
    float acc[R][kOut] = {};
    for (int64_t k = 0; k < kGroup; ++k) {
      float q[kOut];
      for (int j = 0; j < kOut; ++j) q[j] = F::code(codes, k, j);
      for (int r = 0; r < R; ++r) {
        const float a = x[r * ldx + g * kGroup + k];
        for (int j = 0; j < kOut; ++j) acc[r][j] += a * q[j];
      }
    }
    for (int r = 0; r < R; ++r) {
      const float s = F::kOffset ? xsum[r * groups + g] : 0.0f;
      for (int j = 0; j < kOut; ++j) out[r][j] = (out[r][j] + scale[j] * acc[r][j]) + offset[j] * s;
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, out[r], sizeof(out[r]));
}

#ifdef POCKETLLM_X86
// Accumulators and outputs are named variables, not arrays: GCC keeps an array of vectors on the stack and
// stores it on every iteration (measured: 2.7x slower at four rows). Past two rows the outputs do not all fit
// in registers with the accumulators; they are spilled around the inner loop, once per group.
#define POCKETLLM_ROW(r)                                    \
  if constexpr (R > r) {                                    \
    const __m256 a = _mm256_broadcast_ss(xg + r * ldx + k); \
    acc##r##0 = _mm256_fmadd_ps(a, q0, acc##r##0);          \
    acc##r##1 = _mm256_fmadd_ps(a, q1, acc##r##1);          \
  }
#define POCKETLLM_SCALE(r)                                                                              \
  if constexpr (R > r) {                                                                                \
    out##r##0 = _mm256_fmadd_ps(s0, acc##r##0, out##r##0);                                              \
    out##r##1 = _mm256_fmadd_ps(s1, acc##r##1, out##r##1);                                              \
    if constexpr (F::kOffset) {                                                                         \
      const __m256 sum = _mm256_broadcast_ss(xsum + r * groups + g);                                    \
      out##r##0 = _mm256_fmadd_ps(o0, sum, out##r##0);                                                  \
      out##r##1 = _mm256_fmadd_ps(o1, sum, out##r##1);                                                  \
    }                                                                                                   \
  }

#define POCKETLLM_STORE(r)                           \
  if constexpr (R > r) {                              \
    _mm256_storeu_ps(y + r * ldy, out##r##0);         \
    _mm256_storeu_ps(y + r * ldy + 8, out##r##1);     \
  }

template <class F, int R>
__attribute__((target("avx2,fma"))) void columns_avx2(const float* x, int64_t ldx, const float* xsum,
                                                       int64_t groups, const uint8_t* blocks, float* y,
                                                       int64_t ldy) {
  static_assert(R >= 1 && R <= kMaxRows);
  __m256 out00 = _mm256_setzero_ps(), out01 = out00, out10 = out00, out11 = out00;
  __m256 out20 = out00, out21 = out00, out30 = out00, out31 = out00;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* codes = blocks + g * F::kBlockBytes;
    const float* xg = x + g * kGroup;
    __m256 acc00 = _mm256_setzero_ps(), acc01 = acc00, acc10 = acc00, acc11 = acc00;
    __m256 acc20 = acc00, acc21 = acc00, acc30 = acc00, acc31 = acc00;
    for (int64_t k = 0; k < kGroup; ++k) {
      __m256 q0, q1;
      F::codes_avx2(codes, k, q0, q1);
      POCKETLLM_ROW(0)
      POCKETLLM_ROW(1)
      POCKETLLM_ROW(2)
      POCKETLLM_ROW(3)
    }
    const float* scale = reinterpret_cast<const float*>(codes + F::kCodeBytes);
    const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
    __m256 o0 = _mm256_setzero_ps(), o1 = o0;
    if constexpr (F::kOffset) o0 = _mm256_loadu_ps(scale + kOut), o1 = _mm256_loadu_ps(scale + kOut + 8);
    POCKETLLM_SCALE(0)
    POCKETLLM_SCALE(1)
    POCKETLLM_SCALE(2)
    POCKETLLM_SCALE(3)
  }
  POCKETLLM_STORE(0)
  POCKETLLM_STORE(1)
  POCKETLLM_STORE(2)
  POCKETLLM_STORE(3)
}
#undef POCKETLLM_ROW
#undef POCKETLLM_SCALE
#undef POCKETLLM_STORE

// Many rows (prefill) go group by group instead, as a GEMM does: each group's weights are converted to float32
// once (2 KB, kept in L1) for all the rows, which take them a pass of several rows at a time, their outputs kept
// in y between groups, their activations packed beforehand so that a pass reads one contiguous run ([group][input]
// [row of the pass]). Each output still sees the operations above, in their order (its group's accumulator from
// zero over the 32 inputs, then the scale, then the offset), in one lane of a vector: the same bits.
using GroupRowsFn = void (*)(const float* weights, const float* scale, int64_t scale_stride, bool first,
                             const float* xg, const float* xsum, int64_t groups, float* y, int64_t ldy);
using ConvertFn = void (*)(const uint8_t* codes, float* weights);

// AVX2: 6 rows of 16 outputs in 12 accumulators, as oneDNN's AVX2 GEMM tiles them.
#define POCKETLLM_ROWS6(M) M(0) M(1) M(2) M(3) M(4) M(5)
#define POCKETLLM_ZERO(r) __m256 acc##r##0 = _mm256_setzero_ps(), acc##r##1 = acc##r##0;
#define POCKETLLM_ROW(r)                                          \
  if constexpr (R > r) {                                          \
    const __m256 a = _mm256_broadcast_ss(xg + k * kRowsAvx2 + r); \
    acc##r##0 = _mm256_fmadd_ps(a, w0, acc##r##0);                \
    acc##r##1 = _mm256_fmadd_ps(a, w1, acc##r##1);                \
  }
#define POCKETLLM_SCALE(r)                                                                         \
  if constexpr (R > r) {                                                                           \
    float* yr = y + r * ldy;                                                                       \
    __m256 out0 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(yr);                               \
    __m256 out1 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(yr + 8);                           \
    out0 = _mm256_fmadd_ps(s0, acc##r##0, out0);                                                   \
    out1 = _mm256_fmadd_ps(s1, acc##r##1, out1);                                                   \
    if constexpr (F::kOffset) {                                                                    \
      const __m256 sum = _mm256_broadcast_ss(xsum + r * groups);                                   \
      out0 = _mm256_fmadd_ps(o0, sum, out0);                                                       \
      out1 = _mm256_fmadd_ps(o1, sum, out1);                                                       \
    }                                                                                              \
    _mm256_storeu_ps(yr, out0);                                                                    \
    _mm256_storeu_ps(yr + 8, out1);                                                                \
  }
constexpr int kRowsAvx2 = 6;

template <class F, int R>
__attribute__((target("avx2,fma"))) void group_rows_avx2(const float* weights, const float* scale, bool first,
                                                          const float* xg, const float* xsum, int64_t groups,
                                                          float* y, int64_t ldy) {
  static_assert(R >= 1 && R <= kRowsAvx2);
  POCKETLLM_ROWS6(POCKETLLM_ZERO)
  for (int64_t k = 0; k < kGroup; ++k) {
    const __m256 w0 = _mm256_load_ps(weights + k * kOut), w1 = _mm256_load_ps(weights + k * kOut + 8);
    POCKETLLM_ROWS6(POCKETLLM_ROW)
  }
  const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
  __m256 o0 = _mm256_setzero_ps(), o1 = o0;
  if constexpr (F::kOffset) o0 = _mm256_loadu_ps(scale + kOut), o1 = _mm256_loadu_ps(scale + kOut + 8);
  POCKETLLM_ROWS6(POCKETLLM_SCALE)
}

template <class F>
__attribute__((target("avx2,fma"))) void convert_avx2(const uint8_t* codes, float* weights) {
  for (int64_t k = 0; k < kGroup; ++k) {
    __m256 q0, q1;
    F::codes_avx2(codes, k, q0, q1);
    _mm256_store_ps(weights + k * kOut, q0);
    _mm256_store_ps(weights + k * kOut + 8, q1);
  }
}
#undef POCKETLLM_ROWS6
#undef POCKETLLM_ZERO
#undef POCKETLLM_ROW
#undef POCKETLLM_SCALE

// GCC 12 warns that its own AVX-512 conversion intrinsics read an uninitialised (ignored) operand.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// AVX-512: 8 rows of 2 blocks (32 outputs) in 16 accumulators: 10 loads for 16 FMAs, where 16 rows of one block
// take 17 and are bound by them (measured: 47 against 59 GMAC/s).
#define POCKETLLM_ROWS8(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
#define POCKETLLM_ZERO(r) __m512 acc0##r = _mm512_setzero_ps(), acc1##r = acc0##r;
#define POCKETLLM_ROW(r)                                           \
  if constexpr (R > r) {                                           \
    const __m512 a = _mm512_set1_ps(xg[k * kRowsAvx512 + r]);      \
    acc0##r = _mm512_fmadd_ps(a, w0, acc0##r);                     \
    if constexpr (B > 1) acc1##r = _mm512_fmadd_ps(a, w1, acc1##r); \
  }
#define POCKETLLM_SCALE_ONE(b, r)                                                                \
  {                                                                                              \
    float* yr = y + r * ldy + b * kOut;                                                          \
    __m512 out = first ? _mm512_setzero_ps() : _mm512_loadu_ps(yr);                              \
    out = _mm512_fmadd_ps(s##b, acc##b##r, out);                                                 \
    if constexpr (F::kOffset) out = _mm512_fmadd_ps(o##b, _mm512_set1_ps(xsum[r * groups]), out); \
    _mm512_storeu_ps(yr, out);                                                                   \
  }
#define POCKETLLM_SCALE(r)                           \
  if constexpr (R > r) {                             \
    POCKETLLM_SCALE_ONE(0, r)                        \
    if constexpr (B > 1) POCKETLLM_SCALE_ONE(1, r)   \
  }
constexpr int kRowsAvx512 = 8;
constexpr int kBlocksAvx512 = 2;

template <class F, int B, int R>
__attribute__((target("avx512f"))) void group_rows_avx512(const float* weights, const float* scale,
                                                         int64_t scale_stride, bool first, const float* xg,
                                                         const float* xsum, int64_t groups, float* y, int64_t ldy) {
  static_assert(B >= 1 && B <= kBlocksAvx512 && R >= 1 && R <= kRowsAvx512);
  POCKETLLM_ROWS8(POCKETLLM_ZERO)
  for (int64_t k = 0; k < kGroup; ++k) {
    const __m512 w0 = _mm512_load_ps(weights + k * kOut);
    const __m512 w1 = B > 1 ? _mm512_load_ps(weights + (kGroup + k) * kOut) : w0;
    POCKETLLM_ROWS8(POCKETLLM_ROW)
  }
  const float* scale1 = scale + (B > 1 ? scale_stride : 0);
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale1);
  const __m512 o0 = F::kOffset ? _mm512_loadu_ps(scale + kOut) : _mm512_setzero_ps();
  const __m512 o1 = F::kOffset ? _mm512_loadu_ps(scale1 + kOut) : _mm512_setzero_ps();
  POCKETLLM_ROWS8(POCKETLLM_SCALE)
}

template <class F>
__attribute__((target("avx512f"))) void convert_avx512(const uint8_t* codes, float* weights) {
  for (int64_t k = 0; k < kGroup; ++k) _mm512_store_ps(weights + k * kOut, F::codes_avx512(codes, k));
}
#undef POCKETLLM_ROWS8
#undef POCKETLLM_ZERO
#undef POCKETLLM_ROW
#undef POCKETLLM_SCALE_ONE
#undef POCKETLLM_SCALE
#pragma GCC diagnostic pop

// How one instruction set runs the group-by-group path: its conversion, and its kernel for each count of blocks
// and rows.
struct GroupMajor {
  ConvertFn convert;
  const GroupRowsFn* fns;  // [blocks - 1][rows - 1]
  int64_t blocks;  // most blocks a kernel computes together
  int64_t pass;  // most rows
  GroupRowsFn kernel(int64_t b, int64_t r) const { return fns[(b - 1) * pass + r - 1]; }
};

template <class F, int B, int R>
void avx2_rows(const float* weights, const float* scale, int64_t, bool first, const float* xg, const float* xsum,
               int64_t groups, float* y, int64_t ldy) {
  static_assert(B == 1);
  group_rows_avx2<F, R>(weights, scale, first, xg, xsum, groups, y, ldy);
}

template <class F, int Blocks, int Rows, template <class, int, int> class Kernel, std::size_t... I>
constexpr std::array<GroupRowsFn, sizeof...(I)> group_rows_table(std::index_sequence<I...>) {
  return {Kernel<F, I / Rows + 1, I % Rows + 1>::fn...};
}

template <class F, int B, int R>
struct Avx2Rows { static constexpr GroupRowsFn fn = avx2_rows<F, B, R>; };
template <class F, int B, int R>
struct Avx512Rows { static constexpr GroupRowsFn fn = group_rows_avx512<F, B, R>; };

template <class F>
GroupMajor group_major(Isa isa) {
  static constexpr auto kAvx2 = group_rows_table<F, 1, kRowsAvx2, Avx2Rows>(std::make_index_sequence<kRowsAvx2>());
  static constexpr auto kAvx512 = group_rows_table<F, kBlocksAvx512, kRowsAvx512, Avx512Rows>(
      std::make_index_sequence<kBlocksAvx512 * kRowsAvx512>());
  if (isa == Isa::kAvx512) return {convert_avx512<F>, kAvx512.data(), kBlocksAvx512, kRowsAvx512};
  return {convert_avx2<F>, kAvx2.data(), 1, kRowsAvx2};
}

// x [rows, groups * 32] in passes of `pass` rows: [pass index][group][input][row of the pass], zero-padded.
std::vector<float> pack_passes(const float* x, int64_t rows, int64_t groups, int64_t pass) {
  const int64_t passes = (rows + pass - 1) / pass, in_features = groups * kGroup;
  std::vector<float> packed(passes * groups * kGroup * pass, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = packed.data() + (r / pass) * groups * kGroup * pass + r % pass;
    for (int64_t i = 0; i < in_features; ++i) dst[i * pass] = x[r * in_features + i];
  }
  return packed;
}

// `count` consecutive block columns (16 outputs each) for `rows` rows, group by group; xpacked holds the rows as
// pack_passes made them.
template <class F>
void columns_group_major(const GroupMajor& path, int64_t count, const float* xpacked, const float* xsum,
                         int64_t groups, const uint8_t* blocks, float* y, int64_t ldy, int64_t rows) {
  alignas(64) float weights[kBlocksAvx512 * kGroup * kOut];
  const int64_t pass_floats = groups * kGroup * path.pass, column_bytes = groups * F::kBlockBytes;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* codes = blocks + g * F::kBlockBytes;
    for (int64_t b = 0; b < count; ++b) path.convert(codes + b * column_bytes, weights + b * kGroup * kOut);
    const float* scale = reinterpret_cast<const float*>(codes + F::kCodeBytes);
    for (int64_t r = 0; r < rows; r += path.pass) {
      const int64_t n = std::min<int64_t>(path.pass, rows - r);
      const float* xg = xpacked + (r / path.pass) * pass_floats + g * kGroup * path.pass;
      const float* sums = F::kOffset ? xsum + r * groups + g : nullptr;
      path.kernel(count, n)(weights, scale, column_bytes / 4, g == 0, xg, sums, groups, y + r * ldy, ldy);
    }
  }
}
#endif

using ColumnsFn = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*, float*, int64_t);

template <class F, int R>
ColumnsFn columns_for(Isa isa) {
#ifdef POCKETLLM_X86
  if (isa != Isa::kScalar) return columns_avx2<F, R>;
#endif
  return columns_scalar<F, R>;
}

template <class F>
ColumnsFn columns_for(Isa isa, int rows) {
  switch (rows) {
    case 1: return columns_for<F, 1>(isa);
    case 2: return columns_for<F, 2>(isa);
    case 3: return columns_for<F, 3>(isa);
    default: return columns_for<F, 4>(isa);
  }
}

template <class F>
at::Tensor grouped_linear(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), op, ": tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, op, ": x must be a 2-D float32 tensor, got ",
              x.scalar_type(), " of ", x.dim(), " dims");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == F::kBlockBytes &&
                  packed.is_contiguous(),
              op, ": packed must be contiguous uint8 [N/16, K/32, ", F::kBlockBytes, "] (see pocketllm_torch.native)");
  const int64_t nb = packed.size(0), groups = packed.size(1), rows = x.size(0), in_features = x.size(1);
  TORCH_CHECK(out_features == nb * kOut, op, ": out_features ", out_features, " does not match ", nb,
              " packed blocks of ", kOut);
  TORCH_CHECK(in_features == groups * kGroup, op, ": x has ", in_features, " features, the weight ",
              groups * kGroup);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || nb == 0) return y;
  const float* xp = xc.const_data_ptr<float>();
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  float* yp = y.mutable_data_ptr<float>();
  // Sums of x over each group of inputs, for the offsets (4-bit groups only).
  std::vector<float> xsum(F::kOffset ? rows * groups : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i) {
    const float* xg = xp + i * kGroup;  // rows * groups groups of kGroup floats, in order
    float sum = 0;
    for (int64_t k = 0; k < kGroup; ++k) sum += xg[k];
    xsum[i] = sum;
  }
  const Isa isa = active_isa().load(std::memory_order_relaxed);
#ifdef POCKETLLM_X86
  const bool group_by_group = isa != Isa::kScalar && rows >= kMinRowsGroupMajor;
  const GroupMajor path = group_major<F>(isa);
  const std::vector<float> xpacked = group_by_group ? pack_passes(xp, rows, groups, path.pass) : std::vector<float>();
#endif
  // Split the outputs, not the rows: every thread streams a disjoint part of the weight.
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
#ifdef POCKETLLM_X86
    if (group_by_group) {
      // A tile of rows at a time, which stays in L2 while the thread streams its part of the weight past it.
      const int64_t tile = std::max<int64_t>(1, kTileRows / path.pass) * path.pass;
      for (int64_t r = 0; r < rows; r += tile) {
        const int64_t count = std::min<int64_t>(tile, rows - r);
        const float* xr = xpacked.data() + (r / path.pass) * groups * kGroup * path.pass;
        const float* sums = F::kOffset ? xsum.data() + r * groups : nullptr;
        for (int64_t n = begin; n < end; n += path.blocks) {
          columns_group_major<F>(path, std::min<int64_t>(path.blocks, end - n), xr, sums, groups,
                                 wp + n * groups * F::kBlockBytes, yp + r * out_features + n * kOut, out_features,
                                 count);
        }
      }
      return;
    }
#endif
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* blocks = wp + n * groups * F::kBlockBytes;
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        const int count = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r));
        const float* sums = F::kOffset ? xsum.data() + r * groups : nullptr;
        columns_for<F>(isa, count)(xp + r * in_features, in_features, sums, groups, blocks,
                                   yp + r * out_features + n * kOut, out_features);
      }
    }
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  return grouped_linear<Int4>("int4_linear", x, packed, out_features);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  return grouped_linear<Int8>("int8_linear", x, packed, out_features);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pocketllm, m) {
  m.def("int4_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pocketllm, CPU, m) {
  m.impl("int4_linear", int4_linear);
  m.impl("int8_linear", int8_linear);
}

}  // namespace pocketllm
