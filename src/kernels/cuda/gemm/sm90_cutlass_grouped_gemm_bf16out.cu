// fusedmoe CUDA: sm_90a CUTLASS grouped GEMM instantiation, tile 128 x 256
// cooperative, bf16 A / B, bf16 D (the w13 GEMM).
#include "kernels/cuda/gemm/sm90_cutlass_grouped_gemm.cuh"

namespace fusedmoe::cuda::sm90 {

void grouped_gemm_bf16out(const Sm90GemmArgs& args, Stream stream) {
  run<Cooperative128x256<cutlass::bfloat16_t, cutlass::bfloat16_t>>(args, stream);
}
size_t workspace_bytes_bf16out(int64_t num_experts) {
  return workspace_bytes<Cooperative128x256<cutlass::bfloat16_t, cutlass::bfloat16_t>>(num_experts);
}

}  // namespace fusedmoe::cuda::sm90
