// fusedmoe CUDA: device-initiated expert-parallel dispatch / combine over peer
// GPU memory (ep_peer.h).
//
// Ordering: a block's stores into peer memory are followed by a system-scope
// fence before it counts itself done (atomicAdd on `done`); the last block
// fences again and publishes with st.release.sys on the peer's flag; a waiter
// polls its own flag with ld.acquire.sys, then __syncthreads() hands the
// acquired view to the block (the threadfence-reduction pattern, at system
// scope).
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdio>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/ep_dispatch.h"
#include "kernels/cuda/ep_peer.h"
#include "kernels/cuda/gemm/gemv_common.cuh"  // unpack8
#include "kernels/cuda/slot_sum.cuh"          // SortedRows, YVec, sum_slots

namespace fusedmoe::cuda {
namespace {

constexpr int kThreads = 128;
// Dispatch / combine blocks.
constexpr int kCopyThreads = 256;

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t* dispatch_flags(char* w) {
  return reinterpret_cast<uint64_t*>(w);
}
__device__ __forceinline__ uint64_t* combine_flags(char* w, int P) {
  return reinterpret_cast<uint64_t*>(w) + P;
}
__device__ __forceinline__ int64_t* row_counts(char* w, int P) {
  return reinterpret_cast<int64_t*>(w) + 2 * P;
}

// Polls flag until it reaches `want`; after timeout_ns prints what it waited
// for and traps (the context is lost: the process fails instead of hanging).
__device__ void wait_flag(const uint64_t* flag, uint64_t want, uint64_t timeout_ns,
                          const char* what, int rank, int peer) {
  const uint64_t t0 = globaltimer_ns();
  while (ld_acquire_sys(flag) < want) {
    if (globaltimer_ns() - t0 > timeout_ns) {
      printf(
          "fusedmoe: expert-parallel peer transport: rank %d waited %.1f s for rank %d's %s "
          "(epoch %llu, FUSEDMOE_COMM_TIMEOUT_S); every rank must call forward() the same number "
          "of times\n",
          rank, timeout_ns * 1e-9, peer, what, static_cast<unsigned long long>(want));
      __trap();
    }
    __nanosleep(64);
  }
}

// True in every thread of the block that finished last (after all others'
// stores and fences); resets *done for the next call.
__device__ bool last_block(unsigned* done) {
  __shared__ bool last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(done, 1u) == gridDim.x * gridDim.y - 1;
    if (last) *done = 0;
  }
  __syncthreads();
  if (last) __threadfence_system();
  return last;
}

__device__ __forceinline__ int32_t* rec_ids(char* r, const PeerLayout& L) {
  return reinterpret_cast<int32_t*>(r + L.payload);
}
__device__ __forceinline__ float* rec_weights(char* r, const PeerLayout& L) {
  return reinterpret_cast<float*>(r + L.payload + 4 * L.top_k);
}
__device__ __forceinline__ int32_t* rec_token(char* r, const PeerLayout& L) {
  return reinterpret_cast<int32_t*>(r + L.payload + 8 * L.top_k);
}
__device__ __forceinline__ float* rec_scales(char* r, const PeerLayout& L) {  // fp8 records
  return reinterpret_cast<float*>(r + L.hidden);
}

// 8 half values (bf16 or f16 bits) <-> f32.
__device__ __forceinline__ void half8_to_f32(uint4 a, bool f16, float* v) {
  if (f16)
    gemm::unpack8<__half>(a, v);
  else
    gemm::unpack8<uint16_t>(a, v);
}
__device__ __forceinline__ uint4 f32_to_half8(const float* v, bool f16) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (f16) {
      const __half2 h = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&h);
    } else {
      w[i] = static_cast<uint32_t>(float_to_bf16_bits(v[2 * i])) |
             (static_cast<uint32_t>(float_to_bf16_bits(v[2 * i + 1])) << 16);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Persistent grids: a few blocks an SM loop over the work items, so each block
// pays last_block()'s system-scope fence once, not once an item.
constexpr int kBlocksPerSm = 8;
unsigned persistent_grid(int64_t items, int sms) {
  return static_cast<unsigned>(std::clamp<int64_t>(items, 1, int64_t{kBlocksPerSm} * sms));
}

// A token's row (x: its H half values) to every destination r with pos[r] >= 0,
// at row pos[r] of region L.rank: 16-byte vectors, one a thread.
__device__ __forceinline__ void dispatch_row(const uint16_t* x, const int32_t* pos,
                                             char* const* peers, const PeerLayout& L) {
  const int64_t nv = L.hidden / 8;
  const uint4* xs = reinterpret_cast<const uint4*>(x);
  for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
    const uint4 v = xs[i];
    for (int r = 0; r < L.ep_size; ++r)
      if (pos[r] >= 0)
        reinterpret_cast<uint4*>(peers[r] + L.off_recv +
                                 (L.rank * L.capacity + pos[r]) * L.rec)[i] = v;
  }
}

