#include "reference_moe.h"

#include <algorithm>
#include <cmath>

#include "test_util.h"

namespace fusedmoe::test {

double reference_activation(const ActivationParams& p, double gate, double up) {
  switch (p.activation) {
    case Activation::kSiluGlu:
      return gate / (1.0 + std::exp(-gate)) * up;
    case Activation::kGeluGlu:
      // 1 + erf(y) = erfc(-y) (no cancellation for gate << 0).
      return 0.5 * gate * std::erfc(-gate / std::sqrt(2.0)) * up;
    case Activation::kGeluTanhGlu: {
      const double z = std::sqrt(2.0 / M_PI) * (gate + 0.044715 * gate * gate * gate);
      // 0.5 (1 + tanh z) = 1 / (1 + e^{-2z}) exactly (no cancellation for gate << 0).
      return gate / (1.0 + std::exp(-2.0 * z)) * up;
    }
    case Activation::kSwigluOai: {
      const double limit = p.swiglu_limit, alpha = p.swiglu_alpha;
      const double g = std::min(gate, limit);
      const double u = std::clamp(up, -limit, limit);
      const double glu = g / (1.0 + std::exp(-g * alpha));
      return (u + 1.0) * glu;
    }
  }
  return 0.0;
}

namespace {

// One expert MLP on one input row x [H] -> y [H] (+= scale * result).
struct ExpertsF64 {
  int64_t E, H, I;
  std::vector<double> w13, w2, b13, b2;
  explicit ExpertsF64(const ExpertWeights& w)
      : E(w.num_experts()),
        H(w.hidden_size()),
        I(w.intermediate_size()),
        w13(to_f64_vector(w.w13)),
        w2(to_f64_vector(w.w2)) {
    if (w.w13_bias) b13 = to_f64_vector(*w.w13_bias);
    if (w.w2_bias) b2 = to_f64_vector(*w.w2_bias);
  }
  void run(int64_t e, const ActivationParams& act, const double* x, double scale, double* y) const {
    std::vector<double> a(I);
    const double* W = w13.data() + e * 2 * I * H;
    for (int64_t i = 0; i < I; ++i) {
      double g = b13.empty() ? 0.0 : b13[e * 2 * I + i];
      double u = b13.empty() ? 0.0 : b13[e * 2 * I + I + i];
      for (int64_t h = 0; h < H; ++h) {
        g += W[i * H + h] * x[h];
        u += W[(I + i) * H + h] * x[h];
      }
      a[i] = reference_activation(act, g, u);
    }
    const double* W2 = w2.data() + e * H * I;
    for (int64_t h = 0; h < H; ++h) {
      double s = b2.empty() ? 0.0 : b2[e * H + h];
      for (int64_t i = 0; i < I; ++i) s += W2[h * I + i] * a[i];
      y[h] += scale * s;
    }
  }
};

std::vector<double> rows_f64(const TensorView& x) {
  return to_f64_vector(x);
}

}  // namespace

std::vector<double> reference_experts(const TensorView& hidden_states, const TensorView& topk_ids,
                                      const TensorView& topk_weights, const ExpertWeights& weights,
                                      const ActivationParams& act,
                                      bool apply_router_weight_on_input) {
  const int64_t T = hidden_states.size(0), H = hidden_states.size(1), k = topk_ids.size(1);
  const std::vector<double> x = rows_f64(hidden_states);
  const std::vector<double> ids = to_f64_vector(topk_ids);
  const std::vector<double> w = to_f64_vector(topk_weights);
  const ExpertsF64 ex(weights);
  std::vector<double> out(T * H, 0.0), xin(H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t id = static_cast<int64_t>(ids[t * k + j]);
      if (id < 0) continue;
      const double wt = w[t * k + j];
      if (apply_router_weight_on_input) {
        // HF Llama4: routed_in = hidden * score, computed in the model dtype
        // (f32 here), so the input is the f32 product.
        for (int64_t h = 0; h < H; ++h)
          xin[h] = static_cast<float>(static_cast<float>(x[t * H + h]) * static_cast<float>(wt));
        ex.run(id, act, xin.data(), 1.0, out.data() + t * H);
      } else {
        ex.run(id, act, x.data() + t * H, wt, out.data() + t * H);
      }
    }
  return out;
}

std::vector<double> reference_router_logits(const MoEConfig& config, const MoELayerWeights& weights,
                                            const TensorView& hidden_states) {
  const int64_t T = hidden_states.size(0), H = hidden_states.size(1);
  const int64_t L = config.num_router_logits();
  const std::vector<double> x = rows_f64(hidden_states);
  const std::vector<double> g = to_f64_vector(weights.gate_weight);
  std::vector<double> b;
  if (weights.gate_bias) b = to_f64_vector(*weights.gate_bias);
  std::vector<double> out(T * L);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t l = 0; l < L; ++l) {
      double s = b.empty() ? 0.0 : b[l];
      for (int64_t h = 0; h < H; ++h) s += x[t * H + h] * g[l * H + h];
      out[t * L + l] = s;
    }
  return out;
}

std::vector<double> reference_moe_layer(const MoEConfig& config, const MoELayerWeights& weights,
                                        const TensorView& hidden_states, const TensorView& topk_ids,
                                        const TensorView& topk_weights) {
  const ActivationParams act = ActivationParams::from_config(config);
  std::vector<double> out =
      reference_experts(hidden_states, topk_ids, topk_weights, weights.experts, act,
                        config.apply_router_weight_on_input);
  if (!config.has_shared_expert()) return out;
  const int64_t T = hidden_states.size(0), H = hidden_states.size(1);
  const std::vector<double> x = rows_f64(hidden_states);
  const ExpertsF64 shared(*weights.shared_experts);
  std::vector<double> gate;
  if (config.has_shared_expert_gate) gate = to_f64_vector(*weights.shared_expert_gate);
  for (int64_t t = 0; t < T; ++t) {
    double scale = 1.0;
    if (!gate.empty()) {
      double z = 0.0;
      for (int64_t h = 0; h < H; ++h) z += x[t * H + h] * gate[h];
      scale = 1.0 / (1.0 + std::exp(-z));
    }
    shared.run(0, act, x.data() + t * H, scale, out.data() + t * H);
  }
  return out;
}

}  // namespace fusedmoe::test
