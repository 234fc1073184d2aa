// fusedmoe CUDA: sm_90a CUTLASS grouped GEMM instantiation, the w13 GEMM with
// the gated activation in its epilogue (weights in W13Layout::kInterleaved128),
// f16 in and out, tile 128 x 256 cooperative.
#include "kernels/cuda/gemm/sm90_cutlass_grouped_gemm.cuh"

namespace fusedmoe::cuda::sm90 {

void grouped_gemm_glu_f16_m128(const Sm90GemmArgs& args, Stream stream) {
  run<GluCooperative128x256<__half, cutlass::half_t>>(args, stream);
}
size_t workspace_bytes_glu_f16_m128(int64_t num_experts) {
  return workspace_bytes<GluCooperative128x256<__half, cutlass::half_t>>(num_experts);
}

}  // namespace fusedmoe::cuda::sm90
