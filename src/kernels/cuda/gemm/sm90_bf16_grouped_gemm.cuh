// fusedmoe CUDA: bf16 / fp16 grouped GEMM over experts (the element type a
// template parameter: __nv_bfloat16 or __half), f32 accumulation, tensor
// cores through mma.sync.m16n8k16 (.bf16 or .f16) (ldmatrix from XOR-swizzled shared memory,
// multi-stage pipeline: the weight tiles by TMA tensor copies completing on one
// mbarrier a stage (tma.cuh), the activation rows by cp.async, gathered),
// persistent CTAs over (expert, n tile, m tile)
// work items, epilogues fused: gated activation (w13) or weighted scatter by
// slot (w2). Included by one .cu per tile configuration (compile time).
//
// Work order: expert-major, then n tile, then m tile innermost, so the CTAs
// running at one time share each expert's weight panel (read once from HBM)
// and the expert's activation rows stay in L2 across its n tiles. Each CTA
// takes item blockIdx.x first, then (with Params::work_counter) claims the next
// from the counter as it goes, or (without) every gridDim.x-th.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "fusedmoe/core/env.h"
#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm/cp_async.cuh"
#include "kernels/cuda/gemm/tma.cuh"
#include "kernels/cuda/pdl.cuh"

namespace fusedmoe::cuda::gemm {

// A stage holds kBK / 64 k panels of the A and B tiles, each [rows][64]
// elements: 128-byte rows of 8 chunks of 16 bytes, XOR-swizzled (swz).
constexpr int kPanelK = 64;
// expert_offsets entries kept in shared memory (E + 1 <= this; else read from global).
constexpr int kSmemOffsets = 520;

template <int kBM_, int kBN_, int kWarpsM_, int kWarpsN_, int kStages_, int kBK_ = 64>
struct TileConfig {
  static constexpr int kBM = kBM_, kBN = kBN_, kWarpsM = kWarpsM_, kWarpsN = kWarpsN_;
  static constexpr int kStages = kStages_;
  static constexpr int kBK = kBK_;  // k elements per stage
  static constexpr int kPanels = kBK / kPanelK;
  static_assert(kBK % kPanelK == 0, "whole k panels");
  static constexpr int kThreads = kWarpsM * kWarpsN * 32;
  static constexpr int kWTM = kBM / kWarpsM, kWTN = kBN / kWarpsN;  // warp tile
  static constexpr int kMI = kWTM / 16, kNI = kWTN / 8;             // mma tiles per warp
  static constexpr int kStageBytes = (kBM + kBN) * kBK * 2;
  // (+ 1 KiB: the stages start at the first 1024-byte boundary, the alignment of
  // the TMA's 128-byte swizzle pattern)
  static constexpr int kSmemBytes = kStages * kStageBytes + kSmemOffsets * 8 + 1024;
  // CTAs an SM that the shared memory allows (an H100 / H200 SM: 228 KiB, 1 KiB
  // of it reserved a CTA): the kernel's __launch_bounds__ asks the compiler for
  // registers that allow as many. Without it the GLU epilogue's kernel took 193
  // registers a thread, two 128-thread CTAs an SM instead of three (session 28's
  // dynamic schedule, 155 before), and streamed the Qwen3-30B-A3B w13 weights
  // with a third fewer bytes in flight.
  static constexpr int kMinBlocks = (228 * 1024) / (kSmemBytes + 1024);
  static_assert(kWTM % 16 == 0 && kWTN % 16 == 0, "warp tile must be a multiple of 16 x 16");
  static_assert((kBM * 8 * kPanels) % kThreads == 0, "load balance (the A rows' copies)");
  static_assert(kBN <= 256, "a TMA box spans at most 256 rows");
};

// Kernel parameters (device pointers; see GroupedGemmArgs in kernels/cuda.h).
// a / w / the kGlu output hold elements of the kernel's type T (bf16 or f16 bits).
struct Params {
  const uint16_t* a;
  int64_t lda;
  int gather;
  int a_div;
  const int32_t* sorted_slot;
  const int64_t* expert_offsets;  // null: dense (one expert, rows [0, m))
  int num_experts;
  int64_t m;
  const uint16_t* w;
  int64_t n, k;
  int64_t inter;         // kGlu: I (= n / 2)
  bool w13_interleaved;  // kGlu: w in W13Layout::kInterleaved128
  int n_tiles;
  const float* bias;
  Activation act;
  float swiglu_alpha, swiglu_limit;
  const float* row_scale;
  void* out;
  int64_t ldc;
  int32_t* work_counter;  // null: static schedule (GroupedGemmArgs::work_counter)
};

// ---- PTX wrappers ----
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                            uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
// D += A . B, m16n8k16, f32 accumulators; T = __nv_bfloat16 or __half.
#define FUSEDMOE_MMA_16816(ty)                                                          \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." ty "." ty                       \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
template <class T>
__device__ __forceinline__ void mma_16816(float* c, const uint32_t* a, const uint32_t* b) {
  if constexpr (std::is_same_v<T, __half>)
    FUSEDMOE_MMA_16816("f16");
  else
    FUSEDMOE_MMA_16816("bf16");
}
#undef FUSEDMOE_MMA_16816
template <class T>
__device__ __forceinline__ float to_float(uint16_t bits) {
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(__ushort_as_half(bits));
  else
    return bf16_bits_to_float(bits);
}
// float -> T bits, round to nearest even (f16: beyond 65504 rounds to +-inf).
template <class T>
__device__ __forceinline__ uint16_t from_float_bits(float f) {
  if constexpr (std::is_same_v<T, __half>)
    return __half_as_ushort(__float2half_rn(f));
  else
    return float_to_bf16_bits(f);
}
// Two consecutive T elements from floats, one 4-byte store (p 4-byte aligned).
template <class T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(from_float_bits<T>(a)) |
                                    (static_cast<uint32_t>(from_float_bits<T>(b)) << 16);
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a [rows][64] bf16 tile.
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// The gated activations, act(gate, up), in f32. The sigmoids are g / (1 +
// e^-g) with __expf and __fdividef: branch-free (IEEE division's slow-path
// branch kept the w13 epilogue from interleaving its elements), within a few
// ulp of the exact quotient, and 0 where e^-g overflows (g < ~-87), the limit.
template <Activation A>
__device__ __forceinline__ float act_glu_t(float g, float u, float alpha, float limit) {
  if constexpr (A == Activation::kSiluGlu) {
    return __fdividef(g, 1.0f + __expf(-g)) * u;
  } else if constexpr (A == Activation::kGeluGlu) {
    return 0.5f * g * erfcf(g * -0.70710678118654752f) * u;
  } else if constexpr (A == Activation::kGeluTanhGlu) {
    const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return __fdividef(g, 1.0f + __expf(-2.0f * z)) * u;  // g/2 (1 + tanh z) = g sigmoid(2z)
  } else {
    static_assert(A == Activation::kSwigluOai, "a gated activation");
    const float gg = fminf(g, limit);
    const float uu = fminf(fmaxf(u, -limit), limit);
    return (uu + 1.0f) * __fdividef(gg, 1.0f + __expf(-alpha * gg));
  }
}
// Calls f.template operator()<A>() for the activation `act` (one switch outside
// an element loop instead of one per element).
template <class F>
__device__ __forceinline__ void with_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::kSiluGlu:
      f.template operator()<Activation::kSiluGlu>();
      return;
    case Activation::kGeluGlu:
      f.template operator()<Activation::kGeluGlu>();
      return;
    case Activation::kGeluTanhGlu:
      f.template operator()<Activation::kGeluTanhGlu>();
      return;
    case Activation::kSwigluOai:
      f.template operator()<Activation::kSwigluOai>();
      return;
  }
}
__device__ __forceinline__ float act_glu(Activation act, float g, float u, float alpha,
                                         float limit) {
  float r = 0.0f;
  with_activation(act, [&]<Activation A>() { r = act_glu_t<A>(g, u, alpha, limit); });
  return r;
}

