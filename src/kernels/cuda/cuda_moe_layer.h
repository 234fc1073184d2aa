// fusedmoe internal: one MoE layer on a CUDA device — device-resident weights,
// a workspace sized once for max_num_tokens, and the forward pass
//   gate GEMM -> route -> bf16 input (ep_route) -> shared expert on a second
//   stream joined with events (ep_shared) -> routed experts (routed_experts.h:
//   align -> w13 GEMM + activation -> w2 GEMM, mma.sync or sm90) -> finalize
// with no allocation and no host synchronisation, so it can be captured in a
// CUDA graph. Used by MoERunner when RunnerOptions::device is CUDA.
#pragma once

#include <cstdint>
#include <memory>

#include "fusedmoe/kernels/cuda.h"
#include "fusedmoe/runner/moe_runner.h"

namespace fusedmoe::cuda {

class CudaMoELayer {
 public:
  // Uploads `weights` (biases and gates as f32 where the kernels want them) to
  // the current device and allocates the workspace. The expert weights (routed
  // and shared) are kept as expert_dtype (kBF16 or kF16; f32, bf16 and f16
  // host weights are converted: bf16 -> f16 is exact within the f16 range),
  // the expert inputs and the intermediates take that type too (hidden states
  // of the other types are converted), accumulation is f32 (dtype() tells which).
  // Throws Error(kUnsupported) for what the kernels do not handle (H or I not a
  // multiple of 8, top_k > 32), Error(kInvalidArgument) for
  // an expert_dtype other than bf16 / f16 or, with f16, a weight beyond the f16
  // range (naming the tensor), Error(kInternal) on CUDA errors.
  // routed_sm90 = false: no scratch for the sm90 routed-experts path (its [T*k, 2I]
  // w13 output and CUTLASS arguments); the routed experts then always take the
  // mma.sync / GEMV kernels — what expert parallelism's experts() runs anyway.
  // shared_workspace: the workspace's scratch (all but a few bytes of state
  // kept between calls) comes from it instead of an allocation of the layer's
  // own (SharedWorkspace's contract: forwards one at a time in stream order).
  CudaMoELayer(const MoEConfig& config, const MoELayerWeights& weights, int64_t max_num_tokens,
               DType expert_dtype = DType::kBF16, bool routed_sm90 = true,
               const std::shared_ptr<SharedWorkspace>& shared_workspace = nullptr);
  ~CudaMoELayer();
  CudaMoELayer(const CudaMoELayer&) = delete;
  CudaMoELayer& operator=(const CudaMoELayer&) = delete;

  // Device views (checked by the caller: shapes; here: device, dtypes, T <= max).
  // hidden_states f32/bf16/f16 [T, H]; output f32/bf16/f16 [T, H] (f16: values
  // beyond 65504 become +-inf, rounded to nearest as torch's .half()); router_logits f32
  // [T, E + Z] (any row stride) or null; token_ids i32 [T] (hash routing);
  // outputs: optional device buffers for the router's results.
  // num_valid_tokens (device i32 scalar, optional): rows at and past it are
  // padding (CUDA-graph replay at a capture size): routed to no expert.
  void forward(const TensorView& hidden_states, const TensorView& output,
               const TensorView* router_logits, const TensorView* token_ids,
               const ForwardOutputs* outputs, Stream stream,
               const int32_t* num_valid_tokens = nullptr);
  // Synchronises `stream`, then throws Error(kInvalidArgument) naming the first
  // token whose router logits held a NaN in a forward since the last check
  // (the routing kernels record it on the device; see cuda::route), and clears it.
  void check_errors(Stream stream);
  // router_logits f32 [T, E + Z] = hidden_states . gate^T (+ bias), on the device.
  void router_logits(const TensorView& hidden_states, const TensorView& logits, Stream stream);