// The same as fp8 records: kE values a thread (16: one 16-byte store of e4m3
// values, H % 16 == 0; else 8), the 128 / kE threads of a 128-column group
// sharing its amax (shuffles within aligned lanes; every lane of the block
// runs every step of the loop), s = amax / 448 (1 for an all-zero group),
// e4m3(x / s) satfinite, rounded to nearest; the group's first lane puts s in
// scales (shared memory: the record's tail, sent whole by send_tail).
template <int kE>
__device__ __forceinline__ void dispatch_row_fp8(const uint16_t* x, const int32_t* pos,
                                                 char* const* peers, const PeerLayout& L,
                                                 float* scales) {
  constexpr int kLanes = 128 / kE;
  const int64_t nv = L.hidden / kE;
  const uint4* xs = reinterpret_cast<const uint4*>(x);
  for (int64_t base = 0; base < nv; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const bool ok = i < nv;
    float f[kE];
#pragma unroll
    for (int u = 0; u < kE / 8; ++u)
      half8_to_f32(ok ? xs[i * (kE / 8) + u] : make_uint4(0, 0, 0, 0), L.x_f16, f + 8 * u);
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < kE; ++e) amax = fmaxf(amax, fabsf(f[e]));
#pragma unroll
    for (int o = kLanes / 2; o > 0; o >>= 1)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = amax > 0.0f && isfinite(amax) ? amax / 448.0f : 1.0f;
    uint32_t q[kE / 4];
#pragma unroll
    for (int h = 0; h < kE / 4; ++h) {
      const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
          make_float2(f[4 * h] / scale, f[4 * h + 1] / scale), __NV_SATFINITE, __NV_E4M3);
      const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
          make_float2(f[4 * h + 2] / scale, f[4 * h + 3] / scale), __NV_SATFINITE, __NV_E4M3);
      q[h] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    if (!ok) continue;
    if ((threadIdx.x & (kLanes - 1)) == 0) scales[i / kLanes] = scale;
    for (int r = 0; r < L.ep_size; ++r) {
      if (pos[r] < 0) continue;
      char* dst = peers[r] + L.off_recv + (L.rank * L.capacity + pos[r]) * L.rec;
      if constexpr (kE == 16)
        reinterpret_cast<uint4*>(dst)[i] = make_uint4(q[0], q[1], q[2], q[3]);
      else
        reinterpret_cast<uint2*>(dst)[i] = make_uint2(q[0], q[1]);
    }
  }
}

// A record's tail: the bytes after its values (fp8: from H, the scales on; else
// from 2 H: ids, weights, token index, padding), 16-byte aligned (8 for fp8
// records with H % 16 == 8). Built in shared memory and sent as whole vectors:
// a few 16-byte stores a destination, not one 4-byte store a scale and an id
// (small stores over NVLink cost about as much as full ones).
__host__ __device__ inline int64_t tail_offset(const PeerLayout& L) {
  return L.fp8 ? L.hidden : 2 * L.hidden;
}
template <typename V>
__device__ __forceinline__ void send_tail(const char* tail, int64_t bytes, char* dst) {
  for (int64_t v = threadIdx.x; v < bytes / static_cast<int64_t>(sizeof(V)); v += blockDim.x)
    reinterpret_cast<V*>(dst)[v] = reinterpret_cast<const V*>(tail)[v];
}

