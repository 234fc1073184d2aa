// fusedmoe CUDA: the routed experts of a few tokens (decode, T * k <= 128): two
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
//     slower). Ids outside [0, E) (-1: no expert) form no group. From 33 to 128
//     slots the block builds the same groups (R = 4) in shared memory first
//     (GroupTable: slots sorted by expert, one thread a slot);
//   * decode_w13: warp items (group, 4 gate/up row pairs), each lane streaming
//     16-byte weight loads (two K steps in flight) against the group's <= R input
//     rows (read through L1), a butterfly reduction, bias + gated activation ->
//     inter[slot, I] (the weights' half type, as the other paths);
//   * decode_w2: warp items (group, 8 rows of w2; 4 for I >= 4096), the same streaming against
//     inter -> y[slot, H] = topk_weight * (. + b2) in f32, finalize() sums a
//     token's slots in slot order (the mma path's contract: y by slot);
//   * a group streams with the registers and loads in flight of its real
//     size (1, 2 or 4 slots), not of the largest R;
//   * when the caller's finalize would add only the routed rows (no shared
//     expert) and it pays (decode_sum_pays: T = 1, or small experts),
//     decode_w2_sum replaces decode_w2 + finalize: blocks of 8 warps run
//     decode_w2's items for all work groups over a few rows and add each
//     token's slots in shared memory in finalize's order (the same bits), one
//     dependent kernel fewer (H200, Qwen3-30B-A3B T = 1: 26.9 -> 24.6 us;
//     bench/results/2026-11-29-session6.md).
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
#include <type_traits>

#include "kernels/cuda/gemm/gemv_common.cuh"
#include "kernels/cuda/gemm/sm90_bf16_grouped_gemm.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/routed_experts.h"

