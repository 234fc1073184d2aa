// fusedmoe internal: the CPU PrepareFinalize and Experts (kernels/modular_kernel.h).
#pragma once

#include "fusedmoe/kernels/modular_kernel.h"

namespace fusedmoe::cpu {

// Groups routed rows by expert (stable: slot order t * k + j within an expert)
// and sums them back per token in slot order. Parallel over rows / tokens.
class CpuPrepareFinalize final : public PrepareFinalize {
 public:
  explicit CpuPrepareFinalize(ThreadPool* pool) : pool_(pool) {}
  PrepareResult prepare(const TensorView& hidden_states, const TensorView& topk_ids,
                        const TensorView& topk_weights, int64_t num_experts,
                        bool apply_router_weight_on_input, DType compute_dtype,
                        Workspace& ws) override;
  void finalize(const TensorView& expert_output, const PrepareResult& prepared,
                const TensorView& topk_weights, bool apply_router_weight_on_input,
                const TensorView& output) override;

 private:
  ThreadPool& pool() const { return pool_ ? *pool_ : ThreadPool::global(); }
  ThreadPool* pool_;
};

// w13 GEMM + activation, then w2 GEMM, over (expert, row block, column block)
// work items claimed dynamically by the pool's threads. Uses the fixed-order
// GEMM of gemm.h, so every output row is bit-identical whatever the batch.
class CpuExperts final : public Experts {
 public:
  explicit CpuExperts(ThreadPool* pool) : pool_(pool) {}
  // prepared.permuted may have a row stride > H (rows contiguous); only
  // permuted and expert_offsets are read.
  void apply(const PrepareResult& prepared, const ExpertWeights& weights,
             const ExpertsParams& params, const TensorView& out, Workspace& ws) override;

 private:
  ThreadPool& pool() const { return pool_ ? *pool_ : ThreadPool::global(); }
  ThreadPool* pool_;
};

}  // namespace fusedmoe::cpu