// Work item: token t. Its destinations (ranks holding one of its k experts)
// take a row each from a per-destination cursor (atomicAdd: the rows' order
// on a destination varies from run to run, the outputs do not: every row is
// computed alone, the combine writes by token index and the source sums in
// rank order), written to row_pos; then its row to each destination
// (dispatch_row / dispatch_row_fp8), then the record's tail (the fp8 scales,
// the ids local to that destination, weights, token index; dynamic shared
// memory of rec - tail_offset bytes). The last block publishes the row counts,
// resets the cursors and signals.
template <bool kFp8, int kE>
__global__ void __launch_bounds__(kCopyThreads)
    dispatch_kernel(const uint16_t* __restrict__ x, const int32_t* __restrict__ ids,
                    const float* __restrict__ w, int64_t T, const int32_t* __restrict__ rank_of,
                    const int32_t* __restrict__ local_of, int32_t* __restrict__ row_pos,
                    int64_t* __restrict__ counts, unsigned* cursor, char* const* __restrict__ peers,
                    PeerLayout L, uint64_t* epoch, unsigned* done) {
  const int P = L.ep_size, k = L.top_k, me = L.rank;
  const int64_t H = L.hidden;
  __shared__ int32_t pos[kPeerMaxRanks];
  extern __shared__ uint4 tail_mem[];
  char* tail = reinterpret_cast<char*>(tail_mem);
  const int64_t toff = tail_offset(L), tail_bytes = L.rec - toff;
  const int64_t meta = L.payload - toff;  // ids, weights, token at tail + meta
  for (int64_t b = meta + 8 * k + 4 + threadIdx.x; b < tail_bytes; b += blockDim.x)
    tail[b] = 0;  // the padding
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    if (threadIdx.x < P) {
      const int r = threadIdx.x;
      bool has = false;
      for (int j = 0; j < k; ++j) {
        const int32_t id = ids[t * k + j];
        has = has || (id >= 0 && rank_of[id] == r);
      }
      const int32_t p = has ? static_cast<int32_t>(atomicAdd(&cursor[r], 1u)) : -1;
      pos[r] = p;
      row_pos[t * P + r] = p;
    }
    __syncthreads();
    if constexpr (kFp8)
      dispatch_row_fp8<kE>(x + t * H, pos, peers, L, reinterpret_cast<float*>(tail));
    else
      dispatch_row(x + t * H, pos, peers, L);
    for (int r = 0; r < P; ++r) {
      if (pos[r] < 0) continue;
      for (int j = threadIdx.x; j < k; j += blockDim.x) {
        const int32_t id = ids[t * k + j];
        reinterpret_cast<int32_t*>(tail + meta)[j] =
            id >= 0 && rank_of[id] == r ? local_of[id] : -1;
        reinterpret_cast<float*>(tail + meta + 4 * k)[j] = w[t * k + j];
      }
      if (threadIdx.x == 0)
        *reinterpret_cast<int32_t*>(tail + meta + 8 * k) = static_cast<int32_t>(t);
      __syncthreads();  // the tail (the scales too) is complete
      char* dst = peers[r] + L.off_recv + (me * L.capacity + pos[r]) * L.rec + toff;
      if (kFp8 && kE == 8)
        send_tail<uint2>(tail, tail_bytes, dst);  // H % 16 == 8: 8-byte aligned
      else
        send_tail<uint4>(tail, tail_bytes, dst);
      __syncthreads();  // the ids are the next destination's
    }
    __syncthreads();  // pos and the tail are the next token's
  }
  if (!last_block(done)) return;
  __shared__ uint64_t e;
  if (threadIdx.x == 0) {
    e = *epoch + 1;
    *epoch = e;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < P; r += blockDim.x) {
    const int64_t rows = __ldcg(&cursor[r]);
    cursor[r] = 0;
    counts[r * 3] = rows;
    counts[r * 3 + 1] = 0;
    counts[r * 3 + 2] = T;
    row_counts(peers[r], P)[me] = rows;
    st_release_sys(&dispatch_flags(peers[r])[me], e);
  }
}

