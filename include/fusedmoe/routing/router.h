// fusedmoe: routers — router logits to (topk_ids, topk_weights).
//
// Every router fills
//   topk_ids     i32 [T, k]: expert ids in [0, E), or -1 ("no expert": a zero
//                expert). Ids of one token are distinct (never duplicated).
//   topk_weights f32 [T, k]: the weight each chosen expert's output is scaled by,
//                routed_scaling_factor included (applied exactly once, here).
// from router_logits f32 [T, E + num_zero_experts] (row stride may exceed the
// row length; the last dimension must have stride 1). T = 0 is valid.
//
// Ties: among equal scores the lower expert id wins (stable, documented, and
// what torch.topk does on CPU for distinct-valued ties in practice).
// NaN in router_logits: Error(kInvalidArgument) naming the token and expert;
// a NaN never silently becomes an id.
// Sums of selected weights that are 0 (sigmoid underflow) are guarded by an
// epsilon of 1e-20 when renormalizing, as DeepSeek's reference does, so no NaN.
//
// Algorithms: softmax top-k (Shazeer et al. 2017; Mixtral), grouped top-k with
// score-correction bias (DeepSeek-V2/V3 technical reports and HF modeling code),
// Llama-4 sigmoid top-1 (HF Llama4TextMoe), gpt-oss top-k then softmax (HF
// GptOssTopKRouter), hash routing (Roller et al. 2021), sqrtsoftplus and zero
// experts as in vLLM's router factory.
#pragma once

#include <memory>
#include <optional>

#include "fusedmoe/config/moe_config.h"
#include "fusedmoe/core/tensor.h"

namespace fusedmoe {

// Learned or user-provided tensors some routers need.
struct RouterParams {
  // f32 or bf16 [E]: DeepSeek-V3 e_score_correction_bias (selection only).
  std::optional<Tensor> e_score_correction_bias;
  // i32 [hash_vocab_size, k]: kHash expert table.
  std::optional<Tensor> hash_table;
};

class Router {
 public:
  virtual ~Router() = default;

  // router_logits: f32 [T, E + num_zero_experts]; may be empty for kSimulated
  //   (then T is taken from topk_ids).
  // topk_ids: i32 [T, k] (written), topk_weights: f32 [T, k] (written), both
  //   with contiguous rows.
  // token_ids: i32 [T], required by kHash only (values in [0, hash_vocab_size)).
  // Throws Error(kInvalidArgument) on shape/dtype mismatch, NaN logits, or
  //   out-of-range token ids; nothing is written when it throws for shapes.
  virtual void select_experts(const TensorView& router_logits, const TensorView& topk_ids,
                              const TensorView& topk_weights,
                              const TensorView* token_ids = nullptr) const = 0;

  virtual const char* name() const = 0;
  const MoEConfig& config() const { return config_; }

 protected:
  explicit Router(const MoEConfig& config) : config_(config) {}
  MoEConfig config_;
};

// Builds the router for `config` (validated first). Priority order:
//   1. routing_method == kSimulated -> simulator (benchmarks)
//   2. routing_method == kHash      -> hash router (needs params.hash_table)
//   3. routing_method == kLlama4    -> Llama-4 sigmoid top-1
//   4. routing_method == kGroupedTopK or num_expert_group > 1 -> grouped top-k
//   5. routing_method == kTopKSoftmax -> top-k on logits, softmax over the k
//   6. otherwise                    -> scoring_func + top-k (+ renormalize)
// Throws Error(kInvalidArgument) when a needed param is missing or has the
// wrong shape (e_score_correction_bias must be [E] when the config says so).
std::unique_ptr<Router> create_router(const MoEConfig& config, const RouterParams& params = {});

}  // namespace fusedmoe
