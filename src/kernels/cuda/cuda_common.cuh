// fusedmoe internal: helpers shared by the CUDA kernels and launchers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fusedmoe/core/error.h"
#include "fusedmoe/kernels/cuda.h"  // kW13Block
#include "kernels/cuda/cuda_check.h"

namespace fusedmoe::cuda {

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Multiprocessor count of the current device (cached per device index).
int num_sms();

// The row of w13 (within one expert) holding gate (half 0) or up (half 1)
// intermediate column i, in either W13Layout (fusedmoe/kernels/cuda.h).
__host__ __device__ __forceinline__ int64_t w13_row(int64_t i, int half, int64_t inter,
                                                    bool interleaved) {
  return interleaved ? (i / kW13Block) * (2 * kW13Block) + half * kW13Block + i % kW13Block
                     : half * inter + i;
}

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

// kCols consecutive output elements (kCols a multiple of 4): vector stores
// (16 bytes, or 8 for four 16-bit values) where p is aligned to them, one
// element at a time otherwise (any ldo).
template <int kCols, typename Out>
__device__ __forceinline__ void store_out_vec(Out* p, const float* v) {
  static_assert(kCols % 4 == 0, "store_out_vec: kCols must be a multiple of 4");
  constexpr uintptr_t kAlign = sizeof(Out) * kCols < 16 ? sizeof(Out) * kCols : 16;
  if (reinterpret_cast<uintptr_t>(p) % kAlign != 0) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) store_out(p + c, v[c]);
    return;
  }
  if constexpr (sizeof(Out) == 4) {
#pragma unroll
    for (int c = 0; c < kCols; c += 4)
      *reinterpret_cast<float4*>(p + c) = make_float4(v[c], v[c + 1], v[c + 2], v[c + 3]);
  } else {
    // Two 16-bit values a word, eight a 16-byte store (four: one 8-byte store).
    uint32_t w[kCols / 2];
#pragma unroll
    for (int c = 0; c < kCols; c += 2) {
      Out pair[2];
      store_out(&pair[0], v[c]);
      store_out(&pair[1], v[c + 1]);
      w[c / 2] = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&pair[0])) |
                 (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&pair[1])) << 16);
    }
#pragma unroll
    for (int c = 0; c + 4 <= kCols / 2; c += 4)
      *reinterpret_cast<uint4*>(p + 2 * c) = make_uint4(w[c], w[c + 1], w[c + 2], w[c + 3]);
    if constexpr ((kCols / 2) % 4 != 0) {
      constexpr int c = kCols / 2 - 2;
      *reinterpret_cast<uint2*>(p + 2 * c) = make_uint2(w[c], w[c + 1]);
    }
  }
}
#endif

}  // namespace fusedmoe::cuda
