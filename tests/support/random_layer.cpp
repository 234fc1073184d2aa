#include "random_layer.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "test_util.h"

namespace fusedmoe::test {

Tensor random_weight(std::mt19937_64& rng, std::initializer_list<int64_t> shape, float scale,
                     DType dtype) {
  Tensor t = random_f32(rng, shape, -scale, scale);
  return dtype == DType::kBF16 ? to_bf16(t) : dtype == DType::kF16 ? to_f16(t) : t;
}

ExpertWeights random_experts(std::mt19937_64& rng, int64_t E, int64_t H, int64_t I, DType dtype,
                             bool bias) {
  ExpertWeights w;
  w.w13 = random_weight(rng, {E, 2 * I, H}, 2.0f / std::sqrt(static_cast<float>(H)), dtype);
  w.w2 = random_weight(rng, {E, H, I}, 2.0f / std::sqrt(static_cast<float>(I)), dtype);
  if (bias) {
    w.w13_bias = random_weight(rng, {E, 2 * I}, 0.5f, dtype);
    w.w2_bias = random_weight(rng, {E, H}, 0.5f, dtype);
  }
  return w;
}

MoELayerWeights random_layer(std::mt19937_64& rng, const MoEConfig& c, DType dtype) {
  MoELayerWeights w;
  const int64_t L = c.num_router_logits(), H = c.hidden_size;
  w.gate_weight = random_weight(rng, {L, H}, 3.0f / std::sqrt(static_cast<float>(H)), dtype);
  if (c.has_router_bias) w.gate_bias = random_weight(rng, {L}, 0.5f, dtype);
  if (c.has_e_score_correction_bias)
    w.router_params.e_score_correction_bias = random_f32(
        rng,
        {c.routing_method == RoutingMethod::kGroupedTopK || c.num_expert_group > 1 ? c.num_experts
                                                                                   : L},
        -0.1f, 0.1f);
  if (c.routing_method == RoutingMethod::kHash) {
    Tensor table = Tensor::empty(DType::kI32, {c.hash_vocab_size, c.top_k});
    std::vector<int32_t> perm(static_cast<size_t>(L));
    for (int64_t v = 0; v < c.hash_vocab_size; ++v) {
      for (int64_t e = 0; e < L; ++e) perm[e] = static_cast<int32_t>(e);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int64_t j = 0; j < c.top_k; ++j) table.data_as<int32_t>()[v * c.top_k + j] = perm[j];
    }
    w.router_params.hash_table = table;
  }
  w.experts = random_experts(rng, c.num_experts, H, c.intermediate_size, dtype, c.has_expert_bias);
  if (c.has_shared_expert())
    w.shared_experts = random_experts(rng, 1, H, c.shared_intermediate_size, dtype, false);
  if (c.has_shared_expert_gate) w.shared_expert_gate = random_weight(rng, {1, H}, 0.3f, dtype);
  return w;
}

MoEConfig base_config(int64_t E, int64_t k, int64_t H, int64_t I) {
  MoEConfig c;
  c.num_experts = E;
  c.top_k = k;
  c.hidden_size = H;
  c.intermediate_size = I;
  return c;
}

MoEConfig arch_config(const std::string& arch, int64_t E, int64_t k, int64_t H, int64_t I) {
  MoEConfig c = base_config(E, k, H, I);
  if (arch == "mixtral") {
    c.renormalize = true;
  } else if (arch == "qwen2_moe") {
    c.shared_intermediate_size = 56;
    c.has_shared_expert_gate = true;
  } else if (arch == "deepseek_v3") {
    c.routing_method = RoutingMethod::kGroupedTopK;
    c.scoring_func = ScoringFunc::kSigmoid;
    c.num_expert_group = 4;
    c.topk_group = 2;
    c.group_score = GroupScore::kSumTop2;
    c.has_e_score_correction_bias = true;
    c.renormalize = true;
    c.routed_scaling_factor = 2.5f;
    c.shared_intermediate_size = 48;
  } else if (arch == "gpt_oss") {
    c.routing_method = RoutingMethod::kTopKSoftmax;
    c.has_router_bias = true;
    c.has_expert_bias = true;
    c.activation = Activation::kSwigluOai;
  } else if (arch == "llama4") {
    c.routing_method = RoutingMethod::kLlama4;
    c.scoring_func = ScoringFunc::kSigmoid;
    c.apply_router_weight_on_input = true;
    c.shared_intermediate_size = 40;
  } else if (arch == "zero_experts") {
    c.num_zero_experts = 3;
    c.activation = Activation::kGeluTanhGlu;
  } else {
    FUSEDMOE_THROW(kInvalidArgument, "arch_config: unknown architecture '", arch, "'");
  }
  return c;
}

}  // namespace fusedmoe::test
