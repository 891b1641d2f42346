// AVX-512 (F, BW, VL) with VNNI: the x86 kernels with vpdpbusd (u8 x s8 -> s32 in one instruction) and, with 32
// vector registers, tiles of 4 weight rows x 4 activation rows. Compiled with those flags alone (CMakeLists.txt)
// and called only after the CPU was checked (isa.cpp). The vectors stay 256-bit: a 512-bit kernel (two blocks
// per vpdpbusd, 16 block scales per gather) measured slower on Zen 4, whose 512-bit ops take two 256-bit slots.
#define PLLM_VNNI 1
#define PLLM_GEMM gemm_avx512
#define PLLM_TILE_ROWS 4
#define PLLM_TILE_ACT 4  // activation rows per batched tile: each loaded weight vector serves 4 dot products
#include "kernels_x86.inl"