// blockIdx.y: the source rank; blockIdx.x strides over its capacity * k slots
// and, with fp8 records, over its received rows' 8-value vectors (dequantised
// into x_out).
__global__ void __launch_bounds__(kThreads)
    receive_kernel(char* own, PeerLayout L, const uint64_t* epoch, uint64_t timeout_ns,
                   int32_t* __restrict__ ids, float* __restrict__ w,
                   int64_t* __restrict__ rows_seen, uint16_t* __restrict__ x_out) {
  const int P = L.ep_size, k = L.top_k, p = blockIdx.y;
  if (threadIdx.x == 0)
    wait_flag(&dispatch_flags(own)[p], *epoch, timeout_ns, "dispatch records", L.rank, p);
  __syncthreads();
  const int64_t n = __ldcg(&row_counts(own, P)[p]);
  if (blockIdx.x == 0 && threadIdx.x == 0) rows_seen[p] = n;
  const int64_t slots = L.capacity * k;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t s = first; s < slots; s += stride) {
    const int64_t i = s / k, j = s % k, m = p * L.capacity + i;
    char* r = own + L.off_recv + m * L.rec;
    ids[m * k + j] = i < n ? __ldcg(&rec_ids(r, L)[j]) : -1;
    w[m * k + j] = i < n ? __ldcg(&rec_weights(r, L)[j]) : 0.0f;
  }
  if (!L.fp8) return;
  const int64_t H = L.hidden, nv = H / 8;
  for (int64_t u = first; u < n * nv; u += stride) {
    const int64_t m = p * L.capacity + u / nv, v = u % nv;
    char* r = own + L.off_recv + m * L.rec;
    const uint2 q = __ldcg(reinterpret_cast<const uint2*>(r) + v);
    const float scale = __ldcg(&rec_scales(r, L)[v / 16]);
    const uint32_t qw[2] = {q.x, q.y};
    float f[8];
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(qw[h / 2] >> (16 * (h % 2))), __NV_E4M3);
      const float2 f2 = __half22float2(__half2(hr));
      f[2 * h] = f2.x * scale;
      f[2 * h + 1] = f2.y * scale;
    }
    reinterpret_cast<uint4*>(x_out + m * H)[v] = f32_to_half8(f, L.x_f16);
  }
}

// Work item (received row m, chunk of kCopyThreads * kCols columns; kCols =
// YVec<Y>::kCols: 8 bf16 or 4 f32 y values a thread) (P * capacity rows; rows
// past a region's count are skipped): the row's slots held here, summed in
// slot order in f32 as finalize sums them (sum_slots; y by slot, or
// expert-sorted with bias and scale), go back to the source as one row,
// y[t * P + rank] (f32, or rounded to bf16: C). 4 slots in flight a thread:
// 2 x H200, T = 4096 a rank, combine kernel ms with 1 / 4 / 8 (fp8 dispatch,
// bf16 combine): DeepSeek-V3 0.374 / 0.313 / 0.409, Qwen3 0.104 / 0.092 /
// 0.128, Mixtral 0.127 / 0.116 / 0.158 (8 holds more registers: fewer
// blocks an SM; bench/results/2026-11-30-session14.md).
template <typename Y>
__host__ __device__ constexpr int64_t combine_cols() {
  return int64_t{kCopyThreads} * YVec<Y>::kCols;
}
template <typename Y, bool kRows, typename C>
__global__ void __launch_bounds__(kCopyThreads)
    combine_kernel(const Y* __restrict__ y, SortedRows rows, const int32_t* __restrict__ ids,
                   char* own, char* const* __restrict__ peers, PeerLayout L, const uint64_t* epoch,
                   unsigned* done) {
  constexpr int kCols = YVec<Y>::kCols;
  const int P = L.ep_size, k = L.top_k;
  const int64_t H = L.hidden;
  const int64_t chunks = (H + combine_cols<Y>() - 1) / combine_cols<Y>();
  for (int64_t item = blockIdx.x; item < P * L.capacity * chunks; item += gridDim.x) {
    const int64_t m = item / chunks;
    const int p = static_cast<int>(m / L.capacity);
    const int64_t i = m % L.capacity;
    const int64_t h = (item % chunks) * combine_cols<Y>() + threadIdx.x * kCols;
    if (i >= __ldcg(&row_counts(own, P)[p]) || h >= H) continue;
    const int64_t t = __ldcg(rec_token(own + L.off_recv + m * L.rec, L));
    float acc[kCols] = {};
    sum_slots<kRows, Y, 4>(y, ids, k, 0, H, m * k, h, rows, acc);
    C* dst = reinterpret_cast<C*>(peers[p] + L.off_y) + (t * P + L.rank) * H + h;
    if constexpr (sizeof(C) == 2) {  // bf16, round to nearest even
      uint32_t w[kCols / 2];
#pragma unroll
      for (int c = 0; c < kCols / 2; ++c)
        w[c] = static_cast<uint32_t>(float_to_bf16_bits(acc[2 * c])) |
               (static_cast<uint32_t>(float_to_bf16_bits(acc[2 * c + 1])) << 16);
      if constexpr (kCols == 8)
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      else
        *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
      for (int c = 0; c < kCols; c += 4)
        *reinterpret_cast<float4*>(dst + c) =
            make_float4(acc[c], acc[c + 1], acc[c + 2], acc[c + 3]);
    }
  }
  if (!last_block(done)) return;
  const uint64_t e = *epoch;
  for (int r = threadIdx.x; r < P; r += blockDim.x)
    st_release_sys(&combine_flags(peers[r], P)[L.rank], e);
}