namespace fusedmoe::cuda {
namespace {

using gemm::ld_nc;
using gemm::ld_weight;
using gemm::unpack8;
using gemm::warp_reduce_all;

constexpr int kThreads = 128;
constexpr int kWarpSlots = 32;  // up to this many slots, a warp groups them itself
constexpr int kWarps = kThreads / 32;
// Per warp item: w13 4 gate/up row pairs, w2 8 rows (4 from kLongW2Row
// intermediate columns on), each lane keeping 16 weight loads of 16 bytes in
// flight (8 with 4 input rows, within 128 registers): kUnroll K steps of the
// item's kW rows. Measured against other shapes of the same kernel in
// bench/results/2026-11-29-session5.md.
constexpr int kPairs = 4;
static_assert(kW13Block % kPairs == 0, "an item's gate / up rows stay in one block of w13");
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
  bool w13_interleaved;  // W13Layout::kInterleaved128 (kPairs rows stay in one block)
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
// Group `w`: its expert, slots (-1 past the group's end) and size (1..R).
// Warp-uniform.
template <int R>
__device__ __forceinline__ int group_members(const Groups& g, int w, int lane, int32_t* slot,
                                             int* size) {
  const bool me = ((g.starters >> lane) & 1u) && __popc(g.starters & ((1u << lane) - 1u)) == w;
  const int first = __ffs(__ballot_sync(0xffffffffu, me)) - 1;
  const int expert = __shfl_sync(0xffffffffu, g.id, first);
  uint32_t m = __shfl_sync(0xffffffffu, g.match, first) & ~((1u << first) - 1u);
  *size = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    slot[r] = m != 0 ? __ffs(m) - 1 : -1;
    *size += m != 0;
    m &= m - 1u;
  }
  return expert;
}

// More than 32 slots (up to kDecodeMaxSlots, one per thread of the block): the
// work groups from a table in shared memory, built by the whole block — the
// valid slots sorted by (expert, slot), cut into runs of at most R slots of
// one expert. The same groups as the warp's view would give.
struct GroupTable {
  int32_t ids[kDecodeMaxSlots];     // valid id, or -1
  int16_t sorted[kDecodeMaxSlots];  // valid slots by (expert, slot)
  int8_t starts[kDecodeMaxSlots];   // sorted position i starts a group
  int16_t first[kDecodeMaxSlots];   // group g: sorted[first[g] ..] ...
  int8_t size[kDecodeMaxSlots];     // ... size[g] slots
};
template <int R>
__device__ __forceinline__ int build_table(const DecodeParams& p, GroupTable& t) {
  const int s = threadIdx.x;  // blockDim.x >= kDecodeMaxSlots >= slots
  int32_t id = -1;
  if (s < p.slots) id = __ldcg(p.topk_ids + s);  // .cg: decode_w2 reads them before pdl_wait()
  if (!(id >= 0 && id < p.num_experts)) id = -1;
  if (s < kDecodeMaxSlots) t.ids[s] = id;
  const int valid = __syncthreads_count(id >= 0);
  if (id >= 0) {
    int pos = 0, rank = 0;
    for (int q = 0; q < p.slots; ++q) {
      const int32_t o = t.ids[q];
      pos += o >= 0 && (o < id || (o == id && q < s));
      rank += o == id && q < s;
    }
    t.sorted[pos] = static_cast<int16_t>(s);
    t.starts[pos] = rank % R == 0;
  }
  __syncthreads();
  const int i = threadIdx.x;
  const bool starter = i < valid && t.starts[i];
  if (starter) {
    int g = 0;
    for (int j = 0; j < i; ++j) g += t.starts[j];
    const int32_t e = t.ids[t.sorted[i]];
    int n = 1;
    while (n < R && i + n < valid && t.ids[t.sorted[i + n]] == e) ++n;
    t.first[g] = static_cast<int16_t>(i);
    t.size[g] = static_cast<int8_t>(n);
  }
  return __syncthreads_count(starter);
}
template <int R>
__device__ __forceinline__ int table_members(const GroupTable& t, int w, int32_t* slot, int* size) {
  const int first = t.first[w];
  *size = t.size[w];
#pragma unroll
  for (int r = 0; r < R; ++r) slot[r] = r < *size ? t.sorted[first + r] : -1;
  return t.ids[slot[0]];
}

// The work groups of either view: the warp's (kBig = false: <= 32 slots) or
// the block's table (kBig). init() is block-collective for kBig.
template <int R, bool kBig>
struct GroupSet {
  Groups g;
  const GroupTable* t;
  int count;
  uint32_t valid;  // !kBig: lanes with a valid id
  __device__ __forceinline__ void init(const DecodeParams& p, int lane, GroupTable& table) {
    if constexpr (kBig) {
      count = build_table<R>(p, table);
      t = &table;
    } else {
      g = make_groups<R>(p, lane);
      count = g.count;
      valid = __ballot_sync(0xffffffffu, g.id >= 0);
    }
  }
  // Group w's expert, slots (-1 past its end) and size (1..R). Warp-uniform.
  __device__ __forceinline__ int members(int w, int lane, int32_t* slot, int* size) const {
    if constexpr (kBig)
      return table_members<R>(*t, w, slot, size);
    else
      return group_members<R>(g, w, lane, slot, size);
  }
  __device__ __forceinline__ bool slot_valid(int s) const {
    if constexpr (kBig)
      return t->ids[s] >= 0;
    else
      return (valid >> s) & 1u;
  }
};

// The weight chunks of kU K steps from k0 of a lane (rows as in stream_rows).
template <int kW, int kParts, int kU>
__device__ __forceinline__ void load_step(const uint16_t* const* w, int valid, int64_t K,
                                          int64_t k0, uint4 (&wraw)[kU][kW]) {
  constexpr int kPer = kW / kParts;
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int j = 0; j < kW; ++j)
      wraw[u][j] = j % kPer < valid && k0 + u * 256 < K
                       ? ld_weight(w[j / kPer] + (j % kPer) * K + k0 + u * 256)
                       : make_uint4(0, 0, 0, 0);
}

