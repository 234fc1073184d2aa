// fusedmoe CUDA: the "contiguous" grouped GEMM over experts on Hopper (wgmma,
// TMA, warp-specialized pingpong), after DeepGEMM's m-grouped contiguous
// layout: one GEMM over all expert-sorted rows, every 64-row tile inside one
// expert (align() with block_m = 64 pads each expert's rows), one TMA
// descriptor for A (all rows), one for B (the stacked experts [E, N, K], the
// expert a third TMA coordinate) and one for D.
//
// Why: CUTLASS's ptr-array grouped kernel (sm90_cutlass_grouped_gemm.cuh)
// rewrites and fences its TMA descriptors whenever a CTA's next tile is in
// another group, and its group scheduler walks the groups' shapes in global
// memory to find each tile's group. With many small experts (Qwen3: 24-40
// tiles an expert, the persistent CTAs striding 132 tiles) that happens on
// every tile: session 20 measured the same work 6-7 % slower in 64 experts than
// in 8 (bench/results/2026-12-01-session20.md). Here a tile's expert is one
// load from a table (tile_expert, written from expert_offsets by a one-block
// kernel before the GEMMs) and the descriptors never change.
//
// Built from CUTLASS's own sm90 pieces: the non-grouped pingpong kernel
// (KernelTmaWarpSpecializedPingpong), its TMA mainloop with load() taking B's
// expert coordinate from the table (ContigMainloop), and a persistent tile
// scheduler in the grouped scheduler's expert-major order that stops at the
// device-side row count (ContigScheduler): the problem's M is the host's upper
// bound max_padded_rows(T*k, E, 64), so nothing waits on the host.
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
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/gemm/sm90_cutlass_grouped_gemm.cuh"  // PdlKernel, GluEpilogue
#include "kernels/cuda/pdl.cuh"

namespace fusedmoe::cuda::sm90 {

// The tile scheduler: persistent CTAs striding over the linear tile index L
// as CUTLASS's static persistent scheduler does, but in the order of CUTLASS's
// grouped scheduler (expert-major: all tiles of expert 0, then of expert 1,
// ...; within an expert, its m tiles fastest, so the CTAs running at one time
// share each weight panel through L2 and an expert's rows stay in L2 across
// its n tiles), ending at the device-side row count expert_offsets[E]. With
// every expert's rows a multiple of kBM and n_tiles per m tile, the tiles
// before expert e are m0_e * n_tiles (m0_e = off[e] / kBM), so L's expert is
// tile_expert[L / n_tiles]: one table load, no walk over the groups.
template <int kBM>
class ContigScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    const int64_t* offsets = nullptr;      // device i64 [E + 1], multiples of kBM
    const int32_t* tile_expert = nullptr;  // device: the expert of each m tile
    int num_experts = 0;
  };
  struct Params : Base::Params {
    const int64_t* offsets = nullptr;
    const int32_t* tile_expert = nullptr;
    int num_experts = 0;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    static_assert(cute::size<0>(TileShape{}) == kBM, "the scheduler's tile height");
    Params p;
    static_cast<Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shape_mnkl, tile_shape, cluster_shape, hw_info, args,
                                      workspace, epilogue_subtile, ktile_start_alignment_count);
    p.offsets = args.offsets;
    p.tile_expert = args.tile_expert;
    p.num_experts = args.num_experts;
    return p;
  }
  CUTLASS_HOST_DEVICE static bool can_implement(Arguments const& args) {
    return Base::can_implement(args) && args.offsets != nullptr && args.tile_expert != nullptr &&
           args.num_experts >= 1;
  }

  CUTLASS_DEVICE explicit ContigScheduler(Params const& params)
      : Base(params),
        offsets_(params.offsets),
        tile_expert_(params.tile_expert),
        n_tiles_(params.problem_tiles_n_) {
#if defined(__CUDA_ARCH__)
    linear_ = uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * gridDim.x;
    grid_ = uint64_t(gridDim.x) * gridDim.y * gridDim.z;
#endif
    total_ = uint64_t(offsets_[params.num_experts] / kBM) * n_tiles_;
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
    if (linear_ >= total_) return WorkTileInfo::invalid_work_tile();
    const int e = __ldg(tile_expert_ + linear_ / n_tiles_);
    const int64_t m0 = __ldg(offsets_ + e) / kBM, me = __ldg(offsets_ + e + 1) / kBM - m0;
    const int64_t local = static_cast<int64_t>(linear_) - m0 * n_tiles_;
    return {static_cast<int32_t>(m0 + local % me), static_cast<int32_t>(local / me), 0, true};
  }
  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }
  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) {
    linear_ += grid_ * advance_count;
  }
  // Only a hint for an early dependent launch (CUTLASS_ENABLE_GDC_FOR_SM90): never.
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t = 1) const {
    return false;
  }

 private:
  const int64_t* offsets_;
  const int32_t* tile_expert_;
  int64_t n_tiles_;
  uint64_t linear_ = 0, grid_ = 1, total_ = 0;
};

