// Tests of the routers (routing/router.h) against the float64 references in
// tests/support/reference_routing.h, edge cases, the simulator's
// distributions, and the HF fixtures' router outputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fixtures.h"
#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/routing/router.h"
#include "reference_routing.h"
#include "routing/scores.h"
#include "test_util.h"

namespace fusedmoe {
namespace {

using test::ReferenceRouting;

constexpr int32_t kIdPoison = 0x7f7f7f7f;

MoEConfig base_config(int64_t E, int64_t k) {
  MoEConfig c;
  c.num_experts = E;
  c.top_k = k;
  c.hidden_size = 64;
  c.intermediate_size = 32;
  return c;
}

// Random router logits [T, cols] viewed with row stride `ld` >= cols.
struct Logits {
  Tensor storage;
  TensorView view;
  float* row(int64_t t) const { return storage.data_as<float>() + t * view.stride(0); }
};

Logits make_logits(std::mt19937_64& rng, int64_t T, int64_t cols, int64_t ld, float stddev = 1.0f) {
  Logits l;
  l.storage = test::randn_f32(rng, {T, ld}, stddev);
  const int64_t shape[2] = {T, cols};
  const int64_t strides[2] = {ld, 1};
  l.view = TensorView(l.storage.data(), DType::kF32, shape, strides);
  return l;
}

struct Routed {
  Tensor ids, weights;
  int32_t id(int64_t t, int64_t j) const { return ids.data_as<int32_t>()[t * ids.size(1) + j]; }
  float weight(int64_t t, int64_t j) const {
    return weights.data_as<float>()[t * weights.size(1) + j];
  }
};

Routed make_outputs(int64_t T, int64_t k) {
  Routed r{Tensor::empty(DType::kI32, {T, k}), Tensor::empty(DType::kF32, {T, k})};
  std::fill_n(r.ids.data_as<int32_t>(), T * k, kIdPoison);
  test::poison(r.weights);
  return r;
}

// Runs the router on poisoned outputs and checks every element was written,
// ids are in [-1, E) and distinct per token, weights finite.
Routed route(const Router& router, const TensorView& logits, int64_t T,
             const TensorView* token_ids = nullptr) {
  const MoEConfig& c = router.config();
  Routed r = make_outputs(T, c.top_k);
  router.select_experts(logits, r.ids, r.weights, token_ids);
  for (int64_t t = 0; t < T; ++t) {
    std::set<int32_t> seen;
    for (int64_t j = 0; j < c.top_k; ++j) {
      const int32_t id = r.id(t, j);
      EXPECT_TRUE(id >= -1 && id < c.num_experts)
          << "token " << t << " slot " << j << ": id " << id;
      if (id >= 0) EXPECT_TRUE(seen.insert(id).second) << "token " << t << ": duplicate id " << id;
      EXPECT_TRUE(std::isfinite(r.weight(t, j))) << "token " << t << " slot " << j;
    }
  }
  return r;
}

// Positional comparison (both orders are score-descending, ties by lower id).
::testing::AssertionResult matches(const Routed& got, const ReferenceRouting& ref,
                                   double rel_tol = 1e-6) {
  const int64_t T = ref.num_tokens, k = ref.top_k;
  if (got.ids.size(0) != T) return ::testing::AssertionFailure() << "T mismatch";
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const double w = got.weight(t, j), rw = ref.weight(t, j);
      if (got.id(t, j) != ref.id(t, j) || std::abs(w - rw) > rel_tol * std::abs(rw) + 1e-37) {
        std::ostringstream os;
        os << "token " << t << " slot " << j << ": got (" << got.id(t, j) << ", " << w
           << "), reference (" << ref.id(t, j) << ", " << rw << "); got ids";
        for (int64_t i = 0; i < k; ++i) os << " " << got.id(t, i);
        os << ", reference ids";
        for (int64_t i = 0; i < k; ++i) os << " " << ref.id(t, i);
        return ::testing::AssertionFailure() << os.str();
      }
    }
  return ::testing::AssertionSuccess();
}

template <typename Fn>
void expect_error(Fn&& fn, std::initializer_list<std::string> substrings) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    for (const std::string& s : substrings)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos)
          << "message \"" << e.what() << "\" lacks \"" << s << "\"";
  }
}

std::vector<double> random_bias(std::mt19937_64& rng, int64_t n, double scale) {
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> b(n);
  for (double& v : b) v = static_cast<float>(d(rng));  // f32-representable
  return b;
}

Tensor bias_tensor(const std::vector<double>& b) {
  Tensor t = Tensor::empty(DType::kF32, {static_cast<int64_t>(b.size())});
  for (size_t i = 0; i < b.size(); ++i) t.data_as<float>()[i] = static_cast<float>(b[i]);
  return t;
}

const int64_t kTokenCounts[] = {0, 1, 5, 300};
struct Shape {
  int64_t E, k;
};
const Shape kShapes[] = {{8, 1}, {8, 2}, {60, 4}, {60, 6}, {256, 8}};