// acc += the products of kU K steps' weight chunks (wraw) from k0 with R input rows.
template <class T, int kW, int R, int kU>
__device__ __forceinline__ void fma_step(const uint4 (&wraw)[kU][kW], const uint16_t* const* xrow,
                                         int64_t K, int64_t k0, float* acc) {
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
// (null: skipped, warp-uniform). Lane L covers k = 8 L + 256 i, in order of i
// whatever the unroll (so the sums do not depend on R). The first kPre K steps'
// chunks are `pre` (load_step, issued earlier), then kUnroll<R, kW> steps at a time.
template <class T, int kW, int kParts, int R, int kPre>
__device__ __forceinline__ void stream_rows(const uint16_t* const* w, int valid,
                                            const uint16_t* const* xrow, int64_t K, int lane,
                                            float* acc, const uint4 (*pre)[kW]) {
  constexpr int kU = kUnroll<R, kW>;
  int64_t k0 = lane * 8;
  if constexpr (kPre > 0) {
    uint4 wraw[kPre][kW];
#pragma unroll
    for (int u = 0; u < kPre; ++u)
#pragma unroll
      for (int j = 0; j < kW; ++j) wraw[u][j] = pre[u][j];
    if (k0 < K) fma_step<T, kW, R, kPre>(wraw, xrow, K, k0, acc);
    k0 += 256 * kPre;
  }
  for (; k0 < K; k0 += 256 * kU) {
    uint4 wraw[kU][kW];  // all weight loads issued before any use
    load_step<kW, kParts, kU>(w, valid, K, k0, wraw);
    fma_step<T, kW, R, kU>(wraw, xrow, K, k0, acc);
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

// A warp item: an expert, its group's slots (-1 past `size`), the first
// output row, the parts' first weight rows and how many rows of each are real.
template <int R, int kParts>
struct Item {
  int e;
  int32_t slot[R];
  int size;
  int64_t n0;
  const uint16_t* w[kParts];
  int valid;
};

// Where decode_w2's items put their products: y[s * ld + n - n0] for slot s,
// row n (decode_w2: p.y, H, 0; decode_w2_sum: its shared-memory block).
struct YOut {
  float* y;
  int64_t ld, n0;
};

// Streams item `it` against its first Rn input rows (Rn >= it.size) and writes
// its outputs: inter (w13: bias + gated activation) or yo (w2: weighted, biased).

template <class T, int Rn, bool kW13, int kW, int kPre, int R, int kParts>
__device__ __forceinline__ void run_item(const DecodeParams& p, const Item<R, kParts>& it, int lane,
                                         const uint4 (*pre)[kW], const YOut& yo) {
  constexpr int kPer = kW / kParts;  // outputs per input row and item
  const int64_t I = p.inter, H = p.hidden;
  const int64_t K = kW13 ? H : I, out_rows = kW13 ? I : H;
  const uint16_t* xrow[Rn];
#pragma unroll
  for (int r = 0; r < Rn; ++r)
    xrow[r] = it.slot[r] < 0 ? nullptr
              : kW13         ? p.x + static_cast<int64_t>(it.slot[r] / p.top_k) * p.ldx
                             : p.inter_rows + static_cast<int64_t>(it.slot[r]) * I;
  float acc[kW * Rn];
#pragma unroll
  for (int i = 0; i < kW * Rn; ++i) acc[i] = 0.0f;
  stream_rows<T, kW, kParts, Rn, kPre>(it.w, it.valid, xrow, K, lane, acc, pre);
  // Reduce over the warp; lane o < kPer * Rn takes output row o / Rn of input row o % Rn.
  warp_reduce_all<kW * Rn>(acc);
  const int o = lane;
  if (o >= kPer * Rn) return;
  const int jj = o / Rn, r = o % Rn;
  int32_t s = -1;
#pragma unroll
  for (int i = 0; i < Rn; ++i)
    if (r == i) s = it.slot[i];
  const int64_t n = it.n0 + jj;
  if (n >= out_rows || s < 0) return;
  if constexpr (kW13) {
    float gate = pick<kW * Rn>(acc, jj * Rn + r);
    float up = pick<kW * Rn>(acc, (kPer + jj) * Rn + r);
    if (p.b13) {
      gate += p.b13[static_cast<int64_t>(it.e) * 2 * I + n];
      up += p.b13[static_cast<int64_t>(it.e) * 2 * I + I + n];
    }
    p.inter_rows[static_cast<int64_t>(s) * I + n] =
        gemm::from_float_bits<T>(gemm::act_glu(p.act, gate, up, p.alpha, p.limit));
  } else {
    const float b = p.b2 ? p.b2[static_cast<int64_t>(it.e) * H + n] : 0.0f;
    const float scale = p.row_scale ? p.row_scale[s] : 1.0f;
    yo.y[s * yo.ld + n - yo.n0] = scale * (pick<kW * Rn>(acc, o) + b);
  }
}

// run_item with the registers and loads in flight of the group's real size:
// Rn = 1, 2 or 4 input rows (at most R).
template <class T, int R, bool kW13, int kW, int kPre, int kParts>
__device__ __forceinline__ void run_group(const DecodeParams& p, const Item<R, kParts>& it,
                                          int lane, const uint4 (*pre)[kW], const YOut& yo) {
  if (R >= 4 && it.size > 2)
    run_item<T, (R >= 4 ? 4 : 1), kW13, kW, kPre>(p, it, lane, pre, yo);
  else if (R >= 2 && it.size == 2)
    run_item<T, (R >= 2 ? 2 : 1), kW13, kW, kPre>(p, it, lane, pre, yo);
  else
    run_item<T, 1, kW13, kW, kPre>(p, it, lane, pre, yo);
}

// decode_w13 (kW13) or decode_w2; see the file comment.
template <class T, int R, bool kW13, int kW2, bool kBig>
__global__ void __launch_bounds__(kThreads, 4) decode_kernel(const DecodeParams p) {
  static_assert(!kBig || kThreads >= kDecodeMaxSlots, "one thread a slot");
  __shared__ GroupTable table;
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
  GroupSet<R, kBig> g;
  g.init(p, lane, table);
  const int64_t I = p.inter, H = p.hidden;
  const int64_t K = kW13 ? H : I, out_rows = kW13 ? I : H;
  const int64_t per_group = (out_rows + kPer - 1) / kPer;
  const int64_t items = g.count * per_group;
  auto item_of = [&](int64_t item) {  // warp-collective
    Item<R, kParts> it;
    it.e = g.members(static_cast<int>(item / per_group), lane, it.slot, &it.size);
    it.n0 = (item % per_group) * kPer;
    it.valid = static_cast<int>(min(out_rows - it.n0, int64_t{kPer}));
    if constexpr (kW13) {
      const uint16_t* base = p.w13 + static_cast<int64_t>(it.e) * 2 * I * H;
      it.w[0] = base + w13_row(it.n0, 0, I, p.w13_interleaved) * H;
      it.w[kParts - 1] = base + w13_row(it.n0, 1, I, p.w13_interleaved) * H;
    } else {
      it.w[0] = p.w2 + (static_cast<int64_t>(it.e) * H + it.n0) * I;
    }
    return it;
  };
  // decode_w2 may read the ids and the weights before pdl_wait() (written two
  // or more kernels before / by none, pdl.cuh): the first K step(s) of its
  // first item (as many as the largest group streams at once) are in flight
  // while decode_w13 drains.
  constexpr int kPre = kW13 ? 0 : kUnroll<R, kW>;
  uint4 pre[kPre > 0 ? kPre : 1][kW];
  int64_t item = warp;
  Item<R, kParts> first{};
  if (kPre > 0 && item < items) {
    first = item_of(item);
    load_step<kW, kParts, (kPre > 0 ? kPre : 1)>(first.w, first.valid, K, lane * 8, pre);
  }
  if constexpr (kPre > 0) {
    pdl_wait();  // inter comes from decode_w13
    pdl_launch_dependents();
    if (item < items) {
      run_group<T, R, kW13, kW, kPre>(p, first, lane, pre, YOut{p.y, H, 0});
      item += num_warps;
    }
  }
  for (; item < items; item += num_warps)
    run_group<T, R, kW13, kW, 0>(p, item_of(item), lane, nullptr, YOut{p.y, H, 0});
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

// decode_w2 with finalize folded in (callers whose finalize would add only the
// routed rows: no shared expert): out[t, n] = sum over token t's slots s, in
// slot order, of topk_weight[s] * (w2[e_s] . inter[s] + b2[e_s])[n]. A block
// of kSumWarps warps takes kM = ceil(kSumWarps / groups) blocks of kW rows
// for all work groups: warp tasks (group t % groups, row block t / groups),
// each exactly a decode_w2 item (run_group: the same loads, fma order and warp
// reduction) with its products in shared memory; then the block adds each
// token's slots in slot order as finalize() does. The output has the bits of
// decode_w2 + finalize, without finalize's dependent step.
constexpr int kSumWarps = 8;
constexpr int kSumThreads = kSumWarps * 32;

template <class T, int R, int kW, typename Out, bool kBig>
__global__ void __launch_bounds__(kSumThreads, 2)
    decode_w2_sum_kernel(const DecodeParams p, Out* __restrict__ out, int64_t ldo) {
  static_assert(!kBig || kSumThreads >= kDecodeMaxSlots, "one thread a slot");
  constexpr int kPre = kUnroll<R, kW>;
  constexpr int kLd = kSumWarps * kW;  // ys row: kM <= kSumWarps row blocks
  __shared__ float ys[(kBig ? kDecodeMaxSlots : kWarpSlots) * kLd];
  __shared__ GroupTable table;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  // .cg reads of the ids (written two or more kernels before): before pdl_wait().
  GroupSet<R, kBig> g;
  g.init(p, lane, table);
  const int groups = g.count;
  const int kM = groups > 0 ? (kSumWarps + groups - 1) / groups : 1;
  const int tasks = groups * kM;
  const int64_t I = p.inter, H = p.hidden;
  const int64_t items = (H + kM * kW - 1) / (kM * kW);
  const int tokens = p.slots / p.top_k;
  auto task_of = [&](int64_t item, int t) {  // warp-collective
    Item<R, 1> it;
    it.e = g.members(t % groups, lane, it.slot, &it.size);
    it.n0 = (item * kM + t / groups) * kW;
    it.valid = it.n0 < H ? static_cast<int>(min(H - it.n0, int64_t{kW})) : 0;
    it.w[0] = p.w2 + (static_cast<int64_t>(it.e) * H + (it.n0 < H ? it.n0 : 0)) * I;
    return it;
  };
  auto yout = [&](int t, const Item<R, 1>& it) { return YOut{ys + (t / groups) * kW, kLd, it.n0}; };
  // Token t, row block m, row r: its slots in order, invalid ones skipped.
  auto sum_rows = [&](int64_t item) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < tokens * kLd; idx += kSumThreads) {
      const int m = (idx / kW) % kSumWarps, r = idx % kW, t = idx / kLd;
      const int64_t n = (item * kM + m) * kW + r;
      if (m >= kM || n >= H) continue;
      float sum = 0.0f;
      for (int j = 0; j < p.top_k; ++j) {
        const int s = t * p.top_k + j;
        if (g.slot_valid(s)) sum += ys[s * kLd + m * kW + r];
      }
      store_out(out + t * ldo + n, sum);
    }
    __syncthreads();  // ys reused by the next item
  };
  // Before pdl_wait(): the first K step(s) of this warp's first task.
  uint4 pre[kPre][kW];
  int64_t item = blockIdx.x;
  const bool first = item < items && wid < tasks;
  Item<R, 1> it0{};
  if (first) {
    it0 = task_of(item, wid);
    load_step<kW, 1, kPre>(it0.w, it0.valid, I, lane * 8, pre);
  }
  pdl_wait();  // inter comes from decode_w13; out may be read by kernels before
  pdl_launch_dependents();
  if (item < items) {  // peeled: `pre` dies in the first task
    int t = wid;
    if (first) {
      run_group<T, R, false, kW, kPre>(p, it0, lane, pre, yout(t, it0));
      t += kSumWarps;
    }
    for (; t < tasks; t += kSumWarps) {
      const Item<R, 1> it = task_of(item, t);
      run_group<T, R, false, kW, 0>(p, it, lane, nullptr, yout(t, it));
    }
    sum_rows(item);
    item += gridDim.x;
  }
  for (; item < items; item += gridDim.x) {
    for (int t = wid; t < tasks; t += kSumWarps) {
      const Item<R, 1> it = task_of(item, t);
      run_group<T, R, false, kW, 0>(p, it, lane, nullptr, yout(t, it));
    }
    sum_rows(item);
  }
}

template <class T, int R, int kW, bool kBig>
void launch_w2_sum(const DecodeParams& p, void* out, DType out_dtype, int64_t ldo, Stream stream) {
  const int64_t items = ceil_div(p.hidden, int64_t{kW});  // the most: one row block a block
  auto go = [&](auto* o) {
    using Out = std::remove_pointer_t<decltype(o)>;
    constexpr auto kernel = decode_w2_sum_kernel<T, R, kW, Out, kBig>;
    static const int64_t resident = [] {
      int per_sm = 0;
      FUSEDMOE_CUDA_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kSumThreads, 0));
      return static_cast<int64_t>(std::max(per_sm, 1)) * num_sms();
    }();
    launch_pdl(kernel, static_cast<unsigned>(std::min(items, resident)), kSumThreads, 0, stream, p,
               o, ldo);
  };
  if (out_dtype == DType::kF32)
    go(static_cast<float*>(out));
  else if (out_dtype == DType::kF16)
    go(static_cast<__half*>(out));
  else
    go(static_cast<uint16_t*>(out));
}

