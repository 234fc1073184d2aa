// fusedmoe: the routed experts of one MoE layer spread over ranks (EP, TP,
// EP x TP, DP + EP), on CPU ranks.
//
// Layout: ParallelGroups (parallel/communicator.h). This rank holds
//   shard_expert_weights(all experts, map.local_experts(ep_rank), tp_size, tp_rank)
// i.e. its EP share of the experts, each narrowed to its TP slice of I.
// forward() computes this rank's tokens' routed output:
//   dp_size == 1, ep_size > 1: EpPrepareFinalize (all-to-all dispatch, local
//       experts, all-to-all combine, weighted sum over k in slot order);
//   dp_size > 1, ep_size == dp_size (vLLM's naive DP+EP): all-gather the DP
//       group's hidden states, topk_ids and topk_weights, run the local experts
//       on every gathered token (others' experts are -1), reduce-scatter the
//       partial sums back to the tokens' ranks;
//   otherwise (ep_size == 1): the local experts on the local tokens, no
//       communication.
// With tp_size > 1 the result is this rank's TP partial sum; reduce_tp() adds
// the TP group's partials (one all-reduce) — call it once, after adding the
// (TP-sliced) shared expert, so that routed + shared are reduced together.
// Results: EP alone is bit-identical to the single-rank modular kernel with
// f32 payloads and with the bf16 payloads kAuto picks (ep_prepare_finalize.h);
// TP and DP+EP change the order of some f32 sums (<= ~1e-6 relative).
#pragma once

#include <memory>

#include "fusedmoe/config/moe_config.h"
#include "fusedmoe/kernels/modular_kernel.h"
#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/parallel/ep_prepare_finalize.h"
#include "fusedmoe/parallel/expert_map.h"

namespace fusedmoe {

struct DistributedOptions {
  ExpertPlacement placement = ExpertPlacement::kContiguous;
  // EP all-to-all payload: only with ep_size > 1 and dp_size 1 (the only
  // layout with a dispatch); elsewhere anything but kAuto is Error(kInvalidArgument).
  DispatchDType dispatch_dtype = DispatchDType::kAuto;
  ThreadPool* pool = nullptr;  // nullptr: ThreadPool::global()
};

// The experts a rank of `groups` holds: the EP share (ep_rank of ep_size) of
// config.num_experts experts under `placement`.
ExpertMap make_expert_map(const MoEConfig& config, const ParallelConfig& parallel,
                          ExpertPlacement placement);

class DistributedExperts {
 public:
  // local_weights: this rank's experts in local id order, TP-narrowed (see above):
  // w13 [E_local, 2 * It, H], w2 [E_local, H, It]. Throws Error(kInvalidArgument)
  // when their shapes do not match config / groups / placement. Collective over
  // groups.world when it has several ranks: every rank must pass the same
  // layer shape (num_experts, hidden / intermediate size, top_k, expert bias),
  // sizes, placement and dispatch dtype (check_same_on_all_ranks: otherwise
  // Error(kInvalidArgument) on every rank, naming the first that differs).
  DistributedExperts(const MoEConfig& config, ParallelGroups groups, ExpertWeights local_weights,
                     DistributedOptions options = {});
  ~DistributedExperts();

  // Collective over the EP / DP group: every rank calls it, also with T = 0.
  // hidden_states f32 [T, H] (row stride may be > H); topk_ids i32 [T, k]:
  // global ids in [-1, num_experts) (checked); topk_weights f32 [T, k];
  // output f32 [T, H] (row stride may be > H) is overwritten.
  void forward(const TensorView& hidden_states, const TensorView& topk_ids,
               const TensorView& topk_weights, const ExpertsParams& params,
               bool apply_router_weight_on_input, const TensorView& output, Workspace& ws);

  // output f32 [T, H] (rows contiguous) = sum over the TP group (in place;
  // TP ranks hold the same tokens). No-op when tp_size == 1.
  void reduce_tp(const TensorView& output);

  const ParallelGroups& groups() const { return groups_; }
  const ExpertMap& expert_map() const { return map_; }
  const ExpertWeights& local_weights() const { return weights_; }
  // Dispatch / combine statistics of the last forward (EP all-to-all path only).
  const EpStats* ep_stats() const { return ep_ ? &ep_->stats() : nullptr; }

 private:
  MoEConfig config_;
  ParallelGroups groups_;
  ExpertMap map_;
  ExpertWeights weights_;
  DistributedOptions options_;
  std::vector<int32_t> global_to_local_;
  std::unique_ptr<ModularKernel> local_;   // CPU PrepareFinalize + Experts
  std::unique_ptr<EpPrepareFinalize> ep_;  // EP all-to-all path
  std::unique_ptr<Workspace> own_ws_;
};

}  // namespace fusedmoe
