// fusedmoe internal: the building blocks of the CUDA-core GEMV kernels (the
// m8gemv grouped GEMM tile and the decode experts): 16-byte read-only weight
// loads (with and without L1 allocation), bf16 / f16 unpacking to f32 and warp reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace fusedmoe::cuda::gemm {

__device__ __forceinline__ uint4 ld_nc(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// The same without L1 allocation: for weights, each byte read once (L1 keeps
// the input rows). On an H200 2-6 % faster than ld_nc in the decode kernels.
__device__ __forceinline__ uint4 ld_weight(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// 8 elements of type T (bf16 or f16) -> f32.
template <class T>
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __half>) {
      const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = h.x;
      f[2 * i + 1] = h.y;
    } else {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

// Sums v[0..N) over the warp by recursive halving; afterwards lane L holds the
// totals of indices [L * N / 32, (L + 1) * N / 32) in v[0 .. N / 32).
template <int kN, int kOffset>
__device__ __forceinline__ void halving_step(float* v, int lane) {
  const bool upper = (lane & kOffset) != 0;
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) {
    const float keep = upper ? v[i + kN / 2] : v[i];
    const float send = upper ? v[i] : v[i + kN / 2];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kOffset);
  }
}
template <int N>
__device__ __forceinline__ void warp_reduce_halving(float* v, int lane) {
  halving_step<N, 16>(v, lane);
  halving_step<N / 2, 8>(v, lane);
  halving_step<N / 4, 4>(v, lane);
  halving_step<N / 8, 2>(v, lane);
  halving_step<N / 16, 1>(v, lane);
}

// Every lane gets the warp's totals of all kN values (butterfly).
template <int kN>
__device__ __forceinline__ void warp_reduce_all(float* v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
}

}  // namespace fusedmoe::cuda::gemm
