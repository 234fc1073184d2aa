// fusedmoe CUDA: grouped-GEMM tile configurations and the heuristic that picks
// one (tuning data, kept apart from the kernels), and the validating launcher.
//
// Heuristic by the expected rows per touched expert (rows = T * k / touched,
// rounded), from a sweep of every tile over the Mixtral / Qwen3 / DeepSeek-V3
// shapes at T = 1 .. 4096 on an H200 (bench/results/2026-11-29-cuda-bench.md):
//   (a few slots, pick_decode_experts, bypass this table: decode_experts.cu)
//   T * k <= 4   m8gemv:   single-token decode; CUDA-core GEMV, 16-byte weight
//                          loads (Mixtral T = 1: 188 us vs 197 us with m16n64;
//                          already slower at Qwen3 T = 16: 249 vs 220 us). Up to
//                          16 routed rows before session 11; since session 10's
//                          m16n64 it loses at 8-16 (Mixtral T = 4 / 8: 540 / 904
//                          vs 449 / 645 us, DeepSeek-V3 T = 4: 759 vs 649).
//   <= 16 rows   m16n64:   decode; weight streaming, many small n tiles so the
//                          few touched experts still spread over all SMs
//   <= 256 rows  m64n128:  (Mixtral T = 1024: 2.74 ms vs 3.01 ms with m128n128;
//                          Qwen3 T = 4096: 1.43 vs 1.66 ms)
//   otherwise    m128n128: (Mixtral T = 4096: 9.40 ms vs 10.0 ms with m64n128)
// m128n256 (64 x 64 warp tiles) was never faster by more than 1.5 %: not picked.
//
// From 11-13 expected rows per expert on (sm90_min_rows_per_expert; 12 in sessions 10-30,
// 16 before session 10's 128-deep m16n64
// stages, 32 before session 4's 64-row tiles), the
// routed experts take the sm_90a wgmma + TMA path instead (sm90_experts),
// from the side-by-side runs of bench/results/2026-11-29-cuda-bench-wgmma.md
// (bench_cuda_moe --sweep-sm90, us, mma.sync pick vs sm90):
//   rows/expert  8: DeepSeek T = 256   5376 vs 5826   (mma)
//               16: Qwen3 T = 256       351 vs 365, DeepSeek T = 512 5913 vs 6016 (mma)
//               32: Mixtral T = 128     771 vs 788,  Qwen3 T = 512 438 vs 381,
//                   DeepSeek T = 1024  6416 vs 6172  (sm90 on balance)
//               64: Mixtral T = 256    1025 vs 778   (sm90)
//             1024: Mixtral T = 4096   9446 vs 5315  (sm90)
// Session 4 (bench/results/2026-11-29-session4.md; the w2 output rows in bf16,
// bench_cuda_moe --sweep-sm90 and FUSEDMOE_CUDA_SM90_TILE=m64|m128, us):
//   sm90 with 64 x 256 pingpong tiles now wins from 16 rows per expert:
//     Mixtral T = 64  684 vs 762 (mma m16n64), Qwen3 T = 256 334 vs 356,
//     DeepSeek T = 512 5348 vs 6333; at 8 rows a tie (Mixtral T = 32 687 vs
//     709, Qwen3 T = 128 324 vs 324, DeepSeek T = 256 5199 vs 5188).
//   64 x 256 pingpong vs 128 x 256 cooperative (bf16): better or equal at every
//   point but one: Mixtral T = 128 702 vs 770, T = 512 917 vs 1010, T = 2048
//   2300 vs 2443, T = 4096 4186-4654 vs 4547-4713; Qwen3 T = 512 362 vs 377,
//   T = 2048 528 vs 542, T = 4096 785-797 vs 776-834 (noise); DeepSeek T = 1024
//   5558 vs 5709, T = 2048 5931 vs 6060, T = 4096 7327 vs 7533; worse: Mixtral
//   T = 256 (64 rows per expert) 784 vs 756. So bf16 takes m64 everywhere;
//   f16 (and the f32-output dense shared expert) keeps the 128 x 256 instances.
// Session 8 (bench/results/2026-11-30-session8.md; ncu, each GEMM alone, us,
// w13 / w2, FUSEDMOE_CUDA_SM90_TILE=m64 vs m128):
//   Mixtral T = 256 (64 rows per expert): w2 282.7 vs 233.4 (71 vs 85 % of DRAM
//     bandwidth; our reading: experts with more than 64 rows add 64-row tiles
//     beyond the 132 SMs, which run in a second round and stream their
//     weights again); w13 (896 tiles) 488.2 vs 488.3.
//   Mixtral T = 64 (16 rows): w13 442.7 vs 532.7, w2 226.5 vs 232.8 (m64);
//   T = 1024: w13 896.7 vs 873.3, w2 417.8 vs 443.6; Qwen3 T = 256-4096 and
//   DeepSeek-V3 T = 1024-4096: m64 equal or better (1-9 %).
//   Mixtral w2 at T = 96 / 128 / 192 / 320 (24 / 32 / 48 / 80 rows): m64 234.2
//     / 233.4 / 232.1 / 234.7 vs m128 244.3 / 243.4 / 239.9 / 249.6: only where
//     the experts' row counts straddle 64 (T = 256) does m128 win. Routed
//     experts end to end, same lease: T = 256 766 / 761 (m128 w2) vs 791 / 794
//     (m64); T = 288 766 / 769 vs 760 / 762, so the straddle test takes
//     rows +- 0.75 sqrt(rows) (T = 288: 66-78 rows, m64).
//   64 x 128 pingpong tiles (K tile 64 or 128) were slower than m64 at every
//   point but a few ties within 0.5 % (e.g. Mixtral T = 4096 w13 4522 vs 2659 us,
//   Qwen3 T = 4096 594 vs 373, DeepSeek-V3 T = 4096 6243 vs 4050): not kept.
// Session 27 (bench/results/2026-12-01-session27.md): the GEMMs with A and B
// swapped (D^T = W . A^T: weights as the M operand in 256-row tiles, an expert's
// rows as N in tiles of 144 or 160, column-major D) were 1-2 % faster at
// DeepSeek-V3 T = 4096 and 2-9 % slower for Qwen3 T = 1024-4096 (w2, K = 768):
// not kept. (CuTe picks the wgmma of such an N only with
// CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED; else m64n16, at half the speed.)
// Two other CUTLASS configurations were measured there and not kept (each
// would cost two more heavy translation units): 128 x 128 pingpong and
// 128 x 256 cooperative in 2 x 1 clusters (B multicast) were slower at every
// shape except Mixtral T = 4096's w2 GEMM (5-7 %, inside run-to-run noise).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "fusedmoe/core/env.h"
#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/cuda_common.cuh"  // num_sms
#include "kernels/cuda/gemm/gemm_instances.h"
#include "kernels/cuda/routed_experts.h"