template <class T, int R, bool kW13, int kW2, bool kBig>
void launch_kernel(const DecodeParams& p, Stream stream) {
  constexpr auto kernel = decode_kernel<T, R, kW13, kW2, kBig>;
  const int64_t per_group = ceil_div(kW13 ? p.inter : p.hidden, kW13 ? kPairs : kW2);
  // At most one work group per slot.
  const int64_t blocks = ceil_div(static_cast<int64_t>(p.slots) * per_group, kWarps);
  const auto grid = static_cast<unsigned>(std::min(blocks, resident_blocks<kernel>()));
  launch_pdl(kernel, grid, kThreads, 0, stream, p);
}

// decode_w13, then decode_w2 (y by slot) or, given the output, decode_w2_sum.
template <class T, int R, bool kBig>
void launch_decode(const DecodeParams& p, void* out, DType out_dtype, int64_t ldo, Stream stream) {
  launch_kernel<T, R, true, kW2Rows, kBig>(p, stream);  // decode_w13 (kW2 unused)
  // decode_w2: long w2 rows (I >= 4096, Mixtral's 14336) stream in 4-row items,
  // 4 K steps in flight: twice the warps at the same bytes in flight each
  // (Mixtral T = 1 180 -> 172 us, T = 4 478 -> 456 us on an H200; Qwen3 and
  // DeepSeek-V3 1-2 % slower with them, so 8 rows there).
  const bool long_rows = p.inter >= kLongW2Row;
  if (out != nullptr) {
    if (long_rows)
      launch_w2_sum<T, R, kW2Rows / 2, kBig>(p, out, out_dtype, ldo, stream);
    else
      launch_w2_sum<T, R, kW2Rows, kBig>(p, out, out_dtype, ldo, stream);
  } else if (long_rows) {
    launch_kernel<T, R, false, kW2Rows / 2, kBig>(p, stream);
  } else {
    launch_kernel<T, R, false, kW2Rows, kBig>(p, stream);
  }
}

