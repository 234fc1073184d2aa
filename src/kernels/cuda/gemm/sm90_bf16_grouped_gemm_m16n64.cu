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

int m16n64_ctas_per_sm(int stages, bool glu, DType dtype) {
  FUSEDMOE_CHECK(stages == 3 || stages == 4, "m16n64_ctas_per_sm: stages must be 3 or 4, got ",
                 stages);
  FUSEDMOE_CHECK(dtype == DType::kBF16 || dtype == DType::kF16,
                 "m16n64_ctas_per_sm: dtype must be bf16 or f16, got ", dtype_name(dtype));
  int ctas = 0;
  auto query = [&]<class Cfg>() {
    const auto run = [&]<class T>() {
      auto kernel = glu ? grouped_gemm_kernel<T, Cfg, true> : grouped_gemm_kernel<T, Cfg, false>;
      FUSEDMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               Cfg::kSmemBytes));
      FUSEDMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &ctas, kernel, Cfg::kThreads, Cfg::kSmemBytes));
    };
    if (dtype == DType::kF16)
      run.template operator()<__half>();
    else
      run.template operator()<__nv_bfloat16>();
  };
  if (stages == 4)
    query.template operator()<TileConfig<16, 64, 1, 4, 4, 128>>();
  else
    query.template operator()<TileConfig<16, 64, 1, 4, 3, 128>>();
  return ctas;
}

}  // namespace fusedmoe::cuda::gemm
