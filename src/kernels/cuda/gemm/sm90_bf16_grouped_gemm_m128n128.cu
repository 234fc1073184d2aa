// fusedmoe CUDA: grouped GEMM instantiation, tile 128 x 128 (warps 2 x 4, 4 stages).
#include "kernels/cuda/gemm/gemm_instances.h"
#include "kernels/cuda/gemm/sm90_bf16_grouped_gemm.cuh"

namespace fusedmoe::cuda::gemm {

void launch_m128n128(const GroupedGemmArgs& args, Stream stream) {
  launch<TileConfig<128, 128, 2, 4, 4>>(args, stream);
}

}  // namespace fusedmoe::cuda::gemm