  // ---- expert parallelism (CudaEpMoELayer, kernels/cuda/cuda_ep_moe_layer.h) ----
  // The layer is then built over this rank's experts only (weights.experts =
  // E_local experts, local ids), routing over all E (config.num_experts).
  // ep_route(): forward() up to the routed experts — gate GEMM, router
  // (global topk_ids), the bf16 / f16 (dtype()) expert inputs (x * topk_weight
  // with apply_router_weight_on_input). Its results stay in the layer (topk_ids(),
  // topk_weights(), expert_input(): [T, k], [T, k], dtype() [T, H]) until
  // ep_finalize().
  // num_valid_tokens: as forward()'s. A NaN logit is recorded for check_errors().
  void ep_route(const TensorView& hidden_states, const TensorView* router_logits,
                const TensorView* token_ids, const ForwardOutputs* outputs, Stream stream,
                const int32_t* num_valid_tokens = nullptr);
  // The shared expert of ep_route()'s T tokens, launched on the side stream
  // (joined by ep_finalize), with the GEMM tiles forward() picks for
  // tile_tokens tokens (the batch whose output this must reproduce).
  void ep_shared(int64_t num_tokens, int64_t tile_tokens, Stream stream);
  // The routed experts on given rows: x dtype() [M, H] (row stride ldx elements,
  // a multiple of 8), topk_ids i32 [M, k] LOCAL ids in [-1, E_local),
  // topk_weights f32 [M, k]. Returns finalize's arguments for the rows (y,
  // y_dtype, slot_row, row_scale, bias; the layer's buffers, valid until the
  // next call). By slot (allow_sm90 false, or the path not taken): y f32
  // [M * k, H], y[m*k + j] = w[m, j] * expert_j(x[m]) (no weight with
  // apply_router_weight_on_input) for ids != -1; other rows are not written.
  // With allow_sm90 (a layer built with routed_sm90) and many rows per
  // expert: the sm90 path's expert-sorted rows (bf16 with bf16 weights),
  // weighted and biased by whoever sums them (finalize's arithmetic); after an
  // ep_shared() that took the sm90 path, its GEMMs wait for the shared expert's.
  // The kernels (GEMM tile, decode path, sm90 or not) are those forward()
  // picks for batch_tokens tokens (the batch whose output this must
  // reproduce, bit for bit). M <= batch_tokens and M <= max_num_tokens().
  FinalizeArgs experts(const uint16_t* x, int64_t ldx, const int32_t* topk_ids,
                       const float* topk_weights, int64_t num_rows, int64_t batch_tokens,
                       bool allow_sm90, Stream stream);
  // forward()'s end for ep_route()'s T tokens: output [T, H] = sum over slots
  // j (in order, ids != -1) of y[t*k + j] + the (gated) shared expert.
  // rows / rows_per_token: instead of y by slot, y [T * rows_per_token, H]
  // summed over the rows whose rows[t * rows_per_token + r] >= 0, in order r
  // (the peer transport: one row a (token, rank) pair, rows = the dispatch's row_pos).
  // y_dtype: kF32, or kBF16 (the peer transport's bf16 combine rows).
  void ep_finalize(const void* y, const TensorView& output, int64_t num_tokens, Stream stream,
                   const int32_t* rows = nullptr, int64_t rows_per_token = 0,
                   DType y_dtype = DType::kF32);
  const int32_t* topk_ids() const;
  const float* topk_weights() const;
  const uint16_t* expert_input() const;

  int64_t max_num_tokens() const;
  const MoEConfig& config() const;
  size_t weight_bytes() const;
  DType dtype() const;             // the experts' half type: kBF16 or kF16
  size_t workspace_bytes() const;  // the scratch's bytes (own or in the shared workspace)
  // The workspace its scratch is a block of: the one given, or its own.
  const std::shared_ptr<SharedWorkspace>& shared_workspace() const;

 private:
  // finalize() of the routed part `f` (y, topk_ids, sizes, and for the sm90
  // path slot_row / row_scale / bias) plus the shared expert into `output`.
  void finish(FinalizeArgs f, const TensorView& output, Stream stream);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fusedmoe::cuda