// ---------------------------------------------------------------------------
// routing/scores.h (the CPU routers' and the CUDA kernels' shared double
// scores) against libm: exp within 1 ulp, log1p within 4, over the whole
// range, with the limits (NaN, +-inf, under / overflow) libm's.
TEST(Router, SharedScoresMatchLibm) {
  std::mt19937_64 rng(test::fresh_seed());
  auto ulps = [](double got, double want) {
    if (got == want) return 0.0;
    return std::abs(got - want) / (std::nextafter(std::abs(want), INFINITY) - std::abs(want));
  };
  std::uniform_real_distribution<double> wide(-750.0, 712.0), narrow(-4.0, 4.0), unit(0.0, 1.0);
  double worst_exp = 0, worst_log1p = 0, worst_sig = 0;
  for (int i = 0; i < 200000; ++i) {
    const double x = i % 2 ? wide(rng) : narrow(rng);
    worst_exp = std::max(worst_exp, ulps(routing::exp_d(x), std::exp(x)));
    const double y = unit(rng);
    worst_log1p = std::max(worst_log1p, ulps(routing::log1p_unit_d(y), std::log1p(y)));
    const double f = static_cast<float>(narrow(rng) * 4);
    worst_sig = std::max(worst_sig, std::abs(routing::sigmoid(f) - 1.0 / (1.0 + std::exp(-f))) /
                                        (1.0 / (1.0 + std::exp(-f))));
  }
  EXPECT_LE(worst_exp, 1.0);
  EXPECT_LE(worst_log1p, 4.0);
  EXPECT_LE(worst_sig, 4e-16);
  EXPECT_TRUE(std::isnan(routing::exp_d(NAN)));
  EXPECT_EQ(routing::exp_d(INFINITY), INFINITY);
  EXPECT_EQ(routing::exp_d(-INFINITY), 0.0);
  EXPECT_EQ(routing::exp_d(710.0), INFINITY);
  EXPECT_EQ(routing::exp_d(-746.0), 0.0);
  EXPECT_EQ(routing::exp_d(0.0), 1.0);
  EXPECT_GT(routing::exp_d(-744.0), 0.0);  // subnormal, as libm's
  EXPECT_EQ(routing::log1p_unit_d(0.0), 0.0);
  EXPECT_EQ(routing::sigmoid(-1e300), 0.0);
  EXPECT_EQ(routing::sigmoid(1e300), 1.0);
  EXPECT_EQ(routing::sqrt_softplus(-1e300), 0.0);
  EXPECT_NEAR(routing::sqrt_softplus(3.0), std::sqrt(std::log1p(std::exp(3.0))), 1e-15);
}

TEST(Router, TopKMatchesReference) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int variant = 0;
  for (ScoringFunc f : {ScoringFunc::kSoftmax, ScoringFunc::kSigmoid, ScoringFunc::kSqrtSoftplus})
    for (bool renorm : {false, true})
      for (const Shape& s : kShapes)
        for (int64_t T : kTokenCounts) {
          MoEConfig c = base_config(s.E, s.k);
          c.scoring_func = f;
          c.renormalize = renorm;
          c.routed_scaling_factor = (variant % 2) ? 2.5f : 1.0f;
          const int64_t ld = s.E + (variant++ % 3) * 7;  // strided rows 2 out of 3 times
          SCOPED_TRACE(std::string(to_string(f)) + " renorm " + std::to_string(renorm) + " E " +
                       std::to_string(s.E) + " k " + std::to_string(s.k) + " T " +
                       std::to_string(T) + " ld " + std::to_string(ld));
          auto router = create_router(c);
          EXPECT_STREQ(router->name(), "topk");
          Logits l = make_logits(rng, T, s.E, ld, 2.0f);
          Routed got = route(*router, l.view, T);
          EXPECT_TRUE(matches(got, test::reference_route(c, l.view)));
        }
}

TEST(Router, TopKWithSelectionBiasMatchesReference) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (ScoringFunc f : {ScoringFunc::kSoftmax, ScoringFunc::kSigmoid, ScoringFunc::kSqrtSoftplus})
    for (const Shape& s : kShapes) {
      MoEConfig c = base_config(s.E, s.k);
      c.scoring_func = f;
      c.renormalize = true;
      c.has_e_score_correction_bias = true;
      const std::vector<double> bias = random_bias(rng, s.E, 0.3);
      auto router = create_router(c, {bias_tensor(bias), std::nullopt});
      const int64_t T = 300;
      Logits l = make_logits(rng, T, s.E, s.E + 3);
      Routed got = route(*router, l.view, T);
      EXPECT_TRUE(matches(got, test::reference_route(c, l.view, bias)))
          << to_string(f) << " E " << s.E << " k " << s.k;
    }
}

TEST(Router, TopKSoftmaxMatchesReferenceAndEqualsSoftmaxTopKRenormalize) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const Shape& s : kShapes)
    for (int64_t T : kTokenCounts) {
      MoEConfig c = base_config(s.E, s.k);
      c.routing_method = RoutingMethod::kTopKSoftmax;
      auto router = create_router(c);
      EXPECT_STREQ(router->name(), "topk_softmax");
      Logits l = make_logits(rng, T, s.E, s.E + 1, 3.0f);
      Routed got = route(*router, l.view, T);
      EXPECT_TRUE(matches(got, test::reference_route(c, l.view))) << "E " << s.E << " T " << T;

      // gpt-oss's top-k-then-softmax == softmax -> top-k -> renormalize:
      // softmax is monotone (same ids) and exp(x_i - m) / sum_all divided by
      // sum_{top-k} exp(x_j - m) / sum_all is exp(x_i - m) / sum_{top-k}.
      MoEConfig c2 = base_config(s.E, s.k);
      c2.scoring_func = ScoringFunc::kSoftmax;
      c2.renormalize = true;
      Routed other = route(*create_router(c2), l.view, T);
      const ReferenceRouting ref2 = test::reference_topk(c2, l.row(0), T, l.view.stride(0));
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < s.k; ++j) {
          ASSERT_EQ(got.id(t, j), other.id(t, j)) << "token " << t;
          ASSERT_EQ(got.id(t, j), ref2.id(t, j)) << "token " << t;
          EXPECT_NEAR(got.weight(t, j), other.weight(t, j), 1e-6 * other.weight(t, j));
          EXPECT_NEAR(got.weight(t, j), ref2.weight(t, j), 1e-6 * ref2.weight(t, j));
        }
    }
}

