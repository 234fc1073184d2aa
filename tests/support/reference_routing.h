// fusedmoe tests: plain float64 reference routers.
//
// Written to follow the HF / vLLM formulas literally (full score vectors,
// stable sorts, masks), not fast. Selection is on the double scores; ties go
// to the lower expert id (std::stable_sort on descending score). Ids >= E
// (zero experts) are written as -1, like the library.
#pragma once

#include <cstdint>
#include <vector>

#include "fusedmoe/config/moe_config.h"
#include "fusedmoe/core/tensor.h"

namespace fusedmoe::test {

struct ReferenceRouting {
  int64_t num_tokens = 0;
  int64_t top_k = 0;
  std::vector<int32_t> topk_ids;     // [T, k], descending score order
  std::vector<double> topk_weights;  // [T, k]
  int32_t id(int64_t t, int64_t j) const { return topk_ids[t * top_k + j]; }
  double weight(int64_t t, int64_t j) const { return topk_weights[t * top_k + j]; }
};

// logits: T rows of config.num_router_logits() floats, row stride `ld`.

// scoring_func -> (optional bias for selection) -> top-k -> optional
// renormalize (sum; + 1e-20 for sigmoid/sqrtsoftplus) -> * routed_scaling_factor.
ReferenceRouting reference_topk(const MoEConfig& config, const float* logits, int64_t T, int64_t ld,
                                const std::vector<double>& bias = {});
// gpt-oss: top-k of the logits, softmax over them, * routed_scaling_factor.
ReferenceRouting reference_topk_softmax(const MoEConfig& config, const float* logits, int64_t T,
                                        int64_t ld);
// DeepSeek-V2/V3 grouped top-k (HF DeepseekV3TopkRouter with -inf masking).
ReferenceRouting reference_grouped_topk(const MoEConfig& config, const float* logits, int64_t T,
                                        int64_t ld, const std::vector<double>& bias = {});
// Llama-4: top-k logits, weight sigmoid(logit) (renormalized if set) * scale.
ReferenceRouting reference_llama4(const MoEConfig& config, const float* logits, int64_t T,
                                  int64_t ld);
// Hash: ids = table[token], weights = routed_scaling_factor / k.
ReferenceRouting reference_hash(const MoEConfig& config, const int32_t* table,
                                const int32_t* token_ids, int64_t T);

// Dispatches on the config like create_router (not kSimulated / kHash).
// router_logits: f32 [T, E + Z] (any row stride).
ReferenceRouting reference_route(const MoEConfig& config, const TensorView& router_logits,
                                 const std::vector<double>& bias = {});

}  // namespace fusedmoe::test
