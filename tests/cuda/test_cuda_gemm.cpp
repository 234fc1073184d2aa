// CUDA grouped GEMM: every tile configuration, routed (gather by slot, padded
// expert rows) and dense (shared expert) modes, each activation, biases, K, N
// not multiples of the tile; the w13 -> activation -> w2 x weight chain per
// routed slot against float64 on the host.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "kernels/cuda/gemm/gemm_instances.h"  // m16n64_ctas_per_sm
#include "reference_moe.h"

namespace fusedmoe {
namespace {

using test::DeviceTensor;

// float64 w2[e] . act(w13[e] . x[s / k] + b13[e]) + b2[e] for every slot s =
// t * k + j of expert e = topk_ids[s] (rows of -1 ids stay 0): [T * k, H].
std::vector<double> slot_reference(const Tensor& x, const ExpertWeights& w, const Tensor& ids_h,
                                   int64_t k, Activation act, bool bias) {
  const int64_t slots = ids_h.numel(), H = w.w2.size(1), I = w.w2.size(2);
  const Tensor xf = to_f32(x), w13f = to_f32(w.w13), w2f = to_f32(w.w2);
  const Tensor b13f = bias ? to_f32(*w.w13_bias) : Tensor(),
               b2f = bias ? to_f32(*w.w2_bias) : Tensor();
  ActivationParams ap;
  ap.activation = act;
  std::vector<double> rows(slots * H, 0.0), h(I);
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = ids_h.data_as<int32_t>()[s];
    if (e < 0) continue;
    const float* xr = xf.data_as<float>() + (s / k) * H;
    for (int64_t i = 0; i < I; ++i) {
      double gsum = 0, usum = 0;
      const float* wg = w13f.data_as<float>() + (e * 2 * I + i) * H;
      const float* wu = w13f.data_as<float>() + (e * 2 * I + I + i) * H;
      for (int64_t c = 0; c < H; ++c) {
        gsum += static_cast<double>(xr[c]) * wg[c];
        usum += static_cast<double>(xr[c]) * wu[c];
      }
      if (bias) {
        gsum += b13f.data_as<float>()[e * 2 * I + i];
        usum += b13f.data_as<float>()[e * 2 * I + I + i];
      }
      h[i] = test::reference_activation(ap, gsum, usum);
    }
    for (int64_t n = 0; n < H; ++n) {
      double acc = 0;
      const float* wr = w2f.data_as<float>() + (e * H + n) * I;
      for (int64_t i = 0; i < I; ++i) acc += h[i] * wr[i];
      if (bias) acc += b2f.data_as<float>()[e * H + n];
      rows[s * H + n] = acc;
    }
  }
  return rows;
}

// w13 on the device in `layout` (interleave_w13 of the standard copy).
DeviceTensor device_w13(const ExpertWeights& w, cuda::W13Layout layout) {
  DeviceTensor d = DeviceTensor::from_host(w.w13);
  if (layout == cuda::W13Layout::kInterleaved128)
    cuda::interleave_w13(d.data_as<uint16_t>(), w.w13.size(0), w.w13.size(1) / 2, w.w13.size(2),
                         nullptr);
  return d;
}
const char* layout_name(cuda::W13Layout layout) {
  return layout == cuda::W13Layout::kInterleaved128 ? " w13 interleaved" : "";
}

// dt: the element type of x, the weights and the intermediate (bf16 or f16).
// claims: run both GEMMs with work counters (GroupedGemmArgs::work_counter,
// poisoned, then zeroed by align, or by a memset in dense mode) and return their
// final values (the work items each GEMM's CTAs claimed), then the number of
// m tiles (each expert's rows in tiles of the tile's block_m).
void check_tile(cuda::GemmTile tile, int64_t T, int64_t E, int64_t k, int64_t H, int64_t I,
                Activation act, bool bias, bool dense, std::mt19937_64& rng,
                DType dt = DType::kBF16, cuda::W13Layout layout = cuda::W13Layout::kStandard,
                std::vector<int32_t>* claims = nullptr) {
  SCOPED_TRACE(std::string(cuda::gemm_tile_name(tile)) + " T " + std::to_string(T) + " E " +
               std::to_string(E) + " k " + std::to_string(k) + " H " + std::to_string(H) + " I " +
               std::to_string(I) + (dense ? " dense" : " routed") + " " + dtype_name(dt) +
               layout_name(layout));
  if (dense) {
    E = 1;
    k = 1;
  }
  const ExpertWeights w = test::random_experts(rng, E, H, I, dt, bias);
  const Tensor x = dt == DType::kF16 ? test::to_f16(test::randn_f32(rng, {T, H}))
                                     : test::to_bf16(test::randn_f32(rng, {T, H}));
  Tensor ids_h = Tensor::empty(DType::kI32, {T, k});
  Tensor wt_h = test::random_f32(rng, {T, k}, 0.1f, 1.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)  // distinct per token, some -1
      ids_h.data_as<int32_t>()[t * k + j] =
          dense ? 0 : (rng() % 13 == 0 ? -1 : static_cast<int32_t>((t + j * 7 + rng() % 3) % E));
  const int64_t slots = T * k;
  const int bm = cuda::gemm_tile_block_m(tile);
  const int64_t padded = std::max<int64_t>(cuda::max_padded_rows(slots, E, bm), T);

  DeviceTensor xd = DeviceTensor::from_host(x), w13 = device_w13(w, layout),
               w2 = DeviceTensor::from_host(w.w2), ids = DeviceTensor::from_host(ids_h),
               wt = DeviceTensor::from_host(wt_h);
  DeviceTensor b13, b2;
  if (bias) {
    b13 = DeviceTensor::from_host(to_f32(*w.w13_bias));
    b2 = DeviceTensor::from_host(to_f32(*w.w2_bias));
  }
  DeviceTensor offsets(DType::kI64, {E + 1}), sorted(DType::kI32, {padded}),
      counts(DType::kI32, {E}), cursor(DType::kI32, {E});
  DeviceTensor inter(dt, {padded, I}), y(DType::kF32, {std::max<int64_t>(slots, 1), H});
  y.poison();
  DeviceTensor counters(DType::kI32, {2});
  counters.poison();
  if (claims && dense) ASSERT_EQ(cudaMemset(counters.data(), 0, 8), cudaSuccess);
  if (!dense) {
    cuda::AlignArgs al;
    al.topk_ids = ids.data_as<int32_t>();
    al.num_slots = slots;
    al.num_experts = E;
    al.block_m = bm;
    al.expert_offsets = offsets.data_as<int64_t>();
    al.sorted_slot = sorted.data_as<int32_t>();
    al.expert_counts = counts.data_as<int32_t>();
    al.expert_cursor = cursor.data_as<int32_t>();
    if (claims) {
      al.zero_words = counters.data_as<int32_t>();
      al.num_zero_words = 2;
    }
    cuda::align(al, nullptr);
  }
  cuda::GroupedGemmArgs g;
  g.epilogue = cuda::GemmEpilogue::kGlu;
  g.tile = tile;
  g.dtype = dt;
  g.a = xd.data_as<uint16_t>();
  g.lda = H;
  g.gather = !dense;
  g.a_div = static_cast<int>(k);
  g.sorted_slot = dense ? nullptr : sorted.data_as<int32_t>();
  g.expert_offsets = dense ? nullptr : offsets.data_as<int64_t>();
  g.num_experts = E;
  g.m = slots;
  g.w = w13.data_as<uint16_t>();
  g.n = 2 * I;
  g.k = H;
  g.bias = bias ? b13.data_as<float>() : nullptr;
  g.act.activation = act;
  g.w13_layout = layout;
  g.out = inter.data();
  g.ldc = I;
  g.work_counter = claims ? counters.data_as<int32_t>() : nullptr;
  cuda::grouped_gemm(g, nullptr);
  if (!dense) {
    // The w2 GEMM reads its own rows (no gather) with their padding rows as they
    // are (GroupedGemmArgs): NaN there must reach no slot's output.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Tensor sh = sorted.to_host();
    const uint16_t nan_bits = dt == DType::kF16 ? 0x7e00 : 0x7fc0;
    const std::vector<uint16_t> nan_row(I, nan_bits);
    for (int64_t r = 0; r < padded; ++r)
      if (sh.data_as<int32_t>()[r] < 0)
        ASSERT_EQ(cudaMemcpy(inter.data_as<uint16_t>() + r * I, nan_row.data(), I * 2,
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
  }
  cuda::GroupedGemmArgs g2 = g;
  g2.epilogue = cuda::GemmEpilogue::kScatter;
  g2.a = inter.data_as<uint16_t>();
  g2.lda = I;
  g2.gather = false;
  g2.w = w2.data_as<uint16_t>();
  g2.n = H;
  g2.k = I;
  g2.bias = bias ? b2.data_as<float>() : nullptr;
  g2.row_scale = dense ? nullptr : wt.data_as<float>();
  g2.out = y.data();
  g2.ldc = H;
  g2.work_counter = claims ? counters.data_as<int32_t>() + 1 : nullptr;
  cuda::grouped_gemm(g2, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor yh = y.to_host();
  if (claims) {
    const Tensor c = counters.to_host();
    claims->assign(c.data_as<int32_t>(), c.data_as<int32_t>() + 2);
    int64_t m_tiles = (T + bm - 1) / bm;
    if (!dense) {
      std::vector<int64_t> rows(E, 0);
      for (int64_t s = 0; s < slots; ++s)
        if (ids_h.data_as<int32_t>()[s] >= 0) ++rows[ids_h.data_as<int32_t>()[s]];
      m_tiles = 0;
      for (int64_t r : rows) m_tiles += (r + bm - 1) / bm;
    }
    claims->push_back(static_cast<int32_t>(m_tiles));
  }

  // float64 per slot: scale * (w2 . act(w13 . x + b13) + b2).
  const std::vector<double> rows = slot_reference(x, w, ids_h, k, act, bias);
  double num = 0, den = 0;
  for (int64_t s = 0; s < slots; ++s) {
    if (ids_h.data_as<int32_t>()[s] < 0) continue;
    const double scale = dense ? 1.0 : wt_h.data_as<float>()[s];
    for (int64_t n = 0; n < H; ++n) {
      const double want = scale * rows[s * H + n], got = yh.data_as<float>()[s * H + n];
      ASSERT_TRUE(std::isfinite(got)) << "slot " << s << " col " << n << " not written";
      num += (got - want) * (got - want);
      den += want * want;
    }
  }
  if (den > 0) EXPECT_LE(std::sqrt(num / den), 1e-2);
}

TEST(CudaGroupedGemm, EveryTileEveryMode) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int ti = 0; ti < cuda::kNumGemmTiles; ++ti) {
    const auto tile = static_cast<cuda::GemmTile>(ti);
    check_tile(tile, 37, 5, 2, 96, 80, Activation::kSiluGlu, false, false, rng);
    check_tile(tile, 300, 4, 3, 136, 200, Activation::kSwigluOai, true, false, rng);
    check_tile(tile, 9, 60, 6, 264, 24, Activation::kGeluGlu, false, false, rng);
    check_tile(tile, 77, 1, 1, 200, 136, Activation::kGeluTanhGlu, false, true, rng);
    check_tile(tile, 1, 1, 1, 64, 264, Activation::kSiluGlu, true, true, rng);
    // The GEMV's 2-row variant (T = M / top_k <= 2), K off the 256-column step of its
    // unrolled loads, repeated ids (T = 2, k = 4 > E = 2: experts with more rows than
    // the variant takes at once), and dense 2 rows.
    check_tile(tile, 2, 16, 8, 136, 264, Activation::kSiluGlu, true, false, rng);
    check_tile(tile, 1, 16, 8, 264, 96, Activation::kSwigluOai, false, false, rng);
    check_tile(tile, 2, 2, 4, 200, 136, Activation::kSiluGlu, true, false, rng);
    check_tile(tile, 2, 1, 1, 520, 40, Activation::kGeluGlu, true, true, rng);
    // Many work items a CTA (the loads run ahead across items; w13's K = 72 is
    // 2 k tiles, fewer than the pipeline's stages: loads several items ahead),
    // and E + 1 beyond the expert_offsets kept in shared memory (global search).
    check_tile(tile, 6000, 4, 2, 72, 520, Activation::kSiluGlu, false, false, rng);
    check_tile(tile, 64, 600, 8, 72, 48, Activation::kSiluGlu, true, false, rng);
    // w13 in W13Layout::kInterleaved128 (I a multiple of 128; several blocks, N tiles
    // across block boundaries), routed and dense, with and without biases.
    const auto il = cuda::W13Layout::kInterleaved128;
    check_tile(tile, 37, 5, 2, 96, 384, Activation::kSwigluOai, true, false, rng, DType::kBF16, il);
    check_tile(tile, 2, 16, 8, 136, 256, Activation::kSiluGlu, false, false, rng, DType::kBF16, il);
    check_tile(tile, 1, 16, 8, 264, 128, Activation::kGeluGlu, true, false, rng, DType::kBF16, il);
    check_tile(tile, 77, 1, 1, 200, 256, Activation::kSiluGlu, true, true, rng, DType::kBF16, il);
    if (HasFailure()) return;
  }
}

// Work items claimed from a counter (GroupedGemmArgs::work_counter), where the
// K steps cover the pipeline (K >= (stages + 1) x the tile's K depth): every
// output written and right, and each GEMM's counter ends at its number of work
// items (expert tiles x n tiles: each claimed once; the CTAs' first items are
// blockIdx.x and each CTA's last claim is past the end). Short K falls back to
// the static order (counter left at 0). Routed (align zeroes the counters) and
// dense (a memset).
TEST(CudaGroupedGemm, DynamicScheduleClaimsEveryItemOnce) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Tile {
    cuda::GemmTile tile;
    int64_t bn, bk_stages;  // columns, K depth x (its largest stage count + 1)
  };
  const Tile tiles[] = {{cuda::GemmTile::kM16N64, 64, 128 * 5},
                        {cuda::GemmTile::kM64N128, 128, 64 * 5},
                        {cuda::GemmTile::kM128N128, 128, 64 * 5},
                        {cuda::GemmTile::kM128N256, 256, 64 * 5}};
  for (const Tile& t : tiles) {
    for (const bool dense : {false, true}) {
      const int64_t T = dense ? 3000 : 700, E = dense ? 1 : 8, k = dense ? 1 : 2;
      const int64_t H = t.bk_stages + 40, I = t.bk_stages + 24;  // K of w13 / w2
      std::vector<int32_t> claims;
      check_tile(t.tile, T, E, k, H, I, Activation::kSiluGlu, true, dense, rng, DType::kBF16,
                 cuda::W13Layout::kStandard, &claims);
      if (HasFailure()) return;
      ASSERT_EQ(claims.size(), 3u);
      const int64_t m_tiles = claims[2];
      const int64_t n13 = (I + t.bn / 2 - 1) / (t.bn / 2), n2 = (H + t.bn - 1) / t.bn;
      SCOPED_TRACE("m tiles " + std::to_string(m_tiles));
      EXPECT_EQ(claims[0], m_tiles * n13) << "w13's work items";
      EXPECT_EQ(claims[1], m_tiles * n2) << "w2's work items";
    }
  }
  // Short K (fewer K steps than the pipeline needs): the static order, the
  // counter untouched after align zeroed it.
  std::vector<int32_t> claims;
  check_tile(cuda::GemmTile::kM16N64, 300, 4, 2, 136, 200, Activation::kSiluGlu, false, false, rng,
             DType::kBF16, cuda::W13Layout::kStandard, &claims);
  ASSERT_EQ(claims.size(), 3u);
  EXPECT_EQ(claims[0], 0);
  EXPECT_EQ(claims[1], 0);
}

// The m16n64 weight stream's bytes in flight scale with the CTAs an SM holds:
// with 3 K stages that is 3 (the shared memory's limit), GLU epilogue or not.
// Session 28's dynamic schedule had raised the GLU kernel to 193 registers, two
// CTAs an SM, unnoticed; __launch_bounds__ now asks for three (H200, Qwen3-30B-A3B
// T = 64: 312 -> 293 us with the slimmer load issue; bench/results/2026-12-02-session29.md).
TEST(CudaGroupedGemm, M16n64KernelsHoldAsManyCtasAsTheirSharedMemoryAllows) {
  FUSEDMOE_REQUIRE_CUDA();
  for (const DType dtype : {DType::kBF16, DType::kF16})
    for (const bool glu : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (glu ? " GLU" : " scatter"));
      EXPECT_EQ(cuda::gemm::m16n64_ctas_per_sm(3, glu, dtype), 3);
      EXPECT_EQ(cuda::gemm::m16n64_ctas_per_sm(4, glu, dtype), 2);
    }
  EXPECT_THROW(cuda::gemm::m16n64_ctas_per_sm(5, true, DType::kBF16), Error);
}