template <class T, class Cfg, bool kGlu>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap w_map, const Params p) {
  constexpr int BM = Cfg::kBM, BN = Cfg::kBN, STAGES = Cfg::kStages;
  constexpr int MI = Cfg::kMI, NI = Cfg::kNI, WTM = Cfg::kWTM, WTN = Cfg::kWTN;
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kBK = Cfg::kBK, kPanels = Cfg::kPanels;
  constexpr int kRowChunks = kPanels * 8;  // 16-byte chunks of a row per stage
  // (work_ring below needs the loads two or more steps ahead of the math)
  static_assert(STAGES >= 3, "at least three stages");
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // The stages from the first 1024-byte boundary (kSmemBytes has the slack).
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  // expert_offsets, when E + 1 <= kSmemOffsets (the work decode's binary search).
  int64_t* s_offsets = reinterpret_cast<int64_t*>(smem + STAGES * Cfg::kStageBytes);
  // One mbarrier a stage, on which the stage's weight copies complete (one
  // arrival a phase: thread 0's, with the copies' byte count).
  __shared__ __align__(8) uint64_t w_full[STAGES];
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(smem_u32(&w_full[s]), 1);
  }
  pdl_wait();  // expert_offsets, sorted_slot and a come from the kernels before (pdl.cuh)
  pdl_launch_dependents();
  const bool dense = p.expert_offsets == nullptr;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / Cfg::kWarpsN, wn = warp % Cfg::kWarpsN;
  const bool offsets_in_smem = !dense && p.num_experts + 1 <= kSmemOffsets;
  if (offsets_in_smem) {
    for (int i = tid; i <= p.num_experts; i += kThreads) s_offsets[i] = p.expert_offsets[i];
    __syncthreads();
  }
  // (a shared or a global load by a uniform branch: a generic load through one
  // pointer to either is slower, and the decode's binary search chains them)
  auto offs = [&](int i) -> int64_t {
    return offsets_in_smem ? s_offsets[i] : p.expert_offsets[i];
  };
  const int64_t total_tiles = dense ? (p.m + BM - 1) / BM : offs(p.num_experts) / BM;
  const int64_t total_work = total_tiles * p.n_tiles;
  const int64_t K = p.k;
  const int k_tiles = static_cast<int>((K + kBK - 1) / kBK);
  const uint32_t smem_base = smem_u32(smem);

  // A work item: (expert, n tile, m tile); expert-major, n tile, then m tile.
  struct Work {
    int e;
    int n_tile;
    int64_t row0;
  };
  auto decode = [&](int64_t work) {
    Work w{0, 0, 0};
    int64_t tile_begin = 0, tiles_e = total_tiles;
    if (!dense) {
      int lo = 0, hi = p.num_experts - 1;  // largest e with start(e) <= work
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (offs(mid) / BM * p.n_tiles <= work)
          lo = mid;
        else
          hi = mid - 1;
      }
      w.e = lo;
      tile_begin = offs(lo) / BM;
      tiles_e = offs(lo + 1) / BM - tile_begin;
    }
    const int64_t local = work - tile_begin * p.n_tiles;
    w.n_tile = static_cast<int>(local / tiles_e);
    w.row0 = (tile_begin + local % tiles_e) * BM;
    return w;
  };
  // The slot of row `row` (-1: padding, or past m when dense).
  auto slot_of = [&](int64_t row) -> int32_t {
    if (dense) return row < p.m ? static_cast<int32_t>(row) : -1;
    return p.sorted_slot[row];
  };

  // The load side runs STAGES - 1 k tiles ahead of the math, across work items:
  // the next item's first tiles are in flight while this one finishes and
  // writes its epilogue (no pipeline drain per item; short-K w2 items of the
  // decode-size tiles lost up to a quarter of the DRAM bandwidth to it).
  // Per-thread load assignments of the item being loaded.
  constexpr int kAChunks = BM * kRowChunks / kThreads;
  // Chunk c of row r of a [rows] x kBK tile: panel c / 8, swizzled within it.
  auto tile_off = [](int rows, int r, int c) {
    return static_cast<uint32_t>((c >> 3) * rows * 128) + swz(r, c & 7);
  };
  // Per A chunk: its source at k = 0 (a valid address, row 0's, where the row is
  // padding: nothing is read from it), its bytes (16, or 0 for such a row:
  // zero-filled), its shared-memory offset and its k offset in the tile.
  const uint16_t* a_ptr[kAChunks];
  int a_bytes[kAChunks];
  uint32_t a_dst[kAChunks];
  int a_chunk[kAChunks];
  // The weight boxes' coordinates (thread 0 issues them): the item's expert and
  // the first w row of each box (kGlu: of the gate and of the up half).
  int32_t tma_e = 0, tma_row[2] = {0, 0};
  // Each item's decoded (expert, n tile, rows), written by the load side when it
  // sets the item up (thread 0) and read by the math side when it starts the
  // item, at least one __syncthreads later (the load side runs STAGES - 1 >= 2
  // steps ahead, so a step's __syncthreads lies between; the prologue's items
  // have one of their own): one binary search an item, not two. The load side
  // is at most STAGES - 1 items ahead of the math: 8 entries.
  __shared__ Work work_ring[8];
  auto setup_load = [&](int64_t work, int64_t seq) {
    const Work w = decode(work);
    if (tid == 0) work_ring[seq & 7] = w;
#pragma unroll
    for (int i = 0; i < kAChunks; ++i) {
      const int idx = tid + i * kThreads, r = idx / kRowChunks, c = idx % kRowChunks;
      // The scatter (w2) GEMM's own rows (no gather) skip the slot read: a
      // padding row's products are never written, so it need not be zero, and
      // the dependent load held back each item's first A and B copies
      // (ncu, H200, Qwen3-30B-A3B T = 16: the w2 kernel 66.3 -> 64.5 us;
      // bench/results/2026-12-02-session32.md).
      const int32_t slot = kGlu || p.gather || dense ? slot_of(w.row0 + r) : 0;
      const int32_t src =
          slot < 0 || dense ? slot : (p.gather ? slot / p.a_div : static_cast<int32_t>(w.row0 + r));
      a_bytes[i] = src >= 0 ? 16 : 0;
      a_ptr[i] = p.a + (src >= 0 ? static_cast<int64_t>(src) * p.lda : 0) + c * 8;
      a_dst[i] = tile_off(BM, r, c);
      a_chunk[i] = c;
    }
    tma_e = w.e;
    if (kGlu) {
      const int64_t col = static_cast<int64_t>(w.n_tile) * (BN / 2);
      tma_row[0] = static_cast<int32_t>(w13_row(col, 0, p.inter, p.w13_interleaved));
      tma_row[1] = static_cast<int32_t>(w13_row(col, 1, p.inter, p.w13_interleaved));
    } else {
      tma_row[0] = w.n_tile * BN;
    }
  };
  // The weight boxes: kPanels x (two halves of BN / 2 rows for kGlu, else one
  // of BN), each 64 k x rows, by thread 0; rows past N and k past K read as
  // zeros. The A rows: a whole k tile takes each chunk's bytes as set up (a
  // pointer add, a copy); only K's last, partial tile tests each chunk against
  // K (ncu: the per-chunk tests and selects were most of the kernel's
  // instructions, issued between the barrier and the math, while the stage
  // waited for its loads).
  constexpr int kBoxes = kGlu ? 2 : 1, kBoxRows = BN / kBoxes;
  // The 16-row tile's GLU weights go into L2 as the first to be evicted: that
  // tile is picked for experts of <= 16 rows, so each weight panel is read about
  // once, and the gathered x rows (read again by each n tile) and the output the
  // w2 GEMM reads next stay in L2 (H200, against the normal policy: Qwen3-30B-A3B
  // T = 16-128 2.7 % faster, Mixtral T = 16-32 0.8 %, DeepSeek-V3 T = 16-128
  // 0.6-0.8 %; the hint on w2's weights too lost DeepSeek-V3 0.7 %:
  // bench/results/2026-12-02-session33.md).
  constexpr bool kWeightsEvictFirst = kGlu && BM <= 16;
  auto load_stage = [&](int stage, int kt) {
    const uint32_t base = smem_base + stage * Cfg::kStageBytes;
    const int64_t k0 = static_cast<int64_t>(kt) * kBK;
    if (tid == 0) {
      const uint32_t bar = smem_u32(&w_full[stage]);
      mbar_arrive_expect_tx(bar, BN * kBK * 2);
#pragma unroll
      for (int panel = 0; panel < kPanels; ++panel)
#pragma unroll
        for (int h = 0; h < kBoxes; ++h)
          tma_load_3d<kWeightsEvictFirst>(base + BM * kBK * 2 + (panel * BN + h * kBoxRows) * 128,
                                          &w_map, static_cast<int32_t>(k0) + panel * kPanelK,
                                          tma_row[h], tma_e, bar);
    }
    if (k0 + kBK <= K) {
#pragma unroll
      for (int i = 0; i < kAChunks; ++i) cp_async_16(base + a_dst[i], a_ptr[i] + k0, a_bytes[i]);
      return;
    }
#pragma unroll
    for (int i = 0; i < kAChunks; ++i) {
      const bool ok = a_bytes[i] != 0 && k0 + a_chunk[i] * 8 < K;
      cp_async_16(base + a_dst[i], ok ? a_ptr[i] + k0 : p.a, ok ? 16 : 0);
    }
  };
  // This CTA's j-th item: j = 0 blockIdx.x; then, static, blockIdx.x + j * gridDim.x;
  // dynamic (work_counter), the one claimed during item j - 1 (claimed[j % 4]):
  // thread 0 adds to the counter at item j - 1's first K step and stores the
  // result at its second, after whose __syncthreads every thread may read it.
  // The loads of item j start STAGES - 1 steps before its math, i.e. at item
  // j - 1's step k_tiles - STAGES + 1: with k_tiles >= STAGES + 1 that is after
  // the store's step. Each item's id is read by the loads and by the math,
  // both before item j + 3 stores into the same entry.
  __shared__ int64_t claimed[4];
  // (and the int32 counter's claims, up to total_work + gridDim.x, must not wrap)
  const bool dynamic = p.work_counter != nullptr && k_tiles >= STAGES + 1 &&
                       total_work + gridDim.x < (int64_t{1} << 31);
  auto item_of = [&](int64_t j) -> int64_t {
    if (j == 0) return blockIdx.x;
    return dynamic ? claimed[j & 3] : static_cast<int64_t>(blockIdx.x) + j * gridDim.x;
  };
  int64_t load_seq = 0;    // the item (j) being loaded
  int load_stage_idx = 0;  // the stage the next loads fill (the step's index mod STAGES)
  bool load_done = false;
  int load_kt = 0;
  auto issue_next = [&] {  // the next step's loads (one commit group, maybe empty)
    if (!load_done && load_kt == 0) {
      const int64_t work = item_of(load_seq);
      load_done = work >= total_work;
      if (!load_done) setup_load(work, load_seq);
    }
    if (!load_done) {
      load_stage(load_stage_idx, load_kt);
      if (++load_kt == k_tiles) {
        load_kt = 0;
        ++load_seq;
      }
    }
    cp_async_commit();
    load_stage_idx = load_stage_idx == STAGES - 1 ? 0 : load_stage_idx + 1;
  };

  // B rows of this lane's ldmatrix.x4 address for mma tile pair (ni, ni + 1).
  auto b_row = [&](int ni) {
    if (kGlu) {
      return ni < NI / 2 ? wn * (WTN / 2) + ni * 8 : BN / 2 + wn * (WTN / 2) + (ni - NI / 2) * 8;
    }
    return wn * WTN + ni * 8;
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_next();
  __syncthreads();  // the prologue's work_ring entries

  int math_stage = 0;     // the stage of the step being computed
  uint32_t w_parity = 0;  // bit s: the parity of stage s's next phase
  int32_t claim = 0;      // thread 0: the counter's value from this item's first K step
  for (int64_t j = 0;; ++j) {
    const int64_t work = item_of(j);
    if (work >= total_work) break;
    const Work w = work_ring[j & 7];
    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < NI; ++ni)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.0f;

    // ---- main loop ----
    for (int kt = 0; kt < k_tiles; ++kt) {
      // This thread's A copies, then the stage's weight boxes (every thread
      // waits on the mbarrier: that makes the TMA's writes visible to it). The
      // barrier after orders every warp's reads of step - 1's stage before
      // thread 0 refills it (as a consumer release does in CUTLASS's pipelines).
      cp_async_wait<STAGES - 2>();
      mbar_wait(smem_u32(&w_full[math_stage]), (w_parity >> math_stage) & 1);
      w_parity ^= 1u << math_stage;
      __syncthreads();            // step's tiles visible; step - 1's stage free for the loads below
      if (dynamic && tid == 0) {  // the atomic's latency hides behind one K step
        if (kt == 0) claim = atomicAdd(p.work_counter, 1);
        if (kt == 1) claimed[(j + 1) & 3] = static_cast<int64_t>(gridDim.x) + claim;
      }
      issue_next();

      const uint32_t a_base = smem_base + math_stage * Cfg::kStageBytes;
      math_stage = math_stage == STAGES - 1 ? 0 : math_stage + 1;
      const uint32_t b_base = a_base + BM * kBK * 2;
#pragma unroll
      for (int ks = 0; ks < kBK / 16; ++ks) {
        const int panel = ks / (kPanelK / 16), kc = ks % (kPanelK / 16);
        const uint32_t a_panel = a_base + panel * BM * 128, b_panel = b_base + panel * BN * 128;
        uint32_t af[MI][4], bf[NI][2];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          const int r = wm * WTM + mi * 16 + (lane & 15);
          const int c = kc * 2 + (lane >> 4);
          ldmatrix_x4(a_panel + swz(r, c), af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
        }
#pragma unroll
        for (int ni = 0; ni < NI; ni += 2) {
          const int r = b_row(ni + (lane >> 4)) + (lane & 7);
          const int c = kc * 2 + ((lane >> 3) & 1);
          ldmatrix_x4(b_panel + swz(r, c), bf[ni][0], bf[ni][1], bf[ni + 1][0], bf[ni + 1][1]);
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int ni = 0; ni < NI; ++ni) mma_16816<T>(acc[mi][ni], af[mi], bf[ni]);
      }
    }

    // ---- epilogue (registers -> global; the next item's loads are in flight) ----
    const int g_row = lane >> 2, g_col = (lane & 3) * 2;
    const int64_t row0 = w.row0;
    if (kGlu) {
      auto* out = static_cast<T*>(p.out);
      const float* bias = p.bias ? p.bias + static_cast<int64_t>(w.e) * p.n : nullptr;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI / 2; ++ni)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = wm * WTM + mi * 16 + g_row + h * 8;
            const int64_t i =
                static_cast<int64_t>(w.n_tile) * (BN / 2) + wn * (WTN / 2) + ni * 8 + g_col;
            if (i >= p.inter || (dense && row0 + r >= p.m)) continue;
            float g0 = acc[mi][ni][2 * h], g1 = acc[mi][ni][2 * h + 1];
            float u0 = acc[mi][ni + NI / 2][2 * h], u1 = acc[mi][ni + NI / 2][2 * h + 1];
            if (bias) {
              g0 += bias[i];
              g1 += bias[i + 1];
              u0 += bias[p.inter + i];
              u1 += bias[p.inter + i + 1];
            }
            store2<T>(out + (row0 + r) * p.ldc + i,  // i and ldc even: 4-byte aligned
                      act_glu(p.act, g0, u0, p.swiglu_alpha, p.swiglu_limit),
                      act_glu(p.act, g1, u1, p.swiglu_alpha, p.swiglu_limit));
          }
    } else {
      auto* out = static_cast<float*>(p.out);
      const float* bias = p.bias ? p.bias + static_cast<int64_t>(w.e) * p.n : nullptr;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = wm * WTM + mi * 16 + g_row + h * 8;
          const int32_t slot = slot_of(row0 + r);
          if (slot < 0) continue;
          const float scale = p.row_scale ? p.row_scale[slot] : 1.0f;
          float* orow = out + static_cast<int64_t>(slot) * p.ldc;
#pragma unroll
          for (int ni = 0; ni < NI; ++ni) {
            const int64_t n = static_cast<int64_t>(w.n_tile) * BN + wn * WTN + ni * 8 + g_col;
            if (n >= p.n) continue;
            const bool pair = n + 1 < p.n;  // N may be odd (router logits)
            float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
            if (bias) {
              v0 += bias[n];
              if (pair) v1 += bias[n + 1];
            }
            // One 8-byte store where aligned (even N and ldc: every expert GEMM);
            // an odd ldc (any row stride of router_logits) stores single words.
            if (pair && (reinterpret_cast<uintptr_t>(orow + n) & 7) == 0) {
              *reinterpret_cast<float2*>(orow + n) = make_float2(scale * v0, scale * v1);
            } else {
              orow[n] = scale * v0;
              if (pair) orow[n + 1] = scale * v1;
            }
          }
        }
    }
  }
  cp_async_wait<0>();  // only empty groups remain; no copy outlives the kernel
}

