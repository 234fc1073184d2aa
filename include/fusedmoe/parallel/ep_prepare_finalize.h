// fusedmoe: expert-parallel dispatch / combine as a PrepareFinalize.
//
// Every rank of the EP group brings its own tokens (T may differ per rank and
// be 0) and holds the experts ExpertMap assigns it. prepare() (dispatch):
//   1. for each token, the set of ranks holding at least one of its k experts;
//   2. all-to-all of per-rank row counts;
//   3. all-to-all of one record per (token, destination rank) — the hidden
//      state once per rank, not once per expert — carrying the token's k local
//      expert ids on that rank (-1 where another rank holds slot j) and its k
//      topk_weights; records keep the source's token order;
//   4. the received rows are grouped by local expert by the CPU
//      PrepareFinalize (stable order, bf16 rounding, weight on input as there).
// finalize() (combine): every local (row, slot) result goes back to its source
// rank, in the order the source sent them; the source then sums each token's
// k results in slot order j = 0..k-1 with the CPU finalize. A routed row's
// value does not depend on the batch (fixed-order GEMM), and the sum order is
// the single-rank one, so the output is bit-identical to the single-rank
// modular kernel on the same inputs, whatever the arrival order, with f32
// payloads, and with bf16 payloads where the single-rank kernel rounds the
// same way (bf16 compute, router weight not on the input: where kAuto picks
// bf16); a bf16 payload beside f32 compute, and FP8, round the dispatched
// hidden states.
// As DeepEP's / pplx-kernels' normal (non-low-latency) dispatch and combine,
// on host memory with the Communicator's all_to_all_v.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "fusedmoe/core/thread_pool.h"
#include "fusedmoe/kernels/modular_kernel.h"
#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/parallel/expert_map.h"

namespace fusedmoe {

// What the dispatched hidden states are sent as.
enum class DispatchDType : uint8_t {
  kAuto,  // bf16 when compute is bf16 and the weight is not applied on the input
          // (exact: the experts round their input to bf16 anyway), else f32
  kF32,
  kBF16,  // rounds the hidden states to bf16
  kFP8,   // float8 e4m3fn with one f32 scale per 1 x 128 group of each row
          // (DeepSeek-V3 / vLLM per_token_group_quant_fp8): scale = amax / 448
};

const char* to_string(DispatchDType d);
// "auto", "f32", "bf16", "fp8"; Error(kInvalidArgument) otherwise.
DispatchDType parse_dispatch_dtype(const std::string& s);

// The transport that carries the dispatch and combine of the GPUs' expert
// parallelism (CudaEpMoELayer), as FUSEDMOE_EP_TRANSPORT asks for it:
//   kAuto  unset, empty or "auto": peer where every rank can map every other's
//          GPU memory (one host, peer access, CUDA IPC), else nccl;
//   kNccl  "nccl": NCCL all-to-all (host-synchronous);
//   kPeer  "peer": stores into the other GPUs' memory (an error where that is
//          impossible).
// Read here, in a part built without CUDA too, so that the CLI checks the
// variable on every backend (run and bench, before anything runs). Throws
// Error(kInvalidArgument) "FUSEDMOE_EP_TRANSPORT: expected auto, nccl or
// peer, got '<value>'" for any other value.
enum class EpTransport : uint8_t { kAuto, kNccl, kPeer };
EpTransport ep_transport_from_env();

// Byte counts and times of the last prepare/finalize on this rank. "Logical"
// bytes: payload records to / from other ranks (not to itself).
struct EpStats {
  int64_t dispatch_rows_sent = 0, dispatch_rows_received = 0;  // incl. rows to itself
  int64_t dispatch_bytes_sent = 0, dispatch_bytes_received = 0;
  int64_t combine_bytes_sent = 0, combine_bytes_received = 0;
  double dispatch_seconds = 0, combine_seconds = 0;  // the whole prepare / finalize
  // GPU peer transport: dispatch_seconds / combine_seconds are its pack and
  // combine kernels (this rank's stores into the others' memory) and this the
  // time its receive and combine-wait kernels waited for the other ranks
  // (their skew included); 0 elsewhere (inside the phases).
  double wait_seconds = 0;
  // GPU expert parallelism: "nccl" (all-to-all) or "peer" (device-initiated
  // stores into the other GPUs' memory); empty on the CPU.
  std::string transport;
};

// FP8 e4m3fn per-token-group quantization of rows: x f32 [rows, H] (row
// stride ldx) -> q u8 [rows, H] (stride H), scales f32 [rows, ceil(H / group)].
// scale = amax / 448 of the group (1 when the group is all zero or its amax
// is Inf / NaN); q = x / scale
// rounded to e4m3fn (saturating).
void quantize_fp8_groups(const float* x, int64_t rows, int64_t H, int64_t ldx, int64_t group,
                         uint8_t* q, float* scales);
// out[r, h] = f8e4m3fn_to_f32(q[r, h]) * scales[r, h / group] (out stride ldo).
void dequantize_fp8_groups(const uint8_t* q, const float* scales, int64_t rows, int64_t H,
                           int64_t group, float* out, int64_t ldo);

class EpPrepareFinalize final : public PrepareFinalize {
 public:
  // comm: the EP group (size == map.ep_size(); this rank's experts are
  // map.local_experts(comm->rank())). pool: nullptr = ThreadPool::global().
  EpPrepareFinalize(std::shared_ptr<Communicator> comm, ExpertMap map,
                    DispatchDType dispatch_dtype = DispatchDType::kAuto,
                    ThreadPool* pool = nullptr);
  ~EpPrepareFinalize() override;

  // Collective over the EP group (every rank calls it, T = 0 included).
  // hidden_states f32 [T, H] (row stride may be > H); topk_ids i32 [T, k],
  // GLOBAL ids in [-1, num_experts) (the caller checks them); topk_weights f32
  // [T, k]; num_experts must be map.num_experts(). Returns the rows this rank
  // received, grouped by its local experts (expert_offsets [E_local + 1]);
  // src_row / slot_to_row index the received rows. The result lives until
  // the next prepare.
  PrepareResult prepare(const TensorView& hidden_states, const TensorView& topk_ids,
                        const TensorView& topk_weights, int64_t num_experts,
                        bool apply_router_weight_on_input, DType compute_dtype,
                        Workspace& ws) override;
  // Collective. expert_output f32 [M, H] = the local experts applied to
  // prepare()'s rows; topk_weights / output [T, H] as given to prepare (the
  // same rank's tokens): output[t] = sum_{j=0..k-1, id != -1} w[t, j] * row(t, j).
  void finalize(const TensorView& expert_output, const PrepareResult& prepared,
                const TensorView& topk_weights, bool apply_router_weight_on_input,
                const TensorView& output) override;

  const ExpertMap& expert_map() const { return map_; }
  const EpStats& stats() const { return stats_; }

 private:
  struct State;
  std::shared_ptr<Communicator> comm_;
  ExpertMap map_;
  DispatchDType dispatch_dtype_;
  ThreadPool* pool_;
  std::unique_ptr<ModularKernel> local_;  // CPU PrepareFinalize for the local permute / sum
  std::unique_ptr<State> state_;
  EpStats stats_;
};

}  // namespace fusedmoe