// a and w must be 16-byte aligned (cp.async's and the TMA's 16-byte pieces):
// refused on the host, naming the argument, before anything reaches a device
// (so this runs without one: the pointers are never read).
TEST(CudaGroupedGemm, RejectsMisalignedPointers) {
  alignas(16) static uint16_t buf[64];
  cuda::GroupedGemmArgs a;
  a.epilogue = cuda::GemmEpilogue::kScatter;
  a.a = buf;
  a.lda = 8;
  a.w = buf;
  a.n = 8;
  a.k = 8;
  a.m = 1;
  a.ldc = 8;
  a.out = buf;
  auto message = [&] {
    try {
      cuda::grouped_gemm(a, nullptr);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  a.w = buf + 1;
  EXPECT_NE(message().find("grouped_gemm: w must be 16-byte aligned"), std::string::npos)
      << message();
  a.w = buf;
  a.a = buf + 4;
  EXPECT_NE(message().find("grouped_gemm: a must be 16-byte aligned"), std::string::npos)
      << message();
}

// The f16 instantiation of every tile (mma.sync .f16, the GEMV's f16 loads).
TEST(CudaGroupedGemm, EveryTileF16) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int ti = 0; ti < cuda::kNumGemmTiles; ++ti) {
    const auto tile = static_cast<cuda::GemmTile>(ti);
    check_tile(tile, 37, 5, 2, 96, 80, Activation::kSiluGlu, false, false, rng, DType::kF16);
    check_tile(tile, 300, 4, 3, 136, 200, Activation::kSwigluOai, true, false, rng, DType::kF16);
    check_tile(tile, 77, 1, 1, 200, 136, Activation::kGeluTanhGlu, false, true, rng, DType::kF16);
    check_tile(tile, 300, 4, 3, 136, 256, Activation::kSwigluOai, true, false, rng, DType::kF16,
               cuda::W13Layout::kInterleaved128);
    if (HasFailure()) return;
  }
}

