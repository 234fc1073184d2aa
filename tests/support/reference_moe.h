// fusedmoe tests: plain float64 reference of the expert MLPs and of the whole
// MoE layer, given the router's choice (topk_ids / topk_weights) as inputs so
// that it does not depend on the router. Weights (f32 or bf16) are read
// exactly and every product and sum is done in double.
#pragma once

#include <vector>

#include "fusedmoe/config/moe_config.h"
#include "fusedmoe/core/tensor.h"
#include "fusedmoe/experts/expert_weights.h"
#include "fusedmoe/runner/moe_runner.h"

namespace fusedmoe::test {

// act(gate, up) in double: the formulas of Activation (config/moe_config.h);
// gpt-oss as HF GptOssExperts._apply_gate.
double reference_activation(const ActivationParams& p, double gate, double up);

// Routed experts, [T, H] row-major:
//   out[t] = sum_{j: id != -1} w[t,j] * (w2[e] . act(w13[e] . x_t + b13[e]) + b2[e])
// or, with apply_router_weight_on_input, the same with x_t * w[t,j] as the
// input and no output scale (Llama-4). hidden_states f32 [T, H] (any row
// stride), topk_ids i32 [T, k], topk_weights f32 [T, k].
std::vector<double> reference_experts(const TensorView& hidden_states, const TensorView& topk_ids,
                                      const TensorView& topk_weights, const ExpertWeights& weights,
                                      const ActivationParams& act,
                                      bool apply_router_weight_on_input);

// hidden_states . gate_weight^T (+ gate_bias), [T, E + Z] row-major.
std::vector<double> reference_router_logits(const MoEConfig& config, const MoELayerWeights& weights,
                                            const TensorView& hidden_states);

// The whole layer given the router's choice, [T, H] row-major:
//   routed (reference_experts) + shared expert (if any) scaled by
//   sigmoid(x . shared_expert_gate[0]) when the config has that gate.
std::vector<double> reference_moe_layer(const MoEConfig& config, const MoELayerWeights& weights,
                                        const TensorView& hidden_states, const TensorView& topk_ids,
                                        const TensorView& topk_weights);

}  // namespace fusedmoe::test
