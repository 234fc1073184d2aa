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

__device__ __forceinline__ uint4 ld_nc(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// 8 elements of type T (bf16 or f16) -> f32.
template <class T>
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __half>) {
      const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = h.x;
      f[2 * i + 1] = h.y;
    } else {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

// Sums v[0..N) over the warp by recursive halving; afterwards lane L holds the
// totals of indices [L * N / 32, (L + 1) * N / 32) in v[0 .. N / 32).
template <int kN, int kOffset>
__device__ __forceinline__ void halving_step(float* v, int lane) {
  const bool upper = (lane & kOffset) != 0;
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) {
    const float keep = upper ? v[i + kN / 2] : v[i];
    const float send = upper ? v[i] : v[i + kN / 2];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kOffset);
  }
}
template <int N>
__device__ __forceinline__ void warp_reduce_halving(float* v, int lane) {
  halving_step<N, 16>(v, lane);
  halving_step<N / 2, 8>(v, lane);
  halving_step<N / 4, 4>(v, lane);
  halving_step<N / 8, 2>(v, lane);
  halving_step<N / 16, 1>(v, lane);
}

template <class T, bool kGlu>
__global__ void __launch_bounds__(kThreads) grouped_gemv_kernel(const Params p) {
  pdl_wait();  // expert_offsets, sorted_slot and a come from the kernels before
  pdl_launch_dependents();
  constexpr int kRowsPerItem = ::fusedmoe::cuda::gemm::kRowsPerItem<kGlu>;
  constexpr int kW = kGlu ? 2 * kRowsPerItem : kRowsPerItem;  // weight rows streamed per item
  constexpr int kAcc = kW * kTileRows;
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
    int32_t src[kTileRows];
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) src[r] = __shfl_sync(0xffffffffu, my_src, r);

    const uint16_t* w_e = p.w + static_cast<int64_t>(e) * p.n * K;
    const uint16_t* wrow[kW];
    bool wok[kW];
#pragma unroll
    for (int j = 0; j < kW; ++j) {
      const int64_t n = n0 + (j % kRowsPerItem);
      wok[j] = n < out_rows;
      const int64_t wr = kGlu ? (j < kRowsPerItem ? n : p.inter + n) : n;
      wrow[j] = w_e + (wok[j] ? wr : 0) * K;
    }

    float acc[kAcc];  // index ((j % 4) * 8 + r) * (kGlu ? 2 : 1) + (j / 4)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
    for (int64_t k0 = lane * 8; k0 < K; k0 += 256) {
      uint4 wraw[kW];  // all weight loads issued before any use
#pragma unroll
      for (int j = 0; j < kW; ++j) wraw[j] = wok[j] ? ld_nc(wrow[j] + k0) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        if (src[r] < 0) continue;  // warp-uniform
        float xf[8];
        unpack8<T>(ld_nc(p.a + static_cast<int64_t>(src[r]) * p.lda + k0), xf);
#pragma unroll
        for (int j = 0; j < kW; ++j) {
          const int idx = kGlu ? (((j % kRowsPerItem) * kTileRows + r) * 2 + j / kRowsPerItem)
                               : (j * kTileRows + r);
          float wf[8];
          unpack8<T>(wraw[j], wf);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[idx] = fmaf(wf[i], xf[i], acc[idx]);
        }
      }
    }
    warp_reduce_halving<kAcc>(acc, lane);

    // Lane L now holds accumulator indices [2L, 2L + 2). w13: (weight row L / 8,
    // activation row L % 8) with acc[0] = gate, acc[1] = up; w2: weight row
    // L / 4, activation rows 2 (L % 4) and 2 (L % 4) + 1.
    static_assert(kAcc == 64, "the epilogue's lane mapping assumes 64 accumulators");
    const float* bias = p.bias ? p.bias + static_cast<int64_t>(e) * p.n : nullptr;
    if constexpr (kGlu) {
      const int jj = lane / kTileRows, r = lane % kTileRows;
      const int64_t n = n0 + jj;
      if (n >= out_rows || (dense && row0 + r >= p.m)) continue;
      float g = acc[0], u = acc[1];
      if (bias) {
        g += bias[n];
        u += bias[p.inter + n];
      }
      auto* out = static_cast<uint16_t*>(p.out);
      out[(row0 + r) * p.ldc + n] =
          from_float_bits<T>(act_glu(p.act, g, u, p.swiglu_alpha, p.swiglu_limit));
    } else {
      const int jj = lane / 4, r0 = 2 * (lane % 4);
      const int32_t slot0 = __shfl_sync(0xffffffffu, my_slot, r0);
      const int32_t slot1 = __shfl_sync(0xffffffffu, my_slot, r0 + 1);
      const int64_t n = n0 + jj;
      if (n >= out_rows) continue;
      const float b = bias ? bias[n] : 0.0f;
      float* out = static_cast<float*>(p.out);
      if (slot0 >= 0)
        out[static_cast<int64_t>(slot0) * p.ldc + n] =
            (p.row_scale ? p.row_scale[slot0] : 1.0f) * (acc[0] + b);
      if (slot1 >= 0)
        out[static_cast<int64_t>(slot1) * p.ldc + n] =
            (p.row_scale ? p.row_scale[slot1] : 1.0f) * (acc[1] + b);
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
  launch_pdl(glu ? grouped_gemv_kernel<T, true> : grouped_gemv_kernel<T, false>, grid, kThreads,
             0, stream, p);
}

}  // namespace

void launch_m8gemv(const GroupedGemmArgs& a, Stream stream) {
  if (a.dtype == DType::kF16)
    launch_gemv<__half>(a, stream);
  else
    launch_gemv<__nv_bfloat16>(a, stream);
}

}  // namespace fusedmoe::cuda::gemm
