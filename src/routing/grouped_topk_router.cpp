// fusedmoe: grouped top-k (DeepSeek-V2 group_limited_greedy, DeepSeek-V3
// noaux_tc). Source: HF DeepseekV2TopkRouter / DeepseekV3TopkRouter, vLLM
// grouped_topk, DeepSeek-V3 technical report (sec. 2.1.2).
//
// Per token, in double:
//   scores  = scoring_func(logits)                      [E]
//   choice  = scores + e_score_correction_bias (if any)  [E] (selection only)
//   group score g = max(choice in g)             (GroupScore::kMax, V2)
//                 = sum of the 2 largest choice  (GroupScore::kSumTop2, V3)
//   keep the topk_group best groups (ties: lower group id)
//   ids = top-k of choice among the experts of kept groups (ties: lower id);
//         experts of dropped groups are never selected (DeepSeek-V3's reference
//         inference code and vLLM mask them with -inf). HF transformers masks
//         them with 0: the same for V2's softmax scores whenever k fits the kept
//         groups (validate() enforces it), but with V3's bias a kept expert's
//         choice can be negative, and HF then picks dropped experts (0 > it);
//         we do not (test Router.GroupedTopKNeverSelectsDroppedGroupsWithNegativeScores).
//   weights = scores[ids], renormalized with a 1e-20 guard if renormalize,
//             * routed_scaling_factor.
#include <vector>

#include "routing/router_impl.h"

namespace fusedmoe::routing {
namespace {

class GroupedTopKRouter final : public RouterBase {
 public:
  GroupedTopKRouter(const MoEConfig& c, std::vector<double> bias)
      : RouterBase(c, true, false), bias_(std::move(bias)) {}
  const char* name() const override { return "grouped_topk"; }

 protected:
  void route(const RouteArgs& a, int64_t begin, int64_t end) const override {
    const int64_t E = config_.num_experts, k = config_.top_k;
    const int64_t G = config_.num_expert_group, per = E / G, kg = config_.topk_group;
    const double scale = config_.routed_scaling_factor;
    const ScoringFunc f = config_.scoring_func;
    const bool sum_top2 = config_.group_score == GroupScore::kSumTop2;
    std::vector<double> scores(E), choice(E), gvals(kg), evals(k), w(k);
    std::vector<int32_t> gids(kg), eids(k);
    for (int64_t t = begin; t < end; ++t) {
      const float* row = a.logits + t * a.logits_ld;
      if (f == ScoringFunc::kSoftmax) {
        double m = row[0];
        for (int64_t e = 1; e < E; ++e) m = std::max<double>(m, row[e]);
        double denom = 0.0;
        for (int64_t e = 0; e < E; ++e) denom += (scores[e] = rel_exp(row[e], m));
        for (int64_t e = 0; e < E; ++e) scores[e] /= denom;
      } else if (f == ScoringFunc::kSigmoid) {
        for (int64_t e = 0; e < E; ++e) scores[e] = sigmoid(row[e]);
      } else {
        for (int64_t e = 0; e < E; ++e) scores[e] = sqrt_softplus(row[e]);
      }
      if (bias_.empty()) {
        for (int64_t e = 0; e < E; ++e) choice[e] = scores[e];
      } else {
        for (int64_t e = 0; e < E; ++e) choice[e] = scores[e] + bias_[e];
      }
      // Best groups.
      TopKList<double> gtop(gvals.data(), gids.data(), kg);
      for (int64_t g = 0; g < G; ++g) {
        const double* c = choice.data() + g * per;
        double gs;
        if (sum_top2) {
          double m1 = c[0], m2 = c[1];
          if (m2 > m1) std::swap(m1, m2);
          for (int64_t i = 2; i < per; ++i) {
            if (c[i] > m1) {
              m2 = m1;
              m1 = c[i];
            } else if (c[i] > m2) {
              m2 = c[i];
            }
          }
          gs = m1 + m2;
        } else {
          gs = c[0];
          for (int64_t i = 1; i < per; ++i) gs = std::max(gs, c[i]);
        }
        gtop.push(gs, static_cast<int32_t>(g));
      }
      // Experts of the kept groups, visited in increasing id order.
      std::sort(gids.begin(), gids.end());
      TopKList<double> etop(evals.data(), eids.data(), k);
      for (int64_t j = 0; j < kg; ++j) {
        const int64_t e0 = gids[j] * per;
        etop.scan(choice.data() + e0, per, static_cast<int32_t>(e0));
      }
      double sum = 0.0, infinite = 0.0;
      for (int64_t j = 0; j < k; ++j) sum += (w[j] = scores[eids[j]]), infinite += w[j] == HUGE_VAL;
      int32_t* ids = a.ids + t * a.ids_ld;
      float* out = a.weights + t * a.weights_ld;
      for (int64_t j = 0; j < k; ++j) {
        ids[j] = eids[j];
        const double wj = config_.renormalize ? renormalized(w[j], sum, 1e-20, infinite) : w[j];
        out[j] = static_cast<float>(wj * scale);
      }
    }
  }

 private:
  std::vector<double> bias_;  // [E] or empty
};

}  // namespace

std::unique_ptr<Router> make_grouped_topk_router(const MoEConfig& config,
                                                 std::vector<double> bias) {
  return std::make_unique<GroupedTopKRouter>(config, std::move(bias));
}

}  // namespace fusedmoe::routing
