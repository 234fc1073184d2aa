// The GEMM tile heuristic and tile table (host only: runs without a device,
// but for the picks that read the device's SM count).
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "cuda_test_util.h"  // FUSEDMOE_REQUIRE_CUDA
#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/routed_experts.h"  // sm90_tile_for

namespace fusedmoe {
namespace {

using cuda::GemmTile;

TEST(CudaTiles, HeuristicFollowsTheMeasuredTable) {
  // Single-token decode (T * k <= 4): the GEMV path; m16n64 from 5 routed rows.
  EXPECT_EQ(cuda::pick_gemm_tile(1, 2, 28672, 4096), GemmTile::kM8Gemv);
  EXPECT_EQ(cuda::pick_gemm_tile(1, 4, 4096, 7168), GemmTile::kM8Gemv);
  EXPECT_EQ(cuda::pick_gemm_tile(1, 8, 1536, 2048), GemmTile::kM16N64);
  EXPECT_EQ(cuda::pick_gemm_tile(2, 16, 4096, 7168), GemmTile::kM16N64);
  // Otherwise by expected rows per touched expert.
  EXPECT_EQ(cuda::pick_gemm_tile(1, 128, 1536, 2048), GemmTile::kM16N64);
  EXPECT_EQ(cuda::pick_gemm_tile(16, 2048, 1536, 2048), GemmTile::kM16N64);
  EXPECT_EQ(cuda::pick_gemm_tile(17, 2048, 1536, 2048), GemmTile::kM64N128);
  EXPECT_EQ(cuda::pick_gemm_tile(256, 8192, 28672, 4096), GemmTile::kM64N128);
  EXPECT_EQ(cuda::pick_gemm_tile(257, 8192, 28672, 4096), GemmTile::kM128N128);
  EXPECT_EQ(cuda::pick_gemm_tile(1024, 8192, 28672, 4096), GemmTile::kM128N128);
}

// Where the sm90 path starts (session 31's sweep, gemm_configs.cpp): Mixtral (8
// experts) from 11 rows an expert, Qwen3 / DeepSeek-V3 (128 / 256) from 13, one
// dense expert (the shared expert, T rows) from 12.
TEST(CudaTiles, Sm90PathStartsWhereMeasured) {
  const auto min_rows = [](int64_t T, int64_t k, int64_t E) {
    const int64_t rows = cuda::routed_rows_per_expert(T, k, E);
    return cuda::sm90_min_rows_per_expert(rows, T * k);
  };
  EXPECT_EQ(min_rows(44, 2, 8), 11);                      // Mixtral T = 44: 11 rows, sm90
  EXPECT_EQ(min_rows(40, 2, 8), 11);                      // T = 40: 10 rows, m16n64
  EXPECT_EQ(min_rows(192, 8, 128), 13);                   // Qwen3 T = 192: 12 rows, m16n64
  EXPECT_EQ(min_rows(416, 8, 256), 13);                   // DeepSeek-V3 T = 416: 13 rows, sm90
  EXPECT_EQ(cuda::sm90_min_rows_per_expert(12, 12), 12);  // dense, T = 12
  EXPECT_EQ(cuda::sm90_min_rows_per_expert(0, 0), 12);    // no rows: dense's
  EXPECT_EQ(cuda::routed_rows_per_expert(44, 2, 8), 11);
  EXPECT_EQ(cuda::routed_rows_per_expert(192, 8, 128), 12);
  EXPECT_EQ(cuda::routed_rows_per_expert(416, 8, 256), 13);
}

// The sm90 tile rule at the points measured on an H200 (132 SMs; gemm_configs.cpp).
TEST(CudaTiles, Sm90TileFollowsTheMeasuredPoints) {
  using cuda::Sm90Tile;
  const auto tile = [](int64_t rows, int64_t E, int64_t n) {
    return cuda::sm90_tile_for(rows, E, n, 132);
  };
  // Mixtral w2 (E = 8, N = 4096): 128 x 256 cooperative only at T = 256 (64 rows
  // per expert, counts straddling 64); 64 x 256 pingpong at T = 96-192, 288, 320.
  EXPECT_EQ(tile(64, 8, 4096), Sm90Tile::kM128N256);
  for (const int64_t rows : {16, 24, 32, 48, 72, 80, 128, 1024})
    EXPECT_EQ(tile(rows, 8, 4096), Sm90Tile::kM64N256) << rows << " rows";
  // Mixtral w13 (N = 28672: 896 tiles and more): always pingpong.
  for (const int64_t rows : {16, 64, 256, 1024})
    EXPECT_EQ(tile(rows, 8, 28672), Sm90Tile::kM64N256) << rows << " rows";
  // Qwen3 (E = 128) and DeepSeek-V3 (E = 256): thousands of tiles, pingpong.
  for (const int64_t rows : {16, 64, 256}) {
    EXPECT_EQ(tile(rows, 128, 2048), Sm90Tile::kM64N256);
    EXPECT_EQ(tile(rows, 128, 1536), Sm90Tile::kM64N256);
    EXPECT_EQ(tile(rows, 256, 7168), Sm90Tile::kM64N256);
    EXPECT_EQ(tile(rows, 256, 4096), Sm90Tile::kM64N256);
  }
  // One dense expert (the shared expert): one n tile row, never past a wave.
  EXPECT_EQ(tile(64, 1, 4096), Sm90Tile::kM64N256);
}

// PDL for the sm90 GEMMs only where every expert has one m tile (gemm_configs.cpp):
// Mixtral T = 64 / 128 (16 / 32 rows an expert), DeepSeek-V3 T = 1024 (32 rows),
// not Mixtral T = 256 (64 rows: some experts take two 64-row tiles) and up.
TEST(CudaTiles, Sm90GemmPdlOnlyForOneMTileAnExpert) {
  for (const int64_t rows : {1, 16, 32, 48, 58})
    EXPECT_TRUE(cuda::sm90_gemm_pdl(rows, 64)) << rows << " rows";
  for (const int64_t rows : {59, 64, 256, 1024})
    EXPECT_FALSE(cuda::sm90_gemm_pdl(rows, 64)) << rows << " rows";
  EXPECT_TRUE(cuda::sm90_gemm_pdl(64, 128));
  EXPECT_TRUE(cuda::sm90_gemm_pdl(119, 128));
  EXPECT_FALSE(cuda::sm90_gemm_pdl(120, 128));
}

// The L2 hints where about one expert at most needs a second m tile, at the
// points measured on an H200 (gemm_configs.cpp): Mixtral (E = 8) up to 56 rows
// an expert, Qwen3-30B-A3B (E = 128) and DeepSeek-V3 (E = 256) at 32 but not 56.
TEST(CudaTiles, Sm90L2HintsWhereAboutOneExpertNeedsASecondMTile) {
  for (const int64_t rows : {0, 1, 16, 32, 48, 56})
    EXPECT_TRUE(cuda::sm90_l2_hints_pay(rows, 8, 64)) << rows << " rows, E = 8";
  for (const int64_t rows : {64, 65, 256})
    EXPECT_FALSE(cuda::sm90_l2_hints_pay(rows, 8, 64)) << rows << " rows, E = 8";
  for (const int64_t e : {128, 256}) {
    for (const int64_t rows : {16, 32})
      EXPECT_TRUE(cuda::sm90_l2_hints_pay(rows, e, 64)) << rows << " rows, E = " << e;
    for (const int64_t rows : {56, 64, 1024})
      EXPECT_FALSE(cuda::sm90_l2_hints_pay(rows, e, 64)) << rows << " rows, E = " << e;
  }
  EXPECT_TRUE(cuda::sm90_l2_hints_pay(100, 8, 128));
  EXPECT_FALSE(cuda::sm90_l2_hints_pay(16, 0, 64));
}

// Mixtral's contiguous GEMMs only where its experts have several m tiles
// (session 25 for E <= 16 at <= 256 rows; session 34: one m tile, ptr-array).
TEST(CudaTiles, Sm90ContigOnlyForSeveralMTilesAnExpert) {
  FUSEDMOE_REQUIRE_CUDA();  // pick_sm90_tile reads the SM count
  const auto contig = [](int64_t T) {
    return cuda::pick_sm90_contig(DType::kBF16, T * 2 / 8, T * 2, 8, 4096, 14336);
  };
  for (const int64_t T : {128, 192, 224}) EXPECT_FALSE(contig(T)) << "T = " << T;
  for (const int64_t T : {512, 1024}) EXPECT_TRUE(contig(T)) << "T = " << T;
  EXPECT_FALSE(contig(4096));  // 1024 rows an expert: past kContigMaxRowsPerExpert
}

// m16n64's pipeline at the points measured on an H200 (132 SMs; gemm_configs.cpp).
TEST(CudaTiles, M16n64StagesFollowTheMeasuredPoints) {
  const auto stages = [](int64_t rows, int64_t E, int64_t n_tiles, int64_t k) {
    return cuda::m16n64_stages_for(rows, E, n_tiles, k, 132);
  };
  // Mixtral T = 16 and 32: w13 (K = 4096) and w2 (K = 14336) stream long rows: 4 stages.
  EXPECT_EQ(stages(32, 8, 448, 4096), 4);
  EXPECT_EQ(stages(64, 8, 64, 14336), 4);
  // DeepSeek-V3 T = 64: w13 K = 7168 (a tie measured), w2 K = 2048 over ~25k tiles: 3.
  EXPECT_EQ(stages(512, 256, 64, 7168), 4);
  EXPECT_EQ(stages(512, 256, 112, 2048), 3);
  // Qwen3-30B-A3B T = 16 and 64 (K = 2048 and 768, thousands of tiles): 3.
  for (const int64_t rows : {128, 512}) {
    EXPECT_EQ(stages(rows, 128, 24, 2048), 3) << rows;
    EXPECT_EQ(stages(rows, 128, 32, 768), 3) << rows;
  }
  // Short K but 512 tiles (1.3 rounds of 3 CTAs an SM, 1.9 of 2): 4.
  EXPECT_EQ(stages(64, 8, 64, 1024), 4);
  // One dense expert: by its tiles (448: 4; 16384: 3); no rows: 3.
  EXPECT_EQ(stages(100, 1, 64, 1024), 4);
  EXPECT_EQ(stages(4096, 1, 64, 1024), 3);
  EXPECT_EQ(stages(0, 8, 64, 1024), 3);
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
