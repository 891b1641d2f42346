// AVX-512 (F, BW, VL) with VNNI: the x86 kernels with vpdpbusd (u8 x s8 -> s32 in one instruction) and, with 32
// vector registers, tiles of 4 weight rows x 4 activation rows. Compiled with those flags alone (CMakeLists.txt)
// and called only after the CPU was checked (isa.cpp). Decode's vectors stay 256-bit: a 512-bit kernel (two blocks
// per vpdpbusd, 16 block scales per gather) measured slower on Zen 4, whose 512-bit ops take two 256-bit slots. The
// batched tiles pair two weight rows in one 512-bit vector (packed_pairs, k16_pairs): half the instructions.
// A tile of 6 activation rows measured slower than 4 (the sums and accumulators no longer fit the registers).
#define PLLM_VNNI 1
#define PLLM_GEMM gemm_avx512
#define PLLM_TILE_ROWS 4
#define PLLM_TILE_ACT 4  // activation rows per batched tile: each loaded weight vector serves 4 dot products
#include "kernels_x86.inl"
