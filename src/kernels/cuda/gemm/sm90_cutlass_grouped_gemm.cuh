// fusedmoe CUDA: bf16 grouped GEMM over experts on Hopper tensor cores (wgmma,
// TMA loads and stores, warp-specialized producer / consumer warpgroups on an
// mbarrier pipeline), from CUTLASS 3.x's sm90 ptr-array grouped GEMM
// (KernelPtrArrayTmaWarpSpecializedCooperative, GroupProblemShape).
//
// The rows of expert e are the contiguous rows [off[e], off[e+1]) of A (the
// expert-sorted copy of the input made by sm90_experts.cu): TMA reads tiles,
// it cannot gather rows. Per-expert problem shapes and A / B / D pointers are
// written ON THE DEVICE from expert_offsets by a one-block kernel (no host
// sync; the idea of vLLM's cutlass_moe_mm get_group_gemm_starts), so the whole
// sequence stays graph-capturable. Experts with no rows are M = 0 groups,
// which CUTLASS's group tile scheduler skips.
//
// Included by one .cu per instantiation (compile time, ~minutes each).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm/sm90_cutlass_glu_epilogue.cuh"
#include "kernels/cuda/gemm/sm90_cutlass_instances.h"
#include "kernels/cuda/pdl.cuh"

namespace fusedmoe::cuda::sm90 {

// CUTLASS's sm90 ptr-array kernels do not wait on the kernel before them, so
// they cannot be launched with Programmatic Dependent Launch as they are: this
// is the CUTLASS kernel behind pdl_wait() (a no-op when launched plainly). It
// never lets the next kernel launch early (its CTAs exit first).
template <class Base>
struct PdlKernel : Base {
  CUTLASS_DEVICE void operator()(typename Base::Params const& params, char* smem) {
    pdl_wait();  // the group arrays, A rows and offsets come from the kernels before
    Base::operator()(params, smem);
  }
};

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

static_assert(kL2EvictFirst == static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST) &&
                  kL2EvictLast == static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_LAST),
              "the L2 policy operands are CUTLASS's");

// An L2 cache hint for a TMA load (Sm90GemmArgs::cache_hint_*): 0 means none.
CUTLASS_DEVICE cute::TMA::CacheHintSm90 hint_or_normal(uint64_t hint) {
  return hint == 0 ? cute::TMA::CacheHintSm90::EVICT_NORMAL
                   : static_cast<cute::TMA::CacheHintSm90>(hint);
}

// The producer loop of CUTLASS's sm90 TMA mainloops with 1 x 1 clusters, on the
// elected thread: each k tile of gA (BLK_M, BLK_K, k) and gB (BLK_N, BLK_K, k)
// into the next pipeline stage, through the executable TMA atoms
// with_a(barrier) / with_b(barrier) (the mainloop's .with(): descriptor, hint).
template <class Mainloop, class Params, class TensorA, class TensorB, class WithA, class WithB,
          class KTileIterator>
CUTLASS_DEVICE void load_ab_tiles(Params const& params,
                                  typename Mainloop::MainloopPipeline pipeline,
                                  typename Mainloop::PipelineState smem_pipe_write,
                                  TensorA const& gA, TensorB const& gB, WithA with_a, WithB with_b,
                                  KTileIterator k_tile_iter, int k_tile_count,
                                  typename Mainloop::TensorStorage& shared_tensors) {
  using namespace cute;
  cute::Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()),
                                typename Mainloop::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
  cute::Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()),
                                typename Mainloop::SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
  auto block_tma_a = params.tma_load_a.get_slice(0);
  auto block_tma_b = params.tma_load_b.get_slice(0);
  cute::Tensor tAgA = block_tma_a.partition_S(gA);  // (TMA, TMA_M, TMA_K, k)
  cute::Tensor tAsA = block_tma_a.partition_D(sA);  // (TMA, TMA_M, TMA_K, PIPE)
  cute::Tensor tBgB = block_tma_b.partition_S(gB);
  cute::Tensor tBsB = block_tma_b.partition_D(sB);
  CUTLASS_PRAGMA_NO_UNROLL
  for (; k_tile_count > 0; --k_tile_count) {
    pipeline.producer_acquire(smem_pipe_write);
    auto* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
    const int stage = smem_pipe_write.index();
    cute::copy(with_a(*tma_barrier), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage));
    cute::copy(with_b(*tma_barrier), tBgB(_, _, _, *k_tile_iter), tBsB(_, _, _, stage));
    ++k_tile_iter;
    ++smem_pipe_write;
  }
}

