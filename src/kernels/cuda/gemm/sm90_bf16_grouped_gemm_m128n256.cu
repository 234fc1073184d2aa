// fusedmoe CUDA: grouped GEMM instantiation, tile 128 x 256 (warps 2 x 4 of 64 x 64, 3 stages).
#include "kernels/cuda/gemm/gemm_instances.h"
#include "kernels/cuda/gemm/sm90_bf16_grouped_gemm.cuh"

namespace fusedmoe::cuda::gemm {

void launch_m128n256(const GroupedGemmArgs& args, Stream stream) {
  launch<TileConfig<128, 256, 2, 4, 3>>(args, stream);
}

}  // namespace fusedmoe::cuda::gemm