template <class T>
void launch_typed(const DecodeParams& p, int64_t tokens, void* out, DType out_dtype, int64_t ldo,
                  Stream stream) {
  if (p.slots > kWarpSlots)
    launch_decode<T, 4, true>(p, out, out_dtype, ldo, stream);
  else if (tokens <= 1)
    launch_decode<T, 1, false>(p, out, out_dtype, ldo, stream);
  else if (tokens <= 2)
    launch_decode<T, 2, false>(p, out, out_dtype, ldo, stream);
  else
    launch_decode<T, 4, false>(p, out, out_dtype, ldo, stream);
}

// Whether decode_w2_sum (given the output) beats decode_w2 + finalize: it
// saves finalize's dependent step (~2-4 us on an H200) but its block barrier
// idles warps whose share of the block's tasks is smaller. Measured
// (bench/results/2026-11-29-session6.md): faster at T = 1 on every shape
// (Qwen3-30B-A3B 26.9 -> 24.6 us, Mixtral 173 -> 170 us, DeepSeek-V3 equal) and
// at every T <= 4 with small experts (Qwen3: 44.9 -> 42.0 us at T = 2, 80.8 ->
// 77.0 at T = 4); slower with large ones at T >= 2 (DeepSeek-V3 T = 4 613 ->
// 626 us, Mixtral T = 4 451 -> 483 us). Small: w2 of an expert <= 8 MiB.
bool decode_sum_pays(int64_t tokens, int64_t hidden, int64_t inter) {
  return tokens == 1 || hidden * inter * 2 <= (int64_t{8} << 20);
}

}  // namespace

