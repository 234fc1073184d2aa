// fusedmoe CUDA: grouped GEMM instantiations, tile 16 x 64 (warps 1 x 4), K
// stages of 128 elements: 4 stages (2 CTAs an SM) or 3 (3 CTAs an SM), picked
// per GEMM by pick_m16n64_stages (gemm_configs.cpp).
#include "kernels/cuda/gemm/gemm_instances.h"
#include "kernels/cuda/gemm/sm90_bf16_grouped_gemm.cuh"
#include "kernels/cuda/routed_experts.h"  // pick_m16n64_stages

namespace fusedmoe::cuda::gemm {

void launch_m16n64(const GroupedGemmArgs& args, Stream stream) {
  const bool glu = args.epilogue == GemmEpilogue::kGlu;
  const int64_t n_tiles = glu ? ceil_div(args.n / 2, int64_t{32}) : ceil_div(args.n, int64_t{64});
  if (pick_m16n64_stages(args.m, args.expert_offsets ? args.num_experts : 1, n_tiles, args.k) == 4)
    launch<TileConfig<16, 64, 1, 4, 4, 128>>(args, stream);
  else
    launch<TileConfig<16, 64, 1, 4, 3, 128>>(args, stream);
}

}  // namespace fusedmoe::cuda::gemm
