// fusedmoe CUDA: the routed experts of a few tokens (decode, T <= 4): two
// weight-streaming kernels straight from topk_ids, no alignment pass.
//
// Why not align -> m8gemv (w13) -> m8gemv (w2): at T = 1 each GEMV spends its
// first microseconds on a chain of dependent reads (expert_offsets, a binary
// search over E, sorted_slot) before the first weight byte is requested, so on
// an H200 the two GEMVs streamed at 58 % / 36 % of DRAM bandwidth (ncu,
// bench/results/2026-11-29-decode-pdl.md). Here:
//   * every warp reads the T * k (<= 32) ids once, one per lane, and groups the
//     slots by expert with __match_any_sync: a work group is an expert and up to
//     R of its slots (R = 1, 2 or 4 by T; an expert with more slots — repeated
//     ids — makes several groups, each streaming the weights again: right, only
//     slower). Ids outside [0, E) (-1: no expert) form no group;
//   * decode_w13: warp items (group, 4 gate/up row pairs), each lane streaming
//     16-byte weight loads (two K steps in flight) against the group's <= R input
//     rows (read through L1), a butterfly reduction, bias + gated activation ->
//     inter[slot, I] (the weights' half type, as the other paths);
//   * decode_w2: warp items (group, 8 rows of w2; 4 for I >= 4096), the same streaming against
//     inter -> y[slot, H] = topk_weight * (. + b2) in f32, finalize() sums a
//     token's slots in slot order (the mma path's contract: y by slot).
// Both launched with Programmatic Dependent Launch (pdl.cuh); decode_w2 reads
// the ids (written two or more kernels before it, complete when it starts) and
// issues its first item's first K step of weight loads before pdl_wait(), so
// they are in flight while decode_w13 drains. Weight loads skip L1
// (L1::no_allocate). Items are dealt round-robin to the warps of a grid no
// larger than the GPU holds at once. Deterministic: no atomics, fixed
// reduction order; a slot's output does not depend on T or on the other slots
// (so expert parallelism, which runs the received rows of a batch, gives one
// GPU's bits).
// On an H200 (bench/results/2026-11-29-session5.md) this took T = 1 from
// 38.3 to 27.6 us (Qwen3-30B-A3B), 194 to 172 us (Mixtral), 198 to 171 us
// (DeepSeek-V3). Tried and slower there: asking L2 for decode_w2's first
// weights before pdl_wait() (cp.async.bulk.prefetch.L2; with Mixtral the
// prefetched w2 exceeds L2 and is read twice), a per-lane cp.async ring in
// shared memory (4-8 stages, fewer resident warps), 4 or 16 rows per item,
// the L2::256B prefetch hint on the weight loads.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/gemm/gemv_common.cuh"
#include "kernels/cuda/gemm/sm90_bf16_grouped_gemm.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/routed_experts.h"

