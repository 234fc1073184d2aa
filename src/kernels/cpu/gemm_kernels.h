// fusedmoe internal: the per-instruction-set GEMM kernels behind cpu::gemm_nt
// (gemm.h documents the product and the fixed summation order they all share).
//
// gemm_nt_scalar is in gemm.cpp (no ISA flags); gemm_nt_avx2 in gemm_avx2.cpp
// (-mavx2 -mfma) and gemm_nt_avx512 in gemm_avx512.cpp (-mavx512f/bw/vl/dq);
// the latter two exist on x86-64 only (FUSEDMOE_GEMM_X86). Only call a kernel
// whose instruction set the CPU supports (cpu_isa_supported).
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#define FUSEDMOE_GEMM_X86 1
#endif

namespace fusedmoe::cpu {

// Weights the caller multiplies next on the same thread: `rows` rows of
// `row_bytes` bytes, `ld_bytes` apart. A large-M product prefetches them (up
// to 4 KiB per row) into L2 while its own last block runs, so the next
// product's first block does not start from memory. Only a hint.
struct GemmPrefetch {
  const void* base = nullptr;
  int64_t rows = 0, row_bytes = 0, ld_bytes = 0;
};

// C[M, N] = A[M, K] . W[N, K]^T (+ bias), M > 0, N > 0, K >= 0; W and bias are
// bf16 when the flags say so, else f32.
using GemmKernel = void (*)(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                            const void* W, bool w_bf16, int64_t ldw, const void* bias,
                            bool bias_bf16, float* C, int64_t ldc, const GemmPrefetch* next);

void gemm_nt_scalar(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const void* W,
                    bool w_bf16, int64_t ldw, const void* bias, bool bias_bf16, float* C,
                    int64_t ldc, const GemmPrefetch* next);
#ifdef FUSEDMOE_GEMM_X86
void gemm_nt_avx2(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const void* W,
                  bool w_bf16, int64_t ldw, const void* bias, bool bias_bf16, float* C, int64_t ldc,
                  const GemmPrefetch* next);
void gemm_nt_avx512(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const void* W,
                    bool w_bf16, int64_t ldw, const void* bias, bool bias_bf16, float* C,
                    int64_t ldc, const GemmPrefetch* next);
#endif

}  // namespace fusedmoe::cpu
