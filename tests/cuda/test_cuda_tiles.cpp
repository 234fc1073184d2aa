// The GEMM tile heuristic and tile table (host only: runs without a device).
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "fusedmoe/kernels/cuda.h"

namespace fusedmoe {
namespace {

using cuda::GemmTile;

TEST(CudaTiles, HeuristicFollowsTheMeasuredTable) {
  // Single-token decode (T * k <= 16): the GEMV path.
  EXPECT_EQ(cuda::pick_gemm_tile(1, 8, 1536, 2048), GemmTile::kM8Gemv);
  EXPECT_EQ(cuda::pick_gemm_tile(1, 16, 4096, 7168), GemmTile::kM8Gemv);
  // Otherwise by expected rows per touched expert.
  EXPECT_EQ(cuda::pick_gemm_tile(1, 128, 1536, 2048), GemmTile::kM16N64);
  EXPECT_EQ(cuda::pick_gemm_tile(16, 2048, 1536, 2048), GemmTile::kM16N64);
  EXPECT_EQ(cuda::pick_gemm_tile(17, 2048, 1536, 2048), GemmTile::kM64N128);
  EXPECT_EQ(cuda::pick_gemm_tile(256, 8192, 28672, 4096), GemmTile::kM64N128);
  EXPECT_EQ(cuda::pick_gemm_tile(257, 8192, 28672, 4096), GemmTile::kM128N128);
  EXPECT_EQ(cuda::pick_gemm_tile(1024, 8192, 28672, 4096), GemmTile::kM128N128);
}

TEST(CudaTiles, EveryTileHasANameAndBlockHeight) {
  std::set<std::string> names;
  for (int i = 0; i < cuda::kNumGemmTiles; ++i) {
    const auto t = static_cast<GemmTile>(i);
    names.insert(cuda::gemm_tile_name(t));
    const int bm = cuda::gemm_tile_block_m(t);
    EXPECT_TRUE(bm == 8 || bm == 16 || bm == 64 || bm == 128) << cuda::gemm_tile_name(t);
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(cuda::kNumGemmTiles));
  EXPECT_EQ(names.count("?"), 0u);
  EXPECT_EQ(cuda::max_padded_rows(8, 128, 16), 8 + 8 * 15);
  EXPECT_EQ(cuda::max_padded_rows(4096 * 8, 256, 128), 4096 * 8 + 256 * 127);
}

}  // namespace
}  // namespace fusedmoe