namespace fusedmoe::cuda {
namespace {

using gemm::ld_nc;

// A weight load: read-only path, no L1 allocation (each byte is read once;
// L1 keeps the input rows). On an H200 2-6 % faster than ld_nc at T <= 4.
__device__ __forceinline__ uint4 ld_weight(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
using gemm::unpack8;
using gemm::warp_reduce_all;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// Per warp item: w13 4 gate/up row pairs, w2 8 rows (4 from kLongW2Row
// intermediate columns on), each lane keeping 16 weight loads of 16 bytes in
// flight (8 with 4 input rows, within 128 registers): kUnroll K steps of the
// item's kW rows. Measured against other shapes of the same kernel in
// bench/results/2026-11-29-session5.md.
constexpr int kPairs = 4;
constexpr int kW2Rows = 8;
constexpr int64_t kLongW2Row = 4096;
template <int R, int kW>
constexpr int kUnroll = (R >= 4 ? 8 : 16) / kW;

struct DecodeParams {
  const uint16_t* x;
  int64_t ldx;
  const int32_t* topk_ids;
  const float* row_scale;  // per slot, or null
  int slots, top_k, num_experts;
  int64_t hidden, inter;
  const uint16_t* w13;
  const float* b13;
  const uint16_t* w2;
  const float* b2;
  Activation act;
  float alpha, limit;
  uint16_t* inter_rows;  // [slots, I]
  float* y;              // [slots, H]
};

// The work groups of the warp's view of topk_ids (see the file comment).
struct Groups {
  int32_t id;         // this lane's id (lane < slots), or -1
  uint32_t match;     // lanes with this lane's valid id (or just this lane)
  uint32_t starters;  // lanes whose slot starts a work group
  int count;          // work groups
};
template <int R>
__device__ __forceinline__ Groups make_groups(const DecodeParams& p, int lane) {
  Groups g;
  int32_t id = -1;
  // .cg: through L2 only (decode_w2 reads the ids before pdl_wait()).
  if (lane < p.slots) id = __ldcg(p.topk_ids + lane);
  const bool valid = id >= 0 && id < p.num_experts;
  g.id = valid ? id : -1;
  g.match = __match_any_sync(0xffffffffu, valid ? id : -1 - lane);
  const int rank = __popc(g.match & ((1u << lane) - 1u));
  g.starters = __ballot_sync(0xffffffffu, valid && rank % R == 0);
  g.count = __popc(g.starters);
  return g;
}
// Group `w`: its expert and slots (-1 past the group's end). Warp-uniform.
template <int R>
__device__ __forceinline__ int group_members(const Groups& g, int w, int lane, int32_t* slot) {
  const bool me = ((g.starters >> lane) & 1u) && __popc(g.starters & ((1u << lane) - 1u)) == w;
  const int first = __ffs(__ballot_sync(0xffffffffu, me)) - 1;
  const int expert = __shfl_sync(0xffffffffu, g.id, first);
  uint32_t m = __shfl_sync(0xffffffffu, g.match, first) & ~((1u << first) - 1u);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    slot[r] = m != 0 ? __ffs(m) - 1 : -1;
    m &= m - 1u;
  }
  return expert;
}

// The weight chunks of K step k0 of a lane (rows as in stream_rows).
template <int kW, int kParts, int R>
__device__ __forceinline__ void load_step(const uint16_t* const* w, int valid, int64_t K,
                                          int64_t k0, uint4 (&wraw)[kUnroll<R, kW>][kW]) {
  constexpr int kPer = kW / kParts, kU = kUnroll<R, kW>;
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int j = 0; j < kW; ++j)
      wraw[u][j] = j % kPer < valid && k0 + u * 256 < K
                       ? ld_weight(w[j / kPer] + (j % kPer) * K + k0 + u * 256)
                       : make_uint4(0, 0, 0, 0);
}

// acc += the products of K step k0's weight chunks (wraw) with the input rows.
template <class T, int kW, int R>
__device__ __forceinline__ void fma_step(const uint4 (&wraw)[kUnroll<R, kW>][kW],
                                         const uint16_t* const* xrow, int64_t K, int64_t k0,
                                         float* acc) {
  constexpr int kU = kUnroll<R, kW>;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int64_t kk = k0 + u * 256;
    if (kk >= K) break;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (xrow[r] == nullptr) continue;
      float xf[8];
      unpack8<T>(ld_nc(xrow[r] + kk), xf);
#pragma unroll
      for (int j = 0; j < kW; ++j) {
        float wf[8];
        unpack8<T>(wraw[u][j], wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[j * R + r] = fmaf(wf[i], xf[i], acc[j * R + r]);
      }
    }
  }
}

