// fusedmoe internal: the CPU GEMM used by experts, the router gate and shared experts.
//
//   C[M, N] (f32, row stride ldc) = A[M, K] (f32, row stride lda) . W[N, K]^T (+ bias[N])
//
// W holds N rows of K weights (f32 or bf16, row stride ldw), i.e. nn.Linear's
// [out_features, in_features] layout. Accumulation is f32; bf16 is widened
// exactly to f32 (a 16-bit shift), in registers or into a small per-thread
// block, never into an f32 copy of the matrix.
//
// Fixed order (the definition every code path implements exactly):
//   K is padded with zeros to a multiple of 16. Lane l (0..15) of an output
//   element starts at +0 and accumulates a[k] * w[k] for k = l, l + 16,
//   l + 32, ... in increasing k, each step one fused multiply-add (one
//   rounding). The lanes s_0..s_15 are then summed by this fixed tree:
//     h_j = s_j + s_{j+8} (j < 8), q_j = h_j + h_{j+4} (j < 4),
//     p_j = q_j + q_{j+2} (j < 2), c = p_0 + p_1, then c + bias (if any).
// The order depends on K only — never on M, N, the tile or block a row or
// column falls in, the thread, the weight dtype (bf16 weights give the same
// bits as their exact f32 values) or the instruction set — so a token's result
// is bit-identical whether it is computed alone or in a batch, on any x86-64
// that runs it. (A BLAS sgemm is not: its K blocking and small-matrix paths
// change with M — measured on OpenBLAS 0.3.21 — hence the own kernel.) The
// AVX-512 path holds the 16 lanes in one zmm, the AVX2 path in two ymm, the
// scalar path in 16 floats with std::fma; AVX512-BF16 dot products (which sum
// pairs before accumulating) are deliberately not used here. (With bf16
// weights and bf16 compute on a CPU with AMX, the experts use gemm_amx.h
// instead, which has an order of its own.)
//
// Instruction set: chosen at the first call from the CPU (cpuid via
// __builtin_cpu_supports): AVX-512 (F, BW, VL, DQ), else AVX2 + FMA, else
// scalar. The kernels of each set live in their own translation unit compiled
// with that set's flags, so the library itself needs no -march. The
// environment variable FUSEDMOE_CPU_ISA=avx512|avx2|scalar forces a path
// (the first call throws Error(kUnsupported) if this CPU lacks it, or
// kInvalidArgument for an unknown name).
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusedmoe/core/dtype.h"
#include "fusedmoe/core/thread_pool.h"
#include "kernels/cpu/gemm_kernels.h"  // GemmPrefetch

namespace fusedmoe::cpu {

// Serial GEMM on the calling thread (see the file comment). w_dtype: kF32 or
// kBF16; bias: nullptr or N values of bias_dtype (kF32 or kBF16).
// K = 0 gives C = bias (or 0); M or N of 0 writes nothing. Large M uses a
// per-thread scratch (~1.3 MiB, allocated on the thread's first such call).
// `next`: optional hint of the weights this thread multiplies next (see
// GemmPrefetch in gemm_kernels.h); it never changes the result.
void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const void* W,
             DType w_dtype, int64_t ldw, const void* bias, DType bias_dtype, float* C, int64_t ldc,
             const GemmPrefetch* next = nullptr);

// The same product split over `pool` in (row block, column block) work items.
// Results are bit-identical to gemm_nt.
void gemm_nt_parallel(ThreadPool& pool, int64_t M, int64_t N, int64_t K, const float* A,
                      int64_t lda, const void* W, DType w_dtype, int64_t ldw, const void* bias,
                      DType bias_dtype, float* C, int64_t ldc);

// ---- instruction-set selection ------------------------------------------------
enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
// "scalar", "avx2", "avx512".
const char* cpu_isa_name(CpuIsa isa);
// Whether this build has the kernels and this CPU (and OS) can run them.
bool cpu_isa_supported(CpuIsa isa);
// The best set cpu_isa_supported allows.
CpuIsa best_cpu_isa();
// The set gemm_nt uses now (resolved on first use: FUSEDMOE_CPU_ISA, else best).
CpuIsa gemm_isa();
// Switches every later gemm_nt call to `isa` (tests, benchmarks). Throws
// Error(kUnsupported) if !cpu_isa_supported(isa). Not to be called while
// another thread is inside gemm_nt.
void set_gemm_isa(CpuIsa isa);

// Element `i` of an f32 or bf16 array as float.
inline float load_as_f32(const void* p, DType dtype, int64_t i) {
  return dtype == DType::kBF16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i])
                               : static_cast<const float*>(p)[i];
}

}  // namespace fusedmoe::cpu
