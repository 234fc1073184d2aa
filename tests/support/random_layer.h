// Test helpers: random expert weights and whole MoE layers (CPU, CUDA and
// parallel tests build their layers with these).
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "fusedmoe/config/moe_config.h"
#include "fusedmoe/core/tensor.h"
#include "fusedmoe/runner/moe_runner.h"

namespace fusedmoe::test {

// Uniform [-scale, scale) values, stored as `dtype` (kF32, or kBF16 / kF16 rounded).
Tensor random_weight(std::mt19937_64& rng, std::initializer_list<int64_t> shape, float scale,
                     DType dtype);

// E experts: w13 [E, 2I, H] (scale 2/sqrt(H)), w2 [E, H, I] (scale 2/sqrt(I)),
// and with `bias` w13_bias [E, 2I], w2_bias [E, H] (scale 0.5), all `dtype`.
ExpertWeights random_experts(std::mt19937_64& rng, int64_t E, int64_t H, int64_t I, DType dtype,
                             bool bias);

// A random full layer for `c`: gate_weight [L, H] (L = num_router_logits()),
// gate_bias [L], e_score_correction_bias f32 ([E] for grouped routing, else
// [L]), a hash_table [hash_vocab_size, top_k] of distinct ids in [0, L) for
// hash routing, routed experts, the shared expert and its gate [1, H].
MoELayerWeights random_layer(std::mt19937_64& rng, const MoEConfig& c, DType dtype);

// MoEConfig defaults with num_experts E, top_k k, hidden_size H, intermediate_size I.
MoEConfig base_config(int64_t E, int64_t k, int64_t H, int64_t I);

// base_config(E, k, H, I) with the routing, activation and shared expert of an
// architecture: "mixtral" (softmax, renormalize), "qwen2_moe" (shared expert 56
// with sigmoid gate), "deepseek_v3" (4 groups / top 2, sigmoid + bias, scaling
// 2.5, shared 48), "gpt_oss" (top-k then softmax, router and expert biases,
// clamped SwiGLU), "llama4" (sigmoid top-1 on the input, shared 40),
// "zero_experts" (3 zero experts, GELU-tanh). Throws for other names.
MoEConfig arch_config(const std::string& arch, int64_t E, int64_t k, int64_t H, int64_t I);

}  // namespace fusedmoe::test