bool decode_experts_eligible(int64_t num_tokens, int64_t top_k) {
  return num_tokens >= 1 && top_k >= 1 && num_tokens * top_k <= kDecodeMaxSlots;
}

bool pick_decode_experts(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t inter) {
  static const bool enabled = cuda_switch(CudaSwitch::kDecode) != 0;  // 0 turns it off
  // Past T = 4, only while a touched expert gets about two slots or fewer
  // (T * k <= 2 E): groups hold at most 4 slots, and an expert with more is
  // streamed once per group; and up to 96 slots. H200, decode vs align + the
  // grouped GEMM (bench/results/2026-11-29-session7.md): Mixtral-8x7B T = 8 (16
  // slots) 655 vs 843 us; Qwen3-30B-A3B T = 8 / 12 (64 / 96 slots) 130 / 173 vs
  // 144 / 184 us; DeepSeek-V3 T = 8 / 12 1168 / 1655 vs 1205 / 1705 us; at
  // T = 16 (128 slots) a tie (Qwen3 206 vs 206) or slower (DeepSeek-V3 2157 vs 2101).
  // Large experts (I >= kLongW2Row): from T = 4 the m16n64 grouped GEMM (128-deep
  // K stages since session 10) streams them faster. H200, Mixtral-8x7B, decode vs
  // m16n64 (bench_cuda_moe --sweep, bench/results/2026-11-30-session11.md): T = 4
  // 457 vs 449 us, 5 558 vs 526, 6 618 vs 585, 8 737 vs 645. Small experts keep
  // decode (Qwen3-30B-A3B T = 4 / 12: 74 / 176 vs 87 / 180 us; DeepSeek-V3 a tie).
  constexpr int64_t kPickMaxSlots = 96;
  constexpr int64_t kLargeExpertMaxTokens = 3;
  return enabled && decode_experts_eligible(num_tokens, top_k) &&
         num_tokens * top_k <= kPickMaxSlots &&
         (num_tokens <= 4 || num_tokens * top_k <= 2 * num_experts) &&
         (inter < kLongW2Row || num_tokens <= kLargeExpertMaxTokens);
}

