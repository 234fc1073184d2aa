// fusedmoe: expert placement — which EP rank holds which expert — and the
// slices of the expert weights one rank keeps under EP and TP.
//
// Placements (vLLM's determine_expert_map and its round-robin variant):
//   contiguous:  rank r holds a block of consecutive experts; with E experts
//                over P ranks the first E % P ranks hold ceil(E / P), the
//                others floor(E / P);
//   round-robin: expert e lives on rank e % P as local expert e / P.
// E need not be a multiple of ep_size; ep_size must be in [1, E].
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fusedmoe/experts/expert_weights.h"

namespace fusedmoe {

// ExpertPlacement is declared in config/moe_config.h (ParallelConfig).
const char* to_string(ExpertPlacement p);
// "contiguous" or "round-robin" (also "round_robin"); Error(kInvalidArgument) otherwise.
ExpertPlacement parse_expert_placement(const std::string& s);

class ExpertMap {
 public:
  ExpertMap() : ExpertMap(1, 1) {}
  // Throws Error(kInvalidArgument) unless num_experts >= 1 and 1 <= ep_size <= num_experts.
  ExpertMap(int64_t num_experts, int ep_size,
            ExpertPlacement placement = ExpertPlacement::kContiguous);

  int64_t num_experts() const { return num_experts_; }
  int ep_size() const { return ep_size_; }
  ExpertPlacement placement() const { return placement_; }

  // Global expert id in [0, E) -> owning rank / id among that rank's experts.
  int rank_of(int64_t expert) const { return rank_[expert]; }
  int64_t local_id(int64_t expert) const { return local_[expert]; }
  int64_t num_local_experts(int rank) const;
  // Global ids of rank's experts, in local id order.
  std::vector<int64_t> local_experts(int rank) const;
  // i32 [E]: local id on `rank`, -1 for experts other ranks hold (vLLM's expert_map).
  std::vector<int32_t> global_to_local(int rank) const;

 private:
  int64_t num_experts_;
  int ep_size_;
  ExpertPlacement placement_;
  std::vector<int32_t> rank_;
  std::vector<int64_t> local_;
};

// The part of `weights` (all E experts, or any set) that one rank computes:
// experts `experts` (indices into weights' first dimension, in this order),
// each narrowed to TP slice tp_rank of tp_size over the intermediate size I:
//   w13 [n, 2*It, H] = gate rows [i0, i0 + It) then up rows [I + i0, I + i0 + It)
//   w2  [n, H, It]   = columns [i0, i0 + It)
//   w13_bias [n, 2*It] likewise; w2_bias [n, H] on tp_rank 0 and zeros on the
//   others, so that the TP all-reduce adds it once.
// The I rows are split as evenly as possible (the first I % tp_size ranks get
// one more). Dtypes are kept. With tp_size == 1 and a contiguous run of
// experts the result shares the input's storage (no copy); otherwise copies.
// Throws Error(kInvalidArgument) for an expert index out of range or
// tp_size > I. Megatron-LM's column/row-parallel MLP split (Shoeybi et al. 2019).
ExpertWeights shard_expert_weights(const ExpertWeights& weights, std::span<const int64_t> experts,
                                   int tp_size, int tp_rank);

// Rows [i0, i0 + It) of I that TP rank tp_rank holds (as in shard_expert_weights).
std::pair<int64_t, int64_t> tp_slice(int64_t intermediate_size, int tp_size, int tp_rank);

}  // namespace fusedmoe
