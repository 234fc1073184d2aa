// Gated activations (apply_activation) against the float64 formulas.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <random>
#include <vector>

#include "fusedmoe/experts/expert_weights.h"
#include "reference_moe.h"
#include "test_util.h"

namespace fusedmoe {
namespace {

const Activation kAll[] = {Activation::kSiluGlu, Activation::kGeluGlu, Activation::kGeluTanhGlu,
                           Activation::kSwigluOai};

// Runs apply_activation on rows of [gate | up | padding] with padded output rows,
// checks every element against float64 and that the padding is untouched.
void check_rows(const ActivationParams& p, const std::vector<float>& gate,
                const std::vector<float>& up) {
  const int64_t I = static_cast<int64_t>(gate.size());
  const int64_t rows = 3, ldx = 2 * I + 5, ldo = I + 3;
  std::vector<float> x(rows * ldx, 0.0f), out(rows * ldo, NAN);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < I; ++i) {
      // Row r uses a rotated copy so rows differ.
      const int64_t s = (i + r) % I;
      x[r * ldx + i] = gate[s];
      x[r * ldx + I + i] = up[s];
    }
  apply_activation(p, x.data(), ldx, out.data(), ldo, rows, I);
  double err2 = 0, ref2 = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      const float g = x[r * ldx + i], u = x[r * ldx + I + i];
      const double ref = test::reference_activation(p, g, u);
      const float o = out[r * ldo + i];
      ASSERT_TRUE(std::isfinite(o)) << to_string(p.activation) << " gate=" << g << " up=" << u;
      // erfc(|y|) for y = x / sqrt 2 in float has relative condition ~2 y^2 (x << 0):
      // the rounding of x / sqrt 2 alone costs ~1e-5 at x = -12.
      const double rel = p.activation == Activation::kGeluGlu ? 4e-5 : 1e-5;
      const double tol = rel * std::fabs(ref) + 1e-30 * (1.0 + std::fabs(u));
      EXPECT_LE(std::fabs(o - ref), tol) << to_string(p.activation) << " gate=" << g << " up=" << u
                                         << " got " << o << " want " << ref;
      err2 += (o - ref) * (o - ref);
      ref2 += ref * ref;
    }
    for (int64_t i = I; i < ldo; ++i)
      EXPECT_TRUE(std::isnan(out[r * ldo + i])) << "padding written";
  }
  if (ref2 > 1e-20) EXPECT_LE(std::sqrt(err2 / ref2), 1e-5) << to_string(p.activation);
}

TEST(Activation, MatchesFloat64OnRandomInputs) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-12.0f, 12.0f);
  for (Activation a : kAll) {
    for (int64_t I : {1, 7, 16, 33, 80}) {
      std::vector<float> g(I), u(I);
      for (auto& v : g) v = d(rng);
      for (auto& v : u) v = d(rng);
      ActivationParams p{a, 1.702f, 7.0f};
      check_rows(p, g, u);
    }
  }
}

TEST(Activation, LargeMagnitudesStayFinite) {
  const std::vector<float> big = {30.f,    -30.f,    87.f,   -87.f,   88.5f,  -88.5f, 100.f,
                                  -100.f,  1e4f,     -1e4f,  1e10f,   -1e10f, 1e30f,  -1e30f,
                                  FLT_MAX, -FLT_MAX, 1e-30f, -1e-30f, 0.f,    104.f};
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-3.0f, 3.0f);
  for (Activation a : kAll) {
    std::vector<float> u(big.size());
    for (auto& v : u) v = d(rng);
    ActivationParams p{a, 1.702f, 7.0f};
    if (a == Activation::kSwigluOai) {
      // gpt-oss clamps up too: large up values are fine.
      std::vector<float> u2 = big;
      check_rows(p, u, u2);
    }
    // gate large, up bounded (the product must be representable).
    std::vector<float> g = big;
    for (size_t i = 0; i < g.size(); ++i)
      if (std::fabs(g[i]) > 1e30f && a != Activation::kSwigluOai) {
        // silu/gelu(huge) * up = huge * up: keep finite by using up = 0.5.
        u[i] = 0.5f;
      }
    for (size_t i = 0; i < g.size(); ++i)
      if (std::fabs(g[i]) >= 1e38f && a != Activation::kSwigluOai) g[i] = g[i] > 0 ? 1e37f : -1e37f;
    check_rows(p, g, u);
  }
}

TEST(Activation, SwigluOaiClampsAtLimit) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> lim(1.0f, 10.0f), alpha(0.5f, 2.5f);
  for (int rep = 0; rep < 5; ++rep) {
    ActivationParams p{Activation::kSwigluOai, alpha(rng), lim(rng)};
    const float L = p.swiglu_limit;
    // gate above the limit behaves like gate = limit; up is clamped on both sides.
    std::vector<float> g = {L * 1.5f, L, L * 3.0f, -L * 2.0f, 0.5f * L};
    std::vector<float> u = {L * 4.0f, -L * 4.0f, 0.25f, L * 1.01f, -L * 1.01f};
    check_rows(p, g, u);
    float x[2] = {L * 2.0f, L * 9.0f}, y = 0;
    apply_activation(p, x, 2, &y, 1, 1, 1);
    const double glu = L / (1.0 + std::exp(-static_cast<double>(L) * p.swiglu_alpha));
    EXPECT_NEAR(y, (L + 1.0) * glu, 1e-5 * (L + 1.0) * glu);
  }
}

TEST(Activation, ZeroRowsIsNoop) {
  float out = 1.0f;
  const float x[2] = {1.0f, 2.0f};
  apply_activation({}, x, 2, &out, 1, 0, 1);
  EXPECT_EQ(out, 1.0f);
}

}  // namespace
}  // namespace fusedmoe
