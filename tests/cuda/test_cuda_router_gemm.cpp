// The router GEMM's tensor-core path (bf16 x and bf16 gate, T > 32) against
// float64 on the same bf16 inputs: T not a multiple of the tile, an odd number
// of logits, strided x and logits, the gate bias, both tiles it picks; the
// routing that follows against the CPU router (ids equal wherever the
// selection is not a near-tie); and the shared expert's sm_90a path
// (sm90_dense_expert) against float64 and the mma.sync path.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "reference_moe.h"

namespace fusedmoe {
namespace {

using test::DeviceTensor;

// x bf16 [T, H] (row stride ldx), gate bf16 [L, H], bias f32 [L] or none,
// logits f32 [T, L] with row stride ldl: against float64 of the same values.
void check_router_gemm(int64_t T, int64_t H, int64_t L, int64_t ldx, int64_t ldl, bool bias,
                       std::mt19937_64& rng) {
  SCOPED_TRACE("T " + std::to_string(T) + " H " + std::to_string(H) + " L " + std::to_string(L) +
               " ldx " + std::to_string(ldx) + " ldl " + std::to_string(ldl) +
               (bias ? " bias" : ""));
  const Tensor x = test::to_bf16(test::randn_f32(rng, {T, H}));
  const Tensor w = test::to_bf16(
      test::random_f32(rng, {L, H}, -3.0f / std::sqrt(float(H)), 3.0f / std::sqrt(float(H))));
  const Tensor b = test::random_f32(rng, {L}, -0.5f, 0.5f);
  DeviceTensor xd = DeviceTensor::from_host(x, ldx), wd = DeviceTensor::from_host(w);
  DeviceTensor bd = DeviceTensor::from_host(b);
  DeviceTensor out(DType::kF32, {T, L}, ldl);
  out.poison();  // the columns past L of each row must stay NaN: nothing written there
  cuda::router_gemm(xd.data(), DType::kBF16, ldx, T, H, wd.data(), DType::kBF16, L,
                    bias ? bd.data_as<float>() : nullptr, out.data_as<float>(), ldl, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> got(static_cast<size_t>(T * ldl));
  ASSERT_EQ(cudaMemcpy(got.data(), out.data(), got.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);

  const Tensor xf = to_f32(x), wf = to_f32(w);
  double num = 0, den = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t l = 0; l < L; ++l) {
      double want = bias ? b.data_as<float>()[l] : 0.0;
      const float* xr = xf.data_as<float>() + t * H;
      const float* wr = wf.data_as<float>() + l * H;
      for (int64_t h = 0; h < H; ++h) want += static_cast<double>(xr[h]) * wr[h];
      const double g = got[t * ldl + l];
      ASSERT_TRUE(std::isfinite(g)) << "logit (" << t << ", " << l << ") not written";
      num += (g - want) * (g - want);
      den += want * want;
    }
    for (int64_t l = L; l < ldl; ++l)
      ASSERT_TRUE(std::isnan(got[t * ldl + l])) << "wrote past the row: (" << t << ", " << l << ")";
  }
  EXPECT_LE(std::sqrt(num / den), 1e-5) << "vs float64";
}

TEST(CudaRouterGemm, TensorCorePathMatchesFloat64) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Small tile (few work items): T not a multiple of 16 or 64, odd L, odd ldl.
  check_router_gemm(33, 64, 9, 72, 12, true, rng);
  check_router_gemm(300, 1032, 257, 1040, 261, true, rng);
  check_router_gemm(1000, 520, 8, 520, 8, false, rng);
  // Large tile (m64n128: many work items): T and L past the tile's edge.
  check_router_gemm(8200, 264, 257, 264, 259, true, rng);
  check_router_gemm(600, 7168, 256, 7168, 256, false, rng);  // DeepSeek-V3's gate, contiguous
}

// f32 activations or a misaligned bf16 row stride keep the CUDA-core path, with
// the same results up to f32 rounding.
TEST(CudaRouterGemm, OtherInputsKeepTheCudaCorePath) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t T = 200, H = 136, L = 33;
  const Tensor xb = test::to_bf16(test::randn_f32(rng, {T, H}));
  const Tensor w = test::to_bf16(test::random_f32(rng, {L, H}, -0.3f, 0.3f));
  const std::vector<double> xs = test::to_f64_vector(xb), ws = test::to_f64_vector(w);
  std::vector<double> want(static_cast<size_t>(T * L), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t h = 0; h < H; ++h) want[t * L + l] += xs[t * H + h] * ws[l * H + h];
  const TensorView wantv(want.data(), DType::kF64, {T, L});
  DeviceTensor wd = DeviceTensor::from_host(w);
  for (int variant = 0; variant < 2; ++variant) {
    SCOPED_TRACE(variant == 0 ? "f32 x" : "bf16 x, row stride 137");
    DeviceTensor xd =
        variant == 0 ? DeviceTensor::from_host(to_f32(xb)) : DeviceTensor::from_host(xb, 137);
    DeviceTensor out(DType::kF32, {T, L});
    out.poison();
    cuda::router_gemm(xd.data(), variant == 0 ? DType::kF32 : DType::kBF16, xd.ld(), T, H,
                      wd.data(), DType::kBF16, L, nullptr, out.data_as<float>(), L, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Tensor o = out.to_host();
    ASSERT_EQ(test::count_non_finite(o), 0);
    EXPECT_LE(test::rel_l2(o, wantv), 1e-5);
  }
  DeviceTensor xd = DeviceTensor::from_host(xb), out(DType::kF32, {T, L});
  EXPECT_THROW(cuda::router_gemm(xd.data(), DType::kBF16, H, T, H, wd.data(), DType::kBF16, L,
                                 nullptr, out.data_as<float>(), L - 1, nullptr),
               Error);  // ldl < L
}

// x_bf16: the router GEMM also writes x as bf16 (inside its kernel at T <= 32,
// by to_bf16_rows otherwise), bit for bit what to_bf16_rows writes, and the
// logits stay bit for bit those of the call without it.
TEST(CudaRouterGemm, AlsoWritesBf16Inputs) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t H = 200, L = 37;  // H not a multiple of the 256 threads of a block
  const Tensor w = test::to_bf16(test::random_f32(rng, {L, H}, -0.3f, 0.3f));
  DeviceTensor wd = DeviceTensor::from_host(w);
  for (const int64_t T : {int64_t{1}, int64_t{9}, int64_t{32}, int64_t{33}, int64_t{70}}) {
    for (const DType xt : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE("T " + std::to_string(T) + (xt == DType::kF32 ? " f32 x" : " bf16 x"));
      const Tensor x32 = test::randn_f32(rng, {T, H});
      DeviceTensor xd = xt == DType::kF32 ? DeviceTensor::from_host(x32, H + 8)
                                          : DeviceTensor::from_host(test::to_bf16(x32), H + 8);
      DeviceTensor want_xb(DType::kBF16, {T, H}), got_xb(DType::kBF16, {T, H});
      DeviceTensor want_l(DType::kF32, {T, L}), got_l(DType::kF32, {T, L});
      want_xb.poison();
      got_xb.poison();
      want_l.poison();
      got_l.poison();
      cuda::to_bf16_rows(xd.data(), xt, xd.ld(), T, H, nullptr, 0, want_xb.data_as<uint16_t>(),
                         nullptr);
      cuda::router_gemm(xd.data(), xt, xd.ld(), T, H, wd.data(), DType::kBF16, L, nullptr,
                        want_l.data_as<float>(), L, nullptr);
      cuda::router_gemm(xd.data(), xt, xd.ld(), T, H, wd.data(), DType::kBF16, L, nullptr,
                        got_l.data_as<float>(), L, nullptr, got_xb.data_as<uint16_t>());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const Tensor a = want_xb.to_host(), b = got_xb.to_host();
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << "x_bf16 differs";
      const Tensor la = want_l.to_host(), lb = got_l.to_host();
      ASSERT_EQ(test::count_non_finite(lb), 0);
      EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.nbytes()), 0) << "logits differ";
    }
  }
}

