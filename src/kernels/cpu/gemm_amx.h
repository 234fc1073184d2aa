// fusedmoe internal: bf16 x bf16 GEMM on Intel AMX (AMX-TILE + AMX-BF16), used by
// the CPU experts when the compute dtype and the weights are bf16 (cpu_experts.cpp).
//
// The activations X are first packed, 16 rows at a time, into AMX's pair-
// interleaved ("VNNI") tile layout; W (nn.Linear's [N, K], bf16) is read in
// place as the tiles' A operand, so that each C^T tile is W[16 n] . X[16 m]^T.
//
// Order (fixed, like gemm.h's, but its own): K padded with zeros to a multiple
// of 32; c = 0, then for k0 = 0, 32, ... in increasing order one TDPBF16PS step
// adds sum over the 16 pairs of w[k] x[k] + w[k+1] x[k+1] (products exact, f32
// accumulation, round to nearest even; bf16 denormal inputs read as zero and
// denormal results flush to zero, as AMX does); then c + bias. It depends on K
// only, never on M, N, the tile or the thread, so a row's result is the same
// alone or in a batch -- on a CPU with AMX. It is not gemm.h's order: the
// results differ from the AVX-512 / AVX2 / scalar paths by float rounding.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/gemm_kernels.h"  // FUSEDMOE_GEMM_X86

namespace fusedmoe::cpu {

// u16 elements of one packed tile block: 16 pairs x 16 rows x 2.
constexpr int64_t kAmxBlock = 512;

// Whether the AMX kernels can run: the library was built with them, the CPU
// has AMX-TILE, AMX-BF16 and AVX-512 (F, BW, VL, DQ), and the OS grants this
// process the tile data state (Linux arch_prctl ARCH_REQ_XCOMP_PERM, asked at
// the first call; the grant raises the process's smallest accepted
// sigaltstack size, so it is asked only where AMX is about to be used).
bool amx_supported();
// Whether the CPU experts are set to use them for bf16 weights with bf16
// compute: the GEMM instruction set is avx512 (gemm_isa()), the CPU has AMX
// (no system call) and AMX is on. On by default where the CPU has it; the
// environment variable FUSEDMOE_CPU_AMX=0 turns it off, =1 requires it (the
// first use throws Error(kUnsupported) where !amx_supported()), other values
// throw Error(kInvalidArgument).
bool amx_in_use();
// amx_in_use() and amx_supported(): where the experts are about to run on AMX.
bool amx_ready();
// Turns AMX on or off for later calls (tests, benchmarks); Error(kUnsupported)
// when turning it on where !amx_supported(). Not while experts are running.
void set_amx(bool on);
// Throws Error(kOutOfMemory) naming `bytes` (for the AMX kernels, which may not
// use the library's inline helpers).
[[noreturn]] void amx_out_of_memory(size_t bytes);

#if defined(FUSEDMOE_GEMM_X86) && defined(FUSEDMOE_AMX)
// Packs rows X[0:rows, 0:K] (f32, row stride ldx, rows <= 16; with bf16 compute
// already bf16 values) into ceil(K / 32) blocks of
// kAmxBlock u16 at dst: block kb, pair p, row m = bf16 X[m, 32 kb + 2p] and
// X[m, 32 kb + 2p + 1]; rows >= `rows` and k >= K are zero. Values are rounded
// to bf16 (nearest even; NaN stays NaN), which keeps bf16 values as they are.
void amx_pack_rows(const float* X, int64_t ldx, int64_t rows, int64_t K, uint16_t* dst);

// C[0:rows, 0:N] (f32, row stride ldc) = X . W^T (+ bias) in the order above.
// xp: ceil(rows / 16) packed row tiles of ceil(K / 32) blocks each, one after
// the other; W: bf16 [N, K] with row stride ldw; bias: nullptr or N values
// (bf16 if bias_bf16, else f32).
void amx_gemm_packed(const uint16_t* xp, int64_t rows, int64_t N, int64_t K, const uint16_t* W,
                     int64_t ldw, const void* bias, bool bias_bf16, float* C, int64_t ldc);

// The benchmarks' ceiling: 4 x iters TDPBF16PS (16 x 16 x 32 products each,
// 16384 FLOPs) on tiles already in registers; returns an element of the result.
float amx_peak_kernel(int64_t iters);
#endif

}  // namespace fusedmoe::cpu
