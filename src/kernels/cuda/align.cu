// fusedmoe CUDA: align / permute — group routed slots by expert, padded to
// the GEMM tile height (vLLM's moe_align_block_size, without a host sync).
//
// Three ways, picked by size (align() has the timings):
//   * fused: one block counts, scans and scatters in shared memory (few slots);
//   * chunks (many slots, E <= kChunkMaxExperts, with AlignArgs::chunk_counts):
//     the slots in up to kMaxChunks contiguous chunks; chunk_count_kernel
//     writes each chunk's per-expert counts, chunk_scatter_kernel (a block a
//     chunk) sums them into the padded offsets and its chunk's first row per
//     expert, then places its slots in slot order (per-warp counts in shared
//     memory, ranks from __match_any_sync): two launches, no atomics in global
//     memory, and each expert's rows in ascending slot order;
//   * grid: memset(counts) -> count (shared-memory histogram) -> scan (one
//     block: padded exclusive prefix sum, padding rows marked -1, per-expert
//     cursors) -> scatter (an atomic cursor per expert).
// Everything the host does not know (counts, offsets, the number of tiles)
// stays on the device.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "fusedmoe/core/env.h"
#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/pdl.cuh"

namespace fusedmoe::cuda {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kSmemHistMax = 4096;

// Exclusive prefix sum of x over a block of kThreads (a multiple of 32, at
// most 1024) threads: an inclusive scan in each warp, then over the warps'
// sums (warp_sums: shared, kThreads / 32 entries). Every thread must call it;
// *total gets the block's sum. warp_sums is read until the call returns: a
// __syncthreads() is needed before it is reused.
template <int kThreads, class T>
__device__ __forceinline__ T block_exclusive_scan(T x, T* warp_sums, T* total) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T v = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T s = lane < kWarps ? warp_sums[lane] : T(0);
#pragma unroll
    for (int o = 1; o < kWarps; o <<= 1) {
      const T u = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += u;
    }
    if (lane < kWarps) warp_sums[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  *total = warp_sums[kWarps - 1];
  return (warp > 0 ? warp_sums[warp - 1] : T(0)) + v - x;
}

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
                int32_t* __restrict__ sorted_slot, int32_t* __restrict__ zero_words,
                int num_zero_words) {
  __shared__ int64_t warp_sums[kScanThreads / 32];
  __shared__ int64_t carry;
  if (static_cast<int>(threadIdx.x) < num_zero_words) zero_words[threadIdx.x] = 0;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < num_experts; base += kScanThreads) {
    const int e = base + threadIdx.x;
    const int64_t cnt = e < num_experts ? counts[e] : 0;
    const int64_t padded = (cnt + block_m - 1) / block_m * block_m;
    int64_t sum = 0;
    const int64_t start = carry + block_exclusive_scan<kScanThreads>(padded, warp_sums, &sum);
    if (e < num_experts) {
      offsets[e] = start;
      cursor[e] = static_cast<int32_t>(start);
      for (int64_t r = start + cnt; r < start + padded; ++r) sorted_slot[r] = -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) carry += sum;
    __syncthreads();
  }
  if (threadIdx.x == 0) offsets[num_experts] = carry;
}

__global__ void scatter_kernel(const int32_t* __restrict__ ids, int64_t n, int num_experts,
                               int32_t* __restrict__ cursor, int32_t* __restrict__ sorted_slot,
                               int32_t* __restrict__ slot_row) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = ids[i];
    if (e < 0 || e >= num_experts) continue;
    const int32_t pos = atomicAdd(&cursor[e], 1);
    sorted_slot[pos] = static_cast<int32_t>(i);
    if (slot_row) slot_row[i] = pos;
  }
}

// Small batches (the decode path): one block does count, scan and scatter in
// shared memory — one launch instead of memset + three.
constexpr int kFusedThreads = 1024;
constexpr int64_t kFusedMaxSlots = 16384;
constexpr int kFusedMaxExperts = 1024;