// The smallest gap, in float64 selection scores, between a choice the router
// made and the best one it did not make; the ids of a token with a larger gap
// than the logits' error cannot depend on f32 rounding. Plain top-k: the k-th
// and (k+1)-th score; grouped top-k also the topk_group-th and next group.
double decision_margin(const MoEConfig& c, const MoELayerWeights& lw, const double* logits) {
  const int64_t E = c.num_experts, k = c.top_k;
  std::vector<double> s(logits, logits + c.num_router_logits());
  const bool grouped = c.routing_method == RoutingMethod::kGroupedTopK;
  if (grouped) {
    const float* bias = lw.router_params.e_score_correction_bias->data_as<const float>();
    for (int64_t e = 0; e < E; ++e) s[e] = 1.0 / (1.0 + std::exp(-s[e])) + bias[e];
  }  // else: scores = logits (softmax is monotonic; gpt-oss's gate bias is in the logits)
  std::vector<int64_t> cand(s.size());
  std::iota(cand.begin(), cand.end(), 0);
  double margin = INFINITY;
  if (grouped) {
    const int64_t G = c.num_expert_group, per = E / G;
    std::vector<double> gs(G);
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> v(s.begin() + g * per, s.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      gs[g] = v[0] + v[1];  // kSumTop2
    }
    std::vector<int64_t> order(G);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return gs[a] > gs[b]; });
    margin = gs[order[c.topk_group - 1]] - gs[order[c.topk_group]];
    cand.clear();
    for (int64_t i = 0; i < c.topk_group; ++i)
      for (int64_t e = order[i] * per; e < (order[i] + 1) * per; ++e) cand.push_back(e);
  }
  std::sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) { return s[a] > s[b]; });
  return std::min(margin, s[cand[k - 1]] - s[cand[k]]);
}

