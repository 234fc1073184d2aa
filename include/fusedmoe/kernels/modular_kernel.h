// fusedmoe: the modular MoE kernel — prepare -> experts -> finalize.
//
// vLLM's FusedMoEModularKernel split: PrepareFinalize groups the T*k routed
// rows by expert (and later quantizes / dispatches them over ranks), Experts
// runs w13 GEMM -> activation -> w2 GEMM per expert, finalize un-permutes,
// multiplies by topk_weights and sums over k in a fixed order (j = 0..k-1),
// so results are deterministic and independent of the rest of the batch.
//
// Shapes: T tokens, H hidden, k top_k, E experts, M = number of routed slots
// with id != -1 (M <= T*k). Activations are f32 on the CPU backend; with
// compute_dtype bf16 the expert inputs and the intermediate are rounded to
// bf16 (products accumulate in f32), emulating a bf16 GEMM with f32 accumulation.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "fusedmoe/core/tensor.h"
#include "fusedmoe/core/thread_pool.h"
#include "fusedmoe/experts/expert_weights.h"

namespace fusedmoe {

// Grow-only scratch memory reused across calls: no allocation per call once
// the largest batch has been seen.
class Workspace {
 public:
  // Returns a 64-byte aligned buffer of at least `bytes` for slot `slot`
  // (slots are independent buffers; contents are not preserved on growth).
  // An allocation that fails throws Error(kOutOfMemory) with the byte count
  // and `what`, when given, naming the buffer.
  void* get(int slot, size_t bytes, const char* what = nullptr);
  // The same for `shape` elements of `elem_bytes` each, e.g. get(kSlot, "the
  // routed rows' hidden states, f32 [M, H]", {M, H}, 4): Error(kOutOfMemory)
  // naming `what`, the sizes and the bytes also when their product overflows
  // 63 bits (sizes < 0 count as 0).
  void* get(int slot, const char* what, std::initializer_list<int64_t> shape, size_t elem_bytes);
  size_t total_bytes() const;

 private:
  std::vector<std::shared_ptr<void>> buffers_;
  std::vector<size_t> sizes_;
};

// The bytes of `shape` elements of `elem_bytes` each, for an allocation named
// `what` (a noun phrase with the sizes' names, e.g. "the routed rows' hidden
// states, f32 [M, H]"): Error(kOutOfMemory) naming it and the sizes when the
// product overflows 63 bits. Sizes < 0 count as 0.
size_t checked_bytes(const char* what, std::initializer_list<int64_t> shape, size_t elem_bytes);

// The machine's memory and swap together (bytes; 0 when unknown): no set of
// allocations, however it is split, can hold more. ModularKernel::forward
// refuses routed rows whose workspace is more (Error(kOutOfMemory)).
size_t memory_and_swap_bytes();

// Expert-contiguous routed rows.
struct PrepareResult {
  TensorView permuted;        // f32 [M, H]: row m = hidden_states[token of m] (x weight if
                              //   apply_router_weight_on_input), rounded per compute dtype
  TensorView expert_offsets;  // i64 [E + 1]: rows of expert e are [offsets[e], offsets[e+1])
  TensorView src_row;         // i32 [M]: routed slot t * k + j each permuted row came from
  TensorView slot_to_row;     // i32 [T * k]: inverse of src_row, -1 for "no expert" slots
};

struct ExpertsParams {
  ActivationParams activation;
  DType compute_dtype = DType::kF32;  // kF32 or kBF16
};

class PrepareFinalize {
 public:
  virtual ~PrepareFinalize() = default;
  // hidden_states f32 [T, H]; topk_ids i32 [T, k] (-1 or [0, num_experts));
  // topk_weights f32 [T, k]. Views in the result point into `ws`.
  virtual PrepareResult prepare(const TensorView& hidden_states, const TensorView& topk_ids,
                                const TensorView& topk_weights, int64_t num_experts,
                                bool apply_router_weight_on_input, DType compute_dtype,
                                Workspace& ws) = 0;
  // expert_output f32 [M, H]; output f32 [T, H] is overwritten:
  // output[t] = sum_{j : id != -1} w[t, j] * expert_output[slot_to_row[t*k+j]]
  // (w = 1 when the weight was applied on the input). Tokens with no expert get 0.
  virtual void finalize(const TensorView& expert_output, const PrepareResult& prepared,
                        const TensorView& topk_weights, bool apply_router_weight_on_input,
                        const TensorView& output) = 0;
};

class Experts {
 public:
  virtual ~Experts() = default;
  // out f32 [M, H] (written): for each expert e and its rows r:
  //   out[r] = w2[e] . act(w13[e] . x[r] + w13_bias[e]) + w2_bias[e]
  virtual void apply(const PrepareResult& prepared, const ExpertWeights& weights,
                     const ExpertsParams& params, const TensorView& out, Workspace& ws) = 0;
};

class ModularKernel {
 public:
  ModularKernel(std::unique_ptr<PrepareFinalize> prepare_finalize, std::unique_ptr<Experts> experts)
      : prepare_finalize_(std::move(prepare_finalize)), experts_(std::move(experts)) {}

  // Routed experts only: output f32 [T, H] (overwritten). Checks shapes and
  // dtypes of every argument (Error(kInvalidArgument) naming it); T = 0 is a no-op.
  void forward(const TensorView& hidden_states, const TensorView& topk_ids,
               const TensorView& topk_weights, const ExpertWeights& weights,
               const ExpertsParams& params, bool apply_router_weight_on_input,
               const TensorView& output, Workspace& ws);

  PrepareFinalize& prepare_finalize() { return *prepare_finalize_; }
  Experts& experts() { return *experts_; }

 private:
  std::unique_ptr<PrepareFinalize> prepare_finalize_;
  std::unique_ptr<Experts> experts_;
};

// CPU backend: fixed-summation-order GEMMs, AVX-512 / AVX2+FMA / scalar chosen
// at run time (FUSEDMOE_CPU_ISA forces one) with bit-identical results on every
// path (f32 accumulate; bf16 weights widened as they are loaded; batch
// invariant, unlike a BLAS sgemm; see src/kernels/cpu/gemm.h),
// multi-threaded over (expert, row block, weight-row block) work items on
// `pool` (nullptr: ThreadPool::global() at call time).
std::unique_ptr<ModularKernel> make_cpu_modular_kernel(ThreadPool* pool = nullptr);

}  // namespace fusedmoe
