// fusedmoe CUDA: a CUTLASS 3.x epilogue for the sm90 ptr-array grouped GEMM
// that applies the gated activation to the w13 accumulators and writes the
// intermediate once (the w13 GEMM of sm90_experts with W13Layout::kInterleaved128).
//
// The weights' rows come in blocks of 128 gate rows followed by the matching
// 128 up rows, so a 256-column tile n holds gate columns [128 n, 128 n + 128)
// in its first half and the matching up columns in its second. In the wgmma
// accumulator layout a thread holds the same columns of both halves: element i
// and element i + size / 2 sit 128 columns apart (checked below at compile
// time where CuTe can, and on the device otherwise). Each thread writes
// act(g + b_g, u + b_u) of its pairs of adjacent columns as one 4-byte store
// straight from registers (no shared memory, as CUTLASS's DefaultEpilogueArray,
// the operator-style epilogue this one follows; Sm90TmaWarpSpecializedAdapter
// gives it the interface of the warp-specialized kernels). The arithmetic is
// the mma.sync path's kGlu epilogue: the activation on the f32 accumulators,
// rounded once to the output type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/layout.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/gemm/sm90_bf16_grouped_gemm.cuh"  // act_glu, from_float_bits

namespace fusedmoe::cuda::sm90 {

// T: __nv_bfloat16 or __half (the output and weight type); ElementD: its
// CUTLASS spelling. kContig = false: for the ptr-array grouped GEMM (a D
// pointer and stride per group, the group = the expert); true: for the
// contiguous GEMM (sm90_cutlass_contig_gemm.cuh: one D, rows global, the
// expert of each 64-row tile in tile_expert).
template <class T, class ElementD_, bool kContig = false>
class GluEpilogue {
 public:
  using EpilogueSchedule = std::conditional_t<kContig, cutlass::epilogue::NoSmemWarpSpecialized,
                                              cutlass::epilogue::PtrArrayNoSmemWarpSpecialized>;
  using DispatchPolicy = EpilogueSchedule;
  using ElementOutput = ElementD_;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementC = void;
  using StrideC = cutlass::detail::TagToStrideC_t<
      std::conditional_t<kContig, cutlass::layout::RowMajor, cutlass::layout::RowMajor*>>;
  using InternalStrideC = cute::remove_pointer_t<StrideC>;
  using ElementD = ElementD_;
  using StrideD = StrideC;
  using InternalStrideD = InternalStrideC;
  using GmemElementC = ElementD;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  // Named by GemmUniversalAdapter (EpilogueOutputOp); the epilogue does not use it.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<ElementD, 1, float, float>;
  static constexpr int kBlock = kW13Block;  // gate / up rows per block of the weights

  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;

  struct Arguments {
    // Per group: the group's first output row and (ldd, 1, 0); kContig: row 0 and (ldd, 1, 0).
    std::conditional_t<kContig, ElementD*, ElementD**> ptr_D = nullptr;
    StrideD dD{};
    const float* bias = nullptr;  // f32 [groups, 2I] (gate then up, the standard order) or null
    int64_t inter = 0;            // I (output columns), a multiple of kBlock
    ActivationParams act{};
    const int32_t* tile_expert = nullptr;  // kContig: the expert of each m tile (for the bias)
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int = 0) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr_D != nullptr && args.inter > 0 && args.inter % kBlock == 0;
  }

  CUTLASS_HOST_DEVICE explicit GluEpilogue(Params const& params) : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    constexpr int kBM = size<0>(BlockShapeMNK{}), kBN = size<1>(BlockShapeMNK{});
    static_assert(kBN == 2 * kBlock, "a tile must hold one block of gate and one of up columns");
    constexpr int kSize = size(FrgLayout{});
    constexpr int kHalf = kSize / 2;
    static_assert(kSize % 4 == 0, "pairs of adjacent columns in both halves");

    const int M = get<0>(problem_shape_mnkl);
    const int m_coord = get<0>(blk_coord_mnkl), n_coord = get<1>(blk_coord_mnkl);
    // Tile-local coordinates of this thread's accumulators.
    auto cD = make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{}));
    auto tCcD = tiled_mma.get_thread_slice(thread_idx).partition_C(cD);
    CUTE_STATIC_ASSERT_V(size(tCcD) == size(accumulators), "one coordinate per accumulator");

    T* out;
    int64_t ldd;
    const int64_t inter = params_.inter;
    const float* bias = nullptr;
    if constexpr (kContig) {
      out = reinterpret_cast<T*>(params_.ptr_D);
      ldd = get<0>(params_.dD);
      if (params_.bias)
        bias =
            params_.bias + static_cast<int64_t>(__ldg(params_.tile_expert + m_coord)) * 2 * inter;
    } else {
      const int l_coord = get<3>(blk_coord_mnkl);  // the group: the expert
      out = reinterpret_cast<T*>(params_.ptr_D[l_coord]);
      ldd = get<0>(params_.dD[l_coord]);
      if (params_.bias) bias = params_.bias + static_cast<int64_t>(l_coord) * 2 * inter;
    }
    const ActivationParams act = params_.act;
    const int64_t col0 = static_cast<int64_t>(n_coord) * kBlock;
    const int row0 = m_coord * kBM;
    // One loop per activation (the switch outside it): the elements' chains interleave.
    gemm::with_activation(act.activation, [&]<Activation A>() {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kHalf; i += 2) {
        const int r = get<0>(tCcD(i)), c = get<1>(tCcD(i));
        // The layout this epilogue relies on (folded at compile time).
        if (get<0>(tCcD(i + 1)) != r || get<1>(tCcD(i + 1)) != c + 1 ||
            get<0>(tCcD(i + kHalf)) != r || get<1>(tCcD(i + kHalf)) != c + kBlock)
          __trap();
        const int64_t j = col0 + c;  // output column (intermediate index), j + 1 < I
        float g0 = accumulators(i), g1 = accumulators(i + 1);
        float u0 = accumulators(i + kHalf), u1 = accumulators(i + kHalf + 1);
        if (bias) {  // read-only loads: free to move ahead of the stores
          g0 += __ldg(bias + j);
          g1 += __ldg(bias + j + 1);
          u0 += __ldg(bias + inter + j);
          u1 += __ldg(bias + inter + j + 1);
        }
        const float a0 = gemm::act_glu_t<A>(g0, u0, act.swiglu_alpha, act.swiglu_limit);
        const float a1 = gemm::act_glu_t<A>(g1, u1, act.swiglu_alpha, act.swiglu_limit);
        if (row0 + r < M) gemm::store2<T>(out + static_cast<int64_t>(row0 + r) * ldd + j, a0, a1);
      }
    });
  }

 private:
  Params params_;
};

}  // namespace fusedmoe::cuda::sm90