// Through MoERunner on both backends, bf16 activations (so the CUDA gate GEMM
// takes the tensor cores at T > 32): the CUDA ids equal the CPU router's for
// every token whose decision margin exceeds the logits' error bound.
TEST(CudaRouterGemm, RoutingIdsMatchCpuRouter) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  MoEConfig softmax = test::base_config(60, 6, 520, 32);
  softmax.renormalize = true;
  for (const auto& [name, c] : std::vector<std::pair<std::string, MoEConfig>>{
           {"softmax_topk", softmax},
           {"gpt_oss_router_bias", test::arch_config("gpt_oss", 33, 4, 264, 32)},
           {"deepseek_v3_grouped", test::arch_config("deepseek_v3", 64, 8, 1032, 32)}}) {
    SCOPED_TRACE(name);
    const int64_t T = 1000, H = c.hidden_size, k = c.top_k, L = c.num_router_logits();
    const MoELayerWeights lw = test::random_layer(rng, c, DType::kBF16);
    const Tensor xb = test::to_bf16(test::randn_f32(rng, {T, H}));
    const Tensor x = to_f32(xb);  // the same values on the CPU
    RunnerOptions co;
    co.compute_dtype = DType::kBF16;
    MoERunner cpu(c, lw, co);
    Tensor ids_c = Tensor::empty(DType::kI32, {T, k}), w_c = Tensor::empty(DType::kF32, {T, k});
    Tensor out_c = Tensor::empty(DType::kF32, {T, H});
    ForwardOutputs fc{TensorView(), ids_c, w_c};
    cpu.forward(x, out_c, nullptr, nullptr, &fc);

    RunnerOptions go = co;
    go.device = Device{DeviceType::kCUDA, 0};
    go.max_num_tokens = T;
    MoERunner gpu(c, lw, go);
    DeviceTensor xd = DeviceTensor::from_host(xb), out(DType::kBF16, {T, H});
    DeviceTensor lg(DType::kF32, {T, L}), ids(DType::kI32, {T, k}), wt(DType::kF32, {T, k});
    lg.poison();
    ids.poison();
    ForwardOutputs fg{lg, ids, wt};
    gpu.forward(xd, out, nullptr, nullptr, &fg);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    const std::vector<double> ref = test::reference_router_logits(c, lw, x);
    const Tensor lg_h = lg.to_host();
    const TensorView refv(const_cast<double*>(ref.data()), DType::kF64, {T, L});
    ASSERT_LE(test::rel_l2(lg_h, refv), 1e-5) << "gate GEMM logits vs float64";
    // Error bound of a logit (f32 sums of H exact products, on either backend),
    // taken generously: 1e-5 of the largest |logit|, far above the ~1e-7
    // relative error of an f32 sum of this length.
    double max_logit = 0;
    for (double v : ref) max_logit = std::max(max_logit, std::abs(v));
    const double tol = 1e-5 * max_logit;
    const Tensor ids_g = ids.to_host();
    int64_t decided = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (decision_margin(c, lw, ref.data() + t * L) <= tol) continue;  // a near-tie
      ++decided;
      std::vector<int32_t> a(ids_g.data_as<int32_t>() + t * k,
                             ids_g.data_as<int32_t>() + t * k + k);
      std::vector<int32_t> b(ids_c.data_as<int32_t>() + t * k,
                             ids_c.data_as<int32_t>() + t * k + k);
      std::sort(a.begin(), a.end());  // the order of equal-rank ids is the router's business
      std::sort(b.begin(), b.end());
      ASSERT_EQ(a, b) << "token " << t << ": CUDA ids differ from the CPU router's";
    }
    EXPECT_GE(decided, T * 95 / 100) << "too many near-ties for the test to mean anything";
  }
}