MoEConfig deepseek_v3(int64_t E, int64_t k, int64_t G, int64_t kg) {
  MoEConfig c = base_config(E, k);
  c.routing_method = RoutingMethod::kGroupedTopK;
  c.scoring_func = ScoringFunc::kSigmoid;
  c.renormalize = true;
  c.num_expert_group = G;
  c.topk_group = kg;
  c.group_score = GroupScore::kSumTop2;
  c.has_e_score_correction_bias = true;
  c.routed_scaling_factor = 2.5f;
  return c;
}

MoEConfig deepseek_v2(int64_t E, int64_t k, int64_t G, int64_t kg) {
  MoEConfig c = base_config(E, k);
  c.routing_method = RoutingMethod::kGroupedTopK;
  c.scoring_func = ScoringFunc::kSoftmax;
  c.renormalize = false;
  c.num_expert_group = G;
  c.topk_group = kg;
  c.group_score = GroupScore::kMax;
  c.routed_scaling_factor = 16.0f;
  return c;
}

struct GroupShape {
  int64_t E, k, G, kg;
};
const GroupShape kGroupShapes[] = {{8, 1, 4, 1},   {8, 2, 4, 2},    {60, 4, 4, 2}, {60, 6, 6, 3},
                                   {256, 8, 8, 4}, {256, 6, 16, 3}, {16, 4, 4, 1}};

TEST(Router, GroupedTopKMatchesReference) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const GroupShape& s : kGroupShapes)
    for (int64_t T : kTokenCounts)
      for (int v = 0; v < 4; ++v) {
        MoEConfig c = v < 2 ? deepseek_v3(s.E, s.k, s.G, s.kg) : deepseek_v2(s.E, s.k, s.G, s.kg);
        if (v == 1) c.group_score = GroupScore::kMax;  // V3 scores, V2 group score
        if (v == 3) c.scoring_func = ScoringFunc::kSqrtSoftplus, c.renormalize = true;
        std::vector<double> bias;
        RouterParams params;
        if (c.has_e_score_correction_bias) {
          bias = random_bias(rng, s.E, 0.5);
          params.e_score_correction_bias = bias_tensor(bias);
        }
        SCOPED_TRACE("variant " + std::to_string(v) + " E " + std::to_string(s.E) + " k " +
                     std::to_string(s.k) + " G " + std::to_string(s.G) + " T " + std::to_string(T));
        auto router = create_router(c, params);
        EXPECT_STREQ(router->name(), "grouped_topk");
        Logits l = make_logits(rng, T, s.E, s.E + 5);
        Routed got = route(*router, l.view, T);
        EXPECT_TRUE(matches(got, test::reference_route(c, l.view, bias)));
        // Every selected expert lies in one of the topk_group best groups.
        for (int64_t t = 0; t < T; ++t) {
          std::set<int64_t> groups;
          for (int64_t j = 0; j < s.k; ++j) groups.insert(got.id(t, j) / (s.E / s.G));
          EXPECT_LE(static_cast<int64_t>(groups.size()), s.kg) << "token " << t;
        }
      }
}

// All biased scores negative: HF's masked_fill(0.0) would pick experts of
// dropped groups (0 > negative); experts of dropped groups must never be chosen.
TEST(Router, GroupedTopKNeverSelectsDroppedGroupsWithNegativeScores) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  MoEConfig c = deepseek_v3(32, 8, 8, 2);  // 2 groups of 4 kept, k = 8: all of them
  std::vector<double> bias = random_bias(rng, 32, 0.1);
  for (double& b : bias) b -= 3.0;
  auto router = create_router(c, {bias_tensor(bias), std::nullopt});
  const int64_t T = 100;
  Logits l = make_logits(rng, T, 32, 32);
  Routed got = route(*router, l.view, T);
  const ReferenceRouting ref = test::reference_route(c, l.view, bias);
  EXPECT_TRUE(matches(got, ref));
  for (int64_t t = 0; t < T; ++t) {
    // Group scores as DeepSeek-V3 defines them.
    std::vector<std::pair<double, int64_t>> gs;
    for (int64_t g = 0; g < 8; ++g) {
      std::vector<double> m;
      for (int64_t e = 4 * g; e < 4 * g + 4; ++e)
        m.push_back(1.0 / (1.0 + std::exp(-static_cast<double>(l.row(t)[e]))) + bias[e]);
      std::sort(m.rbegin(), m.rend());
      gs.push_back({-(m[0] + m[1]), g});
    }
    std::sort(gs.begin(), gs.end());
    const std::set<int64_t> kept = {gs[0].second, gs[1].second};
    for (int64_t j = 0; j < 8; ++j) EXPECT_TRUE(kept.count(got.id(t, j) / 4)) << "token " << t;
  }
}

