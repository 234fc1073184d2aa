// fusedmoe CUDA: sm_90a CUTLASS grouped GEMM instantiation, tile 128 x 256 cooperative, f32 D (the
// w2 GEMM).
#include "kernels/cuda/gemm/sm90_cutlass_grouped_gemm.cuh"

namespace fusedmoe::cuda::sm90 {
namespace {
using G = GroupedGemm<float, cute::Shape<cute::_128, cute::_256, cute::_64>,
                      cute::Shape<cute::_1, cute::_1, cute::_1>,
                      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
}  // namespace

void grouped_gemm_f32out(const Sm90GemmArgs& args, Stream stream) {
  run<G>(args, stream);
}
size_t workspace_bytes_f32out(int64_t num_experts) {
  return workspace_bytes<G>(num_experts);
}

}  // namespace fusedmoe::cuda::sm90