namespace fusedmoe::cuda {

namespace {
constexpr int64_t kGemvMaxRoutedRows = 4;
// The sm_90a wgmma + TMA path (sm90_experts) from this many expected rows per
// touched expert up (measurements above). Session 10 (bench_cuda_moe --sweep,
// m16n64 with 128-deep K stages vs sm90, us; bench/results/2026-11-30-session10.md):
// 8 rows: Mixtral T = 32 649 vs 679, Qwen3 T = 128 308 vs 314, DeepSeek-V3
// T = 256 5107 vs 5151 (m16n64); 12 rows: Mixtral T = 48 708 vs 677, Qwen3
// T = 192 319 vs 322, DeepSeek-V3 T = 384 5273 vs 5222 (sm90 on balance: an
// expert past 16 rows takes a second m16n64 tile); 16 rows: Mixtral T = 64 731
// vs 686, Qwen3 T = 256 346 vs 323 (sm90).
// Session 31 (bench/results/2026-12-02-session31.md; bench_cuda_moe --sweep-sm90, two
// passes, m16n64 vs sm90, us): with many experts m16n64 still wins at 12 rows and
// ties at 13 (Qwen3 T = 192 310 / 310 vs 318 / 318, T = 208 316 / 314 vs 319 / 318,
// T = 224 (14 rows) 323 / 323 vs 320 / 320; DeepSeek-V3 T = 352 (11) 5123 vs 5215,
// T = 384 (12) 5206 vs 5218, T = 416 (13) 5314 vs 5235); with few (Mixtral's 8) it
// already loses at 11 (T = 40 (10 rows) 646 / 646 vs 671 / 670, T = 44 (11) 688 / 691 vs
// 673 / 672): one expert past 16 rows takes a second m16n64 tile, which streams
// that expert's weights again, and with few experts each is a large share of them.
constexpr int64_t kSm90MinRowsPerExpert = 12;  // one dense expert (the shared expert)
constexpr int64_t kSm90MinRowsFewExperts = 11, kSm90MinRowsManyExperts = 13;
constexpr int64_t kFewExperts = 16;

struct TileRow {
  GemmTile tile;
  const char* name;
  int block_m;
  int64_t max_rows_per_expert;  // pick this tile up to this many expected rows
};
constexpr TileRow kTiles[] = {
    // m8gemv is picked by routed_rows alone (see above), never by this column.
    {GemmTile::kM8Gemv, "m8gemv", 8, -1},       {GemmTile::kM16N64, "m16n64", 16, 16},
    {GemmTile::kM64N128, "m64n128", 64, 256},   {GemmTile::kM128N128, "m128n128", 128, INT64_MAX},
    {GemmTile::kM128N256, "m128n256", 128, -1},  // never picked (see above)
};
}  // namespace

const char* gemm_tile_name(GemmTile tile) {
  for (const TileRow& r : kTiles)
    if (r.tile == tile) return r.name;
  return "?";
}

int gemm_tile_block_m(GemmTile tile) {
  for (const TileRow& r : kTiles)
    if (r.tile == tile) return r.block_m;
  FUSEDMOE_THROW(kInvalidArgument, "gemm_tile_block_m: unknown tile ", static_cast<int>(tile));
}

GemmTile pick_gemm_tile(int64_t rows_per_expert, int64_t routed_rows, int64_t /*n*/,
                        int64_t /*k*/) {
  if (routed_rows <= kGemvMaxRoutedRows) return GemmTile::kM8Gemv;
  for (const TileRow& r : kTiles)
    if (rows_per_expert <= r.max_rows_per_expert) return r.tile;
  return GemmTile::kM128N128;
}

int64_t sm90_min_rows_per_expert(int64_t rows_per_expert, int64_t routed_rows) {
  const int64_t touched = routed_rows / std::max<int64_t>(rows_per_expert, 1);
  if (touched <= 1) return kSm90MinRowsPerExpert;
  return touched <= kFewExperts ? kSm90MinRowsFewExperts : kSm90MinRowsManyExperts;
}

bool pick_sm90_experts(int64_t rows_per_expert, int64_t routed_rows, int64_t /*hidden*/,
                       int64_t /*inter*/) {
  const int choice = cuda_switch(CudaSwitch::kExperts);  // sm90, mma
  const bool force_sm90 = choice == 0, force_mma = choice == 1;
  if (force_mma) return false;
  if (!sm90_experts_available()) {
    if (force_sm90)
      FUSEDMOE_THROW(kUnsupported,
                     "FUSEDMOE_CUDA_EXPERTS=sm90: the sm_90a grouped GEMM is not available (no "
                     "CUTLASS in this build, or the device is not sm_90)");
    return false;
  }
  return force_sm90 || rows_per_expert >= sm90_min_rows_per_expert(rows_per_expert, routed_rows);
}

W13Layout pick_w13_layout(int64_t inter) {
  const bool standard = cuda_switch(CudaSwitch::kW13Layout) == 1;  // interleaved, standard
  return !standard && inter % kW13Block == 0 && sm90_experts_available()
             ? W13Layout::kInterleaved128
             : W13Layout::kStandard;
}

// Session 9 (bench/results/2026-11-30-session9.md, run 4; bench_cuda_moe, us,
// two passes each, w13 interleaved: epilogue vs separate pass): Mixtral T = 256
// 742 / 742 vs 761 / 765, T = 1024 1320 / 1325 vs 1370 / 1364, T = 4096 4218 /
// 4368 vs 4483 / 4509; Qwen3 T = 1024 412 / 389 vs 400 / 403, T = 4096 710 / 719
// vs 744 / 741; DeepSeek-V3 T = 1024 5614 / 5618 vs 5693 / 5685, T = 4096 7330 /
// 7241 vs 7357 / 7423; T = 64 ties. So the epilogue everywhere.
bool pick_sm90_glu_epilogue(int64_t /*rows_per_expert*/, int64_t /*num_experts*/,
                            int64_t /*hidden*/, int64_t /*inter*/) {
  return cuda_switch(CudaSwitch::kSm90Glu) != 1;  // epilogue (default), pass
}

Sm90Tile pick_sm90_tile(DType dtype, int64_t rows_per_expert, int64_t num_experts, int64_t n) {
  if (dtype != DType::kBF16) return Sm90Tile::kM128N256;
  const int forced = cuda_switch(CudaSwitch::kSm90Tile);  // m64, m128
  if (forced >= 0) return forced == 0 ? Sm90Tile::kM64N256 : Sm90Tile::kM128N256;
  return sm90_tile_for(rows_per_expert, num_experts, n, num_sms());
}

// Session 25 (bench/results/2026-12-01-session25.md; bench_cuda_moe, three passes
// alternating FUSEDMOE_CUDA_SM90_CONTIG=off|on, us; ncu per GEMM): the contiguous
// GEMMs (no TMA descriptor updates, one table load a tile for the expert) are
// faster only for few large experts at a few m tiles each: Mixtral T = 512
// 906-911 -> 819-823, T = 1024 1331-1347 -> 1271-1275 (w13 GEMM 583-587 -> 513-516
// and 906-956 -> 812-863 us, L2 bytes -12 %; w2 equal). Elsewhere equal within noise
// (Qwen3 T = 512-4096, DeepSeek-V3 T = 1024 / 4096, Mixtral T = 2048 / 4096 per GEMM) or
// slower (DeepSeek-V3 T = 2048 5699-5723 -> 5813-5831). A finer Mixtral sweep (run 8)
// puts it within +-5 % elsewhere: T = 768 991-1002 -> 1028-1030 (the GEMMs equal under
// ncu), T = 1152 1555-1579 -> 1482-1483, T = 1280 1622-1649 -> 1675-1682; the default
// covers E <= 16 at <= 256 rows (Mixtral T <= 1024). A first version with the
// tiles in raster order along N over all experts (not expert-major) was 5-10 %
// slower for Qwen3 / DeepSeek-V3 and 2x slower for Mixtral.
constexpr int64_t kContigMaxExperts = 16, kContigMaxRowsPerExpert = 256;

bool sm90_contig_fits(int64_t num_slots, int64_t num_experts) {
  return num_slots >= 32 * num_experts;
}

int64_t sm90_contig_max_rows(int64_t num_slots, int64_t num_experts) {
  constexpr int64_t m = kSm90ContigBlockM;
  return (max_padded_rows(num_slots, num_experts, kSm90ContigBlockM) + m - 1) / m * m;
}

bool pick_sm90_contig(DType dtype, int64_t rows_per_expert, int64_t num_slots, int64_t num_experts,
                      int64_t hidden, int64_t inter) {
  const int forced = cuda_switch(CudaSwitch::kSm90Contig);  // on, off
  const bool set = forced == 0;
  if (forced == 1) return false;
  if (dtype != DType::kBF16 || !sm90_contig_fits(num_slots, num_experts)) return false;
  if (pick_sm90_tile(dtype, rows_per_expert, num_experts, 2 * inter) != Sm90Tile::kM64N256 ||
      pick_sm90_tile(dtype, rows_per_expert, num_experts, hidden) != Sm90Tile::kM64N256)
    return false;
  // Where every expert has one m tile the ptr-array GEMMs, with their L2 hints
  // (set_launch_policy in sm90_experts.cu), are faster (session 34, three passes, us: Mixtral T =
  // 128 / 160 / 192 675 / 674 / 674 -> 663 / 668 / 671).
  return set || (num_experts <= kContigMaxExperts && rows_per_expert <= kContigMaxRowsPerExpert &&
                 !sm90_gemm_pdl(rows_per_expert, kSm90ContigBlockM));
}

// Session 18 (bench/results/2026-12-01-session18.md; bench_cuda_moe, two
// passes, old and new binaries alternating, us): both GEMMs launched with PDL
// (their CTAs placed during the previous kernel's tail) vs plainly: Mixtral
// T = 64 684 / 681 -> 676 / 676, T = 128 687 / 686 -> 680 / 681 (one m tile an
// expert); but Mixtral T = 256 735 -> 848, T = 1024 1344 -> 2049, T = 4096 4530 ->
// 5636, Qwen3 T = 4096 701 -> 884, DeepSeek-V3 T = 4096 7333 -> 11519 (several m
// tiles sharing each weight panel through L2, which needs their CTAs in step; ncu
// alone, the same kernels ran at the same speed both ways). So PDL only for one
// m tile an expert.
bool sm90_gemm_pdl(int64_t rows_per_expert, int block_m) {
  const double rows = static_cast<double>(rows_per_expert);
  return rows + 0.75 * std::sqrt(rows) <= block_m;
}

// Session 34 (bench/results/2026-12-03-session34.md; bench_cuda_moe, three
// passes, us): the hints with every expert in one m tile, against none: Mixtral
// T = 64 / 128 695 / 703 -> 681 / 695, Qwen3 T = 256 / 512 337 / 351 -> 325 /
// 345; at 56 rows an expert (0.75 sqrt(rows) would still fit 64), hints on
// against off: Mixtral T = 224 (E = 8, about one expert past 64 rows) 802 vs
// 816, but Qwen3 T = 896 (E = 128, ~16 past) 379 vs 363 and DeepSeek-V3
// T = 1792 (E = 256, ~32 past) 6363 vs 6258.
bool sm90_l2_hints_pay(int64_t rows_per_expert, int64_t num_experts, int block_m) {
  if (num_experts <= 0) return false;
  const double mean = static_cast<double>(std::max<int64_t>(rows_per_expert, 0));
  const double sd = std::sqrt(mean * (1.0 - 1.0 / static_cast<double>(num_experts)));
  const double z = (block_m + 0.5 - mean) / std::max(sd, 1e-9);
  const double past = static_cast<double>(num_experts) * 0.5 * std::erfc(z / std::sqrt(2.0));
  return mean <= block_m && past <= 1.0;
}

Sm90Tile sm90_tile_for(int64_t rows_per_expert, int64_t num_experts, int64_t n, int64_t sms) {
  // Uniform routing gives an expert about rows +- 0.75 sqrt(rows) rows. Where
  // that range straddles a multiple of 64, some experts need one more 64-row
  // tile than others; if those extra tiles push the count past one wave of
  // SMs while 128-row tiles stay within it, the second round is a few
  // straggler tiles, each streaming its expert's whole weight panel again
  // (Mixtral w2 at T = 256, above): take 128 x 256 cooperative there.
  const double spread = 0.75 * std::sqrt(static_cast<double>(rows_per_expert));
  const auto tiles = [&](double rows, int64_t tile_m) {
    return static_cast<int64_t>(std::ceil(rows / tile_m)) * ((n + 255) / 256) * num_experts;
  };
  const double lo = std::max(1.0, rows_per_expert - spread), hi = rows_per_expert + spread;
  if (tiles(lo, 64) != tiles(hi, 64) && tiles(hi, 64) > sms && tiles(hi, 128) <= sms)
    return Sm90Tile::kM128N256;
  return Sm90Tile::kM64N256;
}

// Session 10 (bench/results/2026-11-30-session10.md, run B): m16n64 with K
// stages of 64 elements (128-byte rows) and 6 stages read 76-86 % of DRAM
// bandwidth; 128-element stages read 86-92 % (each weight row streams 256
// bytes a stage). ncu per GEMM, us (64 x 6 / 128 x 4 / 128 x 3 stages):
//   Mixtral T = 16 w13 (K = 4096)  461 / 439 / 443, w2 (K = 14336, 512 tiles)
//     256 / 217 / 235: 512 tiles on 396 resident CTAs (3 an SM) run in two
//     rounds, on 264 (2 an SM) in two full ones;
//   Qwen3 T = 64 w13 (K = 2048) 198 / 193 / 190.5, w2 (K = 768) 104 / 112 / 104;
//   DeepSeek-V3 T = 64 w13 (K = 7168) 2950 / 2850 / 2850, w2 (K = 2048) 1470 /
//     1440 / 1430.
// Routed experts end to end (CUDA events, us): Mixtral T = 16 724 / 660 / 691,
// Qwen3 T = 64 315 / 316 / 304, DeepSeek-V3 T = 64 4562 / 4415 / 4417. So 4
// stages for long K (>= 4096) and where 2 CTAs an SM fill their last round
// clearly better than 3 (few rounds of tiles), else 3.
int m16n64_stages_for(int64_t rows, int64_t num_experts, int64_t n_tiles, int64_t k, int64_t sms) {
  if (k >= 4096) return 4;
  // Expected tiles: touched experts x 16-row tiles of each x n tiles.
  const double e = static_cast<double>(std::max<int64_t>(num_experts, 1));
  const double touched =
      num_experts <= 1 ? 1.0 : e * (1.0 - std::pow(1.0 - 1.0 / e, static_cast<double>(rows)));
  const double per_expert = touched > 0 ? rows / touched : 0.0;
  const double tiles = std::max(1.0, touched * std::ceil(per_expert / 16.0) * n_tiles);
  const auto fill = [&](int64_t per_sm) {  // share of the CTA rounds' slots doing work
    const double slots = static_cast<double>(per_sm * sms);
    return tiles / (std::ceil(tiles / slots) * slots);
  };
  return fill(2) > fill(3) + 0.05 ? 4 : 3;
}

// Session 28 (bench/results/2026-12-02-session28.md): the routed GEMMs' CTAs
// claim their work items from a counter (GroupedGemmArgs::work_counter) rather
// than take every grid-th one. ncu, Qwen3 T = 64: the SMs sat idle 6-7 % of the
// w13 / w2 kernels (static: sm__cycles_active 94.3 / 93.0 % of elapsed; a CTA
// streaming slower than its neighbours holds the end) -> 96.7 / 96.3 %, 205 ->
// 201 / 105.6 -> 102.1 us. bench_cuda_moe, two passes each, FUSEDMOE_CUDA_MMA_
// SCHEDULE=static vs dynamic, us: DeepSeek-V3 T = 32 3218 / 3217 -> 3176 / 3175,
// T = 128 5068 / 5072 -> 5009 / 5011, T = 256 5231 / 5237 -> 5130 / 5134; Qwen3
// T = 64 319 / 322 -> 316 / 313; Mixtral T = 16-32 -0.5 %; Qwen3 T = 16 / 128
// within noise. So dynamic wherever the items are long enough (kernel).
// It had also raised the 3-stage GLU kernel to 193 registers (2 CTAs an SM; the
// times above are with that); session 29 asked for 3 (__launch_bounds__) and
// slimmed the load issue: Qwen3 T = 16 / 64 / 128 213 / 312 / 321 -> 196 / 293 /
// 300 us (bench/results/2026-12-02-session29.md).
int pick_m16n64_stages(int64_t rows, int64_t num_experts, int64_t n_tiles, int64_t k) {
  const int forced = cuda_switch(CudaSwitch::kM16Stages);  // 3, 4
  if (forced >= 0) return 3 + forced;
  return m16n64_stages_for(rows, num_experts, n_tiles, k, num_sms());
}

void grouped_gemm(const GroupedGemmArgs& a, Stream stream) {
  FUSEDMOE_CHECK(a.a != nullptr && a.w != nullptr && a.out != nullptr,
                 "grouped_gemm: a, w and out are required");
  FUSEDMOE_CHECK(a.k > 0 && a.k % 8 == 0, "grouped_gemm: K must be a positive multiple of 8, got ",
                 a.k);
  FUSEDMOE_CHECK(a.lda % 8 == 0 && a.lda >= a.k, "grouped_gemm: lda must be a multiple of 8 >= K (",
                 a.k, "), got ", a.lda);
  FUSEDMOE_CHECK(reinterpret_cast<uintptr_t>(a.a) % 16 == 0,
                 "grouped_gemm: a must be 16-byte aligned, got address ",
                 static_cast<const void*>(a.a));
  FUSEDMOE_CHECK(reinterpret_cast<uintptr_t>(a.w) % 16 == 0,
                 "grouped_gemm: w must be 16-byte aligned, got address ",
                 static_cast<const void*>(a.w));
  if (a.epilogue == GemmEpilogue::kGlu) {
    FUSEDMOE_CHECK(a.n > 0 && a.n % 2 == 0,
                   "grouped_gemm: N must be positive and even (gate and up halves), got ", a.n);
    FUSEDMOE_CHECK(a.ldc % 2 == 0 && a.ldc >= a.n / 2,
                   "grouped_gemm: ldc must be even and >= N / 2 = ", a.n / 2, ", got ", a.ldc);
    FUSEDMOE_CHECK(a.w13_layout == W13Layout::kStandard || (a.n / 2) % kW13Block == 0,
                   "grouped_gemm: w13_layout kInterleaved128 needs I = N / 2 a multiple of ",
                   kW13Block, ", got ", a.n / 2);
  } else {
    FUSEDMOE_CHECK(a.n > 0, "grouped_gemm: N must be positive, got ", a.n);
    FUSEDMOE_CHECK(a.ldc >= a.n, "grouped_gemm: ldc must be >= N = ", a.n, ", got ", a.ldc);
  }
  FUSEDMOE_CHECK(a.num_experts >= 1, "grouped_gemm: num_experts must be >= 1");
  FUSEDMOE_CHECK(a.expert_offsets != nullptr || a.num_experts == 1,
                 "grouped_gemm: dense mode (no expert_offsets) takes one expert");
  FUSEDMOE_CHECK(a.expert_offsets == nullptr || a.sorted_slot != nullptr,
                 "grouped_gemm: routed mode needs sorted_slot");
  FUSEDMOE_CHECK(!a.gather || a.a_div >= 1, "grouped_gemm: a_div must be >= 1");
  FUSEDMOE_CHECK(a.dtype == DType::kBF16 || a.dtype == DType::kF16,
                 "grouped_gemm: dtype must be bf16 or f16, got ", dtype_name(a.dtype));
  if (a.m == 0) return;
  switch (a.tile) {
    case GemmTile::kM16N64:
      gemm::launch_m16n64(a, stream);
      break;
    case GemmTile::kM64N128:
      gemm::launch_m64n128(a, stream);
      break;
    case GemmTile::kM128N128:
      gemm::launch_m128n128(a, stream);
      break;
    case GemmTile::kM128N256:
      gemm::launch_m128n256(a, stream);
      break;
    case GemmTile::kM8Gemv:
      gemm::launch_m8gemv(a, stream);
      break;
  }
}

}  // namespace fusedmoe::cuda