struct ContigSchedulerTag {};

}  // namespace fusedmoe::cuda::sm90

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<fusedmoe::cuda::sm90::ContigSchedulerTag, ArchTag, TileShape,
                             ClusterShape, Stages> {
  using Scheduler = fusedmoe::cuda::sm90::ContigScheduler<cute::size<0>(TileShape{})>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace fusedmoe::cuda::sm90 {

// CUTLASS's sm90 TMA mainloop (MainloopSm90TmaGmmaWarpSpecialized) with B over
// all experts: B's TMA tensor is (N, K, E) and load() reads the tile's expert
// from tile_expert[m tile] for B's third coordinate (A's is 0). The MMA side
// is the base class's, untouched.
template <class Base>
struct ContigMainloop : Base {
  using typename Base::DispatchPolicy;
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;

  struct Arguments {
    ElementA const* ptr_A;
    StrideA dA;
    ElementB const* ptr_B;
    StrideB dB;  // (N stride, 1, expert stride)
    uint32_t mma_promotion_interval = 4;
    int num_experts = 1;
    const int32_t* tile_expert = nullptr;         // device: the expert of each m tile
    uint64_t cache_hint_a = 0, cache_hint_b = 0;  // Sm90GemmArgs::cache_hint_*
  };
  struct Params : Base::Params {
    int num_experts = 1;
    const int32_t* tile_expert = nullptr;
    uint64_t cache_hint_a = 0, cache_hint_b = 0;
  };

  static typename Base::Arguments base_arguments(Arguments const& a) {
    return {a.ptr_A, a.dA, a.ptr_B, a.dB, a.mma_promotion_interval};
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                        void* workspace) {
    using namespace cute;
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shape, base_arguments(args), workspace);
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    (void)M;
    (void)L;
    auto ptr_B = reinterpret_cast<typename Base::InternalElementB const*>(args.ptr_B);
    cute::Tensor tensor_b =
        make_tensor(ptr_B, make_layout(make_shape(N, K, args.num_experts), args.dB));
    p.tma_load_b = make_tma_copy_B_sm90(typename Base::GmemTiledCopyB{}, tensor_b,
                                        typename Base::SmemLayoutB{}(_, _, Int<0>{}), TileShape{},
                                        typename DispatchPolicy::ClusterShape{});
    p.num_experts = args.num_experts;
    p.tile_expert = args.tile_expert;
    p.cache_hint_a = args.cache_hint_a;
    p.cache_hint_b = args.cache_hint_b;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    return Base::can_implement(problem_shape, base_arguments(args)) && args.num_experts >= 1 &&
           args.tile_expert != nullptr;
  }

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL,
                                Params const& params) const {
    using namespace cute;
    using X = Underscore;
    auto [M, N, K, L] = problem_shape_MNKL;
    cute::Tensor mA_mkl = params.tma_load_a.get_tma_tensor(make_shape(M, K, L));
    cute::Tensor mB_nkl = params.tma_load_b.get_tma_tensor(make_shape(N, K, params.num_experts));
    cute::Tensor gA_mkl = local_tile(mA_mkl, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});
    cute::Tensor gB_nkl = local_tile(mB_nkl, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});
    return cute::make_tuple(gA_mkl, gB_nkl);
  }

  // The base class's load() (no cluster multicast: 1 x 1 clusters) with B's
  // expert from the table and the L2 hints of the arguments.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int /*thread_idx*/, uint32_t /*block_rank_in_cluster*/,
                           TensorStorage& shared_tensors) {
    using namespace cute;
    static_assert(size(typename DispatchPolicy::ClusterShape{}) == 1, "1 x 1 clusters");
    if (!cute::elect_one_sync()) return;
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    (void)k_coord;
    (void)l_coord;
    const int expert = __ldg(params.tile_expert + m_coord);
    const auto hint_a = hint_or_normal(params.cache_hint_a);
    const auto hint_b = hint_or_normal(params.cache_hint_b);
    load_ab_tiles<Base>(
        params, pipeline, smem_pipe_write, get<0>(load_inputs)(_, _, m_coord, _, 0),
        get<1>(load_inputs)(_, _, n_coord, _, expert),
        [&](uint64_t& bar) { return params.tma_load_a.with(bar, 0, hint_a); },
        [&](uint64_t& bar) { return params.tma_load_b.with(bar, 0, hint_b); }, k_tile_iter,
        k_tile_count, shared_tensors);
  }
};