// acc[j * R + r] += dot(weight row j, input row r) over K, for kW weight rows:
// rows j < kW / kParts of part q (0 .. kParts - 1) at w[q] + j * K, the first
// `valid` of each part real (the others read as zeros); input rows at xrow
// (null: skipped, warp-uniform). Lane L covers k = 8 L + 256 i. With kPre, the
// first K step's chunks are `pre` (load_step, issued earlier).
template <class T, int kW, int kParts, int R, bool kPre = false>
__device__ __forceinline__ void stream_rows(const uint16_t* const* w, int valid,
                                            const uint16_t* const* xrow, int64_t K, int lane,
                                            float* acc, const uint4 (*pre)[kW] = nullptr) {
  constexpr int kU = kUnroll<R, kW>;
  int64_t k0 = lane * 8;
  if constexpr (kPre) {
    uint4 wraw[kU][kW];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int j = 0; j < kW; ++j) wraw[u][j] = pre[u][j];
    if (k0 < K) fma_step<T, kW, R>(wraw, xrow, K, k0, acc);
    k0 += 256 * kU;
  }
  for (; k0 < K; k0 += 256 * kU) {
    uint4 wraw[kU][kW];  // all weight loads issued before any use
    load_step<kW, kParts, R>(w, valid, K, k0, wraw);
    fma_step<T, kW, R>(wraw, xrow, K, k0, acc);
  }
}

// Lane o of the warp takes the total at index `o` of acc[kN] (all lanes hold
// every total after warp_reduce_all).
template <int kN>
__device__ __forceinline__ float pick(const float* acc, int o) {
  float v = 0.0f;
#pragma unroll
  for (int i = 0; i < kN; ++i)
    if (o == i) v = acc[i];
  return v;
}

// Weight rows per warp item.
template <bool kW13, int kW2>
constexpr int kItemRows = kW13 ? 2 * kPairs : kW2;

