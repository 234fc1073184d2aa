// CUDA routing kernels against the CPU routers (routing/router.h): ids equal,
// weights within 1e-6 relative, for every router variant over T, E, k grids,
// strided router_logits (rows 16-byte aligned and not: the float4 and scalar
// loads), poisoned outputs; random logits, and logits with exact ties (-0 and
// +0 included) and near ties (a few f32 ulps apart) where the lower expert id
// must win as on the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "fusedmoe/routing/router.h"
#include "routing/simulated_routing.h"

namespace fusedmoe {
namespace {

using test::DeviceTensor;

struct Variant {
  std::string name;
  MoEConfig (*make)(int64_t E, int64_t k);
};

MoEConfig plain(int64_t E, int64_t k) {
  return test::base_config(E, k, 8, 8);
}

std::vector<Variant> variants() {
  return {
      {"softmax", [](int64_t E, int64_t k) { return plain(E, k); }},
      {"softmax_renorm",
       [](int64_t E, int64_t k) {
         MoEConfig c = plain(E, k);
         c.renormalize = true;
         return c;
       }},
      {"sigmoid_renorm_scaled",
       [](int64_t E, int64_t k) {
         MoEConfig c = plain(E, k);
         c.scoring_func = ScoringFunc::kSigmoid;
         c.renormalize = true;
         c.routed_scaling_factor = 2.5f;
         return c;
       }},
      {"sqrtsoftplus",
       [](int64_t E, int64_t k) {
         MoEConfig c = plain(E, k);
         c.scoring_func = ScoringFunc::kSqrtSoftplus;
         return c;
       }},
      {"sigmoid_bias",
       [](int64_t E, int64_t k) {
         MoEConfig c = plain(E, k);
         c.scoring_func = ScoringFunc::kSigmoid;
         c.has_e_score_correction_bias = true;
         c.renormalize = true;
         return c;
       }},
      {"softmax_bias",
       [](int64_t E, int64_t k) {
         MoEConfig c = plain(E, k);
         c.has_e_score_correction_bias = true;
         c.renormalize = true;
         return c;
       }},
      {"topk_softmax",
       [](int64_t E, int64_t k) {
         MoEConfig c = plain(E, k);
         c.routing_method = RoutingMethod::kTopKSoftmax;
         c.routed_scaling_factor = 1.5f;
         return c;
       }},
      {"grouped_v3",
       [](int64_t E, int64_t k) {
         MoEConfig c = plain(E, k);
         c.routing_method = RoutingMethod::kGroupedTopK;
         c.scoring_func = ScoringFunc::kSigmoid;
         c.num_expert_group = E % 8 == 0 ? 8 : (E % 2 == 0 ? 2 : 1);
         c.topk_group = c.num_expert_group == 8 ? 4 : 1;
         if (k > c.topk_group * (E / c.num_expert_group)) c.topk_group = c.num_expert_group;
         c.group_score = GroupScore::kSumTop2;
         c.has_e_score_correction_bias = true;
         c.renormalize = true;
         c.routed_scaling_factor = 2.5f;
         return c;
       }},
      {"grouped_v2",
       [](int64_t E, int64_t k) {
         MoEConfig c = plain(E, k);
         c.routing_method = RoutingMethod::kGroupedTopK;
         c.num_expert_group = E % 4 == 0 ? 4 : 1;
         c.topk_group = c.num_expert_group == 4 ? 3 : 1;
         if (k > c.topk_group * (E / c.num_expert_group)) c.topk_group = c.num_expert_group;
         c.group_score = GroupScore::kMax;
         return c;
       }},
      {"sqrtsoftplus_bias",
       [](int64_t E, int64_t k) {
         MoEConfig c = plain(E, k);
         c.scoring_func = ScoringFunc::kSqrtSoftplus;
         c.has_e_score_correction_bias = true;
         c.renormalize = true;
         c.routed_scaling_factor = 1.5f;
         return c;
       }},
      {"grouped_sigmoid_max",
       [](int64_t E, int64_t k) {
         MoEConfig c = plain(E, k);
         c.routing_method = RoutingMethod::kGroupedTopK;
         c.scoring_func = ScoringFunc::kSigmoid;
         c.num_expert_group = E % 8 == 0 ? 8 : (E % 4 == 0 ? 4 : 1);
         c.topk_group = c.num_expert_group > 1 ? c.num_expert_group / 2 : 1;
         if (k > c.topk_group * (E / c.num_expert_group)) c.topk_group = c.num_expert_group;
         c.group_score = GroupScore::kMax;
         return c;
       }},
      {"llama4",
       [](int64_t E, int64_t k) {
         MoEConfig c = plain(E, k);
         c.routing_method = RoutingMethod::kLlama4;
         c.scoring_func = ScoringFunc::kSigmoid;
         return c;
       }},
      {"zero_experts",
       [](int64_t E, int64_t k) {
         MoEConfig c = plain(E, k);
         c.num_zero_experts = 3;
         c.renormalize = true;
         return c;
       }},
  };
}

const int64_t kTokens[] = {0, 1, 3, 17, 130, 1000, 4096};
const int64_t kExperts[] = {8, 10, 60, 128, 256};
const int64_t kTopK[] = {1, 2, 6, 8};

// Kinds of router logits: fresh uniform values, rows built to tie, or fresh
// values with 0, 1 or 2 +inf logits a row (and a -inf in every fourth).
enum class Logits { kRandom, kTies, kInfinite };

// Rows of kTies, in turn: (a) every logit from {-1, -0.5, -0, +0, 0.5, 1}
// (exact ties everywhere, -0 equal to +0); (b) one random base value, each logit
// a random -3..3 f32 ulps from it (near ties: the double scores still differ,
// the order must be exact); (c) random values repeating with period `period`
// (exact ties between columns c and c + period; for grouped configs a period of
// experts per group + 2 shifts the groups against each other).
Tensor tie_logits(std::mt19937_64& rng, int64_t T, int64_t L, int64_t period) {
  static const float kLevels[] = {-1.0f, -0.5f, -0.0f, 0.0f, 0.5f, 1.0f};
  Tensor h = Tensor::empty(DType::kF32, {T, L});
  float* p = h.data_as<float>();
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int64_t t = 0; t < T; ++t) {
    const float base = u(rng);
    for (int64_t c = 0; c < L; ++c) {
      float v;
      if (t % 3 == 0) {
        v = kLevels[rng() % 6];
      } else if (t % 3 == 1) {
        v = base;
        const int steps = static_cast<int>(rng() % 7) - 3;
        for (int s = 0; s < std::abs(steps); ++s)
          v = std::nextafter(v, steps > 0 ? INFINITY : -INFINITY);
      } else {
        v = c < period ? u(rng) : p[t * L + c - period];
      }
      p[t * L + c] = v;
    }
  }
  return h;
}

// aligned_rows: row stride = L rounded up to 4, plus 4 (16-byte aligned rows:
// float4 loads); else L + 5 (scalar loads).
void check_case(const MoEConfig& c, int64_t T, std::mt19937_64& rng, Logits kind = Logits::kRandom,
                bool aligned_rows = false) {
  const int64_t L = c.num_router_logits(), k = c.top_k;
  RouterParams params;
  if (c.has_e_score_correction_bias) {
    const int64_t n = c.routing_method == RoutingMethod::kGroupedTopK ? c.num_experts : L;
    if (kind == Logits::kTies) {  // period 2: equal (logit, bias) pairs tie exactly
      Tensor b = Tensor::empty(DType::kF32, {n});
      for (int64_t e = 0; e < n; ++e) b.data_as<float>()[e] = e % 2 ? 0.125f : 0.0f;
      params.e_score_correction_bias = b;
    } else {
      params.e_score_correction_bias = test::random_f32(rng, {n}, -0.2f, 0.2f);
    }
  }
  auto router = create_router(c, params);
  const int64_t ld = aligned_rows ? (L + 3) / 4 * 4 + 4 : L + 5;  // strided logits
  // Even periods keep the bias (period 2) of repeated logits equal too.
  const bool grouped = c.routing_method == RoutingMethod::kGroupedTopK;
  int64_t period = grouped ? c.num_experts / c.num_expert_group + 2 : std::max<int64_t>(2, L / 2);
  period += period % 2;
  Tensor logits_h = kind == Logits::kTies ? tie_logits(rng, T, L, period)
                                          : test::random_f32(rng, {T, L}, -4.0f, 4.0f);
  if (kind == Logits::kInfinite)
    for (int64_t t = 0; t < T; ++t) {
      float* row = logits_h.data_as<float>() + t * L;
      for (int64_t n = 0; n < t % 3; ++n) row[rng() % L] = INFINITY;
      if (t % 4 == 0) row[rng() % L] = -INFINITY;
    }
  Tensor ids_h = Tensor::empty(DType::kI32, {T, k});
  Tensor w_h = Tensor::empty(DType::kF32, {T, k});
  router->select_experts(logits_h, ids_h, w_h);

  DeviceTensor logits = DeviceTensor::from_host(logits_h, ld);
  DeviceTensor ids(DType::kI32, {T, k}), w(DType::kF32, {T, k});
  ids.poison();
  w.poison();
  DeviceTensor bias;
  if (params.e_score_correction_bias)
    bias = DeviceTensor::from_host(*params.e_score_correction_bias);
  cuda::RouteArgs a;
  a.router_logits = logits.data_as<float>();
  a.logits_ld = ld;
  a.bias = params.e_score_correction_bias ? bias.data_as<float>() : nullptr;
  a.topk_ids = ids.data_as<int32_t>();
  a.topk_weights = w.data_as<float>();
  cuda::route(c, a, T, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor ids_d = ids.to_host(), w_d = w.to_host();
  int bad = 0;
  for (int64_t i = 0; i < T * k && bad < 5; ++i) {
    const int32_t want = ids_h.data_as<int32_t>()[i], got = ids_d.data_as<int32_t>()[i];
    const float ww = w_h.data_as<float>()[i], wg = w_d.data_as<float>()[i];
    if (want != got || !(std::abs(ww - wg) <= 1e-6f * std::abs(ww) + 1e-30f) ||
        !std::isfinite(wg)) {
      ADD_FAILURE() << "token " << i / k << " slot " << i % k << ": id " << got << " (cpu " << want
                    << "), weight " << wg << " (cpu " << ww << ")";
      ++bad;
    }
  }
}

class CudaRouting : public ::testing::TestWithParam<int> {};

TEST_P(CudaRouting, MatchesCpuRouter) {
  FUSEDMOE_REQUIRE_CUDA();
  const Variant v = variants()[GetParam()];
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " variant " + v.name);
  std::mt19937_64 rng(seed);
  int i = 0;
  for (int64_t E : kExperts)
    for (int64_t k : kTopK) {
      if (k > E) continue;
      MoEConfig c = v.make(E, k);
      try {
        c.validate();
      } catch (const Error&) {
        continue;  // e.g. grouped shapes that cannot hold k
      }
      // Two token counts per (E, k), cycling through the list; every T is used.
      for (int64_t T : {kTokens[i % 7], kTokens[(i + 3) % 7]}) {
        SCOPED_TRACE("E " + std::to_string(E) + " k " + std::to_string(k) + " T " +
                     std::to_string(T));
        check_case(c, T, rng, Logits::kRandom, i % 2 == 0);
        if (HasFailure()) return;
      }
      ++i;
    }
}

// Exact and near ties: E in {8, 60, 128, 256}, k in {1, 2, 6, 8}, both row
// alignments; T = 4096 for E = 256, k = 8 (the DeepSeek-V3 / Qwen3 benchmark
// size), else 130.
TEST_P(CudaRouting, TiesMatchCpuRouter) {
  FUSEDMOE_REQUIRE_CUDA();
  const Variant v = variants()[GetParam()];
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " variant " + v.name);
  std::mt19937_64 rng(seed);
  int i = 0;
  for (int64_t E : {8, 60, 128, 256})
    for (int64_t k : {1, 2, 6, 8}) {
      MoEConfig c = v.make(E, k);
      try {
        c.validate();
      } catch (const Error&) {
        continue;
      }
      const int64_t T = E == 256 && k == 8 ? 4096 : 130;
      SCOPED_TRACE("E " + std::to_string(E) + " k " + std::to_string(k) + " T " +
                   std::to_string(T));
      check_case(c, T, rng, Logits::kTies, i++ % 2 == 1);
      if (HasFailure()) return;
    }
}

