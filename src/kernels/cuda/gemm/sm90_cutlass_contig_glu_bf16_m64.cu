// fusedmoe CUDA: sm_90a contiguous grouped GEMM instantiation (one TMA
// descriptor per operand), the w13 GEMM with the gated activation in its
// epilogue (weights in W13Layout::kInterleaved128), bf16 in and out, tile
// 64 x 256 pingpong.
#include "kernels/cuda/gemm/sm90_cutlass_contig_gemm.cuh"

namespace fusedmoe::cuda::sm90 {

void contig_gemm_glu_bf16_m64(const Sm90GemmArgs& args, Stream stream) {
  run_contig<ContigGemmGlu<__nv_bfloat16, cutlass::bfloat16_t>>(args, stream);
}
size_t contig_workspace_bytes_glu_bf16_m64() {
  return contig_workspace_bytes<ContigGemmGlu<__nv_bfloat16, cutlass::bfloat16_t>>();
}

}  // namespace fusedmoe::cuda::sm90