__global__ void __launch_bounds__(kFusedThreads)
    align_fused_kernel(const int32_t* __restrict__ ids, int n, int num_experts, int block_m,
                       int64_t* __restrict__ offsets, int32_t* __restrict__ sorted_slot,
                       int32_t* __restrict__ slot_row, int32_t* __restrict__ zero_words,
                       int num_zero_words) {
  __shared__ int32_t cnt[kFusedMaxExperts];
  __shared__ int32_t cur[kFusedMaxExperts];
  __shared__ int32_t warp_sums[kFusedThreads / 32];
  pdl_wait();  // ids from route; offsets and sorted_slot read by the kernels before
  pdl_launch_dependents();
  const int tid = threadIdx.x;
  if (tid < num_zero_words) zero_words[tid] = 0;
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
  int32_t rows = 0;
  const int32_t start = block_exclusive_scan<kFusedThreads>(padded, warp_sums, &rows);
  if (e < num_experts) {
    offsets[e] = start;
    cur[e] = start;
    for (int32_t r = start + c; r < start + padded; ++r) sorted_slot[r] = -1;
  }
  if (tid == 0) offsets[num_experts] = rows;
  __syncthreads();
  for (int i = tid; i < n; i += kFusedThreads) {
    const int32_t ex = ids[i];
    if (ex < 0 || ex >= num_experts) continue;
    const int32_t pos = atomicAdd(&cur[ex], 1);
    sorted_slot[pos] = i;
    if (slot_row) slot_row[i] = pos;
  }
}

// ---- chunks ----
constexpr int kChunkThreads = 256;
constexpr int kChunkWarps = kChunkThreads / 32;
// Every block of chunk_scatter_kernel reads all chunks' counts (its first
// phase's latency grows with their number): few chunks of many slots.
constexpr int64_t kChunkMinSlots = 1024;
constexpr int64_t kMaxChunks = 32;
constexpr int kChunkMaxExperts = 1024;

int64_t chunk_slots(int64_t num_slots) {
  const int64_t c = std::max(kChunkMinSlots, ceil_div(num_slots, kMaxChunks));
  return ceil_div(c, kChunkThreads) * kChunkThreads;  // whole 32-slot steps of every warp
}
int64_t num_chunks(int64_t num_slots) {
  return std::max<int64_t>(1, ceil_div(num_slots, chunk_slots(num_slots)));
}

// chunk_counts[c * E + e] = routed slots of expert e in chunk c (slots [c *
// chunk, (c + 1) * chunk)); a block a chunk.
__global__ void __launch_bounds__(kChunkThreads)
    chunk_count_kernel(const int32_t* __restrict__ ids, int n, int num_experts, int chunk,
                       int32_t* __restrict__ chunk_counts) {
  extern __shared__ int32_t hist[];
  pdl_wait();  // ids from route; chunk_counts read by the kernels before
  pdl_launch_dependents();
  for (int e = threadIdx.x; e < num_experts; e += kChunkThreads) hist[e] = 0;
  __syncthreads();
  const int begin = blockIdx.x * chunk, end = min(n, begin + chunk);
  for (int i = begin + threadIdx.x; i < end; i += kChunkThreads) {
    const int32_t e = ids[i];
    if (e >= 0 && e < num_experts) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += kChunkThreads)
    chunk_counts[static_cast<int64_t>(blockIdx.x) * num_experts + e] = hist[e];
}