__global__ void wait_combine_kernel(char* own, PeerLayout L, const uint64_t* epoch,
                                    uint64_t timeout_ns) {
  const uint64_t e = *epoch;
  for (int p = threadIdx.x; p < L.ep_size; p += blockDim.x)
    wait_flag(&combine_flags(own, L.ep_size)[p], e, timeout_ns, "combine rows", L.rank, p);
}

uint64_t timeout_ns_of(double s) {
  return s >= 1e9 ? ~uint64_t{0} : static_cast<uint64_t>(s * 1e9);
}

}  // namespace

PeerLayout peer_layout(int ep_size, int rank, int top_k, int64_t hidden, int64_t capacity,
                       bool x_f16, bool fp8, bool combine_bf16, int sms) {
  PeerLayout L;
  L.ep_size = ep_size;
  L.rank = rank;
  L.top_k = top_k;
  L.hidden = hidden;
  L.capacity = capacity;
  L.x_f16 = x_f16;
  L.fp8 = fp8;
  L.combine_bf16 = combine_bf16;
  L.payload = ep_payload_bytes(hidden, fp8);
  L.rec = ep_record_bytes(hidden, top_k, fp8);
  L.sms = std::max(sms, 1);
  const auto up = [](size_t b) { return (b + 255) / 256 * 256; };
  L.off_recv = up(24 * static_cast<size_t>(ep_size));
  L.off_y = L.off_recv + up(static_cast<size_t>(ep_size) * capacity * L.rec);
  L.bytes = L.off_y + up(static_cast<size_t>(capacity) * ep_size * hidden * (combine_bf16 ? 2 : 4));
  return L;
}

