// fusedmoe CUDA: the decode path of the grouped GEMM — at most 8 rows per
// expert tile (block_m = 8), no tensor cores: each warp streams 4 weight rows
// (w13: 4 gate + 4 up rows) once with 16-byte loads, several in flight per
// lane, against the tile's <= 8 activation rows (read through L1), then one
// recursive-halving warp reduction and the same fused epilogues as the MMA
// kernel (gated activation -> bf16 or f16 intermediate; weighted scatter by slot).
// Persistent warps over (tile, row group) items, row groups innermost so the
// warps of an SM share the tile's activation rows. Launched with Programmatic
// Dependent Launch (pdl.cuh): the blocks start while the kernel before (align,
// or the w13 GEMV) drains.
#include "kernels/cuda/gemm/gemm_instances.h"
#include "kernels/cuda/gemm/gemv_common.cuh"
#include "kernels/cuda/gemm/sm90_bf16_grouped_gemm.cuh"
#include "kernels/cuda/pdl.cuh"

namespace fusedmoe::cuda::gemm {
namespace {

constexpr int kTileRows = 8;  // activation rows per tile (block_m)
// Output rows per warp item: w13 4 gate/up pairs, w2 8 rows, so both stream 8
// weight rows (128 bytes per lane in flight) per step.
template <bool kGlu>
constexpr int kRowsPerItem = kGlu ? 4 : 8;
constexpr int kThreads = 128;  // ~160 registers: 3 blocks, 12 warps per SM

// kRows: activation rows a warp item computes at once (8, or 2 for T <= 2, where
// no expert has more: fewer accumulators, so each lane keeps two K steps of
// weight loads in flight and 4 blocks still fit an SM; on an H200 T = 1 / 2
// took 8-16 % less time than with kRows = 8, one row and no unrolling ranked
// below, bench/results/2026-11-29-session4.md). A tile's 8 rows are taken in
// chunks of kRows; chunks without a routed row are skipped, so any routing is
// computed right, only slower where an expert has more rows than kRows.
template <class T, bool kGlu, int kRows>
__global__ void __launch_bounds__(kThreads, kRows == 8 ? 1 : 4)
    grouped_gemv_kernel(const Params p) {
  pdl_wait();  // expert_offsets, sorted_slot and a come from the kernels before
  pdl_launch_dependents();
  constexpr int kRowsPerItem = ::fusedmoe::cuda::gemm::kRowsPerItem<kGlu>;
  constexpr int kW = kGlu ? 2 * kRowsPerItem : kRowsPerItem;  // weight rows streamed per item
  constexpr int kAcc = kW * kRows;
  constexpr int kUnroll = kRows == 8 ? 1 : 2;
  static_assert(kRows == 8 || kRows == 2, "kRows: 8, or 2 (full butterfly reduction)");
  const int lane = threadIdx.x & 31;
  const int64_t warp_id = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  const bool dense = p.expert_offsets == nullptr;
  const int64_t total_tiles =
      dense ? (p.m + kTileRows - 1) / kTileRows : p.expert_offsets[p.num_experts] / kTileRows;
  const int64_t out_rows = kGlu ? p.inter : p.n;  // outputs per activation row
  const int64_t groups = (out_rows + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t K = p.k;

  for (int64_t item = warp_id; item < total_tiles * groups; item += num_warps) {
    const int64_t tile = item / groups;
    const int64_t n0 = (item % groups) * kRowsPerItem;
    const int64_t row0 = tile * kTileRows;
    int e = 0;
    if (!dense) {
      int lo = 0, hi = p.num_experts - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (p.expert_offsets[mid] <= row0)
          lo = mid;
        else
          hi = mid - 1;
      }
      e = lo;
    }
    // Rows of the tile: lane r < 8 looks its row up, then everyone gets all 8.
    int32_t my_slot = -1, my_src = -1;
    if (lane < kTileRows) {
      const int64_t row = row0 + lane;
      if (dense) {
        my_slot = row < p.m ? static_cast<int32_t>(row) : -1;
        my_src = my_slot;
      } else {
        my_slot = p.sorted_slot[row];
        my_src = my_slot < 0 ? -1 : (p.gather ? my_slot / p.a_div : static_cast<int32_t>(row));
      }
    }
    int32_t src_all[kTileRows];
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) src_all[r] = __shfl_sync(0xffffffffu, my_src, r);

    const uint16_t* w_e = p.w + static_cast<int64_t>(e) * p.n * K;
    const uint16_t* wrow[kW];
    bool wok[kW];
#pragma unroll
    for (int j = 0; j < kW; ++j) {
      const int64_t n = n0 + (j % kRowsPerItem);
      wok[j] = n < out_rows;
      const int64_t wr =
          kGlu ? w13_row(n, j < kRowsPerItem ? 0 : 1, p.inter, p.w13_interleaved) : n;
      wrow[j] = w_e + (wok[j] ? wr : 0) * K;
    }
    const float* bias = p.bias ? p.bias + static_cast<int64_t>(e) * p.n : nullptr;

#pragma unroll 1
    for (int c0 = 0; c0 < kTileRows; c0 += kRows) {
      int32_t src[kRows];
      bool any = false;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        src[r] = src_all[c0 + r];
        any |= src[r] >= 0;
      }
      if (!any) continue;  // warp-uniform

      float acc[kAcc];  // index ((j % 4) * kRows + r) * (kGlu ? 2 : 1) + (j / 4)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
      for (int64_t k0 = lane * 8; k0 < K; k0 += 256 * kUnroll) {
        uint4 wraw[kUnroll][kW];  // all weight loads issued before any use
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int j = 0; j < kW; ++j)
            wraw[u][j] =
                wok[j] && k0 + u * 256 < K ? ld_nc(wrow[j] + k0 + u * 256) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t kk = k0 + u * 256;
          if (kk >= K) break;
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            if (src[r] < 0) continue;  // warp-uniform
            float xf[8];
            unpack8<T>(ld_nc(p.a + static_cast<int64_t>(src[r]) * p.lda + kk), xf);
#pragma unroll
            for (int j = 0; j < kW; ++j) {
              const int idx = kGlu ? (((j % kRowsPerItem) * kRows + r) * 2 + j / kRowsPerItem)
                                   : (j * kRows + r);
              float wf[8];
              unpack8<T>(wraw[u][j], wf);
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[idx] = fmaf(wf[i], xf[i], acc[idx]);
            }
          }
        }
      }

      // Output o of the item: w13 (weight row o / kRows, activation row o % kRows)
      // with gate / up at acc[2o], acc[2o + 1]; w2 (weight row o / kRows,
      // activation row o % kRows) at acc[o]. kRows == 8: recursive halving, lane L
      // holds outputs 2L / 2L + 1 (w2) or output L (w13) in acc[0..2); else every
      // lane holds all and lane o < kOut takes output o.
      constexpr int kOut = kGlu ? kAcc / 2 : kAcc;
      float v0 = 0.0f, v1 = 0.0f;
      int o = lane;
      if constexpr (kRows == 8) {
        static_assert(kAcc == 64, "the halving epilogue assumes 64 accumulators");
        warp_reduce_halving<kAcc>(acc, lane);
        v0 = acc[0];
        v1 = acc[1];
        if (!kGlu) o = 2 * lane;
      } else {
        warp_reduce_all<kAcc>(acc);
#pragma unroll
        for (int i = 0; i < kOut; ++i)
          if (lane == i) {
            v0 = kGlu ? acc[2 * i] : acc[i];
            v1 = kGlu ? acc[2 * i + 1] : 0.0f;
          }
      }
      if constexpr (kGlu) {
        if (o >= kOut) continue;
        const int jj = o / kRows, r = o % kRows;
        const int64_t n = n0 + jj;
        if (n >= out_rows || (dense && row0 + c0 + r >= p.m)) continue;
        float g = v0, u = v1;
        if (bias) {
          g += bias[n];
          u += bias[p.inter + n];
        }
        auto* out = static_cast<uint16_t*>(p.out);
        out[(row0 + c0 + r) * p.ldc + n] =
            from_float_bits<T>(act_glu(p.act, g, u, p.swiglu_alpha, p.swiglu_limit));
      } else {
        // Outputs o (and o + 1 with kRows == 8: the same weight row, the next activation row).
        const int jj = o / kRows, r0 = o % kRows;
        const int32_t slot0 = __shfl_sync(0xffffffffu, my_slot, (c0 + r0) & 31);
        const int32_t slot1 = __shfl_sync(0xffffffffu, my_slot, (c0 + r0 + 1) & 31);
        const int64_t n = n0 + jj;
        if (o >= kOut || n >= out_rows) continue;
        const float b = bias ? bias[n] : 0.0f;
        float* out = static_cast<float*>(p.out);
        if (slot0 >= 0)
          out[static_cast<int64_t>(slot0) * p.ldc + n] =
              (p.row_scale ? p.row_scale[slot0] : 1.0f) * (v0 + b);
        if (kRows == 8 && slot1 >= 0)
          out[static_cast<int64_t>(slot1) * p.ldc + n] =
              (p.row_scale ? p.row_scale[slot1] : 1.0f) * (v1 + b);
      }
    }
  }
}

