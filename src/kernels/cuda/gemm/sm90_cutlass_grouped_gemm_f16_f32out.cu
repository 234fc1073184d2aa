// fusedmoe CUDA: sm_90a CUTLASS grouped GEMM instantiation, tile 128 x 256
// cooperative, f16 A / B, f32 D (the w2 GEMM).
#include "kernels/cuda/gemm/sm90_cutlass_grouped_gemm.cuh"

namespace fusedmoe::cuda::sm90 {

void grouped_gemm_f16_f32out(const Sm90GemmArgs& args, Stream stream) {
  run<Cooperative128x256<cutlass::half_t, float>>(args, stream);
}
size_t workspace_bytes_f16_f32out(int64_t num_experts) {
  return workspace_bytes<Cooperative128x256<cutlass::half_t, float>>(num_experts);
}

}  // namespace fusedmoe::cuda::sm90
