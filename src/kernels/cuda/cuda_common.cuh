// fusedmoe internal: helpers shared by the CUDA kernels and launchers.
#pragma once

#include <cuda_bf16.h>
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
#endif

}  // namespace fusedmoe::cuda