using ContigShape = cute::Shape<int, int, int, int>;

// One contiguous GEMM type: D (rows x N, row-major) = A (rows x K, row-major
// bf16 / f16) . B[expert(row)]^T (B: [E, N, K], K contiguous), f32
// accumulation, 64 x 256 x 64 pingpong tiles, 1 x 1 clusters, through the
// epilogue CollectiveEpilogue_.
template <class ElementAB_, class CollectiveEpilogue_, bool kGlu_>
struct ContigGemmWith {
  using ElementA = ElementAB_;
  using ElementB = ElementAB_;
  using TileShape = cute::Shape<cute::_64, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int kBM = 64;
  using CollectiveEpilogue = CollectiveEpilogue_;
  using ElementD = typename CollectiveEpilogue::ElementD;
  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cutlass::layout::RowMajor, 8,
      ElementB, cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using CollectiveMainloop = ContigMainloop<BaseMainloop>;
  using Kernel =
      PdlKernel<cutlass::gemm::kernel::GemmUniversal<ContigShape, CollectiveMainloop,
                                                     CollectiveEpilogue, ContigSchedulerTag>>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename CollectiveMainloop::StrideA;
  using StrideB = typename CollectiveMainloop::StrideB;
  using StrideD = typename CollectiveEpilogue::StrideD;
  static constexpr bool kGlu = kGlu_;
};

// D = A . B^T in ElementD through CUTLASS's TMA-store epilogue.
template <class ElementAB, class ElementD>
using ContigGemm = ContigGemmWith<
    ElementAB,
    typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
        cute::Shape<cute::_64, cute::_256, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
        cutlass::layout::RowMajor, 128 / cutlass::sizeof_bits<ElementD>::value, ElementD,
        cutlass::layout::RowMajor, 128 / cutlass::sizeof_bits<ElementD>::value,
        cutlass::epilogue::TmaWarpSpecialized,
        cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp,
    false>;

// The w13 GEMM with the gated activation in its epilogue (W13Layout::kInterleaved128).
template <class T, class ElementAB>
using ContigGemmGlu =
    ContigGemmWith<ElementAB,
                   cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
                       GluEpilogue<T, ElementAB, /*kContig=*/true>>,
                   true>;

// tile_expert[m] = e for every 64-row tile m of expert e (rows [off[e], off[e+1]),
// multiples of kBM); one block.
template <int kBM>
__global__ void tile_expert_kernel(const int64_t* __restrict__ offsets, int num_experts,
                                   int32_t* __restrict__ tile_expert) {
  pdl_wait();  // offsets from align; the table read by the GEMMs before
  pdl_launch_dependents();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {  // an expert a thread
    const int64_t m0 = offsets[e] / kBM, m1 = offsets[e + 1] / kBM;
    for (int64_t m = m0; m < m1; ++m) tile_expert[m] = e;
  }
}