TEST(Router, GroupedTopKOneExpertPerGroup) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  MoEConfig c = deepseek_v2(8, 2, 8, 4);  // E/G = 1, kMax
  auto router = create_router(c);
  Logits l = make_logits(rng, 300, 8, 8);
  EXPECT_TRUE(matches(route(*router, l.view, 300), test::reference_route(c, l.view)));
  c.group_score = GroupScore::kSumTop2;  // needs >= 2 per group
  expect_error([&] { create_router(c); }, {"group_score", "sum_top2"});
}

TEST(Router, Llama4MatchesReference) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const Shape& s : kShapes)
    for (int64_t T : kTokenCounts) {
      MoEConfig c = base_config(s.E, s.k);
      c.routing_method = RoutingMethod::kLlama4;
      c.apply_router_weight_on_input = s.k == 1;
      auto router = create_router(c);
      EXPECT_STREQ(router->name(), "llama4");
      Logits l = make_logits(rng, T, s.E, s.E + 2);
      EXPECT_TRUE(matches(route(*router, l.view, T), test::reference_route(c, l.view)))
          << "E " << s.E << " k " << s.k << " T " << T;
    }
}

TEST(Router, SigmoidUnderflowGivesFiniteWeights) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t T = 70, E = 16;
  Logits l = make_logits(rng, T, E, E, 1.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) l.row(t)[e] -= 200.0f;
  MoEConfig topk = base_config(E, 4);
  topk.scoring_func = ScoringFunc::kSigmoid;
  topk.renormalize = true;
  MoEConfig v3 = deepseek_v3(E, 4, 4, 2);
  std::vector<double> bias = random_bias(rng, E, 0.1);
  MoEConfig llama = base_config(E, 1);
  llama.routing_method = RoutingMethod::kLlama4;
  llama.renormalize = true;
  for (const auto& [c, b] : {std::pair{topk, std::vector<double>{}}, std::pair{v3, bias},
                             std::pair{llama, std::vector<double>{}}}) {
    RouterParams p;
    if (!b.empty()) p.e_score_correction_bias = bias_tensor(b);
    Routed got = route(*create_router(c, p), l.view, T);  // checks finite
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < c.top_k; ++j) EXPECT_GE(got.weight(t, j), 0.0f);
  }
}

TEST(Router, EqualAndInfiniteLogitsGiveDistinctLowestIds) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t E = 16, k = 4, T = 3;
  const float inf = std::numeric_limits<float>::infinity();
  const float constant = std::uniform_real_distribution<float>(-3.0f, 3.0f)(rng);
  for (float value : {constant, -inf, inf, 3e38f, -3e38f}) {
    Logits l = make_logits(rng, T, E, E);
    std::fill_n(l.storage.data_as<float>(), T * E, value);
    std::vector<MoEConfig> configs;
    for (ScoringFunc f : {ScoringFunc::kSoftmax, ScoringFunc::kSigmoid}) {
      for (bool renorm : {false, true}) {
        MoEConfig c = base_config(E, k);
        c.scoring_func = f;
        c.renormalize = renorm;
        configs.push_back(c);
      }
    }
    // sqrtsoftplus renormalized: infinite scores share 1 (not inf / inf).
    MoEConfig ssp = base_config(E, k);
    ssp.scoring_func = ScoringFunc::kSqrtSoftplus;
    ssp.renormalize = true;
    configs.push_back(ssp);
    MoEConfig ssp_grouped = deepseek_v3(E, k, 4, 2);
    ssp_grouped.scoring_func = ScoringFunc::kSqrtSoftplus;
    ssp_grouped.has_e_score_correction_bias = false;
    configs.push_back(ssp_grouped);
    MoEConfig gpt = base_config(E, k);
    gpt.routing_method = RoutingMethod::kTopKSoftmax;
    configs.push_back(gpt);
    MoEConfig llama = base_config(E, k);
    llama.routing_method = RoutingMethod::kLlama4;
    configs.push_back(llama);
    configs.push_back(deepseek_v2(E, k, 4, 2));
    MoEConfig v3 = deepseek_v3(E, k, 4, 2);
    v3.has_e_score_correction_bias = false;
    configs.push_back(v3);
    for (const MoEConfig& c : configs) {
      SCOPED_TRACE(std::string(to_string(c.routing_method)) + " " + to_string(c.scoring_func) +
                   " value " + std::to_string(value));
      Routed got = route(*create_router(c), l.view, T);  // checks distinct + finite
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < k; ++j) EXPECT_EQ(got.id(t, j), j) << "token " << t;
      if (c.routing_method == RoutingMethod::kTopKSoftmax ||
          (c.scoring_func == ScoringFunc::kSoftmax && c.renormalize) ||
          (c.scoring_func == ScoringFunc::kSqrtSoftplus && value == inf))
        EXPECT_NEAR(got.weight(0, 0), c.routed_scaling_factor / k, 1e-6);
    }
  }
  // One +inf logit among finite ones under a renormalized sqrtsoftplus: all
  // the mass on it (the limit), plain and grouped.
  for (const bool grouped : {false, true}) {
    MoEConfig c = grouped ? deepseek_v3(E, k, 4, 2) : base_config(E, k);
    c.scoring_func = ScoringFunc::kSqrtSoftplus;
    c.renormalize = true;
    c.has_e_score_correction_bias = false;
    Logits l = make_logits(rng, 1, E, E);
    l.row(0)[5] = inf;
    Routed got = route(*create_router(c), l.view, 1);
    EXPECT_EQ(got.id(0, 0), 5);
    EXPECT_FLOAT_EQ(got.weight(0, 0), c.routed_scaling_factor);
    for (int64_t j = 1; j < k; ++j) EXPECT_EQ(got.weight(0, j), 0.0f);
  }
}

