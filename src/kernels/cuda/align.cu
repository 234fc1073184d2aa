// fusedmoe CUDA: align / permute — group routed slots by expert, padded to
// the GEMM tile height (vLLM's moe_align_block_size, without a host sync).
//
// memset(counts) -> count (shared-memory histogram) -> scan (one block: padded
// exclusive prefix sum, 64-bit offsets, padding rows marked -1, per-expert
// cursors) -> scatter (an atomic cursor per expert). Everything the host does
// not know (counts, offsets, the number of tiles) stays on the device.
#include <cstdlib>
#include <cstring>

#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/pdl.cuh"

namespace fusedmoe::cuda {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kSmemHistMax = 4096;

__global__ void count_kernel(const int32_t* __restrict__ ids, int64_t n, int num_experts,
                             int32_t* __restrict__ counts) {
  extern __shared__ int32_t hist[];
  const bool use_smem = num_experts <= kSmemHistMax;
  if (use_smem)
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = ids[i];
    if (e < 0 || e >= num_experts) continue;  // -1: no expert
    if (use_smem)
      atomicAdd(&hist[e], 1);
    else
      atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  if (use_smem)
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
      if (hist[e] != 0) atomicAdd(&counts[e], hist[e]);
}

// One block. Exclusive scan of padded counts in chunks of kScanThreads.
__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(const int32_t* __restrict__ counts, int num_experts, int block_m,
                int64_t* __restrict__ offsets, int32_t* __restrict__ cursor,
                int32_t* __restrict__ sorted_slot) {
  __shared__ int64_t warp_sums[kScanThreads / 32];
  __shared__ int64_t carry;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < num_experts; base += kScanThreads) {
    const int e = base + threadIdx.x;
    const int64_t cnt = e < num_experts ? counts[e] : 0;
    const int64_t padded = (cnt + block_m - 1) / block_m * block_m;
    // Inclusive warp scan, then across warps.
    int64_t v = padded;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t u = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += u;
    }
    if (lane == 31) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
      int64_t s = warp_sums[lane];
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int64_t u = __shfl_up_sync(0xffffffffu, s, o);
        if (lane >= o) s += u;
      }
      warp_sums[lane] = s;  // inclusive over warps
    }
    __syncthreads();
    const int64_t start = carry + (warp > 0 ? warp_sums[warp - 1] : 0) + v - padded;
    if (e < num_experts) {
      offsets[e] = start;
      cursor[e] = static_cast<int32_t>(start);
      for (int64_t r = start + cnt; r < start + padded; ++r) sorted_slot[r] = -1;
    }
    __syncthreads();
    if (threadIdx.x == kScanThreads - 1) carry = start + padded;
    __syncthreads();
  }
  if (threadIdx.x == 0) offsets[num_experts] = carry;
}

__global__ void scatter_kernel(const int32_t* __restrict__ ids, int64_t n, int num_experts,
                               int32_t* __restrict__ cursor, int32_t* __restrict__ sorted_slot) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = ids[i];
    if (e < 0 || e >= num_experts) continue;
    const int32_t pos = atomicAdd(&cursor[e], 1);
    sorted_slot[pos] = static_cast<int32_t>(i);
  }
}

// Small batches (the decode path): one block does count, scan and scatter in
// shared memory — one launch instead of memset + three.
constexpr int kFusedThreads = 1024;
constexpr int64_t kFusedMaxSlots = 16384;
constexpr int kFusedMaxExperts = 1024;
constexpr int kFusedFewExperts = 32;  // up to kFusedMaxSlots slots (align() has the timings)

__global__ void __launch_bounds__(kFusedThreads)
    align_fused_kernel(const int32_t* __restrict__ ids, int n, int num_experts, int block_m,
                       int64_t* __restrict__ offsets, int32_t* __restrict__ sorted_slot) {
  __shared__ int32_t cnt[kFusedMaxExperts];
  __shared__ int32_t cur[kFusedMaxExperts];
  __shared__ int32_t warp_sums[kFusedThreads / 32];
  pdl_wait();  // ids from route; offsets and sorted_slot read by the kernels before
  pdl_launch_dependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < num_experts; e += kFusedThreads) cnt[e] = 0;
  __syncthreads();
  for (int i = tid; i < n; i += kFusedThreads) {
    const int32_t e = ids[i];
    if (e >= 0 && e < num_experts) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  // Exclusive scan of padded counts; experts per thread = ceil(E / 1024) <= 1.
  const int e = tid;
  const int32_t c = e < num_experts ? cnt[e] : 0;
  const int32_t padded = (c + block_m - 1) / block_m * block_m;
  int32_t v = padded;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int32_t s = warp_sums[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t u = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += u;
    }
    warp_sums[lane] = s;
  }
  __syncthreads();
  const int32_t start = (warp > 0 ? warp_sums[warp - 1] : 0) + v - padded;
  if (e < num_experts) {
    offsets[e] = start;
    cur[e] = start;
    for (int32_t r = start + c; r < start + padded; ++r) sorted_slot[r] = -1;
  }
  if (tid == kFusedThreads - 1) offsets[num_experts] = start + padded;
  __syncthreads();
  for (int i = tid; i < n; i += kFusedThreads) {
    const int32_t ex = ids[i];
    if (ex >= 0 && ex < num_experts) sorted_slot[atomicAdd(&cur[ex], 1)] = i;
  }
}

}  // namespace

