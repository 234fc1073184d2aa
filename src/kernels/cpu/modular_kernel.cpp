// fusedmoe: ModularKernel::forward (boundary checks, prepare -> experts ->
// finalize) and the CPU backend factory.
#include "fusedmoe/kernels/modular_kernel.h"

#include <sys/sysinfo.h>

#include <climits>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/workspace_slots.h"

namespace fusedmoe {

size_t memory_and_swap_bytes() {
  static const size_t bytes = [] {
    struct sysinfo si {};
    if (sysinfo(&si) != 0) return size_t{0};
    return static_cast<size_t>((static_cast<unsigned long long>(si.totalram) + si.totalswap) *
                               si.mem_unit);
  }();
  return bytes;
}

void ModularKernel::forward(const TensorView& hidden_states, const TensorView& topk_ids,
                            const TensorView& topk_weights, const ExpertWeights& weights,
                            const ExpertsParams& params, bool apply_router_weight_on_input,
                            const TensorView& output, Workspace& ws) {
  // ---- boundary checks: nothing is written before all pass ----
  // Sizes: E and I from w2 (expert_sizes_from_w2: where w13 [E, 2I, H] and
  // w2 [E, H, I] disagree on them, both shapes are named, unless w13 cannot be
  // [E, 2I, H] at all: then validate() names it with w2's sizes). H from w13,
  // or from w2 where only w2 agrees with hidden_states, which then says which
  // weight is wrong.
  const ExpertSizes sizes = expert_sizes_from_w2(weights, "experts.w13", "experts.w2");
  const int64_t E = sizes.num_experts, I = sizes.intermediate_size;
  const TensorView& w2v = weights.w2.view();
  int64_t H = weights.w13.size(2);
  if (w2v.size(1) != H && hidden_states.ndim() == 2 && w2v.size(1) == hidden_states.size(1))
    H = w2v.size(1);  // w13 is the odd one out: validate() names it
  weights.validate(E, H, I, weights.w13_bias.has_value() || weights.w2_bias.has_value(), "experts");
  FUSEDMOE_CHECK(params.compute_dtype == DType::kF32 || params.compute_dtype == DType::kBF16,
                 "compute_dtype: expected f32 or bf16, got ", dtype_name(params.compute_dtype));
  check_tensor(hidden_states, "hidden_states", DType::kF32, {-1, H});
  const int64_t T = hidden_states.size(0);
  check_tensor(topk_ids, "topk_ids", DType::kI32, {T, -1});
  const int64_t k = topk_ids.size(1);
  FUSEDMOE_CHECK(k >= 1, "topk_ids: expected [T, k] with k >= 1 (top_k), got ",
                 topk_ids.shape_str());
  check_topk_shapes_agree(topk_ids, topk_weights);
  check_tensor(topk_weights, "topk_weights", DType::kF32, {T, k});
  check_router_weight_on_input(apply_router_weight_on_input, topk_ids);
  params.activation.validate();
  check_tensor(output, "output", DType::kF32, {T, H});
  // The workspace of up to T * k routed rows: sizes whose bytes overflow are
  // refused before the checks below read the inputs (Error(kOutOfMemory)).
  checked_bytes("the routed rows' hidden states, f32 [T, k, H]", {T, k, H}, 4);
  checked_bytes("the routed rows' intermediate activations, f32 [T, k, I]", {T, k, I}, 4);
  // prepare's row indices (src_row, slot_to_row) are i32.
  if (T * k > INT32_MAX)
    FUSEDMOE_THROW(kUnsupported, "topk_ids: the CPU backend takes at most ", INT32_MAX,
                   " routed slots (T * k, i32 row indices), got ", T, " * ", k, " = ", T * k);
  // Non-finite inputs would silently give NaN outputs (O(T * (H + k)) reads).
  check_finite_rows(hidden_states, "hidden_states");
  check_finite_rows(topk_weights, "topk_weights");
  if (T == 0) return;
  const int32_t* ids = topk_ids.data_as<const int32_t>();
  const int64_t ld_ids = topk_ids.stride(0);
  int64_t routed = 0;  // M: the slots with an expert
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t id = ids[t * ld_ids + j];
      FUSEDMOE_CHECK(id >= -1 && id < E, "topk_ids: expected values in [-1, ", E, "), got ", id,
                     " at [", t, ", ", j, "]");
      routed += id >= 0;
    }
  // The workspace of the M routed rows (their hidden states and the experts'
  // output rows f32 [M, H], the intermediate activations f32 [M, I], their
  // indices) beyond the machine's memory and swap: refused before anything is
  // allocated (the buffers were allocated and filled one by one, seconds
  // before the largest failed, or the process was ended by the OOM killer).
  // The output f32 [T, H] (the caller's, written at the end) is counted too:
  // a workspace just below the limit beside it met the OOM killer (trial).
  const double need = static_cast<double>(routed) * static_cast<double>(8 * H + 4 * I + 4) +
                      static_cast<double>(T * k) * 4.0;
  const double out_bytes = static_cast<double>(T) * static_cast<double>(H) * 4.0;
  const size_t memory = memory_and_swap_bytes();
  if (memory > 0 && need + out_bytes > static_cast<double>(memory) &&
      need > static_cast<double>(ws.total_bytes()))
    FUSEDMOE_THROW(kOutOfMemory, "hidden_states: ", T, " tokens routed to M = ", routed,
                   " expert rows (topk_ids [", T, ", ", k, "]) need ",
                   bytes_str(static_cast<unsigned long long>(need)),
                   " of workspace (f32 [M, H] twice and [M, I], H = ", H, ", I = ", I,
                   "), with the output's ", bytes_str(static_cast<unsigned long long>(out_bytes)),
                   " (f32 [T, H]) more than the machine's ", bytes_str(memory),
                   " of memory and swap; pass fewer tokens a call");

  // ---- prepare -> experts -> finalize ----
  const PrepareResult prepared =
      prepare_finalize_->prepare(hidden_states, topk_ids, topk_weights, E,
                                 apply_router_weight_on_input, params.compute_dtype, ws);
  const int64_t M = prepared.permuted.size(0);
  auto* expert_out = static_cast<float*>(
      ws.get(cpu::kWsExpertOutput, "the experts' output rows, f32 [M, H]", {M, H}, 4));
  const TensorView expert_output(expert_out, DType::kF32, {M, H});
  experts_->apply(prepared, weights, params, expert_output, ws);
  prepare_finalize_->finalize(expert_output, prepared, topk_weights, apply_router_weight_on_input,
                              output);
}

std::unique_ptr<ModularKernel> make_cpu_modular_kernel(ThreadPool* pool) {
  return std::make_unique<ModularKernel>(std::make_unique<cpu::CpuPrepareFinalize>(pool),
                                         std::make_unique<cpu::CpuExperts>(pool));
}

}  // namespace fusedmoe