// A block a chunk (gridDim.x chunks). From every chunk's counts: the padded
// offsets (written by block 0), padding rows -1 (expert e by block e % chunks)
// and this chunk's first row of each expert; then the chunk's slots, each
// warp a contiguous run of them, in slot order: per-warp counts, their
// exclusive prefix over warps, then each slot's rank among the equal ids of
// its 32-slot step (__match_any_sync). No global atomics; deterministic.
// The warp's first kIdSteps steps of ids are read before pdl_wait(): they come
// from the kernel before chunk_count_kernel, complete when this one starts
// (pdl.cuh), so the read overlaps chunk_count_kernel.
constexpr int kIdSteps = 8;
__device__ __forceinline__ void load_ids(const int32_t* __restrict__ ids, int i0, int end, int lane,
                                         int32_t (&id)[kIdSteps]) {
#pragma unroll
  for (int j = 0; j < kIdSteps; ++j) {
    const int i = i0 + j * 32 + lane;
    id[j] = i < end ? __ldcg(ids + i) : -1;
  }
}
__global__ void __launch_bounds__(kChunkThreads)
    chunk_scatter_kernel(const int32_t* __restrict__ ids, int n, int num_experts, int chunk,
                         int block_m, const int32_t* __restrict__ chunk_counts,
                         int64_t* __restrict__ offsets, int32_t* __restrict__ sorted_slot,
                         int32_t* __restrict__ slot_row, int32_t* __restrict__ zero_words,
                         int num_zero_words) {
  extern __shared__ int32_t sm[];
  int32_t* first = sm;                // [E]: this chunk's first row of expert e
  int32_t* whist = sm + num_experts;  // [warps][E]: counts, then first rows per warp
  __shared__ int32_t warp_sums[kChunkWarps];
  __shared__ int32_t carry;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.x, chunks = gridDim.x;
  const int per_warp = chunk / kChunkWarps;  // a multiple of 32
  const int w_begin = b * chunk + warp * per_warp;
  const int w_end = min(n, w_begin + per_warp);
  int32_t id0[kIdSteps];  // the first kIdSteps steps (all of them up to 8192 slots a chunk)
  load_ids(ids, w_begin, w_end, lane, id0);
  pdl_wait();  // chunk_counts from chunk_count_kernel; outputs read by the kernels before
  pdl_launch_dependents();
  if (b == 0 && tid < num_zero_words) zero_words[tid] = 0;
  if (tid == 0) carry = 0;
  for (int i = tid; i < kChunkWarps * num_experts; i += kChunkThreads) whist[i] = 0;
  __syncthreads();
  for (int e0 = 0; e0 < num_experts; e0 += kChunkThreads) {
    const int e = e0 + tid;
    int32_t total = 0, before = 0;
    if (e < num_experts) {
#pragma unroll 16
      for (int c = 0; c < chunks; ++c) {
        const int32_t v = chunk_counts[static_cast<int64_t>(c) * num_experts + e];
        total += v;
        before += c < b ? v : 0;
      }
    }
    const int32_t padded = (total + block_m - 1) / block_m * block_m;
    int32_t sum = 0;
    const int32_t start = carry + block_exclusive_scan<kChunkThreads>(padded, warp_sums, &sum);
    if (e < num_experts) {
      first[e] = start + before;
      if (b == 0) offsets[e] = start;
      if (e % chunks == b)
        for (int32_t r = start + total; r < start + padded; ++r) sorted_slot[r] = -1;
    }
    __syncthreads();
    if (tid == 0) carry += sum;
    __syncthreads();
  }
  if (b == 0 && tid == 0) offsets[num_experts] = carry;

  int32_t* h = whist + warp * num_experts;
  const uint32_t lanes_below = (1u << lane) - 1u;
  // Pass 1 counts the warp's slots per expert, pass 2 places them; kIdSteps
  // steps of ids at a time (the first batch already in id0, its peer masks
  // kept from pass 1 in peers0).
  uint32_t peers0[kIdSteps];
  for (int pass = 0; pass < 2; ++pass) {
    for (int i0 = w_begin; i0 < w_end; i0 += kIdSteps * 32) {
      int32_t id[kIdSteps];
      const bool first_batch = i0 == w_begin;
      if (first_batch) {
#pragma unroll
        for (int j = 0; j < kIdSteps; ++j) id[j] = id0[j];
      } else {
        load_ids(ids, i0, w_end, lane, id);
      }
#pragma unroll
      for (int j = 0; j < kIdSteps; ++j) {
        if (i0 + j * 32 >= w_end) break;  // warp-uniform
        const int32_t e = id[j];
        const bool valid = e >= 0 && e < num_experts;
        uint32_t peers;
        if (pass == 1 && first_batch) {
          peers = peers0[j];
        } else {
          peers = __match_any_sync(0xffffffffu, valid ? e : -1 - lane);
          if (first_batch) peers0[j] = peers;
        }
        const bool leader = valid && (peers & lanes_below) == 0;
        if (pass == 1 && valid) {
          const int i = i0 + j * 32 + lane;
          const int32_t pos = h[e] + __popc(peers & lanes_below);
          sorted_slot[pos] = i;
          if (slot_row) slot_row[i] = pos;
        }
        __syncwarp();  // h[e] read by every lane before its leader adds the step's count
        if (leader) h[e] += __popc(peers);
        __syncwarp();
      }
    }
    __syncthreads();
    if (pass == 0) {
      for (int e = tid; e < num_experts; e += kChunkThreads) {
        int32_t row = first[e];
        for (int w = 0; w < kChunkWarps; ++w) {
          const int32_t c = whist[w * num_experts + e];
          whist[w * num_experts + e] = row;
          row += c;
        }
      }
      __syncthreads();
    }
  }
}

}  // namespace

int64_t max_padded_rows(int64_t num_slots, int64_t num_experts, int block_m) {
  const int64_t touched = num_slots < num_experts ? num_slots : num_experts;
  return num_slots + touched * (block_m - 1);
}

int64_t align_chunk_counts_size(int64_t num_slots, int64_t num_experts) {
  if (num_experts <= 0 || num_experts > kChunkMaxExperts) return 0;  // the chunks do not apply
  return num_chunks(std::max<int64_t>(num_slots, 0)) * num_experts;
}

