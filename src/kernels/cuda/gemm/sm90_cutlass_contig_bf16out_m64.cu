// fusedmoe CUDA: sm_90a contiguous grouped GEMM instantiation (one TMA
// descriptor per operand), tile 64 x 256 pingpong, bf16 A / B, bf16 D (w2, and
// w13 where the activation is a separate pass).
#include "kernels/cuda/gemm/sm90_cutlass_contig_gemm.cuh"

namespace fusedmoe::cuda::sm90 {

void contig_gemm_bf16out_m64(const Sm90GemmArgs& args, Stream stream) {
  run_contig<ContigGemm<cutlass::bfloat16_t, cutlass::bfloat16_t>>(args, stream);
}
size_t contig_workspace_bytes_bf16out_m64() {
  return contig_workspace_bytes<ContigGemm<cutlass::bfloat16_t, cutlass::bfloat16_t>>();
}

}  // namespace fusedmoe::cuda::sm90