template <class T>
void launch_gemv(const GroupedGemmArgs& a, Stream stream) {
  const Params p = make_params(a);
  const bool glu = a.epilogue == GemmEpilogue::kGlu;
  const int64_t max_tiles = a.expert_offsets
                                ? max_padded_rows(a.m, a.num_experts, kTileRows) / kTileRows
                                : ceil_div(a.m, kTileRows);
  const int64_t items = max_tiles * (glu ? ceil_div(p.inter, kRowsPerItem<true>)
                                         : ceil_div(p.n, kRowsPerItem<false>));
  if (items == 0) return;
  const int64_t warps_per_block = kThreads / 32;
  // Enough warps to keep many loads in flight; blocks beyond residency just queue.
  const int64_t max_blocks = static_cast<int64_t>(num_sms()) * 8;
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>(ceil_div(items, warps_per_block), max_blocks));
  // The most rows an expert gets when each token's ids are distinct (the routers'):
  // the token count, M / top_k (dense: all M rows). Repeated ids stay right (more
  // chunks), but each chunk streams the expert's weights again.
  const int64_t tokens = a.expert_offsets ? a.m / std::max(1, a.a_div) : a.m;
  auto pick = [&](auto glu_tag) {
    constexpr bool kG = decltype(glu_tag)::value;
    if (tokens <= 2) return grouped_gemv_kernel<T, kG, 2>;
    return grouped_gemv_kernel<T, kG, 8>;
  };
  launch_pdl(glu ? pick(std::true_type{}) : pick(std::false_type{}), grid, kThreads, 0, stream, p);
}

}  // namespace

void launch_m8gemv(const GroupedGemmArgs& a, Stream stream) {
  if (a.dtype == DType::kF16)
    launch_gemv<__half>(a, stream);
  else
    launch_gemv<__nv_bfloat16>(a, stream);
}

}  // namespace fusedmoe::cuda::gemm
