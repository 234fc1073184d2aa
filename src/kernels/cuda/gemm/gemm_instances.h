// fusedmoe internal: the grouped-GEMM tile configurations, one translation
// unit each (sm90_bf16_grouped_gemm_<tile>.cu), so each compiles quickly.
#pragma once

#include "fusedmoe/kernels/cuda.h"

namespace fusedmoe::cuda::gemm {

// BM x BN tile, warps (M x N), pipeline stages. Keep in sync with
// gemm_configs.cpp (block_m) and the .cu files.
void launch_m16n64(const GroupedGemmArgs& args, Stream stream);   // 16 x 64, 1 x 4 warps, 6 stages
void launch_m64n128(const GroupedGemmArgs& args, Stream stream);  // 64 x 128, 2 x 2 warps, 4 stages
void launch_m128n128(const GroupedGemmArgs& args,
                     Stream stream);  // 128 x 128, 2 x 4 warps, 4 stages

}  // namespace fusedmoe::cuda::gemm
