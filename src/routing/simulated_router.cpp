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
#include <vector>

#include "routing/router_impl.h"
#include "routing/simulated_routing.h"

namespace fusedmoe::routing {
namespace {

class SimulatedRouter final : public RouterBase {
 public:
  explicit SimulatedRouter(const MoEConfig& c) : RouterBase(c, false, false) {
    if (c.simulated == SimulatedRouting::kZipf)
      simulated::zipf_tables(c.num_router_logits(), c.zipf_s, pmf_, cdf_);
  }
  const char* name() const override { return "simulated"; }

 protected:
  void route(const RouteArgs& a, int64_t begin, int64_t end) const override {
    const int64_t n = config_.num_router_logits(), k = config_.top_k;
    const float w = static_cast<float>(static_cast<double>(config_.routed_scaling_factor) /
                                       static_cast<double>(k));
    std::vector<int32_t> sel(k);
    for (int64_t t = begin; t < end; ++t) {
      simulated::draw_token(config_.simulated, config_.simulation_seed, t, n, k, pmf_.data(),
                            cdf_.data(), sel.data());
      int32_t* ids = a.ids + t * a.ids_ld;
      float* out = a.weights + t * a.weights_ld;
      for (int64_t j = 0; j < k; ++j) {
        ids[j] = out_id(sel[j]);
        out[j] = w;
      }
    }
  }

 private:
  std::vector<double> pmf_, cdf_;  // kZipf: weights 1/(c+1)^s and their prefix sums
};

}  // namespace

std::unique_ptr<Router> make_simulated_router(const MoEConfig& config) {
  return std::make_unique<SimulatedRouter>(config);
}

}  // namespace fusedmoe::routing