// sm90_experts (CUTLASS wgmma + TMA grouped GEMMs over expert-sorted rows) and
// finalize's expert-sorted mode against float64: per token
// sum_j w_j * (w2 . act(w13 . x + b13) + b2), -1 ids, experts with no rows,
// H and I not multiples of the 128 x 256 tile; a second run bit-identical.
void check_sm90(int64_t T, int64_t E, int64_t k, int64_t H, int64_t I, Activation act, bool bias,
                std::mt19937_64& rng, DType dt = DType::kBF16,
                cuda::W13Layout layout = cuda::W13Layout::kStandard, int block_m = 1) {
  SCOPED_TRACE("sm90 T " + std::to_string(T) + " E " + std::to_string(E) + " k " +
               std::to_string(k) + " H " + std::to_string(H) + " I " + std::to_string(I) + " " +
               dtype_name(dt) + layout_name(layout) + " block_m " + std::to_string(block_m));
  const ExpertWeights w = test::random_experts(rng, E, H, I, dt, bias);
  const Tensor x = dt == DType::kF16 ? test::to_f16(test::randn_f32(rng, {T, H}))
                                     : test::to_bf16(test::randn_f32(rng, {T, H}));
  Tensor ids_h = Tensor::empty(DType::kI32, {T, k});
  Tensor wt_h = test::random_f32(rng, {T, k}, 0.1f, 1.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)  // distinct per token, some -1, odd experts of E > 4 empty
      ids_h.data_as<int32_t>()[t * k + j] =
          rng() % 11 == 0
              ? -1
              : static_cast<int32_t>(E > 4 ? ((t + j) * 2) % (E & ~int64_t{1}) : (t + j) % E);
  const int64_t slots = T * k;
  DeviceTensor xd = DeviceTensor::from_host(x), w13 = device_w13(w, layout),
               w2 = DeviceTensor::from_host(w.w2), ids = DeviceTensor::from_host(ids_h),
               wt = DeviceTensor::from_host(wt_h);
  DeviceTensor b13, b2;
  if (bias) {
    b13 = DeviceTensor::from_host(to_f32(*w.w13_bias));
    b2 = DeviceTensor::from_host(to_f32(*w.w2_bias));
  }
  // block_m 64 (the contiguous GEMMs): each expert's rows padded to 64, the
  // buffers as Sm90ExpertsArgs asks (y_rows: bf16 padded rows or f32 slot rows).
  const int64_t padded = cuda::max_padded_rows(slots, E, block_m);
  DeviceTensor offsets(DType::kI64, {E + 1}), sorted(DType::kI32, {padded}),
      counts(DType::kI32, {E}), cursor(DType::kI32, {E});
  DeviceTensor inter(dt, {padded, I}), y(DType::kF32, {std::max(slots, (padded + 1) / 2), H}),
      slot_row(DType::kI32, {slots}), out(DType::kF32, {T, H});
  const size_t ws_bytes = cuda::sm90_experts_workspace_bytes(slots, E, I);
  DeviceTensor ws(DType::kU8, {static_cast<int64_t>(ws_bytes)});
  inter.poison();
  y.poison();
  ws.poison();

  cuda::AlignArgs al;
  al.topk_ids = ids.data_as<int32_t>();
  al.num_slots = slots;
  al.num_experts = E;
  al.block_m = block_m;
  al.expert_offsets = offsets.data_as<int64_t>();
  al.sorted_slot = sorted.data_as<int32_t>();
  al.slot_row = slot_row.data_as<int32_t>();
  al.expert_counts = counts.data_as<int32_t>();
  al.expert_cursor = cursor.data_as<int32_t>();
  cuda::Sm90ExpertsArgs a;
  a.dtype = dt;
  a.x = xd.data_as<uint16_t>();
  a.ldx = H;
  a.topk_ids = ids.data_as<int32_t>();
  a.sorted_slot = sorted.data_as<int32_t>();
  a.expert_offsets = offsets.data_as<int64_t>();
  a.num_tokens = T;
  a.top_k = k;
  a.num_experts = E;
  a.hidden = H;
  a.inter = I;
  a.w13 = w13.data_as<uint16_t>();
  a.w13_layout = layout;
  a.w13_bias = bias ? b13.data_as<float>() : nullptr;
  a.w2 = w2.data_as<uint16_t>();
  a.act.activation = act;
  a.inter_rows = inter.data_as<uint16_t>();
  a.y_rows = y.data_as<float>();
  a.slot_row = slot_row.data_as<int32_t>();
  a.block_m = block_m;
  a.workspace = ws.data();
  a.workspace_bytes = ws_bytes;
  cuda::FinalizeArgs f;
  f.y = y.data_as<float>();
  f.topk_ids = ids.data_as<int32_t>();
  f.num_tokens = T;
  f.top_k = k;
  f.hidden = H;
  f.out = out.data();
  f.out_dtype = DType::kF32;
  f.ldo = H;
  f.y_dtype = dt == DType::kBF16 ? DType::kBF16 : DType::kF32;  // sm90_experts' y rows
  f.slot_row = slot_row.data_as<int32_t>();
  f.row_scale = wt.data_as<float>();
  f.bias = bias ? b2.data_as<float>() : nullptr;
  Tensor first;
  for (int run = 0; run < 2; ++run) {
    out.poison();
    cuda::align(al, nullptr);
    cuda::sm90_experts(a, nullptr);
    cuda::finalize(f, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (run == 0) {
      first = out.to_host();
    } else {
      const Tensor again = out.to_host();
      EXPECT_EQ(std::memcmp(first.data(), again.data(), first.nbytes()), 0)
          << "second run not bit-identical";
    }
  }

  const std::vector<double> rows = slot_reference(x, w, ids_h, k, act, bias);
  std::vector<double> ref(T * H, 0.0);
  for (int64_t s = 0; s < slots; ++s) {
    if (ids_h.data_as<int32_t>()[s] < 0) continue;
    const double scale = wt_h.data_as<float>()[s];
    for (int64_t n = 0; n < H; ++n) ref[(s / k) * H + n] += scale * rows[s * H + n];
  }
  double num = 0, den = 0;
  for (int64_t i = 0; i < T * H; ++i) {
    const double got = first.data_as<float>()[i];
    ASSERT_TRUE(std::isfinite(got)) << "output " << i << " not written";
    num += (got - ref[i]) * (got - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den > 0) EXPECT_LE(std::sqrt(num / den), 1e-2);
}

TEST(CudaSm90Experts, MatchesFloat64) {
  FUSEDMOE_REQUIRE_CUDA();
  if (!cuda::sm90_experts_available()) GTEST_SKIP() << "skipped: no sm_90 device or no CUTLASS";
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // bf16 has several tile configurations (pick_sm90_tile): each on every case.
  // T = 37, 9 and 1 give every expert one m tile, so their GEMMs load with the
  // L2 hints (sm90_l2_hints_pay); T = 300 and 700 without.
  for (const char* tile : {"m64", "m128"}) {
    SCOPED_TRACE(std::string("FUSEDMOE_CUDA_SM90_TILE=") + tile);
    setenv("FUSEDMOE_CUDA_SM90_TILE", tile, 1);
    check_sm90(37, 5, 2, 96, 80, Activation::kSiluGlu, false, rng);
    check_sm90(300, 4, 3, 136, 200, Activation::kSwigluOai, true, rng);
    check_sm90(9, 60, 6, 264, 24, Activation::kGeluGlu, false, rng);
    check_sm90(1, 8, 1, 64, 40, Activation::kGeluTanhGlu, true, rng);
    check_sm90(700, 8, 2, 328, 296, Activation::kSiluGlu, true, rng);  // > 1 M tile, > 1 N tile
    // The activation in the w13 epilogue (W13Layout::kInterleaved128): -1 ids, empty
    // experts, several M and N tiles (rows not a multiple of the tile), biases.
    const auto il = cuda::W13Layout::kInterleaved128;
    check_sm90(37, 5, 2, 96, 128, Activation::kSiluGlu, false, rng, DType::kBF16, il);
    check_sm90(300, 4, 3, 136, 256, Activation::kSwigluOai, true, rng, DType::kBF16, il);
    check_sm90(9, 60, 6, 264, 384, Activation::kGeluGlu, false, rng, DType::kBF16, il);
    check_sm90(700, 8, 2, 328, 384, Activation::kGeluTanhGlu, true, rng, DType::kBF16, il);
  }
  unsetenv("FUSEDMOE_CUDA_SM90_TILE");
}

// The contiguous GEMMs (block_m 64: one TMA descriptor per operand, the expert
// of each 64-row tile from a table): -1 ids, empty experts, N and K not multiples
// of the 256 x 64 tile (B's tiles run past an expert's rows, which TMA fills with
// zeros, not the next expert's), several m tiles an expert, both w13 layouts.
TEST(CudaSm90Experts, ContiguousMatchesFloat64) {
  FUSEDMOE_REQUIRE_CUDA();
  if (!cuda::sm90_experts_available()) GTEST_SKIP() << "skipped: no sm_90 device or no CUTLASS";
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const auto st = cuda::W13Layout::kStandard, il = cuda::W13Layout::kInterleaved128;
  const DType bf = DType::kBF16;
  check_sm90(37, 5, 2, 96, 80, Activation::kSiluGlu, false, rng, bf, st, 64);
  check_sm90(300, 4, 3, 136, 200, Activation::kSwigluOai, true, rng, bf, st, 64);
  check_sm90(9, 60, 6, 264, 24, Activation::kGeluGlu, false, rng, bf, st, 64);
  check_sm90(1, 8, 1, 64, 40, Activation::kGeluTanhGlu, true, rng, bf, st, 64);
  check_sm90(700, 8, 2, 328, 296, Activation::kSiluGlu, true, rng, bf, st, 64);
  check_sm90(37, 5, 2, 96, 128, Activation::kSiluGlu, false, rng, bf, il, 64);
  check_sm90(300, 4, 3, 136, 256, Activation::kSwigluOai, true, rng, bf, il, 64);
  check_sm90(9, 60, 6, 264, 384, Activation::kGeluGlu, false, rng, bf, il, 64);
  check_sm90(700, 8, 2, 328, 384, Activation::kGeluTanhGlu, true, rng, bf, il, 64);
  check_sm90(1000, 128, 8, 512, 256, Activation::kSiluGlu, false, rng, bf, il, 64);
}

// The f16 CUTLASS instances and the f16 activation kernel.
TEST(CudaSm90Experts, MatchesFloat64F16) {
  FUSEDMOE_REQUIRE_CUDA();
  if (!cuda::sm90_experts_available()) GTEST_SKIP() << "skipped: no sm_90 device or no CUTLASS";
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  check_sm90(300, 4, 3, 136, 200, Activation::kSwigluOai, true, rng, DType::kF16);
  check_sm90(700, 8, 2, 328, 296, Activation::kSiluGlu, true, rng, DType::kF16);
  check_sm90(700, 8, 2, 328, 256, Activation::kSwigluOai, true, rng, DType::kF16,
             cuda::W13Layout::kInterleaved128);
}

TEST(CudaSm90Experts, RejectsBadArguments) {
  FUSEDMOE_REQUIRE_CUDA();
  if (!cuda::sm90_experts_available()) GTEST_SKIP() << "skipped: no sm_90 device or no CUTLASS";
  DeviceTensor buf(DType::kU8, {1 << 20});
  cuda::Sm90ExpertsArgs a;
  a.x = a.w13 = a.w2 = a.inter_rows = buf.data_as<uint16_t>();
  a.topk_ids = a.sorted_slot = a.slot_row = buf.data_as<int32_t>();
  a.expert_offsets = buf.data_as<int64_t>();
  a.y_rows = buf.data_as<float>();
  a.workspace = buf.data();
  a.num_tokens = 4;
  a.top_k = 2;
  a.num_experts = 4;
  a.hidden = 64;
  a.inter = 36;  // not a multiple of 8
  a.ldx = 64;
  a.workspace_bytes = 1 << 20;
  EXPECT_THROW(cuda::sm90_experts(a, nullptr), Error);
  a.inter = 32;
  a.workspace_bytes = 16;  // too small
  EXPECT_THROW(cuda::sm90_experts(a, nullptr), Error);
  a.workspace_bytes = 1 << 20;
  a.w13_layout = cuda::W13Layout::kInterleaved128;  // I = 32: not a multiple of 128
  try {
    cuda::sm90_experts(a, nullptr);
    ADD_FAILURE() << "kInterleaved128 with I = 32 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kInterleaved128"), std::string::npos) << e.what();
  }
  a.w13_layout = cuda::W13Layout::kStandard;
  for (const int bm : {16, 128}) {  // block_m: 1, or 64 (bf16)
    a.block_m = bm;
    EXPECT_THROW(cuda::sm90_experts(a, nullptr), Error) << "block_m " << bm;
  }
  a.block_m = 64;
  a.dtype = DType::kF16;  // the contiguous GEMMs are bf16
  try {
    cuda::sm90_experts(a, nullptr);
    ADD_FAILURE() << "block_m 64 with f16 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("block_m"), std::string::npos) << e.what();
  }
  a.dtype = DType::kBF16;
  a.block_m = 1;

  cuda::FinalizeArgs f;
  f.y = buf.data();
  f.topk_ids = buf.data_as<int32_t>();
  f.num_tokens = 4;
  f.top_k = 2;
  f.hidden = 64;
  f.out = buf.data();
  f.ldo = 64;
  f.y_dtype = DType::kF16;
  f.slot_row = buf.data_as<int32_t>();
  EXPECT_THROW(cuda::finalize(f, nullptr), Error);
}