// decode_w13 (kW13) or decode_w2; see the file comment.
template <class T, int R, bool kW13, int kW2>
__global__ void __launch_bounds__(kThreads, 4) decode_kernel(const DecodeParams p) {
  constexpr int kW = kItemRows<kW13, kW2>;  // weight rows streamed per item
  constexpr int kParts = kW13 ? 2 : 1;      // w13: gate rows, then up rows
  constexpr int kPer = kW / kParts;         // outputs per input row and item
  // decode_w13 reads the ids its predecessor (routing) may still be writing:
  // wait first. decode_w2 waits below, after its first weight loads.
  if constexpr (kW13) {
    pdl_wait();
    pdl_launch_dependents();
  }
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const Groups g = make_groups<R>(p, lane);
  const int64_t I = p.inter, H = p.hidden;
  const int64_t K = kW13 ? H : I, out_rows = kW13 ? I : H;
  const int64_t per_group = (out_rows + kPer - 1) / kPer;
  const int64_t items = g.count * per_group;
  // Item -> expert, slots, the first output row, the parts' first weight rows
  // and how many rows of each are real. Warp-collective.
  struct Item {
    int e;
    int32_t slot[R];
    int64_t n0;
    const uint16_t* w[kParts];
    int valid;
  };
  auto item_of = [&](int64_t item) {
    Item it;
    it.e = group_members<R>(g, static_cast<int>(item / per_group), lane, it.slot);
    it.n0 = (item % per_group) * kPer;
    it.valid = static_cast<int>(min(out_rows - it.n0, int64_t{kPer}));
    if constexpr (kW13) {
      const uint16_t* base = p.w13 + static_cast<int64_t>(it.e) * 2 * I * H;
      it.w[0] = base + it.n0 * H;
      it.w[kParts - 1] = base + (I + it.n0) * H;
    } else {
      it.w[0] = p.w2 + (static_cast<int64_t>(it.e) * H + it.n0) * I;
    }
    return it;
  };
  auto input_rows = [&](const Item& it, const uint16_t** xrow) {
#pragma unroll
    for (int r = 0; r < R; ++r)
      xrow[r] = it.slot[r] < 0 ? nullptr
                : kW13         ? p.x + static_cast<int64_t>(it.slot[r] / p.top_k) * p.ldx
                               : p.inter_rows + static_cast<int64_t>(it.slot[r]) * I;
  };
  // Reduces acc over the warp and writes the item's outputs: lane o < kPer * R
  // takes output row o / R of input row o % R.
  auto epilogue = [&](const Item& it, float* acc) {
    warp_reduce_all<kW * R>(acc);
    const int o = lane;
    if (o >= kPer * R) return;
    const int jj = o / R, r = o % R;
    int32_t s = -1;
#pragma unroll
    for (int i = 0; i < R; ++i)
      if (r == i) s = it.slot[i];
    const int64_t n = it.n0 + jj;
    if (n >= out_rows || s < 0) return;
    if constexpr (kW13) {
      float gate = pick<kW * R>(acc, jj * R + r);
      float up = pick<kW * R>(acc, (kPer + jj) * R + r);
      if (p.b13) {
        gate += p.b13[static_cast<int64_t>(it.e) * 2 * I + n];
        up += p.b13[static_cast<int64_t>(it.e) * 2 * I + I + n];
      }
      p.inter_rows[static_cast<int64_t>(s) * I + n] =
          gemm::from_float_bits<T>(gemm::act_glu(p.act, gate, up, p.alpha, p.limit));
    } else {
      const float b = p.b2 ? p.b2[static_cast<int64_t>(it.e) * H + n] : 0.0f;
      const float scale = p.row_scale ? p.row_scale[s] : 1.0f;
      p.y[static_cast<int64_t>(s) * H + n] = scale * (pick<kW * R>(acc, o) + b);
    }
  };

  // decode_w2 may read the ids and the weights before pdl_wait() (written two
  // or more kernels before / by none, pdl.cuh): its first K step is in flight
  // while decode_w13 drains.
  constexpr bool kPre = !kW13;
  uint4 pre[kUnroll<R, kW>][kW];
  if (kPre && warp < items) {
    const Item it = item_of(warp);
    load_step<kW, kParts, R>(it.w, it.valid, K, lane * 8, pre);
  }
  if constexpr (kPre) {
    pdl_wait();  // inter comes from decode_w13
    pdl_launch_dependents();
  }
  int64_t item = warp;
  if (kPre && item < items) {  // the first item, its first K step loaded above
    const Item it = item_of(item);
    const uint16_t* xrow[R];
    input_rows(it, xrow);
    float acc[kW * R];
#pragma unroll
    for (int i = 0; i < kW * R; ++i) acc[i] = 0.0f;
    stream_rows<T, kW, kParts, R, true>(it.w, it.valid, xrow, K, lane, acc, pre);
    epilogue(it, acc);
    item += num_warps;
  }
  for (; item < items; item += num_warps) {
    const Item it = item_of(item);
    const uint16_t* xrow[R];
    input_rows(it, xrow);
    float acc[kW * R];
#pragma unroll
    for (int i = 0; i < kW * R; ++i) acc[i] = 0.0f;
    stream_rows<T, kW, kParts, R>(it.w, it.valid, xrow, K, lane, acc);
    epilogue(it, acc);
  }
}

// Blocks of `Kernel` the GPU holds at once (the grid cap: every warp's items
// are dealt up front, no block waits for a slot). Cached: one GPU model per process.
template <auto Kernel>
int64_t resident_blocks() {
  static const int64_t blocks = [] {
    int per_sm = 0;
    FUSEDMOE_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, 0));
    return static_cast<int64_t>(std::max(per_sm, 1)) * num_sms();
  }();
  return blocks;
}

template <class T, int R, bool kW13, int kW2>
void launch_kernel(const DecodeParams& p, Stream stream) {
  constexpr auto kernel = decode_kernel<T, R, kW13, kW2>;
  const int64_t per_group = ceil_div(kW13 ? p.inter : p.hidden, kW13 ? kPairs : kW2);
  // At most one work group per slot.
  const int64_t blocks = ceil_div(static_cast<int64_t>(p.slots) * per_group, kWarps);
  const auto grid = static_cast<unsigned>(std::min(blocks, resident_blocks<kernel>()));
  launch_pdl(kernel, grid, kThreads, 0, stream, p);
}