// sm90_dense_expert (the shared expert at many rows) against float64 and the
// mma.sync dense path, T not a multiple of the 128-row tile, 2I not a multiple
// of 256, with and without a w13 bias; a short workspace is refused.
TEST(CudaSm90DenseExpert, MatchesFloat64AndMmaPath) {
  FUSEDMOE_REQUIRE_CUDA();
  if (!cuda::sm90_experts_available()) GTEST_SKIP() << "skipped: no sm_90 device or no CUTLASS";
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t T, H, I;
    bool bias;
  };
  for (const Case& cs :
       {Case{1, 64, 40, false}, Case{300, 264, 136, true}, Case{1000, 1032, 264, false}}) {
    const int64_t T = cs.T, H = cs.H, I = cs.I;
    SCOPED_TRACE("T " + std::to_string(T) + " H " + std::to_string(H) + " I " + std::to_string(I));
    ExpertWeights w = test::random_experts(rng, 1, H, I, DType::kBF16, cs.bias);
    w.w2_bias.reset();  // the dense path adds no w2 bias (the shared expert has none)
    const Tensor xb = test::to_bf16(test::randn_f32(rng, {T, H}));
    DeviceTensor xd = DeviceTensor::from_host(xb), w13 = DeviceTensor::from_host(w.w13),
                 w2 = DeviceTensor::from_host(w.w2);
    DeviceTensor b13;
    if (cs.bias) b13 = DeviceTensor::from_host(to_f32(*w.w13_bias));
    DeviceTensor inter(DType::kBF16, {T, I}), out(DType::kF32, {T, H});
    DeviceTensor ws(DType::kU8,
                    {static_cast<int64_t>(cuda::sm90_dense_expert_workspace_bytes(T, I))});
    out.poison();
    cuda::Sm90DenseExpertArgs a;
    a.x = xd.data_as<uint16_t>();
    a.num_tokens = T;
    a.hidden = H;
    a.inter = I;
    a.w13 = w13.data_as<uint16_t>();
    a.w13_bias = cs.bias ? b13.data_as<float>() : nullptr;
    a.w2 = w2.data_as<uint16_t>();
    a.inter_rows = inter.data_as<uint16_t>();
    a.out = out.data_as<float>();
    a.workspace = ws.data();
    a.workspace_bytes = cuda::sm90_dense_expert_workspace_bytes(T, I);
    cuda::sm90_dense_expert(a, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Tensor got = out.to_host();
    ASSERT_EQ(test::count_non_finite(got), 0) << "unwritten rows";

    Tensor ids = Tensor::empty(DType::kI32, {T, 1}), ones = Tensor::empty(DType::kF32, {T, 1});
    for (int64_t t = 0; t < T; ++t) {
      ids.data_as<int32_t>()[t] = 0;
      ones.data_as<float>()[t] = 1.0f;
    }
    std::vector<double> ref =
        test::reference_experts(to_f32(xb), ids, ones, w, ActivationParams{}, false);
    EXPECT_LE(test::rel_l2(got, TensorView(ref.data(), DType::kF64, {T, H})), 1e-2) << "vs float64";

    // The mma.sync dense path on the same inputs.
    DeviceTensor out2(DType::kF32, {T, H}), inter2(DType::kBF16, {T, I});
    out2.poison();
    cuda::GroupedGemmArgs g;
    g.epilogue = cuda::GemmEpilogue::kGlu;
    g.tile = cuda::GemmTile::kM64N128;
    g.a = xd.data_as<uint16_t>();
    g.lda = H;
    g.m = T;
    g.w = w13.data_as<uint16_t>();
    g.n = 2 * I;
    g.k = H;
    g.bias = a.w13_bias;
    g.out = inter2.data();
    g.ldc = I;
    cuda::grouped_gemm(g, nullptr);
    cuda::GroupedGemmArgs g2;
    g2.epilogue = cuda::GemmEpilogue::kScatter;
    g2.tile = cuda::GemmTile::kM64N128;
    g2.a = inter2.data_as<uint16_t>();
    g2.lda = I;
    g2.m = T;
    g2.w = w2.data_as<uint16_t>();
    g2.n = H;
    g2.k = I;
    g2.out = out2.data();
    g2.ldc = H;
    cuda::grouped_gemm(g2, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LE(test::rel_l2(got, out2.to_host()), 1e-2) << "vs the mma.sync path";

    a.workspace_bytes -= 1;
    EXPECT_THROW(cuda::sm90_dense_expert(a, nullptr), Error);
  }
}

}  // namespace
}  // namespace fusedmoe