int64_t max_padded_rows(int64_t num_slots, int64_t num_experts, int block_m) {
  const int64_t touched = num_slots < num_experts ? num_slots : num_experts;
  return num_slots + touched * (block_m - 1);
}

void align(const AlignArgs& a, Stream stream) {
  FUSEDMOE_CHECK(a.num_experts > 0 && a.block_m > 0, "align: num_experts and block_m must be > 0");
  FUSEDMOE_CHECK(a.num_slots < (int64_t{1} << 31) - a.num_experts * a.block_m,
                 "align: too many routed slots for 32-bit row indices: ", a.num_slots);
  FUSEDMOE_CHECK(a.expert_offsets && a.sorted_slot && a.expert_counts && a.expert_cursor,
                 "align: output and scratch pointers are required");
  const int E = static_cast<int>(a.num_experts);
  // The one-block kernel where it fits and is faster (session 16, ncu, us,
  // one block vs count + scan + scatter, bench/results/2026-11-30-session16.md):
  // E = 128 / 256 at 2048-4096 slots 5-7 vs 8-10, at 8192 11-12 vs 9-10 (+ the
  // memset: a tie), at 16384 20-21 vs 11-12; E = 8 at 8192 5.8 vs 9.5.
  // FUSEDMOE_CUDA_ALIGN=fused|grid forces one (fused: where it fits).
  const char* env = std::getenv("FUSEDMOE_CUDA_ALIGN");
  const bool set = env != nullptr && env[0] != '\0';
  FUSEDMOE_CHECK(!set || std::strcmp(env, "fused") == 0 || std::strcmp(env, "grid") == 0,
                 "FUSEDMOE_CUDA_ALIGN: expected fused or grid, got ", env);
  const bool fits = a.num_slots <= kFusedMaxSlots && E <= kFusedMaxExperts;
  const bool faster = a.num_slots <= kFusedMaxSlots / 2 || E <= kFusedFewExperts;
  if (fits && (set ? std::strcmp(env, "fused") == 0 : faster)) {
    launch_pdl(align_fused_kernel, 1, kFusedThreads, 0, stream, a.topk_ids,
               static_cast<int>(a.num_slots), E, a.block_m, a.expert_offsets, a.sorted_slot);
    return;
  }
  FUSEDMOE_CUDA_CHECK(cudaMemsetAsync(a.expert_counts, 0, sizeof(int32_t) * E, stream));
  if (a.num_slots > 0) {
    const int threads = 256;
    const int64_t blocks = ceil_div(a.num_slots, threads);
    const unsigned grid = static_cast<unsigned>(blocks < 1024 ? blocks : 1024);
    const size_t smem = E <= kSmemHistMax ? sizeof(int32_t) * E : 0;
    count_kernel<<<grid, threads, smem, stream>>>(a.topk_ids, a.num_slots, E, a.expert_counts);
    FUSEDMOE_CUDA_CHECK_LAUNCH();
  }
  scan_kernel<<<1, kScanThreads, 0, stream>>>(a.expert_counts, E, a.block_m, a.expert_offsets,
                                              a.expert_cursor, a.sorted_slot);
  FUSEDMOE_CUDA_CHECK_LAUNCH();
  if (a.num_slots > 0) {
    const int threads = 256;
    const int64_t blocks = ceil_div(a.num_slots, threads);
    const unsigned grid = static_cast<unsigned>(blocks < 1024 ? blocks : 1024);
    scatter_kernel<<<grid, threads, 0, stream>>>(a.topk_ids, a.num_slots, E, a.expert_cursor,
                                                 a.sorted_slot);
    FUSEDMOE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace fusedmoe::cuda