// Kernel parameters from the launcher's arguments (shared with the GEMV path);
// n_tiles is left to the launch, it depends on the tile.
inline Params make_params(const GroupedGemmArgs& a) {
  Params p{};
  p.a = a.a;
  p.lda = a.lda;
  p.gather = a.gather ? 1 : 0;
  p.a_div = a.a_div;
  p.sorted_slot = a.sorted_slot;
  p.expert_offsets = a.expert_offsets;
  p.num_experts = static_cast<int>(a.num_experts);
  p.m = a.m;
  p.w = a.w;
  p.n = a.n;
  p.k = a.k;
  p.inter = a.epilogue == GemmEpilogue::kGlu ? a.n / 2 : a.n;
  p.w13_interleaved =
      a.epilogue == GemmEpilogue::kGlu && a.w13_layout == W13Layout::kInterleaved128;
  p.bias = a.bias;
  p.act = a.act.activation;
  p.swiglu_alpha = a.act.swiglu_alpha;
  p.swiglu_limit = a.act.swiglu_limit;
  p.row_scale = a.row_scale;
  p.out = a.out;
  p.ldc = a.ldc;
  p.work_counter = cuda_switch(CudaSwitch::kMmaSchedule) == 1 ? nullptr : a.work_counter;
  return p;
}

