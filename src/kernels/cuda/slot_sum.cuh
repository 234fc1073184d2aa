// fusedmoe CUDA (internal): the sum of a token's expert rows in slot order —
// the inner loop of finalize (finalize.cu) and of the peer transport's combine
// (ep_peer.cu), which must add the same values in the same order.
#pragma once

#include <cstdint>

#include "kernels/cuda/gemm/gemv_common.cuh"  // unpack8

namespace fusedmoe::cuda {

// Expert-sorted y (kRows): the y row of slot s is slot_row[s], weighted and
// biased by the sum: scale * (C + b), the kScatter epilogue's arithmetic.
struct SortedRows {
  const int32_t* slot_row;
  const float* row_scale;  // or null: 1
  const float* bias;       // f32 [E, H] or null
};

// 16 bytes of y: four f32 values, or eight bf16 (sm90_experts' rows). Loaded
// raw (4 registers), unpacked to f32 only when added: a thread's kU loads in
// flight take 4 kU registers, not 4 or 8 kU.
template <typename Y>
struct YVec {
  static constexpr int kCols = 4;
  __device__ __forceinline__ static uint4 load(const float* p) {
    return *reinterpret_cast<const uint4*>(p);
  }
  __device__ __forceinline__ static void unpack(const uint4& a, float* v) {
    v[0] = __uint_as_float(a.x);
    v[1] = __uint_as_float(a.y);
    v[2] = __uint_as_float(a.z);
    v[3] = __uint_as_float(a.w);
  }
};
template <>
struct YVec<uint16_t> {
  static constexpr int kCols = 8;
  __device__ __forceinline__ static uint4 load(const uint16_t* p) {
    return *reinterpret_cast<const uint4*>(p);
  }
  __device__ __forceinline__ static void unpack(const uint4& a, float* v) {
    gemm::unpack8<uint16_t>(a, v);
  }
};

// acc[0 .. kCols) += the rows of slots s = slot0 + j, j < top_k, at columns
// [h, h + kCols), in slot order, skipping ids < 0 (and >= num_experts when
// num_experts > 0). y: by slot (kRows false: row s) or expert-sorted (kRows:
// row slot_row[s], scale * (C + b)). kU slots at a time: their ids, rows and
// scales in one round trip, then their kU row loads in flight together (the
// loop is latency-bound).
template <bool kRows, typename Y, int kU>
__device__ __forceinline__ void sum_slots(const Y* __restrict__ y, const int32_t* __restrict__ ids,
                                          int top_k, int num_experts, int64_t hidden, int64_t slot0,
                                          int64_t h, const SortedRows& rows, float* acc) {
  constexpr int kCols = YVec<Y>::kCols;
  for (int j0 = 0; j0 < top_k; j0 += kU) {
    int32_t e[kU], row[kU];
    float sc[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t s = slot0 + j0 + u;
      const bool in = j0 + u < top_k;
      e[u] = in ? ids[s] : -1;
      row[u] = in && kRows ? rows.slot_row[s] : 0;
      sc[u] = in && kRows && rows.row_scale ? rows.row_scale[s] : 1.0f;
    }
    uint4 raw[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const bool ok = e[u] >= 0 && (num_experts <= 0 || e[u] < num_experts);
      if (!ok) e[u] = -1;
      raw[u] = make_uint4(0, 0, 0, 0);
      if (ok) {
        const int64_t r = kRows ? static_cast<int64_t>(row[u]) : slot0 + j0 + u;
        raw[u] = YVec<Y>::load(y + r * hidden + h);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (e[u] < 0) continue;
      float v[kCols];
      YVec<Y>::unpack(raw[u], v);
      if (kRows) {
        if (rows.bias) {
          const float* b = rows.bias + static_cast<int64_t>(e[u]) * hidden + h;
#pragma unroll
          for (int c = 0; c < kCols; c += 4) {
            const float4 b4 = *reinterpret_cast<const float4*>(b + c);
            v[c] += b4.x;
            v[c + 1] += b4.y;
            v[c + 2] += b4.z;
            v[c + 3] += b4.w;
          }
        }
#pragma unroll
        for (int c = 0; c < kCols; ++c) v[c] *= sc[u];
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[c] += v[c];
    }
  }
}

}  // namespace fusedmoe::cuda
