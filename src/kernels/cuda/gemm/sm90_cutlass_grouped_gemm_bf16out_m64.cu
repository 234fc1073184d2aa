// fusedmoe CUDA: sm_90a CUTLASS grouped GEMM instantiation, tile 64 x 256
// pingpong, bf16 A / B, bf16 D (w13 and w2 of the bf16 path at 32 to ~300 rows
// per expert).
#include "kernels/cuda/gemm/sm90_cutlass_grouped_gemm.cuh"

namespace fusedmoe::cuda::sm90 {

void grouped_gemm_bf16out_m64(const Sm90GemmArgs& args, Stream stream) {
  run<Pingpong64x256<cutlass::bfloat16_t, cutlass::bfloat16_t>>(args, stream);
}
size_t workspace_bytes_bf16out_m64(int64_t num_experts) {
  return workspace_bytes<Pingpong64x256<cutlass::bfloat16_t, cutlass::bfloat16_t>>(num_experts);
}

}  // namespace fusedmoe::cuda::sm90
