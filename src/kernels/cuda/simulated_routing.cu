// fusedmoe CUDA: the routing simulator (RoutingMethod::kSimulated) on the
// device — one thread per token runs the CPU router's own per-token draw
// (routing/simulated_routing.h), so ids equal the CPU's for the same
// simulation_seed; topk_weights = routed_scaling_factor / k.
#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/cuda_common.cuh"
#include "routing/simulated_routing.h"

namespace fusedmoe::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxTopK = 32;

__global__ void __launch_bounds__(kThreads)
    route_simulated_kernel(SimulatedRouting kind, uint64_t seed, int64_t num_tokens, int cols,
                           int experts, int top_k, float weight, const double* __restrict__ pmf,
                           const double* __restrict__ cdf, int32_t* __restrict__ topk_ids,
                           float* __restrict__ topk_weights,
                           const int32_t* __restrict__ num_valid_tokens) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= num_tokens) return;
  int32_t* ids = topk_ids + t * top_k;
  float* w = topk_weights + t * top_k;
  if (num_valid_tokens != nullptr && t >= *num_valid_tokens) {  // padding row
    for (int j = 0; j < top_k; ++j) {
      ids[j] = -1;
      w[j] = 0.0f;
    }
    return;
  }
  int32_t sel[kMaxTopK];
  routing::simulated::draw_token(kind, seed, t, cols, top_k, pmf, cdf, sel);
  for (int j = 0; j < top_k; ++j) {
    ids[j] = sel[j] < experts ? sel[j] : -1;
    w[j] = weight;
  }
}

}  // namespace

void route_simulated(const MoEConfig& c, const RouteArgs& a, int64_t num_tokens, Stream stream) {
  const int64_t cols = c.num_router_logits(), k = c.top_k;
  FUSEDMOE_CHECK(c.routing_method == RoutingMethod::kSimulated,
                 "route_simulated: config.routing_method must be simulated");
  FUSEDMOE_CHECK(a.topk_ids != nullptr && a.topk_weights != nullptr,
                 "route_simulated: topk_ids and topk_weights are required");
  if (k > kMaxTopK)
    FUSEDMOE_THROW(kUnsupported, "route_simulated: top_k at most ", kMaxTopK, " on CUDA, got ", k);
  FUSEDMOE_CHECK(c.simulated != SimulatedRouting::kZipf || (a.zipf_pmf && a.zipf_cdf),
                 "route_simulated: zipf routing needs RouteArgs::zipf_pmf and zipf_cdf (device "
                 "f64 [E + Z], from routing::simulated::zipf_tables)");
  if (num_tokens == 0) return;
  const float w =
      static_cast<float>(static_cast<double>(c.routed_scaling_factor) / static_cast<double>(k));
  route_simulated_kernel<<<static_cast<unsigned>(ceil_div(num_tokens, kThreads)), kThreads, 0,
                           stream>>>(c.simulated, c.simulation_seed, num_tokens,
                                     static_cast<int>(cols), static_cast<int>(c.num_experts),
                                     static_cast<int>(k), w, a.zipf_pmf, a.zipf_cdf, a.topk_ids,
                                     a.topk_weights, a.num_valid_tokens);
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fusedmoe::cuda
