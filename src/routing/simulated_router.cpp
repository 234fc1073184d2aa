// fusedmoe: the routing simulator for benchmarks (RoutingMethod::kSimulated).
// Ignores router_logits. Each token draws its k distinct experts from the
// E + Z columns (zero-expert columns become -1) with a private generator
// seeded from (simulation_seed, token index), so a run is reproducible and a
// token's routing does not depend on the batch split or thread count.
//   kUniform : k distinct experts uniformly at random (Floyd's algorithm)
//   kZipf    : sequential draws without replacement, P(e) ~ 1 / (e + 1)^zipf_s
//   kAllToOne: experts 0..k-1 (expert 0 first)
// topk_weights = routed_scaling_factor / k (uniform: the simulator measures
// load, not gate quality).
#include <algorithm>
#include <cmath>
#include <vector>

#include "routing/router_impl.h"

namespace fusedmoe::routing {
namespace {

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct TokenRng {
  TokenRng(uint64_t seed, int64_t token) : state(seed) {
    uint64_t s = seed ^ (static_cast<uint64_t>(token) * 0xd1b54a32d192ed03ull);
    state = splitmix64(s);
  }
  uint64_t next() { return splitmix64(state); }
  // Uniform integer in [0, n) (multiply-shift; bias < n / 2^64).
  int64_t below(int64_t n) {
    return static_cast<int64_t>(
        (static_cast<unsigned __int128>(next()) * static_cast<uint64_t>(n)) >> 64);
  }
  // Uniform double in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  uint64_t state;
};

inline bool contains(const int32_t* v, int64_t n, int32_t x) {
  for (int64_t i = 0; i < n; ++i)
    if (v[i] == x) return true;
  return false;
}

class SimulatedRouter final : public RouterBase {
 public:
  explicit SimulatedRouter(const MoEConfig& c) : RouterBase(c, false, false) {
    if (c.simulated == SimulatedRouting::kZipf) {
      const int64_t n = c.num_router_logits();
      pmf_.resize(n);
      cdf_.resize(n);
      double acc = 0.0;
      for (int64_t e = 0; e < n; ++e) {
        pmf_[e] = std::pow(static_cast<double>(e + 1), -c.zipf_s);
        cdf_[e] = (acc += pmf_[e]);
      }
    }
  }
  const char* name() const override { return "simulated"; }

 protected:
  void route(const RouteArgs& a, int64_t begin, int64_t end) const override {
    const int64_t n = config_.num_router_logits(), k = config_.top_k;
    const float w = static_cast<float>(static_cast<double>(config_.routed_scaling_factor) /
                                       static_cast<double>(k));
    std::vector<int32_t> sel(k);
    for (int64_t t = begin; t < end; ++t) {
      TokenRng rng(config_.simulation_seed, t);
      switch (config_.simulated) {
        case SimulatedRouting::kUniform:
          // Floyd: for j = n-k .. n-1 draw r in [0, j]; take r, or j if r was taken.
          for (int64_t j = n - k, m = 0; j < n; ++j, ++m) {
            const int32_t r = static_cast<int32_t>(rng.below(j + 1));
            sel[m] = contains(sel.data(), m, r) ? static_cast<int32_t>(j) : r;
          }
          break;
        case SimulatedRouting::kZipf:
          for (int64_t m = 0; m < k; ++m) sel[m] = draw_zipf(rng, sel.data(), m);
          break;
        case SimulatedRouting::kAllToOne:
          for (int64_t m = 0; m < k; ++m) sel[m] = static_cast<int32_t>(m);
          break;
      }
      int32_t* ids = a.ids + t * a.ids_ld;
      float* out = a.weights + t * a.weights_ld;
      for (int64_t j = 0; j < k; ++j) {
        ids[j] = out_id(sel[j]);
        out[j] = w;
      }
    }
  }

 private:
  // One draw from the Zipf pmf conditioned on not being in taken[0..m):
  // rejection from the full distribution, then (if unlucky) an exact walk over
  // the remaining mass. Both give the same conditional distribution.
  int32_t draw_zipf(TokenRng& rng, const int32_t* taken, int64_t m) const {
    const int64_t n = static_cast<int64_t>(cdf_.size());
    const double total = cdf_.back();
    for (int attempt = 0; attempt < 32; ++attempt) {
      const double u = rng.uniform() * total;
      int64_t e = std::upper_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin();
      e = std::min(e, n - 1);
      if (!contains(taken, m, static_cast<int32_t>(e))) return static_cast<int32_t>(e);
    }
    double remaining = total;
    for (int64_t i = 0; i < m; ++i) remaining -= pmf_[taken[i]];
    const double u = rng.uniform() * remaining;
    double acc = 0.0;
    int32_t last = -1;
    for (int64_t e = 0; e < n; ++e) {
      if (contains(taken, m, static_cast<int32_t>(e))) continue;
      last = static_cast<int32_t>(e);
      acc += pmf_[e];
      if (acc > u) return last;
    }
    return last;  // rounding: the last free expert
  }
  std::vector<double> pmf_, cdf_;  // kZipf: weights 1/(e+1)^s and their prefix sums
};

}  // namespace

std::unique_ptr<Router> make_simulated_router(const MoEConfig& config) {
  return std::make_unique<SimulatedRouter>(config);
}

}  // namespace fusedmoe::routing
