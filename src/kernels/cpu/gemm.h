// fusedmoe internal: the CPU GEMM used by experts, the router gate and shared experts.
//
//   C[M, N] (f32, row stride ldc) = A[M, K] (f32, row stride lda) . W[N, K]^T (+ bias[N])
//
// W holds N rows of K weights (f32 or bf16, row stride ldw), i.e. nn.Linear's
// [out_features, in_features] layout. Accumulation is f32. bf16 W is widened
// exactly to f32: in registers when M is small (memory-bound decode), or panel
// by panel (kGemmPanelRows rows) into a per-thread scratch when M is large —
// never a whole persistent f32 copy of a matrix.
//
// Fixed order, batch invariant: every C element is computed by the same
// sequence of operations — lane l (of 16) accumulates k = l, l + 16, ... with
// FMA in increasing k, the 16 lanes are summed by a fixed tree, then the bias
// is added. The order depends on K only, never on M, N, the tile a row falls
// in, the thread or the panel path, so a token's result is bit-identical
// whether it is computed alone or in a batch. (A BLAS sgemm is not: its
// K-blocking and small-matrix paths change with M; measured on OpenBLAS 0.3.21.)
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusedmoe/core/dtype.h"
#include "fusedmoe/core/thread_pool.h"

namespace fusedmoe::cpu {

// Rows of W widened to f32 at a time (64 x K f32 = 512 KiB for K = 2048: stays in L2).
inline constexpr int64_t kGemmPanelRows = 64;
// From this M on, bf16 W is widened to an f32 panel once and reused by all rows.
inline constexpr int64_t kGemmPanelMinM = 48;

// Floats of per-thread scratch gemm_nt needs for K (kGemmPanelRows padded rows).
size_t gemm_scratch_floats(int64_t k);

// Serial GEMM on the calling thread (see the file comment). w_dtype: kF32 or
// kBF16; bias: nullptr or N values of bias_dtype (kF32 or kBF16). scratch:
// gemm_scratch_floats(K) floats or nullptr (then bf16 W is always widened in
// registers). M, N or K of 0: C gets the bias only (K = 0) or nothing.
void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const void* W,
             DType w_dtype, int64_t ldw, const void* bias, DType bias_dtype, float* C, int64_t ldc,
             float* scratch);

// The same product split over `pool` in (row block, column block) work items.
// scratch: pool.num_threads() * gemm_scratch_floats(K) floats (or nullptr).
// Results are bit-identical to gemm_nt.
void gemm_nt_parallel(ThreadPool& pool, int64_t M, int64_t N, int64_t K, const float* A,
                      int64_t lda, const void* W, DType w_dtype, int64_t ldw, const void* bias,
                      DType bias_dtype, float* C, int64_t ldc, float* scratch);

// Element `i` of an f32 or bf16 array as float.
inline float load_as_f32(const void* p, DType dtype, int64_t i) {
  return dtype == DType::kBF16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i])
                               : static_cast<const float*>(p)[i];
}

}  // namespace fusedmoe::cpu