void align(const AlignArgs& a, Stream stream) {
  FUSEDMOE_CHECK(a.num_experts > 0 && a.block_m > 0, "align: num_experts and block_m must be > 0");
  FUSEDMOE_CHECK(a.num_slots >= 0, "align: num_slots must be >= 0, got ", a.num_slots);
  FUSEDMOE_CHECK(a.num_slots < (int64_t{1} << 31) - a.num_experts * a.block_m,
                 "align: too many routed slots for 32-bit row indices: ", a.num_slots);
  FUSEDMOE_CHECK(a.expert_offsets && a.sorted_slot && a.expert_counts && a.expert_cursor,
                 "align: output and scratch pointers are required");
  FUSEDMOE_CHECK(a.num_zero_words >= 0 && a.num_zero_words <= kAlignMaxZeroWords &&
                     (a.num_zero_words == 0 || a.zero_words != nullptr),
                 "align: num_zero_words: expected 0 .. ", kAlignMaxZeroWords,
                 " with zero_words given, got ", a.num_zero_words);
  const int E = static_cast<int>(a.num_experts);
  const int n = static_cast<int>(a.num_slots);
  // FUSEDMOE_CUDA_ALIGN=fused|chunks|grid forces one (fused: where it fits;
  // chunks: with chunk_counts and E <= kChunkMaxExperts).
  const int forced = cuda_switch(CudaSwitch::kAlign);  // fused, chunks, grid
  const bool fits = a.num_slots <= kFusedMaxSlots && E <= kFusedMaxExperts;
  const bool chunks_fit = a.chunk_counts != nullptr && E <= kChunkMaxExperts;
  // The one-block kernel where it fits and is faster. Session 16 (ncu, us, one
  // block vs count + scan + scatter, bench/results/2026-11-30-session16.md):
  // E = 128 / 256 at 2048-4096 slots 5-7 vs 8-10, at 8192 11-12 vs 9-10 (+ the
  // memset: a tie), at 16384 20-21 vs 11-12; E = 8 at 8192 5.8 vs 9.5. Session
  // 24 (bench/results/2026-12-01-session24.md; routed experts end to end, us,
  // chunks vs fused): Qwen3 T = 2048 (16384 slots) 447-449 vs 460-462, DeepSeek-V3
  // T = 512 / 1024 5278-5282 / 5427-5440 vs 5287-5291 / 5434-5448; at 2048-4096
  // slots within the noise (Qwen3 T = 256 fused 2-5 us ahead in two of three
  // passes). So the fused kernel up to 4096 slots (any E), else the chunks.
  const bool faster = a.num_slots <= kFusedMaxSlots / 4 || !chunks_fit;
  if (forced >= 0 ? forced == 0 && fits : fits && faster) {
    launch_pdl(align_fused_kernel, 1, kFusedThreads, 0, stream, a.topk_ids, n, E, a.block_m,
               a.expert_offsets, a.sorted_slot, a.slot_row, a.zero_words, a.num_zero_words);
    return;
  }
  if (chunks_fit && forced != 2) {
    const int64_t chunk = chunk_slots(a.num_slots), chunks = num_chunks(a.num_slots);
    launch_pdl(chunk_count_kernel, static_cast<unsigned>(chunks), kChunkThreads,
               sizeof(int32_t) * E, stream, a.topk_ids, n, E, static_cast<int>(chunk),
               a.chunk_counts);
    launch_pdl(chunk_scatter_kernel, static_cast<unsigned>(chunks), kChunkThreads,
               sizeof(int32_t) * E * (1 + kChunkWarps), stream, a.topk_ids, n, E,
               static_cast<int>(chunk), a.block_m, a.chunk_counts, a.expert_offsets, a.sorted_slot,
               a.slot_row, a.zero_words, a.num_zero_words);
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
                                              a.expert_cursor, a.sorted_slot, a.zero_words,
                                              a.num_zero_words);
  FUSEDMOE_CUDA_CHECK_LAUNCH();
  if (a.num_slots > 0) {
    const int threads = 256;
    const int64_t blocks = ceil_div(a.num_slots, threads);
    const unsigned grid = static_cast<unsigned>(blocks < 1024 ? blocks : 1024);
    scatter_kernel<<<grid, threads, 0, stream>>>(a.topk_ids, a.num_slots, E, a.expert_cursor,
                                                 a.sorted_slot, a.slot_row);
    FUSEDMOE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace fusedmoe::cuda