TEST(Router, NaNLogitsAreRejectedNamingTheToken) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t E = 60, T = 300;
  for (RoutingMethod m : {RoutingMethod::kTopK, RoutingMethod::kTopKSoftmax,
                          RoutingMethod::kGroupedTopK, RoutingMethod::kLlama4}) {
    MoEConfig c = m == RoutingMethod::kGroupedTopK ? deepseek_v2(E, 4, 4, 2) : base_config(E, 4);
    c.routing_method = m;
    auto router = create_router(c);
    Logits l = make_logits(rng, T, E, E + 4);
    const int64_t bad_t = std::uniform_int_distribution<int64_t>(0, T - 1)(rng);
    const int64_t bad_e = std::uniform_int_distribution<int64_t>(0, E - 1)(rng);
    l.row(bad_t)[bad_e] = std::numeric_limits<float>::quiet_NaN();
    l.row(T - 1)[E + 1] = std::numeric_limits<float>::quiet_NaN();  // padding: not read
    if (bad_t < T - 1) l.row(T - 1)[0] = std::numeric_limits<float>::quiet_NaN();  // later token
    Routed out = make_outputs(T, 4);
    expect_error([&] { router->select_experts(l.view, out.ids, out.weights); },
                 {"router_logits", "NaN", "token " + std::to_string(bad_t),
                  "expert " + std::to_string(bad_e)});
    // Nothing written.
    for (int64_t i = 0; i < T * 4; ++i) ASSERT_EQ(out.ids.data_as<int32_t>()[i], kIdPoison);
  }
}

TEST(Router, ZeroExpertsBecomeMinusOne) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t E = 8, Z = 4, k = 3, T = 300;
  for (RoutingMethod m :
       {RoutingMethod::kTopK, RoutingMethod::kTopKSoftmax, RoutingMethod::kLlama4}) {
    MoEConfig c = base_config(E, k);
    c.routing_method = m;
    c.num_zero_experts = Z;
    c.renormalize = true;
    auto router = create_router(c);
    Logits l = make_logits(rng, T, E + Z, E + Z + 3);
    for (int64_t t = 0; t < T; t += 3) l.row(t)[E + t % Z] = 10.0f;  // force a zero expert
    Routed got = route(*router, l.view, T);
    EXPECT_TRUE(matches(got, test::reference_route(c, l.view))) << to_string(m);
    int64_t minus_one = 0;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < k; ++j) minus_one += got.id(t, j) == -1;
      if (t % 3 == 0) EXPECT_EQ(got.id(t, 0), -1) << "token " << t;
    }
    EXPECT_GE(minus_one, T / 3);
  }
  // The logits must have E + Z columns.
  MoEConfig c = base_config(E, k);
  c.num_zero_experts = Z;
  Logits l = make_logits(rng, 5, E, E);
  Routed out = make_outputs(5, k);
  expect_error([&] { create_router(c)->select_experts(l.view, out.ids, out.weights); },
               {"router_logits", "[*, 12]", "[5, 8]"});
}

TEST(Router, HashRouting) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t E = 16, k = 2, V = 50;
  MoEConfig c = base_config(E, k);
  c.routing_method = RoutingMethod::kHash;
  c.hash_vocab_size = V;
  c.routed_scaling_factor = 1.5f;
  Tensor table = Tensor::empty(DType::kI32, {V, k});
  for (int64_t v = 0; v < V; ++v) {
    std::vector<int32_t> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < k; ++j) table.data_as<int32_t>()[v * k + j] = perm[j];
  }
  auto router = create_router(c, {std::nullopt, table});
  EXPECT_STREQ(router->name(), "hash");
  for (int64_t T : kTokenCounts) {
    Tensor tokens = Tensor::empty(DType::kI32, {T});
    for (int64_t t = 0; t < T; ++t)
      tokens.data_as<int32_t>()[t] = std::uniform_int_distribution<int32_t>(0, V - 1)(rng);
    const TensorView tv = tokens;
    Routed got = route(*router, TensorView(), T, &tv);
    EXPECT_TRUE(matches(
        got, test::reference_hash(c, table.data_as<int32_t>(), tokens.data_as<int32_t>(), T)));
  }
  // Errors: missing token ids, out-of-range token id, missing / bad table.
  Tensor tokens = Tensor::empty(DType::kI32, {3});
  tokens.data_as<int32_t>()[0] = 1;
  tokens.data_as<int32_t>()[1] = static_cast<int32_t>(V);
  tokens.data_as<int32_t>()[2] = 2;
  const TensorView tv = tokens;
  Routed out = make_outputs(3, k);
  expect_error([&] { router->select_experts(TensorView(), out.ids, out.weights); }, {"token_ids"});
  expect_error([&] { router->select_experts(TensorView(), out.ids, out.weights, &tv); },
               {"token_ids", "50", "at token 1"});
  expect_error([&] { create_router(c); }, {"hash_table"});
  table.data_as<int32_t>()[1] = table.data_as<int32_t>()[0];
  expect_error([&] { create_router(c, {std::nullopt, table}); }, {"hash_table", "distinct"});
  table.data_as<int32_t>()[1] = static_cast<int32_t>(E);
  expect_error([&] { create_router(c, {std::nullopt, table}); }, {"hash_table", "16"});
}

