// fusedmoe: routers — router logits to (topk_ids, topk_weights).
//
// Every router fills
//   topk_ids     i32 [T, k]: expert ids in [0, E), or -1 ("no expert": a zero
//                expert). A token's ids >= 0 are distinct (never duplicated);
//                -1 may repeat (several zero experts chosen).
//   topk_weights f32 [T, k]: the weight each chosen expert's output is scaled by,
//                routed_scaling_factor included (applied exactly once, here).
// from router_logits f32 [T, E + num_zero_experts] (row stride may exceed the
// row length; the last dimension must have stride 1). T = 0 is valid.
//
// Ties: among equal scores the lower expert id wins (stable, documented, and
// what torch.topk does on CPU for distinct-valued ties in practice). Ids are
// written in descending score order. Where the score is monotone in the logit
// (kTopK without bias, kTopKSoftmax, kLlama4) selection runs on the raw f32
// logits, so scores that round equal (sigmoid saturating to 1.0f) never tie.
// Scores and weights are computed in double and stored as f32.
// NaN in router_logits: all logits are checked first; on a NaN select_experts
// throws Error(kInvalidArgument) naming the first (lowest) token and expert
// column, and nothing is written. A NaN never silently becomes an id.
// Infinite logits are allowed: softmax of a row whose maximum is +-inf gives
// the entries equal to the maximum equal shares and the others 0 (the limit),
// never NaN; renormalized sqrtsoftplus scores, infinite for a +inf logit, take
// the same limit (the infinite ones share 1; not renormalized, such a weight is
// +inf).
// Sums of selected weights that are 0 (sigmoid underflow) are guarded by an
// epsilon of 1e-20 when renormalizing (sigmoid / sqrtsoftplus scores), as
// DeepSeek's reference does, so no NaN. Softmax renormalizes by the plain sum.
//
// Zero experts (num_zero_experts = Z > 0; kTopK, kTopKSoftmax, kLlama4, kHash,
// kSimulated): the router sees E + Z columns; a selected column c >= E is
// written as id -1 and keeps the weight it was given (consumers skip -1
// slots, so it contributes nothing). Grouped top-k rejects Z > 0 (validate).
//
// Per method:
// - kTopK: scores = scoring_func(logits) over all E + Z columns; with
//   has_e_score_correction_bias, selection is by scores + bias (bias [E + Z],
//   selection only, as vLLM's fused_topk_bias); weights = scores of the k,
//   renormalized if set, * routed_scaling_factor.
// - kTopKSoftmax: top-k of the logits, softmax over those k,
//   * routed_scaling_factor. scoring_func and renormalize are ignored (the
//   result equals softmax -> top-k -> renormalize).
// - kGroupedTopK: choice = scores + bias (if any); group score = max of choice
//   (GroupScore::kMax) or sum of its two largest (kSumTop2); the topk_group best
//   groups are kept and experts of dropped groups are never selected (vLLM's
//   -inf mask; HF DeepSeek-V2 / V3 mask with 0.0, which differs only when fewer
//   than k kept experts have a positive (biased) choice); top-k by choice, weights = unbiased
//   scores, renormalized (1e-20 guard) if set, * routed_scaling_factor.
// - kLlama4: top-k of the logits, weight = sigmoid(logit) (renormalized if
//   set), * routed_scaling_factor.
// - kHash: ids = hash_table[token_ids[t]] (i32 [hash_vocab_size, k], entries
//   in [0, E + Z), distinct per row, checked by create_router); weights =
//   routed_scaling_factor / k (Roller et al.: a hash layer with k = 1 uses the
//   expert output unweighted; k > 1 averages). router_logits are ignored and
//   may be empty (or [T, E + Z], then shape-checked).
// - kSimulated: ignores router_logits (may be empty); see SimulatedRouting.
//   Each token's k distinct experts come from a generator seeded by
//   (simulation_seed, token index = its row in this call): reproducible,
//   independent of the thread count (a batch split over two calls numbers the
//   second call's rows from 0 again). weights = routed_scaling_factor / k.
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

class ThreadPool;

// Learned or user-provided tensors some routers need.
struct RouterParams {
  // f32 or bf16: DeepSeek-V3 e_score_correction_bias (selection only), [E] for
  // grouped top-k, [E + Z] for kTopK.
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
  // pool: the threads that route (nullptr: ThreadPool::global()).
  // Throws Error(kInvalidArgument) on shape/dtype mismatch, NaN logits, or
  //   out-of-range token ids; nothing is written when it throws.
  virtual void select_experts(const TensorView& router_logits, const TensorView& topk_ids,
                              const TensorView& topk_weights, const TensorView* token_ids = nullptr,
                              ThreadPool* pool = nullptr) const = 0;

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
// wrong shape (e_score_correction_bias must be [E] for grouped top-k, [E + Z]
// for kTopK, when the config says so; it is rejected when the config does not
// use one), or when the hash table is invalid.
std::unique_ptr<Router> create_router(const MoEConfig& config, const RouterParams& params = {});

}  // namespace fusedmoe