// finalize over bf16 rows by slot (the peer transport's bf16 combine rows: one
// row a (token, rank), ids = the dispatch's row positions): each value widened
// to f32, summed in slot order, invalid ids skipped.
TEST(CudaFinalize, Bf16RowsBySlot) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t T = 37, k = 3, H = 96;
  const Tensor y = test::to_bf16(test::randn_f32(rng, {T * k, H}));
  Tensor ids = Tensor::empty(DType::kI32, {T, k});
  std::uniform_int_distribution<int> pick(-1, 5);
  for (int64_t i = 0; i < T * k; ++i) ids.data_as<int32_t>()[i] = pick(rng);
  DeviceTensor yd = DeviceTensor::from_host(y), idd = DeviceTensor::from_host(ids);
  DeviceTensor out(DType::kF32, {T, H});
  out.poison();
  cuda::FinalizeArgs f;
  f.y = yd.data();
  f.y_dtype = DType::kBF16;
  f.topk_ids = idd.data_as<int32_t>();
  f.num_tokens = T;
  f.top_k = k;
  f.hidden = H;
  f.out = out.data();
  f.ldo = H;
  cuda::finalize(f, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor got = out.to_host();
  const Tensor yf = to_f32(y);
  int64_t wrong = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float want = 0.0f;
      for (int64_t j = 0; j < k; ++j)
        if (ids.data_as<int32_t>()[t * k + j] >= 0)
          want += yf.data_as<float>()[(t * k + j) * H + h];
      wrong += got.data_as<float>()[t * H + h] != want;
    }
  EXPECT_EQ(wrong, 0) << "of " << T * H << " outputs differ from the slot-order f32 sum";
}

}  // namespace
}  // namespace fusedmoe
