// Helpers of the parallel tests (single-rank unit tests and mpirun tests):
// random expert layers, random routings, the single-rank routed result.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "fusedmoe/kernels/modular_kernel.h"
#include "fusedmoe/parallel/distributed_experts.h"
#include "test_util.h"

namespace fusedmoe::test {

inline Tensor random_weight(std::mt19937_64& rng, std::initializer_list<int64_t> shape, float scale,
                            DType dtype) {
  Tensor t = random_f32(rng, shape, -scale, scale);
  return dtype == DType::kBF16 ? to_bf16(t) : t;
}

inline ExpertWeights random_experts(std::mt19937_64& rng, int64_t E, int64_t H, int64_t I,
                                    DType dtype, bool bias) {
  ExpertWeights w;
  w.w13 = random_weight(rng, {E, 2 * I, H}, 2.0f / std::sqrt(static_cast<float>(H)), dtype);
  w.w2 = random_weight(rng, {E, H, I}, 2.0f / std::sqrt(static_cast<float>(I)), dtype);
  if (bias) {
    w.w13_bias = random_weight(rng, {E, 2 * I}, 0.5f, dtype);
    w.w2_bias = random_weight(rng, {E, H}, 0.5f, dtype);
  }
  return w;
}

// topk_ids i32 [T, k]: k distinct experts per token, each slot -1 with
// probability p_none; topk_weights f32 [T, k] in [0.05, 1).
inline void random_routing(std::mt19937_64& rng, int64_t T, int64_t k, int64_t E, double p_none,
                           Tensor& ids, Tensor& weights) {
  ids = Tensor::empty(DType::kI32, {T, k});
  weights = random_f32(rng, {T, k}, 0.05f, 1.0f);
  std::vector<int32_t> perm(E);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) perm[e] = static_cast<int32_t>(e);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < k; ++j)
      ids.data_as<int32_t>()[t * k + j] = u(rng) < p_none ? -1 : perm[j];
  }
}

// The single-rank routed output with all experts: f32 [T, H].
inline Tensor single_rank_routed(const TensorView& hidden, const TensorView& ids,
                                 const TensorView& weights, const ExpertWeights& experts,
                                 const ExpertsParams& params, bool on_input) {
  const int64_t T = hidden.size(0), H = hidden.size(1);
  Tensor out = Tensor::empty(DType::kF32, {T, H});
  auto kernel = make_cpu_modular_kernel();
  Workspace ws;
  kernel->forward(hidden, ids, weights, experts, params, on_input, out.view(), ws);
  return out;
}

// Rows [row0, row0 + rows) of a contiguous 2-d tensor, as a view.
inline TensorView rows_of(const Tensor& t, int64_t row0, int64_t rows) {
  return t.view().narrow(0, row0, rows);
}

// True when a and b (f32, same shape, rows contiguous) have identical bits.
inline bool bit_identical(const TensorView& a, const TensorView& b) {
  if (a.size(0) != b.size(0) || a.size(1) != b.size(1)) return false;
  for (int64_t r = 0; r < a.size(0); ++r)
    if (std::memcmp(a.data_as<const float>() + r * a.stride(0),
                    b.data_as<const float>() + r * b.stride(0), a.size(1) * sizeof(float)) != 0)
      return false;
  return true;
}

}  // namespace fusedmoe::test

#include "fusedmoe/runner/moe_runner.h"

namespace fusedmoe::test {

// A random full layer for `c` (router, routed experts, shared expert, gates).
inline MoELayerWeights random_layer(std::mt19937_64& rng, const MoEConfig& c, DType dtype) {
  MoELayerWeights w;
  const int64_t L = c.num_router_logits(), H = c.hidden_size;
  w.gate_weight = random_weight(rng, {L, H}, 3.0f / std::sqrt(static_cast<float>(H)), dtype);
  if (c.has_router_bias) w.gate_bias = random_weight(rng, {L}, 0.5f, dtype);
  if (c.has_e_score_correction_bias)
    w.router_params.e_score_correction_bias = random_f32(rng, {c.num_experts}, -0.1f, 0.1f);
  w.experts = random_experts(rng, c.num_experts, H, c.intermediate_size, dtype, c.has_expert_bias);
  if (c.has_shared_expert())
    w.shared_experts = random_experts(rng, 1, H, c.shared_intermediate_size, dtype, false);
  if (c.has_shared_expert_gate) w.shared_expert_gate = random_weight(rng, {1, H}, 0.3f, dtype);
  return w;
}

}  // namespace fusedmoe::test