template <class T, int R>
void launch_decode(const DecodeParams& p, Stream stream) {
  launch_kernel<T, R, true, kW2Rows>(p, stream);  // decode_w13 (kW2 unused)
  // decode_w2: long w2 rows (I >= 4096, Mixtral's 14336) stream in 4-row items,
  // 4 K steps in flight: twice the warps at the same bytes in flight each
  // (Mixtral T = 1 180 -> 172 us, T = 4 478 -> 456 us on an H200; Qwen3 and
  // DeepSeek-V3 1-2 % slower with them, so 8 rows there).
  if (p.inter >= kLongW2Row)
    launch_kernel<T, R, false, kW2Rows / 2>(p, stream);
  else
    launch_kernel<T, R, false, kW2Rows>(p, stream);
}

template <class T>
void launch_typed(const DecodeParams& p, int64_t tokens, Stream stream) {
  if (tokens <= 1)
    launch_decode<T, 1>(p, stream);
  else if (tokens <= 2)
    launch_decode<T, 2>(p, stream);
  else
    launch_decode<T, 4>(p, stream);
}

}  // namespace

bool decode_experts_eligible(int64_t num_tokens, int64_t top_k) {
  static const bool enabled = [] {
    const char* v = std::getenv("FUSEDMOE_CUDA_DECODE");
    FUSEDMOE_CHECK(
        v == nullptr || v[0] == '\0' || std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0,
        "FUSEDMOE_CUDA_DECODE: expected 0 or 1, got ", v);
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled && num_tokens >= 1 && num_tokens <= kDecodeMaxTokens &&
         num_tokens * top_k <= kDecodeMaxSlots;
}

void decode_experts(const DecodeExpertsArgs& a, Stream stream) {
  FUSEDMOE_CHECK(a.num_tokens >= 1 && a.num_tokens <= kDecodeMaxTokens && a.top_k >= 1 &&
                     a.num_tokens * a.top_k <= kDecodeMaxSlots,
                 "decode_experts: expected 1 <= T <= ", kDecodeMaxTokens,
                 " and T * k <= ", kDecodeMaxSlots, ", got T = ", a.num_tokens, ", k = ", a.top_k);
  FUSEDMOE_CHECK(a.hidden > 0 && a.hidden % 8 == 0 && a.inter > 0 && a.inter % 8 == 0,
                 "decode_experts: H and I must be positive multiples of 8, got H = ", a.hidden,
                 ", I = ", a.inter);
  FUSEDMOE_CHECK(a.ldx >= a.hidden && a.ldx % 8 == 0,
                 "decode_experts: ldx must be a multiple of 8 >= H = ", a.hidden, ", got ", a.ldx);
  FUSEDMOE_CHECK(a.dtype == DType::kBF16 || a.dtype == DType::kF16,
                 "decode_experts: dtype must be bf16 or f16, got ", dtype_name(a.dtype));
  DecodeParams p{};
  p.x = a.x;
  p.ldx = a.ldx;
  p.topk_ids = a.topk_ids;
  p.row_scale = a.row_scale;
  p.slots = static_cast<int>(a.num_tokens * a.top_k);
  p.top_k = static_cast<int>(a.top_k);
  p.num_experts = static_cast<int>(a.num_experts);
  p.hidden = a.hidden;
  p.inter = a.inter;
  p.w13 = a.w13;
  p.b13 = a.w13_bias;
  p.w2 = a.w2;
  p.b2 = a.w2_bias;
  p.act = a.act.activation;
  p.alpha = a.act.swiglu_alpha;
  p.limit = a.act.swiglu_limit;
  p.inter_rows = a.inter_rows;
  p.y = a.y;
  if (a.dtype == DType::kF16)
    launch_typed<__half>(p, a.num_tokens, stream);
  else
    launch_typed<__nv_bfloat16>(p, a.num_tokens, stream);
}

}  // namespace fusedmoe::cuda
