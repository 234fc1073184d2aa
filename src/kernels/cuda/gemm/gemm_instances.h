// fusedmoe internal: the grouped-GEMM tile configurations, one translation
// unit each (sm90_bf16_grouped_gemm_<tile>.cu), so each compiles quickly.
#pragma once

#include "fusedmoe/kernels/cuda.h"

namespace fusedmoe::cuda::gemm {

// BM x BN tile, warps (M x N) and pipeline stages of each:
//   m16n64: 1 x 4 warps, 4 or 3 stages of K 128 (pick_m16n64_stages)
//   m64n128: 2 x 2 warps, 4 stages
//   m128n128: 2 x 4 warps, 4 stages   m128n256: 2 x 4 warps (64 x 64 each), 3 stages
void launch_m16n64(const GroupedGemmArgs& args, Stream stream);
// CTAs an SM of the current device that the m16n64 kernel of `stages` (3 or 4)
// K stages holds at once, GLU epilogue (w13) or not, `dtype` kBF16 or kF16: its
// registers and shared memory allowing (cudaOccupancyMaxActiveBlocksPerMultiprocessor).
// The weight stream's bytes in flight scale with it (3 on an H200 with 3 stages).
int m16n64_ctas_per_sm(int stages, bool glu, DType dtype);
void launch_m64n128(const GroupedGemmArgs& args, Stream stream);
void launch_m128n128(const GroupedGemmArgs& args, Stream stream);
void launch_m128n256(const GroupedGemmArgs& args, Stream stream);
// m8gemv: <= 8 rows per tile, CUDA-core GEMV streaming each weight row once (decode).
void launch_m8gemv(const GroupedGemmArgs& args, Stream stream);

}  // namespace fusedmoe::cuda::gemm