// CUTLASS's ptr-array TMA mainloop (MainloopSm90ArrayTmaGmmaWarpSpecialized)
// with an L2 cache hint on its A and B loads (the base class's load() with the
// hint operand; the MMA side and the tensor-map updates are the base's).
template <class Base>
struct HintedArrayMainloop : Base {
  using typename Base::DispatchPolicy;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;

  struct Arguments : Base::Arguments {
    uint64_t cache_hint_a = 0, cache_hint_b = 0;  // Sm90GemmArgs::cache_hint_*
  };
  struct Params : Base::Params {
    uint64_t cache_hint_a = 0, cache_hint_b = 0;
  };

  template <class ProblemShape_>
  static Params to_underlying_arguments(ProblemShape_ problem_shapes, Arguments const& args,
                                        void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shapes, args, workspace);
    p.cache_hint_a = args.cache_hint_a;
    p.cache_hint_b = args.cache_hint_b;
    return p;
  }

  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int /*thread_idx*/, uint32_t /*block_rank_in_cluster*/,
                           TensorStorage& shared_tensors) {
    using namespace cute;
    static_assert(size(typename DispatchPolicy::ClusterShape{}) == 1, "1 x 1 clusters");
    if (!cute::elect_one_sync()) return;
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    (void)k_coord;
    const auto hint_a = hint_or_normal(params.cache_hint_a);
    const auto hint_b = hint_or_normal(params.cache_hint_b);
    load_ab_tiles<Base>(
        params, pipeline, smem_pipe_write, get<0>(load_inputs)(_, _, m_coord, _, l_coord),
        get<1>(load_inputs)(_, _, n_coord, _, l_coord),
        [&](uint64_t& bar) {
          return params.tma_load_a.with(get<0>(input_tensormaps), bar, 0, hint_a);
        },
        [&](uint64_t& bar) {
          return params.tma_load_b.with(get<1>(input_tensormaps), bar, 0, hint_b);
        },
        k_tile_iter, k_tile_count, shared_tensors);
  }
};

// One grouped-GEMM type: D[e] (M_e x N, row-major, ElementD) = A[e] (M_e x K,
// row-major ElementAB: bf16 or f16) . B[e]^T (B[e]: N x K, K contiguous =
// CUTLASS ColumnMajor), f32 accumulation, no source C, through the epilogue
// CollectiveEpilogue_; the mainloop's stages take the shared memory it leaves.
template <class ElementAB_, class TileShape_, class ClusterShape_, class KernelSchedule_,
          class CollectiveEpilogue_, bool kGlu_>
struct GroupedGemmWith {
  using ElementA = ElementAB_;
  using ElementB = ElementAB_;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  static constexpr int kAlignA = 8, kAlignB = 8;  // 16 bytes of bf16 / f16: K % 8 == 0
  using CollectiveEpilogue = CollectiveEpilogue_;
  using ElementD = typename CollectiveEpilogue::ElementD;

  using CollectiveMainloop =
      HintedArrayMainloop<typename cutlass::gemm::collective::CollectiveBuilder<
          cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignA,
          ElementB, LayoutB*, kAlignB, float, TileShape_, ClusterShape_,
          cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
              sizeof(typename CollectiveEpilogue::SharedStorage))>,
          KernelSchedule_>::CollectiveOp>;

  using Kernel = PdlKernel<
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape = typename ProblemShape::UnderlyingProblemShape;
  static constexpr bool kGlu = kGlu_;
};

// D = A . B^T in ElementD through CUTLASS's TMA-store epilogue (LinearCombination,
// alpha 1, no C).
template <class ElementAB, class ElementD, class TileShape, class ClusterShape,
          class KernelSchedule, class EpilogueSchedule>
using GroupedGemm = GroupedGemmWith<
    ElementAB, TileShape, ClusterShape, KernelSchedule,
    typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
        cutlass::layout::RowMajor*, 128 / cutlass::sizeof_bits<ElementD>::value, ElementD,
        cutlass::layout::RowMajor*, 128 / cutlass::sizeof_bits<ElementD>::value, EpilogueSchedule,
        cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp,
    false>;

