// fusedmoe CUDA: device-initiated expert-parallel dispatch / combine over peer
// GPU memory (ep_peer.h).
//
// Ordering: a block's stores into peer memory are followed by a system-scope
// fence before it counts itself done (atomicAdd on `done`); the last block
// fences again and publishes with st.release.sys on the peer's flag; a waiter
// polls its own flag with ld.acquire.sys, then __syncthreads() hands the
// acquired view to the block (the threadfence-reduction pattern, at system
// scope).
#include <algorithm>
#include <cstdio>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/ep_dispatch.h"
#include "kernels/cuda/ep_peer.h"

namespace fusedmoe::cuda {
namespace {

constexpr int kThreads = 128;
// Dispatch / combine: a block copies kCopyVecs 16-byte vectors of a row
// (blockIdx.y: which chunk), so a few hundred rows still fill the GPU.
constexpr int kCopyThreads = 256;
constexpr int kCopyVecs = 512;

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

__device__ __forceinline__ int32_t* rec_ids(char* r, int64_t H) {
  return reinterpret_cast<int32_t*>(r + 2 * H);
}
__device__ __forceinline__ float* rec_weights(char* r, int64_t H, int k) {
  return reinterpret_cast<float*>(r + 2 * H + 4 * k);
}
__device__ __forceinline__ int32_t* rec_token(char* r, int64_t H, int k) {
  return reinterpret_cast<int32_t*>(r + 2 * H + 8 * k);
}

// One block a (token, chunk of kCopyVecs vectors of its row): at least one
// block (the signals).
__global__ void __launch_bounds__(kCopyThreads)
    dispatch_kernel(const uint16_t* __restrict__ x, const int32_t* __restrict__ ids,
                    const float* __restrict__ w, int64_t T, const int32_t* __restrict__ rank_of,
                    const int32_t* __restrict__ local_of, const int32_t* __restrict__ row_pos,
                    const int64_t* __restrict__ counts, char* const* __restrict__ peers,
                    PeerLayout L, uint64_t* epoch, unsigned* done) {
  const int P = L.ep_size, k = L.top_k, me = L.rank;
  const int64_t H = L.hidden;
  const int64_t t = blockIdx.x;
  if (t < T) {
    const uint4* xs = reinterpret_cast<const uint4*>(x + t * H);
    const int64_t v0 = static_cast<int64_t>(blockIdx.y) * kCopyVecs;
    const int64_t v1 = v0 + kCopyVecs < H / 8 ? v0 + kCopyVecs : H / 8;
    for (int r = 0; r < P; ++r) {
      const int32_t pos = row_pos[t * P + r];
      if (pos < 0) continue;
      char* dst = peers[r] + L.off_recv + (me * L.capacity + pos) * L.rec;
      uint4* xd = reinterpret_cast<uint4*>(dst);
      for (int64_t i = v0 + threadIdx.x; i < v1; i += blockDim.x) xd[i] = xs[i];
      if (blockIdx.y != 0) continue;
      for (int j = threadIdx.x; j < k; j += blockDim.x) {
        const int32_t id = ids[t * k + j];
        rec_ids(dst, H)[j] = id >= 0 && rank_of[id] == r ? local_of[id] : -1;
        rec_weights(dst, H, k)[j] = w[t * k + j];
      }
      if (threadIdx.x == 0) *rec_token(dst, H, k) = static_cast<int32_t>(t);
    }
  }
  if (!last_block(done)) return;
  __shared__ uint64_t e;
  if (threadIdx.x == 0) {
    e = *epoch + 1;
    *epoch = e;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < P; r += blockDim.x) {
    row_counts(peers[r], P)[me] = counts[r * 3];
    st_release_sys(&dispatch_flags(peers[r])[me], e);
  }
}

// blockIdx.y: the source rank; blockIdx.x strides over its capacity * k slots.
__global__ void __launch_bounds__(kThreads)
    receive_kernel(char* own, PeerLayout L, const uint64_t* epoch, uint64_t timeout_ns,
                   int32_t* __restrict__ ids, float* __restrict__ w,
                   int64_t* __restrict__ rows_seen) {
  const int P = L.ep_size, k = L.top_k, p = blockIdx.y;
  const int64_t H = L.hidden;
  if (threadIdx.x == 0)
    wait_flag(&dispatch_flags(own)[p], *epoch, timeout_ns, "dispatch records", L.rank, p);
  __syncthreads();
  const int64_t n = __ldcg(&row_counts(own, P)[p]);
  if (blockIdx.x == 0 && threadIdx.x == 0) rows_seen[p] = n;
  const int64_t slots = L.capacity * k;
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < slots;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = s / k, j = s % k, m = p * L.capacity + i;
    char* r = own + L.off_recv + m * L.rec;
    ids[m * k + j] = i < n ? __ldcg(&rec_ids(r, H)[j]) : -1;
    w[m * k + j] = i < n ? __ldcg(&rec_weights(r, H, k)[j]) : 0.0f;
  }
}

// The expert rows a combine reads: by slot (f32, weighted and biased) or
// expert-sorted (kRows: slot_row, then bias and scale as finalize applies them).
struct CombineRows {
  const int32_t* slot_row;
  const float* row_scale;  // or null: 1
  const float* bias;       // f32 [E_local, H] or null
};

__device__ __forceinline__ void load8(const float* p, float* v) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(const uint16_t* p, float* v) {  // bf16
  const uint4 a = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// One block a (received row, chunk of kCombineCols columns) (P * capacity
// rows; rows past a region's count return): the row's slots held here, summed
// in slot order in f32, go back to the source as one row, y[t * P + rank];
// 8 columns a thread.
constexpr int kCombineCols = kCopyThreads * 8;
template <typename Y, bool kRows>
__global__ void __launch_bounds__(kCopyThreads)
    combine_kernel(const Y* __restrict__ y, CombineRows rows, const int32_t* __restrict__ ids,
                   char* own, char* const* __restrict__ peers, PeerLayout L, const uint64_t* epoch,
                   unsigned* done) {
  const int P = L.ep_size, k = L.top_k;
  const int64_t H = L.hidden;
  const int64_t m = blockIdx.x;
  const int p = static_cast<int>(m / L.capacity);
  const int64_t i = m % L.capacity;
  const int64_t h = static_cast<int64_t>(blockIdx.y) * kCombineCols + threadIdx.x * 8;
  if (i < __ldcg(&row_counts(own, P)[p]) && h < H) {
    const int64_t t = __ldcg(rec_token(own + L.off_recv + m * L.rec, H, k));
    float acc[8] = {};
    for (int j = 0; j < k; ++j) {
      const int64_t s = m * k + j;
      const int32_t e = ids[s];
      if (e < 0) continue;
      float v[8];
      load8(y + (kRows ? static_cast<int64_t>(rows.slot_row[s]) : s) * H + h, v);
      if (kRows) {  // finalize's arithmetic: scale * (C + b)
        if (rows.bias) {
          float b[8];
          load8(rows.bias + static_cast<int64_t>(e) * H + h, b);
#pragma unroll
          for (int c = 0; c < 8; ++c) v[c] += b[c];
        }
        const float sc = rows.row_scale ? rows.row_scale[s] : 1.0f;
#pragma unroll
        for (int c = 0; c < 8; ++c) v[c] *= sc;
      }
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[c] += v[c];
    }
    float4* dst = reinterpret_cast<float4*>(reinterpret_cast<float*>(peers[p] + L.off_y) +
                                            (t * P + L.rank) * H + h);
    dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
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

PeerLayout peer_layout(int ep_size, int rank, int top_k, int64_t hidden, int64_t capacity) {
  PeerLayout L;
  L.ep_size = ep_size;
  L.rank = rank;
  L.top_k = top_k;
  L.hidden = hidden;
  L.capacity = capacity;
  L.rec = ep_record_bytes(hidden, top_k);
  const auto up = [](size_t b) { return (b + 255) / 256 * 256; };
  L.off_recv = up(24 * static_cast<size_t>(ep_size));
  L.off_y = L.off_recv + up(static_cast<size_t>(ep_size) * capacity * L.rec);
  L.bytes = L.off_y + up(static_cast<size_t>(capacity) * ep_size * hidden * 4);
  return L;
}

void peer_dispatch(const uint16_t* x, const int32_t* topk_ids, const float* topk_weights,
                   int64_t num_tokens, const int32_t* rank_of, const int32_t* local_of,
                   const int32_t* row_pos, const int64_t* counts, char* const* peers,
                   const PeerLayout& layout, uint64_t* epoch, unsigned* done, Stream stream) {
  FUSEDMOE_CHECK(layout.hidden % 8 == 0 && num_tokens <= layout.capacity,
                 "peer_dispatch: H % 8 == 0 and T <= capacity expected, got H = ", layout.hidden,
                 ", T = ", num_tokens, ", capacity = ", layout.capacity);
  const int64_t blocks = num_tokens > 0 ? num_tokens : 1;
  const dim3 grid(static_cast<unsigned>(blocks),
                  static_cast<unsigned>((layout.hidden / 8 + kCopyVecs - 1) / kCopyVecs));
  dispatch_kernel<<<grid, kCopyThreads, 0, stream>>>(x, topk_ids, topk_weights, num_tokens, rank_of,
                                                     local_of, row_pos, counts, peers, layout,
                                                     epoch, done);
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

void peer_receive(const char* own, const PeerLayout& layout, const uint64_t* epoch,
                  double timeout_s, int32_t* topk_ids, float* topk_weights, int64_t* rows_seen,
                  Stream stream) {
  const int64_t slots = layout.capacity * layout.top_k;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((slots + kThreads - 1) / kThreads, 64)),
                  static_cast<unsigned>(layout.ep_size));
  receive_kernel<<<grid, kThreads, 0, stream>>>(const_cast<char*>(own), layout, epoch,
                                                timeout_ns_of(timeout_s), topk_ids, topk_weights,
                                                rows_seen);
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
  const int64_t blocks = static_cast<int64_t>(layout.ep_size) * layout.capacity;
  const dim3 grid(static_cast<unsigned>(blocks),
                  static_cast<unsigned>((layout.hidden + kCombineCols - 1) / kCombineCols));
  const CombineRows rows{y.slot_row, y.row_scale, y.bias};
  char* o = const_cast<char*>(own);
  if (y.y_dtype == DType::kBF16)
    combine_kernel<uint16_t, true><<<grid, kCopyThreads, 0, stream>>>(
        static_cast<const uint16_t*>(y.y), rows, topk_ids, o, peers, layout, epoch, done);
  else if (y.slot_row)
    combine_kernel<float, true><<<grid, kCopyThreads, 0, stream>>>(
        static_cast<const float*>(y.y), rows, topk_ids, o, peers, layout, epoch, done);
  else
    combine_kernel<float, false><<<grid, kCopyThreads, 0, stream>>>(
        static_cast<const float*>(y.y), rows, topk_ids, o, peers, layout, epoch, done);
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

void peer_wait_combine(const char* own, const PeerLayout& layout, const uint64_t* epoch,
                       double timeout_s, Stream stream) {
  wait_combine_kernel<<<1, 32, 0, stream>>>(const_cast<char*>(own), layout, epoch,
                                            timeout_ns_of(timeout_s));
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fusedmoe::cuda
