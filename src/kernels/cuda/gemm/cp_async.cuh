// fusedmoe CUDA internal: cp.async (sm_80+) wrappers — 16-byte global ->
// shared copies in commit groups — for the mma.sync grouped GEMMs and the
// benchmark of their load pattern (bench/cuda/bench_cuda_dram.cu).
// Source: PTX ISA, "Data Movement and Conversion Instructions: cp.async".
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fusedmoe::cuda::gemm {

// A generic pointer into shared memory as the 32-bit address PTX takes.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes from `src` to shared address `dst`, through L2 only (.cg): the
// first `src_bytes` (16, or 0 to read nothing) copied, the rest zero-filled.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
// Closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace fusedmoe::cuda::gemm