// +inf logits: the softmax limit for softmax, sigmoid's 1, and for a
// renormalized sqrtsoftplus (an infinite score) the infinite scores sharing 1
// (routing/scores.h's renormalized): the CPU's ids and weights, all finite.
TEST(CudaRouting, InfiniteLogitsTakeTheLimitAsTheCpuRouter) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<Variant> all = variants();
  int i = 0;
  for (const char* name : {"softmax", "softmax_renorm", "sigmoid_renorm_scaled", "sigmoid_bias",
                           "sqrtsoftplus_bias", "grouped_v3", "grouped_v2"}) {
    const Variant v = *std::find_if(all.begin(), all.end(),
                                    [&](const Variant& x) { return x.name == std::string(name); });
    for (const bool sqrt_softplus : {false, true}) {
      for (int64_t E : {8, 60, 256}) {
        MoEConfig c = v.make(E, 6);
        if (sqrt_softplus) {
          if (!c.renormalize) continue;  // an infinite score is an infinite weight then
          c.scoring_func = ScoringFunc::kSqrtSoftplus;
        }
        try {
          c.validate();
        } catch (const Error&) {
          continue;
        }
        SCOPED_TRACE(std::string(name) + (sqrt_softplus ? " sqrtsoftplus" : "") + " E " +
                     std::to_string(E));
        check_case(c, 130, rng, Logits::kInfinite, i++ % 2 == 0);
        if (HasFailure()) return;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllVariants, CudaRouting, ::testing::Range(0, 13),
                         [](const auto& p) { return variants()[p.param].name; });

TEST(CudaRouting, HashRouting) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  MoEConfig c = plain(60, 6);
  c.routing_method = RoutingMethod::kHash;
  c.hash_vocab_size = 97;
  c.num_zero_experts = 2;
  c.routed_scaling_factor = 1.25f;
  MoELayerWeights lw = test::random_layer(rng, c, DType::kF32);
  auto router = create_router(c, lw.router_params);
  const int64_t T = 1000, k = c.top_k;
  Tensor tok = Tensor::empty(DType::kI32, {T});
  for (int64_t t = 0; t < T; ++t) tok.data_as<int32_t>()[t] = static_cast<int32_t>(rng() % 97);
  Tensor ids_h = Tensor::empty(DType::kI32, {T, k}), w_h = Tensor::empty(DType::kF32, {T, k});
  TensorView tv = tok.view();
  router->select_experts(TensorView(), ids_h, w_h, &tv);
  DeviceTensor table = DeviceTensor::from_host(*lw.router_params.hash_table);
  DeviceTensor tok_d = DeviceTensor::from_host(tok);
  DeviceTensor ids(DType::kI32, {T, k}), w(DType::kF32, {T, k});
  ids.poison();
  w.poison();
  cuda::RouteArgs a;
  a.hash_table = table.data_as<int32_t>();
  a.token_ids = tok_d.data_as<int32_t>();
  a.topk_ids = ids.data_as<int32_t>();
  a.topk_weights = w.data_as<float>();
  cuda::route(c, a, T, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor ids_d = ids.to_host(), w_d = w.to_host();
  for (int64_t i = 0; i < T * k; ++i) {
    ASSERT_EQ(ids_d.data_as<int32_t>()[i], ids_h.data_as<int32_t>()[i]) << "slot " << i;
    ASSERT_EQ(w_d.data_as<float>()[i], w_h.data_as<float>()[i]) << "slot " << i;
  }
}

// num_valid_tokens (graph replay padding): rows at and past it get ids -1 and
// weight 0 (so align counts them nowhere); rows before it are routed as usual.
// nan_token: the first token with a NaN logit, padding rows excluded.
TEST(CudaRouting, PaddingRowsAreRoutedNowhereAndNanTokenIsRecorded) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  MoEConfig c = plain(60, 6);
  const int64_t T = 37, valid = 21, k = c.top_k, L = c.num_router_logits();
  Tensor logits_h = test::random_f32(rng, {T, L}, -4.0f, 4.0f);
  const Tensor clean = Tensor::copy_of(logits_h);         // the CPU router rejects NaN logits
  logits_h.data_as<float>()[30 * L + 2] = std::nanf("");  // padding: not reported
  logits_h.data_as<float>()[17 * L + 59] = std::nanf("");
  logits_h.data_as<float>()[19 * L + 0] = std::nanf("");
  Tensor ids_h = Tensor::empty(DType::kI32, {valid, k}),
         w_h = Tensor::empty(DType::kF32, {valid, k});
  create_router(c, {})->select_experts(TensorView(clean.data(), DType::kF32, {valid, L}), ids_h,
                                       w_h);  // CPU: rows < valid
  DeviceTensor logits = DeviceTensor::from_host(logits_h);
  DeviceTensor ids(DType::kI32, {T, k}), w(DType::kF32, {T, k}), scalars(DType::kI32, {2});
  ids.poison();
  w.poison();
  const int32_t init[2] = {static_cast<int32_t>(valid), 0x7fffffff};
  ASSERT_EQ(cudaMemcpy(scalars.data(), init, sizeof init, cudaMemcpyHostToDevice), cudaSuccess);
  cuda::RouteArgs a;
  a.router_logits = logits.data_as<float>();
  a.logits_ld = L;
  a.topk_ids = ids.data_as<int32_t>();
  a.topk_weights = w.data_as<float>();
  a.num_valid_tokens = scalars.data_as<int32_t>();
  a.nan_token = scalars.data_as<int32_t>() + 1;
  cuda::route(c, a, T, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor ids_d = ids.to_host(), w_d = w.to_host(), sc = scalars.to_host();
  EXPECT_EQ(sc.data_as<int32_t>()[1], 17) << "first token with a NaN logit";
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = t * k + j;
      if (t >= valid) {
        ASSERT_EQ(ids_d.data_as<int32_t>()[i], -1) << "padding token " << t;
        ASSERT_EQ(w_d.data_as<float>()[i], 0.0f) << "padding token " << t;
      } else if (t != 17 && t != 19) {
        ASSERT_EQ(ids_d.data_as<int32_t>()[i], ids_h.data_as<int32_t>()[i]) << "token " << t;
      }
    }
  // The NaN tokens: k distinct experts in range, never the NaN column.
  for (const auto& [t, nan_col] : {std::pair<int64_t, int32_t>{17, 59}, {19, 0}}) {
    std::vector<int32_t> got(ids_d.data_as<int32_t>() + t * k,
                             ids_d.data_as<int32_t>() + (t + 1) * k);
    for (int32_t id : got) {
      EXPECT_TRUE(id >= 0 && id < c.num_experts) << "token " << t << ": id " << id;
      EXPECT_NE(id, nan_col) << "token " << t << ": the NaN column was selected";
    }
    std::sort(got.begin(), got.end());
    EXPECT_EQ(std::adjacent_find(got.begin(), got.end()), got.end()) << "token " << t;
  }
}

// kSimulated: the same per-token draw as the CPU simulator (ids and weights
// equal), for every distribution, with zero experts (-1 ids) and a skew large
// enough that zipf draws fall back to the exact walk; padding rows get -1.
TEST(CudaRouting, SimulatedRoutingMatchesCpuSimulator) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Case {
    SimulatedRouting kind;
    double zipf_s;
  };
  for (const Case& cs :
       {Case{SimulatedRouting::kUniform, 1.0}, Case{SimulatedRouting::kZipf, 1.1},
        Case{SimulatedRouting::kZipf, 4.0}, Case{SimulatedRouting::kAllToOne, 1.0}}) {
    SCOPED_TRACE(std::string(to_string(cs.kind)) + " s " + std::to_string(cs.zipf_s));
    MoEConfig c = plain(60, 6);
    c.routing_method = RoutingMethod::kSimulated;
    c.simulated = cs.kind;
    c.zipf_s = cs.zipf_s;
    c.simulation_seed = seed;
    c.num_zero_experts = 2;
    c.routed_scaling_factor = 1.5f;
    const int64_t T = 1000, valid = 990, k = c.top_k, L = c.num_router_logits();
    Tensor ids_h = Tensor::empty(DType::kI32, {T, k}), w_h = Tensor::empty(DType::kF32, {T, k});
    create_router(c, {})->select_experts(TensorView(), ids_h, w_h);
    std::vector<double> pmf, cdf;
    routing::simulated::zipf_tables(L, c.zipf_s, pmf, cdf);
    DeviceTensor pmf_d = DeviceTensor::from_host(TensorView(pmf.data(), DType::kF64, {L}));
    DeviceTensor cdf_d = DeviceTensor::from_host(TensorView(cdf.data(), DType::kF64, {L}));
    DeviceTensor ids(DType::kI32, {T, k}), w(DType::kF32, {T, k}), nv(DType::kI32, {1});
    ids.poison();
    w.poison();
    const int32_t valid32 = static_cast<int32_t>(valid);
    ASSERT_EQ(cudaMemcpy(nv.data(), &valid32, 4, cudaMemcpyHostToDevice), cudaSuccess);
    cuda::RouteArgs a;
    a.topk_ids = ids.data_as<int32_t>();
    a.topk_weights = w.data_as<float>();
    a.num_valid_tokens = nv.data_as<int32_t>();
    if (cs.kind == SimulatedRouting::kZipf) {
      a.zipf_pmf = pmf_d.data_as<double>();
      a.zipf_cdf = cdf_d.data_as<double>();
    }
    cuda::route(c, a, T, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Tensor ids_d = ids.to_host(), w_d = w.to_host();
    int64_t zero_expert_slots = 0;
    for (int64_t i = 0; i < T * k; ++i) {
      const bool pad = i / k >= valid;
      ASSERT_EQ(ids_d.data_as<int32_t>()[i], pad ? -1 : ids_h.data_as<int32_t>()[i])
          << "slot " << i;
      ASSERT_EQ(w_d.data_as<float>()[i], pad ? 0.0f : w_h.data_as<float>()[i]) << "slot " << i;
      zero_expert_slots += !pad && ids_d.data_as<int32_t>()[i] == -1;
    }
    if (cs.kind == SimulatedRouting::kUniform) EXPECT_GT(zero_expert_slots, 0);
  }
  // Zipf without its tables is an error naming them.
  MoEConfig c = plain(60, 6);
  c.routing_method = RoutingMethod::kSimulated;
  c.simulated = SimulatedRouting::kZipf;
  DeviceTensor ids(DType::kI32, {4, 6}), w(DType::kF32, {4, 6});
  cuda::RouteArgs a;
  a.topk_ids = ids.data_as<int32_t>();
  a.topk_weights = w.data_as<float>();
  try {
    cuda::route(c, a, 4, nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("zipf_pmf"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fusedmoe
