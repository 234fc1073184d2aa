// fusedmoe CUDA: grouped GEMM instantiation, tile 64 x 128 (warps 2 x 2, 4 stages).
#include "kernels/cuda/gemm/gemm_instances.h"
#include "kernels/cuda/gemm/sm90_bf16_grouped_gemm.cuh"

namespace fusedmoe::cuda::gemm {

void launch_m64n128(const GroupedGemmArgs& args, Stream stream) {
  launch<TileConfig<64, 128, 2, 2, 4>>(args, stream);
}

}  // namespace fusedmoe::cuda::gemm
