// fusedmoe CUDA: expert-parallel dispatch / combine kernels (ep_dispatch.h).
// Positions come from block-wide scans in token order (cub::BlockScan), so the
// layout of every buffer is deterministic and independent of scheduling.
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/ep_dispatch.h"

namespace fusedmoe::cuda {
namespace {

constexpr int kScanThreads = 256;
constexpr int kCopyThreads = 128;

// (rows << 32) | slots: one scan for both counts (slots < 2^31, checked by the caller).
__global__ void __launch_bounds__(kScanThreads)
    layout_kernel(const int32_t* __restrict__ ids, int64_t T, int k,
                  const int32_t* __restrict__ rank_of, int P, int32_t* __restrict__ row_pos,
                  int32_t* __restrict__ slot_pos, int64_t* __restrict__ counts) {
  using Scan = cub::BlockScan<unsigned long long, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int r = blockIdx.x;
  unsigned long long base = 0;
  for (int64_t c0 = 0; c0 < T; c0 += kScanThreads) {
    const int64_t t = c0 + threadIdx.x;
    int ns = 0;
    if (t < T)
      for (int j = 0; j < k; ++j) {
        const int32_t id = ids[t * k + j];
        ns += id >= 0 && rank_of[id] == r;
      }
    const unsigned long long v = ns ? ((1ull << 32) | static_cast<unsigned long long>(ns)) : 0ull;
    unsigned long long ex = 0, agg = 0;
    Scan(tmp).ExclusiveSum(v, ex, agg);
    __syncthreads();
    if (t < T) {
      ex += base;
      row_pos[t * P + r] = ns ? static_cast<int32_t>(ex >> 32) : -1;
      int32_t sp = static_cast<int32_t>(ex & 0xffffffffull);
      for (int j = 0; j < k; ++j) {
        const int32_t id = ids[t * k + j];
        if (id >= 0 && rank_of[id] == r)
          slot_pos[t * k + j] = sp++;
        else if (id < 0 && r == 0)
          slot_pos[t * k + j] = -1;
      }
    }
    base += agg;
  }
  if (threadIdx.x == 0) {
    counts[r * 3 + 0] = static_cast<int64_t>(base >> 32);
    counts[r * 3 + 1] = static_cast<int64_t>(base & 0xffffffffull);
    counts[r * 3 + 2] = T;
  }
}

// One block per token.
__global__ void __launch_bounds__(kCopyThreads)
    pack_kernel(const uint16_t* __restrict__ x, const int32_t* __restrict__ ids,
                const float* __restrict__ w, int k, int64_t H, const int32_t* __restrict__ rank_of,
                const int32_t* __restrict__ local_of, int P, const int32_t* __restrict__ row_pos,
                const int64_t* __restrict__ counts, char* __restrict__ send, int64_t rec) {
  const int64_t t = blockIdx.x;
  int64_t displ = 0;
  for (int r = 0; r < P; ++r) {
    const int32_t p = row_pos[t * P + r];
    if (p >= 0) {
      char* dst = send + (displ + p) * rec;
      const uint4* xs = reinterpret_cast<const uint4*>(x + t * H);
      uint4* xd = reinterpret_cast<uint4*>(dst);
      for (int64_t i = threadIdx.x; i < H / 8; i += blockDim.x) xd[i] = xs[i];
      if (threadIdx.x < k) {
        const int j = threadIdx.x;
        const int32_t id = ids[t * k + j];
        reinterpret_cast<int32_t*>(dst + 2 * H)[j] =
            id >= 0 && rank_of[id] == r ? local_of[id] : -1;
        reinterpret_cast<float*>(dst + 2 * H + 4 * k)[j] = w[t * k + j];
      }
    }
    displ += counts[r * 3];
  }
}

__global__ void __launch_bounds__(kScanThreads)
    unpack_kernel(const char* __restrict__ recv, int64_t M, int k, int64_t H, int64_t rec,
                  int32_t* __restrict__ ids, float* __restrict__ w, int32_t* __restrict__ cpos) {
  using Scan = cub::BlockScan<int64_t, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int64_t base = 0;
  for (int64_t c0 = 0; c0 < M; c0 += kScanThreads) {
    const int64_t m = c0 + threadIdx.x;
    const char* r = recv + m * rec;
    int64_t ns = 0;
    if (m < M)
      for (int j = 0; j < k; ++j) ns += reinterpret_cast<const int32_t*>(r + 2 * H)[j] >= 0;
    int64_t ex = 0, agg = 0;
    Scan(tmp).ExclusiveSum(ns, ex, agg);
    __syncthreads();
    if (m < M) {
      int64_t s = base + ex;
      for (int j = 0; j < k; ++j) {
        const int32_t id = reinterpret_cast<const int32_t*>(r + 2 * H)[j];
        ids[m * k + j] = id;
        w[m * k + j] = reinterpret_cast<const float*>(r + 2 * H + 4 * k)[j];
        cpos[m * k + j] = id >= 0 ? static_cast<int32_t>(s++) : -1;
      }
    }
    base += agg;
  }
}

// One block per received row.
__global__ void __launch_bounds__(kCopyThreads)
    combine_pack_kernel(const float* __restrict__ y, const int32_t* __restrict__ cpos, int k,
                        int64_t H, float* __restrict__ send) {
  const int64_t m = blockIdx.x;
  for (int j = 0; j < k; ++j) {
    const int32_t p = cpos[m * k + j];
    if (p < 0) continue;
    const float4* src = reinterpret_cast<const float4*>(y + (m * k + j) * H);
    float4* dst = reinterpret_cast<float4*>(send + static_cast<int64_t>(p) * H);
    for (int64_t i = threadIdx.x; i < H / 4; i += blockDim.x) dst[i] = src[i];
  }
}

// One block per token.
__global__ void __launch_bounds__(kCopyThreads)
    combine_unpack_kernel(const float* __restrict__ recv, const int32_t* __restrict__ ids,
                          const int32_t* __restrict__ slot_pos, const int32_t* __restrict__ rank_of,
                          const int64_t* __restrict__ counts, int P, int k, int64_t H,
                          float* __restrict__ y) {
  const int64_t t = blockIdx.x;
  for (int j = 0; j < k; ++j) {
    const int32_t id = ids[t * k + j];
    if (id < 0) continue;
    const int r = rank_of[id];
    int64_t displ = 0;
    for (int q = 0; q < r; ++q) displ += counts[q * 3 + 1];
    const float4* src = reinterpret_cast<const float4*>(recv + (displ + slot_pos[t * k + j]) * H);
    float4* dst = reinterpret_cast<float4*>(y + (t * k + j) * H);
    for (int64_t i = threadIdx.x; i < H / 4; i += blockDim.x) dst[i] = src[i];
  }
}

}  // namespace

void ep_layout(const int32_t* topk_ids, int64_t num_tokens, int top_k, const int32_t* rank_of,
               int ep_size, int32_t* row_pos, int32_t* slot_pos, int64_t* counts, Stream stream) {
  FUSEDMOE_CHECK(num_tokens * top_k < (int64_t{1} << 31), "ep_layout: T * k = ", num_tokens * top_k,
                 " routed slots, expected < 2^31");
  layout_kernel<<<ep_size, kScanThreads, 0, stream>>>(topk_ids, num_tokens, top_k, rank_of, ep_size,
                                                      row_pos, slot_pos, counts);
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

void ep_pack(const uint16_t* x, const int32_t* topk_ids, const float* topk_weights,
             int64_t num_tokens, int top_k, int64_t hidden, const int32_t* rank_of,
             const int32_t* local_of, int ep_size, const int32_t* row_pos, const int64_t* counts,
             void* send, Stream stream) {
  if (num_tokens == 0) return;
  FUSEDMOE_CHECK(hidden % 8 == 0 && top_k <= kCopyThreads,
                 "ep_pack: H % 8 == 0 and k <= ", kCopyThreads, " expected, got H = ", hidden,
                 ", k = ", top_k);
  pack_kernel<<<static_cast<unsigned>(num_tokens), kCopyThreads, 0, stream>>>(
      x, topk_ids, topk_weights, top_k, hidden, rank_of, local_of, ep_size, row_pos, counts,
      static_cast<char*>(send), ep_record_bytes(hidden, top_k));
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

void ep_unpack(const void* recv, int64_t num_rows, int top_k, int64_t hidden, int32_t* topk_ids,
               float* topk_weights, int32_t* combine_pos, Stream stream) {
  if (num_rows == 0) return;
  unpack_kernel<<<1, kScanThreads, 0, stream>>>(static_cast<const char*>(recv), num_rows, top_k,
                                                hidden, ep_record_bytes(hidden, top_k), topk_ids,
                                                topk_weights, combine_pos);
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

void ep_combine_pack(const float* y, const int32_t* combine_pos, int64_t num_rows, int top_k,
                     int64_t hidden, float* send, Stream stream) {
  if (num_rows == 0) return;
  combine_pack_kernel<<<static_cast<unsigned>(num_rows), kCopyThreads, 0, stream>>>(
      y, combine_pos, top_k, hidden, send);
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

void ep_combine_unpack(const float* recv, const int32_t* topk_ids, const int32_t* slot_pos,
                       const int32_t* rank_of, const int64_t* counts, int ep_size,
                       int64_t num_tokens, int top_k, int64_t hidden, float* y, Stream stream) {
  if (num_tokens == 0) return;
  combine_unpack_kernel<<<static_cast<unsigned>(num_tokens), kCopyThreads, 0, stream>>>(
      recv, topk_ids, slot_pos, rank_of, counts, ep_size, top_k, hidden, y);
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fusedmoe::cuda
