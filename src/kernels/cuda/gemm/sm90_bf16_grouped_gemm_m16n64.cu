// fusedmoe CUDA: grouped GEMM instantiation, tile 16 x 64 (warps 1 x 4, 6 stages).
#include "kernels/cuda/gemm/gemm_instances.h"
#include "kernels/cuda/gemm/sm90_bf16_grouped_gemm.cuh"

namespace fusedmoe::cuda::gemm {

void launch_m16n64(const GroupedGemmArgs& args, Stream stream) {
  launch<TileConfig<16, 64, 1, 4, 6>>(args, stream);
}

}  // namespace fusedmoe::cuda::gemm
