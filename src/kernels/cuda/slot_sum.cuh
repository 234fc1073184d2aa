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

// 16 bytes of y as f32: four f32 values, or eight bf16 (sm90_experts' rows).
template <typename Y>
struct YVec {
  static constexpr int kCols = 4;
  __device__ __forceinline__ static void load(const float* p, float* v) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    v[0] = a.x;
    v[1] = a.y;
    v[2] = a.z;
    v[3] = a.w;
  }
};
template <>
struct YVec<uint16_t> {
  static constexpr int kCols = 8;
  __device__ __forceinline__ static void load(const uint16_t* p, float* v) {
    gemm::unpack8<uint16_t>(*reinterpret_cast<const uint4*>(p), v);
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
    float v[kU][kCols];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const bool ok = e[u] >= 0 && (num_experts <= 0 || e[u] < num_experts);
      if (!ok) e[u] = -1;
      if (ok) {
        const int64_t r = kRows ? static_cast<int64_t>(row[u]) : slot0 + j0 + u;
        YVec<Y>::load(y + r * hidden + h, v[u]);
      } else {
#pragma unroll
        for (int c = 0; c < kCols; ++c) v[u][c] = 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (e[u] < 0) continue;
      if (kRows) {
        if (rows.bias) {
          const float* b = rows.bias + static_cast<int64_t>(e[u]) * hidden + h;
#pragma unroll
          for (int c = 0; c < kCols; c += 4) {
            const float4 b4 = *reinterpret_cast<const float4*>(b + c);
            v[u][c] += b4.x;
            v[u][c + 1] += b4.y;
            v[u][c + 2] += b4.z;
            v[u][c + 3] += b4.w;
          }
        }
#pragma unroll
        for (int c = 0; c < kCols; ++c) v[u][c] *= sc[u];
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[c] += v[u][c];
    }
  }
}

}  // namespace fusedmoe::cuda
