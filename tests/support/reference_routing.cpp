// fusedmoe tests: plain float64 reference routers (see reference_routing.h).
#include "reference_routing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace fusedmoe::test {
namespace {

std::vector<double> score_row(ScoringFunc f, const float* x, int64_t n) {
  std::vector<double> s(n);
  if (f == ScoringFunc::kSoftmax) {
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, static_cast<double>(x[i]));
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += (s[i] = std::exp(x[i] - m));
    for (int64_t i = 0; i < n; ++i) s[i] /= sum;
  } else if (f == ScoringFunc::kSigmoid) {
    for (int64_t i = 0; i < n; ++i) s[i] = 1.0 / (1.0 + std::exp(-static_cast<double>(x[i])));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const double v = x[i];
      const double softplus = v > 0.0 ? v + std::log1p(std::exp(-v)) : std::log1p(std::exp(v));
      s[i] = std::sqrt(softplus);
    }
  }
  return s;
}

// Indices of the k largest values (descending; ties: lower index first).
std::vector<int32_t> topk_indices(const std::vector<double>& v, int64_t k) {
  std::vector<int32_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
  idx.resize(k);
  return idx;
}

ReferenceRouting make(int64_t T, int64_t k) {
  ReferenceRouting r;
  r.num_tokens = T;
  r.top_k = k;
  r.topk_ids.resize(T * k);
  r.topk_weights.resize(T * k);
  return r;
}

int32_t map_zero(const MoEConfig& c, int32_t id) {
  return id < c.num_experts ? id : -1;
}

}  // namespace

ReferenceRouting reference_topk(const MoEConfig& c, const float* logits, int64_t T, int64_t ld,
                                const std::vector<double>& bias) {
  const int64_t n = c.num_router_logits(), k = c.top_k;
  ReferenceRouting r = make(T, k);
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<double> s = score_row(c.scoring_func, logits + t * ld, n);
    std::vector<double> choice = s;
    if (!bias.empty())
      for (int64_t i = 0; i < n; ++i) choice[i] += bias[i];
    const std::vector<int32_t> idx = topk_indices(choice, k);
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += s[idx[j]];
    if (c.scoring_func != ScoringFunc::kSoftmax) sum += 1e-20;
    for (int64_t j = 0; j < k; ++j) {
      double w = s[idx[j]];
      if (c.renormalize) w /= sum;
      r.topk_ids[t * k + j] = map_zero(c, idx[j]);
      r.topk_weights[t * k + j] = w * c.routed_scaling_factor;
    }
  }
  return r;
}

ReferenceRouting reference_topk_softmax(const MoEConfig& c, const float* logits, int64_t T,
                                        int64_t ld) {
  const int64_t n = c.num_router_logits(), k = c.top_k;
  ReferenceRouting r = make(T, k);
  for (int64_t t = 0; t < T; ++t) {
    const float* x = logits + t * ld;
    const std::vector<double> v(x, x + n);
    const std::vector<int32_t> idx = topk_indices(v, k);
    std::vector<float> top(k);
    for (int64_t j = 0; j < k; ++j) top[j] = x[idx[j]];
    const std::vector<double> s = score_row(ScoringFunc::kSoftmax, top.data(), k);
    for (int64_t j = 0; j < k; ++j) {
      r.topk_ids[t * k + j] = map_zero(c, idx[j]);
      r.topk_weights[t * k + j] = s[j] * c.routed_scaling_factor;
    }
  }
  return r;
}

ReferenceRouting reference_grouped_topk(const MoEConfig& c, const float* logits, int64_t T,
                                        int64_t ld, const std::vector<double>& bias) {
  const int64_t E = c.num_experts, k = c.top_k, G = c.num_expert_group, per = E / G;
  ReferenceRouting r = make(T, k);
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<double> s = score_row(c.scoring_func, logits + t * ld, E);
    std::vector<double> choice = s;
    if (!bias.empty())
      for (int64_t i = 0; i < E; ++i) choice[i] += bias[i];
    std::vector<double> group_scores(G);
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> members(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::sort(members.begin(), members.end(), std::greater<double>());
      group_scores[g] = c.group_score == GroupScore::kMax ? members[0] : members[0] + members[1];
    }
    const std::vector<int32_t> groups = topk_indices(group_scores, c.topk_group);
    std::vector<double> masked(E, -std::numeric_limits<double>::infinity());
    for (int32_t g : groups)
      for (int64_t i = g * per; i < (g + 1) * per; ++i) masked[i] = choice[i];
    const std::vector<int32_t> idx = topk_indices(masked, k);
    double sum = 1e-20;
    for (int64_t j = 0; j < k; ++j) sum += s[idx[j]];
    for (int64_t j = 0; j < k; ++j) {
      double w = s[idx[j]];
      if (c.renormalize) w /= sum;
      r.topk_ids[t * k + j] = idx[j];
      r.topk_weights[t * k + j] = w * c.routed_scaling_factor;
    }
  }
  return r;
}

ReferenceRouting reference_llama4(const MoEConfig& c, const float* logits, int64_t T, int64_t ld) {
  const int64_t n = c.num_router_logits(), k = c.top_k;
  ReferenceRouting r = make(T, k);
  for (int64_t t = 0; t < T; ++t) {
    const float* x = logits + t * ld;
    const std::vector<double> v(x, x + n);
    const std::vector<int32_t> idx = topk_indices(v, k);
    double sum = 1e-20;
    for (int64_t j = 0; j < k; ++j) sum += 1.0 / (1.0 + std::exp(-v[idx[j]]));
    for (int64_t j = 0; j < k; ++j) {
      double w = 1.0 / (1.0 + std::exp(-v[idx[j]]));
      if (c.renormalize) w /= sum;
      r.topk_ids[t * k + j] = map_zero(c, idx[j]);
      r.topk_weights[t * k + j] = w * c.routed_scaling_factor;
    }
  }
  return r;
}

ReferenceRouting reference_hash(const MoEConfig& c, const int32_t* table, const int32_t* token_ids,
                                int64_t T) {
  const int64_t k = c.top_k;
  ReferenceRouting r = make(T, k);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      r.topk_ids[t * k + j] = map_zero(c, table[token_ids[t] * k + j]);
      r.topk_weights[t * k + j] = static_cast<double>(c.routed_scaling_factor) / k;
    }
  return r;
}

ReferenceRouting reference_route(const MoEConfig& c, const TensorView& router_logits,
                                 const std::vector<double>& bias) {
  const int64_t T = router_logits.size(0);
  const float* x = router_logits.data_as<const float>();
  const int64_t ld = T > 0 ? router_logits.stride(0) : 0;
  const std::vector<double> no_bias;
  const std::vector<double>& b = c.has_e_score_correction_bias ? bias : no_bias;
  if (c.routing_method == RoutingMethod::kLlama4) return reference_llama4(c, x, T, ld);
  if (c.routing_method == RoutingMethod::kGroupedTopK || c.num_expert_group > 1)
    return reference_grouped_topk(c, x, T, ld, b);
  if (c.routing_method == RoutingMethod::kTopKSoftmax) return reference_topk_softmax(c, x, T, ld);
  return reference_topk(c, x, T, ld, b);
}

}  // namespace fusedmoe::test