bool decode_experts(const RoutedExpertsArgs& a, uint16_t* inter_rows, float* y, Stream stream) {
  const int64_t ldx = a.ldx > 0 ? a.ldx : a.hidden;
  FUSEDMOE_CHECK(decode_experts_eligible(a.num_tokens, a.top_k),
                 "decode_experts: expected T >= 1, k >= 1 and T * k <= ", kDecodeMaxSlots,
                 ", got T = ", a.num_tokens, ", k = ", a.top_k);
  FUSEDMOE_CHECK(a.hidden > 0 && a.hidden % 8 == 0 && a.inter > 0 && a.inter % 8 == 0,
                 "decode_experts: H and I must be positive multiples of 8, got H = ", a.hidden,
                 ", I = ", a.inter);
  FUSEDMOE_CHECK(ldx >= a.hidden && ldx % 8 == 0,
                 "decode_experts: ldx must be a multiple of 8 >= H = ", a.hidden, ", got ", ldx);
  FUSEDMOE_CHECK(a.dtype == DType::kBF16 || a.dtype == DType::kF16,
                 "decode_experts: dtype must be bf16 or f16, got ", dtype_name(a.dtype));
  DecodeParams p{};
  p.x = a.x;
  p.ldx = ldx;
  p.topk_ids = a.topk_ids;
  p.row_scale = a.apply_router_weight_on_input ? nullptr : a.topk_weights;
  p.slots = static_cast<int>(a.num_tokens * a.top_k);
  p.top_k = static_cast<int>(a.top_k);
  p.num_experts = static_cast<int>(a.num_experts);
  p.hidden = a.hidden;
  p.inter = a.inter;
  p.w13 = a.w13;
  p.w13_interleaved = a.w13_layout == W13Layout::kInterleaved128;
  FUSEDMOE_CHECK(!p.w13_interleaved || a.inter % kW13Block == 0,
                 "decode_experts: w13_layout kInterleaved128 needs I a multiple of ", kW13Block,
                 ", got ", a.inter);
  p.b13 = a.w13_bias;
  p.w2 = a.w2;
  p.b2 = a.w2_bias;
  p.act = a.act.activation;
  p.alpha = a.act.swiglu_alpha;
  p.limit = a.act.swiglu_limit;
  p.inter_rows = inter_rows;
  p.y = y;
  if (a.out != nullptr)
    FUSEDMOE_CHECK(
        a.out_dtype == DType::kF32 || a.out_dtype == DType::kBF16 || a.out_dtype == DType::kF16,
        "decode_experts: output dtype must be f32, bf16 or f16, got ", dtype_name(a.out_dtype));
  const int64_t ldo = a.ldo > 0 ? a.ldo : a.hidden;
  const bool sum = a.out != nullptr && decode_sum_pays(a.num_tokens, a.hidden, a.inter);
  void* out = sum ? a.out : nullptr;
  if (a.dtype == DType::kF16)
    launch_typed<__half>(p, a.num_tokens, out, a.out_dtype, ldo, stream);
  else
    launch_typed<__nv_bfloat16>(p, a.num_tokens, out, a.out_dtype, ldo, stream);
  return sum;
}

}  // namespace fusedmoe::cuda
