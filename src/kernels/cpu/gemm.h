// fusedmoe internal: the CPU GEMM used by experts, the router gate and shared experts.
//
//   C[M, N] (f32, row stride ldc) = A[M, K] (f32, row stride lda) . W[N, K]^T (+ bias[N])
//
// W holds N rows of K weights (f32 or bf16, row stride ldw), i.e. nn.Linear's
// [out_features, in_features] layout. Accumulation is f32. bf16 W is widened
// exactly to f32 in registers as it is loaded (a 16-bit shift) — never copied
// to an f32 matrix. (Widening panels of W into an f32 scratch first was
// measured slower than this at every M on the 2-core Sapphire Rapids box.)
//
// Fixed order, batch invariant: every C element is computed by the same
// sequence of operations — lane l (of 16) accumulates k = l, l + 16, ... with
// FMA in increasing k, the 16 lanes are summed by a fixed tree, then the bias
// is added. The order depends on K only, never on M, N, the tile a row falls
// in, the thread or the panel path, so a token's result is bit-identical
// whether it is computed alone or in a batch. (A BLAS sgemm is not: its
// K-blocking and small-matrix paths change with M; measured on OpenBLAS 0.3.21,
// which is also 2-4x slower than this kernel for these shapes on that box.)
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusedmoe/core/dtype.h"
#include "fusedmoe/core/thread_pool.h"

namespace fusedmoe::cpu {

// Serial GEMM on the calling thread (see the file comment). w_dtype: kF32 or
// kBF16; bias: nullptr or N values of bias_dtype (kF32 or kBF16).
// K = 0 gives C = bias (or 0); M or N of 0 writes nothing.
void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const void* W,
             DType w_dtype, int64_t ldw, const void* bias, DType bias_dtype, float* C, int64_t ldc);

// The same product split over `pool` in (row block, column block) work items.
// Results are bit-identical to gemm_nt.
void gemm_nt_parallel(ThreadPool& pool, int64_t M, int64_t N, int64_t K, const float* A,
                      int64_t lda, const void* W, DType w_dtype, int64_t ldw, const void* bias,
                      DType bias_dtype, float* C, int64_t ldc);

// Element `i` of an f32 or bf16 array as float.
inline float load_as_f32(const void* p, DType dtype, int64_t i) {
  return dtype == DType::kBF16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i])
                               : static_cast<const float*>(p)[i];
}

}  // namespace fusedmoe::cpu