// ---- simulator -------------------------------------------------------------
MoEConfig simulated(SimulatedRouting s, int64_t E, int64_t k, uint64_t seed) {
  MoEConfig c = base_config(E, k);
  c.routing_method = RoutingMethod::kSimulated;
  c.simulated = s;
  c.simulation_seed = seed;
  return c;
}

std::vector<int64_t> counts(const Routed& r, int64_t E) {
  std::vector<int64_t> n(E, 0);
  for (int64_t i = 0; i < r.ids.numel(); ++i) ++n[r.ids.data_as<int32_t>()[i]];
  return n;
}

TEST(Router, SimulatedUniformIsEvenAndReproducible) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t E = 16, k = 4, T = 20000;
  MoEConfig c = simulated(SimulatedRouting::kUniform, E, k, seed);
  c.routed_scaling_factor = 2.0f;
  auto router = create_router(c);
  EXPECT_STREQ(router->name(), "simulated");
  Routed a = make_outputs(T, k);
  router->select_experts(TensorView(), a.ids, a.weights);  // no logits needed
  Routed b = route(*router, TensorView(), T);              // checks distinct ids
  const std::vector<int64_t> n = counts(b, E);
  const double expected = static_cast<double>(T * k) / E;  // 5000, sd ~ 70
  for (int64_t e = 0; e < E; ++e) EXPECT_NEAR(n[e], expected, 0.06 * expected) << "expert " << e;
  EXPECT_TRUE(std::equal(a.ids.data_as<int32_t>(), a.ids.data_as<int32_t>() + T * k,
                         b.ids.data_as<int32_t>()));
  EXPECT_EQ(b.weight(7, 2), 0.5f);  // scale / k
  // A token's routing does not depend on the batch size.
  Routed small = route(*router, TensorView(), 10);
  for (int64_t i = 0; i < 10 * k; ++i)
    EXPECT_EQ(small.ids.data_as<int32_t>()[i], b.ids.data_as<int32_t>()[i]);
  // Another seed gives another routing.
  Routed other =
      route(*create_router(simulated(SimulatedRouting::kUniform, E, k, seed + 1)), TensorView(), T);
  EXPECT_FALSE(std::equal(other.ids.data_as<int32_t>(), other.ids.data_as<int32_t>() + T * k,
                          b.ids.data_as<int32_t>()));
  // Logits, when given, are shape-checked but ignored.
  std::mt19937_64 rng(seed);
  Logits l = make_logits(rng, 10, E, E);
  Routed with_logits = route(*router, l.view, 10);
  for (int64_t i = 0; i < 10 * k; ++i)
    EXPECT_EQ(with_logits.ids.data_as<int32_t>()[i], b.ids.data_as<int32_t>()[i]);
  // k == E: every expert once per token.
  Routed all =
      route(*create_router(simulated(SimulatedRouting::kUniform, 8, 8, seed)), TensorView(), 100);
  for (int64_t e = 0; e < 8; ++e) EXPECT_EQ(counts(all, 8)[e], 100);
}

TEST(Router, SimulatedZipfIsSkewed) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t E = 16, k = 2, T = 40000;
  MoEConfig c = simulated(SimulatedRouting::kZipf, E, k, seed);
  c.zipf_s = 1.2;
  Routed r = route(*create_router(c), TensorView(), T);  // distinct per token
  const std::vector<int64_t> n = counts(r, E);
  for (int64_t e = 0; e + 1 < 6; ++e) EXPECT_GT(n[e], n[e + 1]) << "expert " << e;
  EXPECT_GT(n[0], 4 * n[E - 1]);
  EXPECT_GT(n[E - 1], 0);
  // Strong skew with k close to E still terminates with distinct ids.
  MoEConfig steep = simulated(SimulatedRouting::kZipf, 16, 12, seed);
  steep.zipf_s = 12.0;
  route(*create_router(steep), TensorView(), 200);
  // Reproducible.
  Routed again = route(*create_router(c), TensorView(), T);
  EXPECT_TRUE(std::equal(r.ids.data_as<int32_t>(), r.ids.data_as<int32_t>() + T * k,
                         again.ids.data_as<int32_t>()));
}

TEST(Router, SimulatedWithZeroExperts) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  MoEConfig c = simulated(SimulatedRouting::kUniform, 8, 4, seed);
  c.num_zero_experts = 8;
  const int64_t T = 4000;
  Routed r = route(*create_router(c), TensorView(), T);  // ids in [-1, 8), distinct
  int64_t minus_one = 0;
  std::vector<int64_t> n(8, 0);
  for (int64_t i = 0; i < T * 4; ++i) {
    const int32_t id = r.ids.data_as<int32_t>()[i];
    id < 0 ? ++minus_one : ++n[id];
  }
  EXPECT_NEAR(minus_one, T * 2, T * 0.1);  // half of the 16 columns are zero experts
  for (int64_t e = 0; e < 8; ++e) EXPECT_NEAR(n[e], T / 4, T * 0.03) << "expert " << e;
}

TEST(Router, SimulatedAllToOne) {
  MoEConfig c = simulated(SimulatedRouting::kAllToOne, 16, 3, test::fresh_seed());
  Routed r = route(*create_router(c), TensorView(), 300);
  for (int64_t t = 0; t < 300; ++t)
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_EQ(r.id(t, j), j);
      EXPECT_FLOAT_EQ(r.weight(t, j), 1.0f / 3.0f);
    }
}