template <class G>
typename G::Gemm::Arguments make_contig_arguments(const Sm90GemmArgs& a, int sm_count, int device) {
  using namespace cute;
  const int M = static_cast<int>(a.max_rows), N = static_cast<int>(a.n), K = static_cast<int>(a.k);
  typename G::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = ContigShape{M, N, K, 1};
  auto& ml = args.mainloop;
  ml.ptr_A = reinterpret_cast<const typename G::ElementA*>(a.a);
  ml.dA = cutlass::make_cute_packed_stride(typename G::StrideA{}, {M, K, 1});
  ml.ptr_B = reinterpret_cast<const typename G::ElementB*>(a.w);
  typename G::StrideB db{};
  get<0>(db) = a.k;        // a weight row
  get<2>(db) = a.n * a.k;  // an expert
  ml.dB = db;
  ml.num_experts = static_cast<int>(a.num_experts);
  ml.tile_expert = a.tile_expert;
  ml.cache_hint_a = a.cache_hint_a;
  ml.cache_hint_b = a.cache_hint_w;
  auto& epi = args.epilogue;
  typename G::StrideD dd{};
  get<0>(dd) = a.ldd;
  if constexpr (G::kGlu) {
    epi.ptr_D = static_cast<typename G::ElementD*>(a.d);
    epi.dD = dd;
    epi.bias = a.glu_bias;
    epi.inter = a.n / 2;
    epi.act = a.glu_act;
    epi.tile_expert = a.tile_expert;
  } else {
    get<2>(dd) = a.ldd * M;
    epi.thread.alpha = 1.0f;
    epi.thread.beta = 0.0f;
    epi.ptr_D = static_cast<typename G::ElementD*>(a.d);
    epi.dD = dd;
  }
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  args.scheduler.max_swizzle_size = 1;
  args.scheduler.raster_order = ContigScheduler<G::kBM>::RasterOrderOptions::AlongN;
  args.scheduler.offsets = a.expert_offsets;
  args.scheduler.tile_expert = a.tile_expert;
  args.scheduler.num_experts = static_cast<int>(a.num_experts);
  return args;
}

template <class G>
size_t contig_workspace_bytes() {
  int device = 0;
  FUSEDMOE_CUDA_CHECK(cudaGetDevice(&device));
  Sm90GemmArgs a;
  a.max_rows = 64;
  a.n = 256;
  a.k = 64;
  a.num_experts = 1;
  return G::Gemm::get_workspace_size(make_contig_arguments<G>(a, num_sms(), device)) + 256;
}

// kPrepare: the tile_expert table (a.tile_expert, max_rows / 64 entries; both
// GEMMs of a layer read one table); kLaunch: the GEMM.
template <class G>
void run_contig(const Sm90GemmArgs& a, Stream stream) {
  FUSEDMOE_CHECK(a.tile_expert != nullptr && a.max_rows > 0 && a.max_rows % G::kBM == 0,
                 "sm90 contiguous GEMM: tile_expert and max_rows (a positive multiple of ", G::kBM,
                 ") are required, got max_rows = ", a.max_rows);
  if (a.phase == Sm90GemmArgs::Phase::kPrepare) {
    launch_pdl(tile_expert_kernel<G::kBM>, 1, 256, 0, stream, a.expert_offsets,
               static_cast<int>(a.num_experts), a.tile_expert);
    return;
  }
  FUSEDMOE_CHECK(a.workspace != nullptr && a.workspace_bytes >= contig_workspace_bytes<G>(),
                 "sm90 contiguous GEMM: workspace of ", contig_workspace_bytes<G>(),
                 " bytes needed, got ", a.workspace_bytes);
  int device = 0;
  FUSEDMOE_CUDA_CHECK(cudaGetDevice(&device));
  const auto args = make_contig_arguments<G>(a, num_sms(), device);
  void* ws = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(a.workspace) + 255) / 256 * 256);
  launch_gemm<typename G::Gemm>(args, ws, a, stream, "sm90 contiguous GEMM");
}

}  // namespace fusedmoe::cuda::sm90