void peer_dispatch(const uint16_t* x, const int32_t* topk_ids, const float* topk_weights,
                   int64_t num_tokens, const int32_t* rank_of, const int32_t* local_of,
                   int32_t* row_pos, int64_t* counts, unsigned* cursor, char* const* peers,
                   const PeerLayout& layout, uint64_t* epoch, unsigned* done, Stream stream) {
  FUSEDMOE_CHECK(
      layout.hidden % 8 == 0 && num_tokens <= layout.capacity && layout.ep_size <= kPeerMaxRanks,
      "peer_dispatch: H % 8 == 0, T <= capacity and ep_size <= ", kPeerMaxRanks,
      " expected, got H = ", layout.hidden, ", T = ", num_tokens, ", capacity = ", layout.capacity,
      ", ep_size = ", layout.ep_size);
  const unsigned grid = persistent_grid(num_tokens, layout.sms);
  auto kernel = !layout.fp8               ? dispatch_kernel<false, 8>
                : layout.hidden % 16 == 0 ? dispatch_kernel<true, 16>
                                          : dispatch_kernel<true, 8>;
  const size_t tail_bytes = static_cast<size_t>(layout.rec - tail_offset(layout));
  FUSEDMOE_CHECK(tail_bytes <= 48 * 1024, "peer_dispatch: a record's tail of ", tail_bytes,
                 " bytes exceeds 48 KiB of shared memory (H = ", layout.hidden, ")");
  kernel<<<grid, kCopyThreads, tail_bytes, stream>>>(x, topk_ids, topk_weights, num_tokens, rank_of,
                                                     local_of, row_pos, counts, cursor, peers,
                                                     layout, epoch, done);
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

void peer_receive(const char* own, const PeerLayout& layout, const uint64_t* epoch,
                  double timeout_s, int32_t* topk_ids, float* topk_weights, int64_t* rows_seen,
                  uint16_t* x_out, Stream stream) {
  FUSEDMOE_CHECK(!layout.fp8 || x_out != nullptr, "peer_receive: fp8 records need x_out");
  const int64_t slots = layout.capacity * layout.top_k;
  int64_t blocks = std::min<int64_t>((slots + kThreads - 1) / kThreads, 64);
  if (layout.fp8)  // the dequantisation: up to 4 blocks an SM over the sources
    blocks = std::clamp<int64_t>((layout.capacity * layout.hidden / 8 + kThreads - 1) / kThreads,
                                 blocks, std::max<int64_t>(4 * layout.sms / layout.ep_size, 64));
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(layout.ep_size));
  receive_kernel<<<grid, kThreads, 0, stream>>>(const_cast<char*>(own), layout, epoch,
                                                timeout_ns_of(timeout_s), topk_ids, topk_weights,
                                                rows_seen, x_out);
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

void peer_combine(const FinalizeArgs& y, const int32_t* topk_ids, const char* own,
                  char* const* peers, const PeerLayout& layout, const uint64_t* epoch,
                  unsigned* done, Stream stream) {
  FUSEDMOE_CHECK(y.y_dtype == DType::kF32 || (y.y_dtype == DType::kBF16 && y.slot_row),
                 "peer_combine: y must be f32, or bf16 expert-sorted rows, got ",
                 dtype_name(y.y_dtype));
  FUSEDMOE_CHECK(y.slot_row || (!y.row_scale && !y.bias),
                 "peer_combine: row_scale and bias apply only to expert-sorted rows");
  const SortedRows rows{y.slot_row, y.row_scale, y.bias};
  char* o = const_cast<char*>(own);
  auto grid = [&](int64_t cols) {
    return persistent_grid(static_cast<int64_t>(layout.ep_size) * layout.capacity *
                               ((layout.hidden + cols - 1) / cols),
                           layout.sms);
  };
  auto go = [&](auto c) {
    using C = decltype(c);
    if (y.y_dtype == DType::kBF16)
      combine_kernel<uint16_t, true, C>
          <<<grid(combine_cols<uint16_t>()), kCopyThreads, 0, stream>>>(
              static_cast<const uint16_t*>(y.y), rows, topk_ids, o, peers, layout, epoch, done);
    else if (y.slot_row)
      combine_kernel<float, true, C><<<grid(combine_cols<float>()), kCopyThreads, 0, stream>>>(
          static_cast<const float*>(y.y), rows, topk_ids, o, peers, layout, epoch, done);
    else
      combine_kernel<float, false, C><<<grid(combine_cols<float>()), kCopyThreads, 0, stream>>>(
          static_cast<const float*>(y.y), rows, topk_ids, o, peers, layout, epoch, done);
  };
  if (layout.combine_bf16)
    go(uint16_t{});
  else
    go(float{});
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

void peer_wait_combine(const char* own, const PeerLayout& layout, const uint64_t* epoch,
                       double timeout_s, Stream stream) {
  wait_combine_kernel<<<1, 32, 0, stream>>>(const_cast<char*>(own), layout, epoch,
                                            timeout_ns_of(timeout_s));
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fusedmoe::cuda