// The w13 GEMM with the gated activation in its epilogue (weights in
// W13Layout::kInterleaved128): GluEpilogue writes act(gate, up) straight
// from the accumulators (no shared memory: the mainloop's stages take it all).
template <class T, class ElementAB, class TileShape, class ClusterShape, class KernelSchedule>
using GroupedGemmGlu = GroupedGemmWith<
    ElementAB, TileShape, ClusterShape, KernelSchedule,
    cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<GluEpilogue<T, ElementAB>>,
    true>;
template <class T, class ElementAB>
using GluCooperative128x256 =
    GroupedGemmGlu<T, ElementAB, cute::Shape<cute::_128, cute::_256, cute::_64>,
                   cute::Shape<cute::_1, cute::_1, cute::_1>,
                   cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
template <class T, class ElementAB>
using GluPingpong64x256 =
    GroupedGemmGlu<T, ElementAB, cute::Shape<cute::_64, cute::_256, cute::_64>,
                   cute::Shape<cute::_1, cute::_1, cute::_1>,
                   cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>;

// The kept configuration: 128 x 256 x 64 tiles, cooperative (2 consumer
// warpgroups on one tile), cluster 1 x 1; one instantiation per .cu file.
template <class ElementAB, class ElementD>
using Cooperative128x256 =
    GroupedGemm<ElementAB, ElementD, cute::Shape<cute::_128, cute::_256, cute::_64>,
                cute::Shape<cute::_1, cute::_1, cute::_1>,
                cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

// For 32 to ~300 rows per expert: 64 x 256 x 64 tiles, pingpong (each consumer
// warpgroup on its own tile, one's epilogue under the other's mainloop),
// cluster 1 x 1. Half the M padding of the 128-row tiles where an expert's rows
// are a little over a multiple of 128 (uniform routing: about half the experts).
template <class ElementAB, class ElementD>
using Pingpong64x256 =
    GroupedGemm<ElementAB, ElementD, cute::Shape<cute::_64, cute::_256, cute::_64>,
                cute::Shape<cute::_1, cute::_1, cute::_1>,
                cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

// Device-side argument arrays, carved from the front of the workspace.
template <class G>
struct GroupArrays {
  typename G::Shape* shape;
  const typename G::ElementA** a;
  const typename G::ElementB** b;
  typename G::ElementD** d;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;

  static size_t bytes(int64_t groups) {
    auto r = [](size_t b) { return (b + 255) / 256 * 256; };
    return r(sizeof(typename G::Shape) * groups) + 3 * r(sizeof(void*) * groups) +
           r(sizeof(typename G::StrideA) * groups) + r(sizeof(typename G::StrideB) * groups) +
           r(sizeof(typename G::StrideD) * groups);
  }
  static GroupArrays carve(void* ws, int64_t groups) {
    auto r = [](size_t b) { return (b + 255) / 256 * 256; };
    char* p = static_cast<char*>(ws);
    GroupArrays g;
    g.shape = reinterpret_cast<typename G::Shape*>(p);
    p += r(sizeof(typename G::Shape) * groups);
    g.a = reinterpret_cast<const typename G::ElementA**>(p);
    p += r(sizeof(void*) * groups);
    g.b = reinterpret_cast<const typename G::ElementB**>(p);
    p += r(sizeof(void*) * groups);
    g.d = reinterpret_cast<typename G::ElementD**>(p);
    p += r(sizeof(void*) * groups);
    g.stride_a = reinterpret_cast<typename G::StrideA*>(p);
    p += r(sizeof(typename G::StrideA) * groups);
    g.stride_b = reinterpret_cast<typename G::StrideB*>(p);
    p += r(sizeof(typename G::StrideB) * groups);
    g.stride_d = reinterpret_cast<typename G::StrideD*>(p);
    return g;
  }
};

// One thread per expert: shape (M_e, N, K), pointers and packed strides.
template <class G>
__global__ void group_args_kernel(GroupArrays<G> g, const int64_t* __restrict__ offsets,
                                  int num_experts, const typename G::ElementA* a,
                                  const typename G::ElementB* b, typename G::ElementD* d, int n,
                                  int k, int64_t ldd) {
  pdl_wait();  // offsets from the kernels before; the arrays read by the GEMM before
  pdl_launch_dependents();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    const int64_t row0 = offsets[e];
    const int m = static_cast<int>(offsets[e + 1] - row0);
    g.shape[e] = typename G::Shape(m, n, k);
    g.a[e] = a + row0 * k;
    g.b[e] = b + static_cast<int64_t>(e) * n * k;
    g.d[e] = d + row0 * ldd;
    g.stride_a[e] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, k, 1});
    g.stride_b[e] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1});
    typename G::StrideD sd{};
    cute::get<0>(sd) = ldd;
    g.stride_d[e] = sd;
  }
}