// ---- scaling, shapes, params ----------------------------------------------
TEST(Router, RoutedScalingFactorAppliedOnce) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const float scale = 2.5f;
  const int64_t T = 100, E = 16, k = 4;
  Logits l = make_logits(rng, T, E, E);
  std::vector<double> bias = random_bias(rng, E, 0.2);
  std::vector<MoEConfig> configs;
  for (ScoringFunc f : {ScoringFunc::kSoftmax, ScoringFunc::kSigmoid}) {
    MoEConfig c = base_config(E, k);
    c.scoring_func = f;
    c.renormalize = true;
    configs.push_back(c);
  }
  MoEConfig gpt = base_config(E, k);
  gpt.routing_method = RoutingMethod::kTopKSoftmax;
  configs.push_back(gpt);
  MoEConfig llama = base_config(E, 1);
  llama.routing_method = RoutingMethod::kLlama4;
  configs.push_back(llama);
  configs.push_back(deepseek_v3(E, k, 4, 2));
  configs.push_back(deepseek_v2(E, k, 4, 2));
  for (MoEConfig c : configs) {
    RouterParams p;
    if (c.has_e_score_correction_bias) p.e_score_correction_bias = bias_tensor(bias);
    c.routed_scaling_factor = 1.0f;
    Routed one = route(*create_router(c, p), l.view, T);
    c.routed_scaling_factor = scale;
    Routed scaled = route(*create_router(c, p), l.view, T);
    const ReferenceRouting ref = test::reference_route(c, l.view, bias);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < c.top_k; ++j) {
        EXPECT_NEAR(scaled.weight(t, j), scale * one.weight(t, j), 1e-6 * scaled.weight(t, j));
        EXPECT_NEAR(scaled.weight(t, j), ref.weight(t, j), 1e-6 * ref.weight(t, j));
      }
    if (c.renormalize || c.routing_method == RoutingMethod::kTopKSoftmax) {
      double sum = 0.0;
      for (int64_t j = 0; j < c.top_k; ++j) sum += scaled.weight(0, j);
      EXPECT_NEAR(sum, scale, 1e-5) << to_string(c.routing_method);
    }
  }
}

TEST(Router, ShapeDtypeAndParamErrors) {
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  MoEConfig c = base_config(8, 2);
  auto router = create_router(c);
  Logits l = make_logits(rng, 5, 8, 8);
  Routed out = make_outputs(5, 2);
  expect_error(
      [&] { router->select_experts(l.storage.view().narrow(1, 0, 7), out.ids, out.weights); },
      {"router_logits: expected f32 [*, 8], got f32 [5, 7]"});
  Tensor bf = test::to_bf16(l.storage);
  expect_error([&] { router->select_experts(bf, out.ids, out.weights); },
               {"router_logits", "bf16"});
  Routed wrong = make_outputs(4, 2);
  expect_error([&] { router->select_experts(l.view, wrong.ids, out.weights); },
               {"topk_ids: expected i32 [5, 2], got i32 [4, 2]"});
  expect_error([&] { router->select_experts(l.view, out.ids, wrong.weights); },
               {"topk_weights: expected f32 [5, 2]"});
  expect_error([&] { router->select_experts(l.view, out.weights, out.ids); }, {"topk_ids", "f32"});
  expect_error([&] { router->select_experts(TensorView(), out.ids, out.weights); },
               {"router_logits"});
  // Transposed logits (last-dimension stride != 1).
  const int64_t shape[2] = {5, 8}, strides[2] = {1, 5};
  expect_error(
      [&] {
        router->select_experts(TensorView(l.storage.data(), DType::kF32, shape, strides), out.ids,
                               out.weights);
      },
      {"router_logits", "stride"});
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(out.ids.data_as<int32_t>()[i], kIdPoison);
  // Bias params.
  MoEConfig v3 = deepseek_v3(16, 4, 4, 2);
  expect_error([&] { create_router(v3); }, {"e_score_correction_bias", "[16]", "got none"});
  expect_error(
      [&] {
        create_router(v3, {bias_tensor(std::vector<double>(8, 0.1)), {}});
      },
      {"e_score_correction_bias", "[16]", "[8]"});
  expect_error(
      [&] {
        create_router(c, {bias_tensor(std::vector<double>(8, 0.1)), {}});
      },
      {"e_score_correction_bias", "has_e_score_correction_bias"});
  MoEConfig llama = base_config(8, 1);
  llama.routing_method = RoutingMethod::kLlama4;
  expect_error(
      [&] {
        create_router(llama, {bias_tensor(std::vector<double>(8, 0.1)), {}});
      },
      {"e_score_correction_bias", "llama4"});
  // bf16 bias accepted.
  Tensor b16 = test::to_bf16(bias_tensor(random_bias(rng, 16, 0.3)));
  EXPECT_NO_THROW(create_router(v3, {b16, {}}));
  // Invalid config rejected by the factory.
  MoEConfig bad = base_config(8, 9);
  expect_error([&] { create_router(bad); }, {"top_k", "got 9"});
}

TEST(Router, ManyTokensMultiThreadedMatchesReference) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t T = 4099;
  MoEConfig c = deepseek_v3(256, 8, 8, 4);
  std::vector<double> bias = random_bias(rng, 256, 0.5);
  auto router = create_router(c, {bias_tensor(bias), {}});
  Logits l = make_logits(rng, T, 256, 256);
  EXPECT_TRUE(matches(route(*router, l.view, T), test::reference_route(c, l.view, bias)));
}

