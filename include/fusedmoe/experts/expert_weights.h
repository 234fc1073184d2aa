// fusedmoe: expert weights and activations.
//
// Layout (vLLM's convention, the one every kernel reads):
//   w13      [E, 2I, H]  rows 0..I-1 = gate_proj (w1), rows I..2I-1 = up_proj (w3)
//   w2       [E, H, I]   down_proj
//   w13_bias [E, 2I]     optional (gpt-oss), same gate/up order
//   w2_bias  [E, H]      optional
// Weights are f32 or bf16 and contiguous; bf16 stays bf16 in memory (kernels
// convert panels on the fly, never a whole f32 copy). Biases are f32 or bf16.
// A shared expert is an ExpertWeights with E = 1.
#pragma once

#include <optional>

#include "fusedmoe/config/moe_config.h"
#include "fusedmoe/core/tensor.h"

namespace fusedmoe {

struct ExpertWeights {
  Tensor w13;
  Tensor w2;
  std::optional<Tensor> w13_bias;
  std::optional<Tensor> w2_bias;

  int64_t num_experts() const { return w13.size(0); }
  int64_t intermediate_size() const { return w2.size(2); }
  int64_t hidden_size() const { return w2.size(1); }
  DType dtype() const { return w13.dtype(); }
  size_t nbytes() const;

  // Throws Error(kInvalidArgument) naming `what` (e.g. "experts", "shared_experts")
  // and the tensor when shapes differ from [E, 2I, H] / [E, H, I] (and the biases
  // from [E, 2I] / [E, H]), dtypes are not f32/bf16 or differ between w13 and w2,
  // tensors are not contiguous, or biases are present/absent against `has_bias`.
  void validate(int64_t num_experts, int64_t hidden_size, int64_t intermediate_size, bool has_bias,
                const char* what) const;
};

// E and I of expert weights given without a config (the functional
// fused_experts): w2 [E, H, I]'s, checked against w13 [E, 2I, H]. Throws
// Error(kInvalidArgument) naming both (`w13_name`, `w2_name`) and their shapes
// when either is not 3-d or they disagree on E or I, except where w13's middle
// size is odd (it cannot be 2I): w13 is then the wrong one, and the caller's
// shape check names it with the [E, 2I, H] that w2 implies.
struct ExpertSizes {
  int64_t num_experts = 0, intermediate_size = 0;
};
ExpertSizes expert_sizes_from_w2(const ExpertWeights& w, const char* w13_name, const char* w2_name);

// apply_router_weight_on_input scales the expert's input by the router weight,
// which only means something with one expert per token (Llama-4; vLLM and HF
// transformers refuse it with top_k > 1): Error(kInvalidArgument) naming it
// and topk_ids [T, k] when it is set and k != 1.
void check_router_weight_on_input(bool apply_router_weight_on_input, const TensorView& topk_ids);

// topk_ids [T, k] and topk_weights [T, k'] (both 2-D, T rows each) with k !=
// k': which one is wrong cannot be told, so Error(kInvalidArgument) names both
// ("topk_ids [5, 1] and topk_weights [5, 2] disagree: expected the same [T,
// top_k]"). Other shapes pass (check_tensor names the one that is wrong).
void check_topk_shapes_agree(const TensorView& topk_ids, const TensorView& topk_weights);

// Parameters of the gated activation (from MoEConfig).
struct ActivationParams {
  Activation activation = Activation::kSiluGlu;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  static ActivationParams from_config(const MoEConfig& c) {
    return {c.activation, c.swiglu_alpha, c.swiglu_limit};
  }
  // kSwigluOai: swiglu_limit finite and > 0 (a limit <= 0 clamps every gate to
  // it and zeroes the output; NaN disables the clamp), swiglu_alpha finite.
  // Another activation: swiglu_alpha and swiglu_limit at their defaults (a
  // value it would ignore is refused). Error(kInvalidArgument) naming the
  // field (and the activation) otherwise.
  void validate() const;
};

// out[r, i] = act(gate = x[r, i], up = x[r, I + i]) for r < rows, i < I.
// x: f32 rows of length >= 2I with row stride ldx; out: f32 with row stride ldo.
// Formulas: see Activation in config/moe_config.h (SiLU-GLU: Shazeer 2020;
// gpt-oss clamped SwiGLU: HF GptOssExperts).
void apply_activation(const ActivationParams& p, const float* x, int64_t ldx, float* out,
                      int64_t ldo, int64_t rows, int64_t intermediate_size);

}  // namespace fusedmoe