// Host side: launches one instantiation (validated by grouped_gemm()).
template <class T, class Cfg>
void launch_typed(const GroupedGemmArgs& a, Stream stream) {
  Params p = make_params(a);
  const bool glu = a.epilogue == GemmEpilogue::kGlu;
  p.n_tiles = static_cast<int>(glu ? ceil_div(p.inter, Cfg::kBN / 2) : ceil_div(a.n, Cfg::kBN));
  // The weights' tensor map ([E][N][K]; dense: one expert). grouped_gemm()
  // checked what the TMA needs (K % 8 == 0, w 16-byte aligned).
  CUtensorMap w_map{};
  FUSEDMOE_CHECK(
      encode_tensor_map_2byte(&w_map, a.w, a.k, a.n, a.expert_offsets ? a.num_experts : 1, kPanelK,
                              glu ? Cfg::kBN / 2 : Cfg::kBN),
      "grouped_gemm: the TMA cannot read w (N ", a.n, ", K ", a.k, ", ", a.num_experts,
      " experts): cuTensorMapEncodeTiled failed");

  // Upper bound of work items known to the host (the true count is on the device).
  const int64_t max_tiles = a.expert_offsets
                                ? max_padded_rows(a.m, a.num_experts, Cfg::kBM) / Cfg::kBM
                                : ceil_div(a.m, Cfg::kBM);
  const int64_t max_work = max_tiles * p.n_tiles;
  if (max_work == 0) return;

  auto kernel = glu ? grouped_gemm_kernel<T, Cfg, true> : grouped_gemm_kernel<T, Cfg, false>;
  // Per device (the shared-memory attribute is set per device: one thread may
  // drive several GPUs) and epilogue, after the attribute is set.
  constexpr int kMaxDevices = 64;
  static thread_local int occupancy[kMaxDevices][2] = {};
  int dev = 0;
  FUSEDMOE_CUDA_CHECK(cudaGetDevice(&dev));
  FUSEDMOE_CHECK(dev >= 0 && dev < kMaxDevices, "grouped_gemm: CUDA device index ", dev,
                 " beyond the ", kMaxDevices, " supported");
  int& occ = occupancy[dev][glu ? 0 : 1];
  if (occ == 0) {
    FUSEDMOE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
    FUSEDMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, Cfg::kThreads,
                                                                      Cfg::kSmemBytes));
    if (occ < 1) occ = 1;
  }
  const int64_t slots = static_cast<int64_t>(num_sms()) * occ;
  const unsigned grid = static_cast<unsigned>(max_work < slots ? max_work : slots);
  launch_pdl(kernel, grid, Cfg::kThreads, Cfg::kSmemBytes, stream, w_map, p);
}
// The instantiation of the element type args.dtype (kBF16 or kF16).
template <class Cfg>
void launch(const GroupedGemmArgs& a, Stream stream) {
  if (a.dtype == DType::kF16)
    launch_typed<__half, Cfg>(a, stream);
  else
    launch_typed<__nv_bfloat16, Cfg>(a, stream);
}

}  // namespace fusedmoe::cuda::gemm