// ---- HF fixtures -------------------------------------------------------------
struct FixtureRouting {
  std::string arch;
  std::vector<int64_t> layers;
  MoEConfig config;
  std::string bias_name;  // "{L}" replaced by the layer
};

std::vector<FixtureRouting> fixture_routings() {
  std::vector<FixtureRouting> v;
  auto topk = [](int64_t E, int64_t k, bool renorm) {
    MoEConfig c = base_config(E, k);
    c.scoring_func = ScoringFunc::kSoftmax;
    c.renormalize = renorm;
    return c;
  };
  v.push_back({"mixtral", {0, 1}, topk(8, 2, true), ""});
  v.push_back({"qwen2_moe", {0, 1}, topk(12, 4, false), ""});
  v.push_back({"qwen3_moe", {0, 1}, topk(16, 4, true), ""});
  v.push_back({"olmoe", {0, 1}, topk(16, 4, false), ""});
  v.push_back({"deepseek_v3",
               {1, 2},
               deepseek_v3(16, 4, 4, 2),
               "model.layers.{L}.mlp.gate.e_score_correction_bias"});
  MoEConfig gpt = base_config(8, 2);
  gpt.routing_method = RoutingMethod::kTopKSoftmax;
  gpt.has_router_bias = true;
  v.push_back({"gpt_oss", {0, 1}, gpt, ""});
  MoEConfig llama = base_config(8, 1);
  llama.routing_method = RoutingMethod::kLlama4;
  llama.apply_router_weight_on_input = true;
  v.push_back({"llama4", {0, 1}, llama, ""});
  return v;
}

TEST(Router, HFFixtureRouting) {
  for (const FixtureRouting& fx : fixture_routings()) {
    SCOPED_TRACE(fx.arch);
    auto ref = test::open_reference(fx.arch);
    const ModelInfo info = load_model_info(test::hf_fixture_dir(fx.arch));
    std::shared_ptr<SafetensorsFile> model;
    if (!fx.bias_name.empty())
      model = SafetensorsFile::open(test::hf_fixture_dir(fx.arch) + "/model.safetensors");
    for (int64_t layer : fx.layers) {
      RouterParams params;
      std::vector<double> bias;
      if (model) {
        std::string name = fx.bias_name;
        name.replace(name.find("{L}"), 3, std::to_string(layer));
        params.e_score_correction_bias = model->get(name);
        bias = test::to_f64_vector(*params.e_score_correction_bias);
      }
      auto router = create_router(fx.config, params);
      auto io_router = create_router(info.layer_config(layer), params);
      const std::vector<int64_t> token_counts = test::reference_token_counts(*ref, layer);
      ASSERT_FALSE(token_counts.empty()) << "layer " << layer;
      for (int64_t T : token_counts) {
        SCOPED_TRACE("layer " + std::to_string(layer) + " T " + std::to_string(T));
        Tensor logits =
            test::load_tensor_f32(*ref, test::reference_name(layer, T, "router_logits"));
        ASSERT_EQ(logits.size(1), fx.config.num_experts);
        Routed got = route(*router, logits, T);
        const int64_t k = fx.config.top_k, E = fx.config.num_experts;
        if (fx.arch == "llama4") {
          Tensor scores =
              test::load_tensor_f32(*ref, test::reference_name(layer, T, "router_scores"));
          for (int64_t t = 0; t < T; ++t)
            for (int64_t e = 0; e < E; ++e) {
              const float s = scores.data_as<float>()[t * E + e];
              if (e == got.id(t, 0))
                EXPECT_NEAR(got.weight(t, 0), s, 1e-5 * std::abs(s)) << "token " << t;
              else
                EXPECT_EQ(s, 0.0f) << "token " << t << " expert " << e;
            }
          continue;
        }
        Tensor ids = test::load_tensor_i32(*ref, test::reference_name(layer, T, "topk_ids"));
        Tensor w = test::load_tensor_f32(*ref, test::reference_name(layer, T, "topk_weights"));
        ASSERT_EQ(ids.size(1), k);
        for (int64_t t = 0; t < T; ++t) {
          std::map<int32_t, float> hf, ours;
          for (int64_t j = 0; j < k; ++j) {
            hf[ids.data_as<int32_t>()[t * k + j]] = w.data_as<float>()[t * k + j];
            ours[got.id(t, j)] = got.weight(t, j);
          }
          ASSERT_EQ(ours.size(), hf.size());
          for (const auto& [id, hw] : hf) {
            ASSERT_TRUE(ours.count(id)) << "token " << t << ": HF chose expert " << id;
            EXPECT_NEAR(ours[id], hw, 1e-5 * std::abs(hw)) << "token " << t << " expert " << id;
          }
        }
        // And the float64 reference agrees with both.
        EXPECT_TRUE(matches(got, test::reference_route(fx.config, logits, bias)));
        // The config io builds from config.json routes the same way.
        Routed via_io = route(*io_router, logits, T);
        for (int64_t i = 0; i < T * k; ++i) {
          EXPECT_EQ(via_io.ids.data_as<int32_t>()[i], got.ids.data_as<int32_t>()[i]);
          EXPECT_EQ(via_io.weights.data_as<float>()[i], got.weights.data_as<float>()[i]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace fusedmoe