template <class G>
typename G::Gemm::Arguments make_arguments(const GroupArrays<G>& g, int64_t groups, int sm_count,
                                           int device, const Sm90GemmArgs& a) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  typename G::Gemm::Arguments args;
  typename G::Kernel::EpilogueArguments epi{};
  if constexpr (G::kGlu) {
    epi.ptr_D = g.d;
    epi.dD = g.stride_d;
    epi.bias = a.glu_bias;
    epi.inter = a.n / 2;
    epi.act = a.glu_act;
  } else {
    epi.thread.alpha = 1.0f;
    epi.thread.beta = 0.0f;
    epi.ptr_D = g.d;
    epi.dD = g.stride_d;
  }
  typename G::Kernel::MainloopArguments ml{};
  ml.ptr_A = g.a;
  ml.dA = g.stride_a;
  ml.ptr_B = g.b;
  ml.dB = g.stride_b;
  ml.cache_hint_a = a.cache_hint_a;
  ml.cache_hint_b = a.cache_hint_w;
  args = typename G::Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                     {static_cast<int>(groups), g.shape, nullptr},
                                     ml,
                                     epi,
                                     hw};
  return args;
}

template <class G>
size_t workspace_bytes(int64_t groups) {
  int device = 0;
  FUSEDMOE_CUDA_CHECK(cudaGetDevice(&device));
  GroupArrays<G> g = GroupArrays<G>::carve(nullptr, groups);
  const auto args = make_arguments<G>(g, groups, num_sms(), device, Sm90GemmArgs{});
  return GroupArrays<G>::bytes(groups) + G::Gemm::get_workspace_size(args) + 256;
}

// can_implement, initialize (on `workspace`) and run a CUTLASS device GEMM, with
// PDL only where the caller asks (Sm90GemmArgs::pdl: one m tile an expert).
template <class Gemm>
void launch_gemm(const typename Gemm::Arguments& args, void* workspace, const Sm90GemmArgs& a,
                 Stream stream, const char* what) {
  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  FUSEDMOE_CHECK(st == cutlass::Status::kSuccess, what, ": CUTLASS cannot implement N = ", a.n,
                 ", K = ", a.k, ": ", cutlassGetStatusString(st));
  st = gemm.initialize(args, workspace, stream);
  FUSEDMOE_CHECK(st == cutlass::Status::kSuccess, what,
                 ": initialize failed: ", cutlassGetStatusString(st));
  st = gemm.run(stream, nullptr, a.pdl && pdl_enabled());
  FUSEDMOE_CHECK(st == cutlass::Status::kSuccess, what,
                 ": launch failed: ", cutlassGetStatusString(st));
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

template <class G>
void run(const Sm90GemmArgs& a, Stream stream) {
  FUSEDMOE_CHECK(a.workspace != nullptr && a.workspace_bytes >= workspace_bytes<G>(a.num_experts),
                 "sm90 grouped GEMM: workspace of ", workspace_bytes<G>(a.num_experts),
                 " bytes needed, got ", a.workspace_bytes);
  GroupArrays<G> g = GroupArrays<G>::carve(a.workspace, a.num_experts);
  if (a.phase == Sm90GemmArgs::Phase::kPrepare) {
    launch_pdl(group_args_kernel<G>, 1, 256, 0, stream, g, a.expert_offsets,
               static_cast<int>(a.num_experts), reinterpret_cast<const typename G::ElementA*>(a.a),
               reinterpret_cast<const typename G::ElementB*>(a.w),
               static_cast<typename G::ElementD*>(a.d), static_cast<int>(a.n),
               static_cast<int>(a.k), a.ldd);
    return;
  }
  const size_t front = GroupArrays<G>::bytes(a.num_experts);
  int device = 0;
  FUSEDMOE_CUDA_CHECK(cudaGetDevice(&device));
  const auto args = make_arguments<G>(g, a.num_experts, num_sms(), device, a);
  launch_gemm<typename G::Gemm>(args, static_cast<char*>(a.workspace) + (front + 255) / 256 * 256,
                                a, stream, "sm90 grouped GEMM");
}

}  // namespace fusedmoe::cuda::sm90
