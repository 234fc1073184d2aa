// fusedmoe CUDA internal: the Hopper tensor memory accelerator (TMA) for the
// mma.sync grouped GEMMs' weight tiles — shared-memory mbarriers, tiled tensor
// copies global -> shared that complete on one (sm_90), and the host's encoding
// of the tensor map they read (through the driver entry point the CUDA runtime
// hands out, so nothing links libcuda).
// Sources: PTX ISA, "Parallel Synchronization and Communication Instructions:
// mbarrier" and "Data Movement and Conversion Instructions: cp.async.bulk.tensor";
// CUDA driver API, cuTensorMapEncodeTiled.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fusedmoe::cuda::gemm {

#ifdef __CUDACC__
// Initializes the mbarrier at shared address `bar` for `count` arrivals a phase,
// and makes the initialization visible to the async proxy (the TMA unit).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Arrives once on `bar` and adds `bytes` to the transfer count its phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits until the phase of `bar` with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// One box of the 3-D tensor map at generic address `map` (a __grid_constant__
// kernel parameter), at element coordinates (c0, c1, c2) (innermost first; out
// of bounds reads as zeros), into shared address `dst`; the bytes complete on
// mbarrier `bar`. kEvictFirst: the lines go into L2 as the first to be evicted
// (createpolicy.fractional.L2::evict_first), for data read once, so that it
// does not push out what the kernel and the next ones read again.
template <bool kEvictFirst = false>
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int32_t c0, int32_t c1,
                                            int32_t c2, uint32_t bar) {
  const uint64_t m = reinterpret_cast<uint64_t>(map);
  if constexpr (kEvictFirst) {
    asm volatile(
        "{\n.reg .b64 policy;\n"
        "createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        ".L2::cache_hint [%0], [%1, {%2, %3, %4}], [%5], policy;\n}\n" ::"r"(dst),
        "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
  }
}
#endif

// Encodes `map` for a [dim2][dim1][dim0] tensor of 2-byte elements at `base`
// (row stride dim0 elements, plane stride dim1 * dim0), boxes of box0 x box1 x 1
// elements (box0 * 2 = 128 bytes) written to shared memory with the 128-byte
// swizzle (16-byte chunk c of box row r lands at chunk c ^ (r % 8), as swz() in
// sm90_bf16_grouped_gemm.cuh), without L2 promotion (the 256-byte promotion
// made the m16n64 GEMMs 3-7 % slower than cp.async on an H200, no promotion
// matched it: bench/results/2026-12-02-session33.md). Returns false, `map`
// unusable, where the TMA cannot read the tensor (base not 16-byte aligned,
// dim0 * 2 not a multiple of 16, a dimension beyond int32) or the driver has no
// cuTensorMapEncodeTiled.
inline bool encode_tensor_map_2byte(CUtensorMap* map, const void* base, int64_t dim0, int64_t dim1,
                                    int64_t dim2, uint32_t box0, uint32_t box1) {
  // cuTensorMapEncodeTiled's signature (CUDA 12.0 on).
  using Encode =
      CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<Encode>(nullptr);
    }
    return reinterpret_cast<Encode>(fn);
  }();
  constexpr int64_t kMax = int64_t{1} << 31;
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || dim0 * 2 % 16 != 0 ||
      dim0 <= 0 || dim1 <= 0 || dim2 <= 0 || dim0 >= kMax || dim1 >= kMax || dim2 >= kMax)
    return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(dim0), static_cast<cuuint64_t>(dim1),
                              static_cast<cuuint64_t>(dim2)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(dim0 * 2),
                                 static_cast<cuuint64_t>(dim0 * dim1 * 2)};
  const cuuint32_t box[3] = {box0, box1, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(base), dims, strides, box,
                elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace fusedmoe::cuda::gemm
