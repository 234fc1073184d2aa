// fusedmoe internal: helpers shared by the CUDA kernels and launchers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fusedmoe/core/error.h"
#include "kernels/cuda/cuda_check.h"

namespace fusedmoe::cuda {

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Multiprocessor count of the current device (cached per device index).
int num_sms();

#ifdef __CUDACC__
__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}
// Round to nearest even, NaN kept (as __float2bfloat16_rn).
__device__ __forceinline__ uint16_t float_to_bf16_bits(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

// One output element: f32, bf16 (uint16_t bits) or f16 (beyond 65504: +-inf).
template <typename Out>
__device__ __forceinline__ void store_out(Out* p, float v);
template <>
__device__ __forceinline__ void store_out<float>(float* p, float v) {
  *p = v;
}
template <>
__device__ __forceinline__ void store_out<uint16_t>(uint16_t* p, float v) {  // bf16
  *p = float_to_bf16_bits(v);
}
template <>
__device__ __forceinline__ void store_out<__half>(__half* p, float v) {  // beyond 65504: +-inf
  *p = __float2half_rn(v);
}
#endif

}  // namespace fusedmoe::cuda
