// fusedmoe CUDA: sm_90a CUTLASS grouped GEMM instantiation, the w13 GEMM with
// the gated activation in its epilogue (weights in W13Layout::kInterleaved128),
// bf16 in and out, tile 128 x 256 cooperative.
#include "kernels/cuda/gemm/sm90_cutlass_grouped_gemm.cuh"

namespace fusedmoe::cuda::sm90 {

void grouped_gemm_glu_bf16_m128(const Sm90GemmArgs& args, Stream stream) {
  run<GluCooperative128x256<__nv_bfloat16, cutlass::bfloat16_t>>(args, stream);
}
size_t workspace_bytes_glu_bf16_m128(int64_t num_experts) {
  return workspace_bytes<GluCooperative128x256<__nv_bfloat16, cutlass::bfloat16_t>>(num_experts);
}

}  // namespace fusedmoe::cuda::sm90
