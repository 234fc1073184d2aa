// fusedmoe internal: one MoE layer with its experts spread over GPUs (expert
// parallelism), the GPU counterpart of EpPrepareFinalize (parallel/
// ep_prepare_finalize.h). Every rank of the EP communicator (a device-buffer
// communicator: NCCL) brings its own tokens (T may differ and be 0) and holds
// the experts ExpertMap assigns it; forward() is collective:
//   1. route on the device (global topk_ids);
//   2. layout kernel: per destination rank, the tokens with at least one of
//      their k experts there and the slots going there (block scans in token
//      order); pack kernel: one record per (token, destination rank) — the
//      bf16 hidden state once per rank, not once per expert — with the local
//      expert ids (-1 for slots held elsewhere) and the k topk_weights;
//   3. all-to-all of the counts (rows, slots, T per peer), then of the records
//      (the shared expert runs meanwhile on the side stream);
//   4. the local experts on the received rows (CudaMoELayer::experts, the GEMM
//      tile the single-GPU layer would pick for the global batch);
//   5. combine: every valid (row, slot) result goes back to its source rank in
//      the order the source sent it (all-to-all), is put at its slot, and the
//      source sums each token's k slots in order j = 0..k-1 with the
//      single-GPU finalize (+ shared expert).
// A routed row's value does not depend on the other rows of its batch, the
// GEMM tiles (routed and shared expert) are the ones the single-GPU layer
// picks for the global batch (sum of T over ranks, from the counts exchange),
// and the sum over slots is the single-GPU finalize, so given the same router
// logits the output (nccl transport) is bit-identical to CudaMoELayer::forward on the
// concatenation of all ranks' tokens, whatever the arrival order (tested).
// With each rank's own gate GEMM the logits may differ from one GPU's in f32
// rounding (router_gemm sums in another order for T <= 32 than for larger
// batches), and so the topk_weights and outputs, by ~1e-7 relative.
// Two transports carry steps 3 and 5 (FUSEDMOE_EP_TRANSPORT=auto|nccl|peer):
//  - nccl: the counts are copied to the host (to size the all-to-all) and the
//    communicator is host-synchronous; the stream is synchronised at each
//    exchange. Any ranks the communicator connects.
//  - peer (auto's choice where every rank can map every other's GPU memory:
//    one GPU per rank, one host, peer access, CUDA IPC between processes):
//    ep_peer.h — the pack kernel stores each record straight into its
//    destination's window (a region of max_tokens_per_rank rows per source)
//    and signals with a flag, the receiver's kernel waits for every source's
//    flag, the local experts run on all ep_size * max_tokens_per_rank rows
//    (unfilled rows have ids -1; GEMM tiles of that batch), and the combine
//    kernel sums each received row's slots held here (slot order, f32) and
//    stores that one row into its source's window; the source's finalize sums
//    a token's rows in rank order (records in fp8 and rows in bf16 on request:
//    dispatch_dtype / combine_dtype). No host synchronisation and no
//    communicator call per forward (capturable in a CUDA graph); the cost of
//    the experts' small kernels grows with max_tokens_per_rank, so size it to
//    the batch. The sums run rank by rank: within f32 rounding of one GPU
//    (bit-identical at ep_size 1). Every rank must ask for the same transport
//    and use the same max_tokens_per_rank (checked at set-up, on every rank);
//    at most 32 ranks. A layer's forwards run one at a time, on one stream,
//    each rank driven by a host thread of its own (a rank's kernels wait on
//    the device for the others' stores; a host call that blocks on one GPU
//    while driving another rank would wait for the timeout). A rank later than
//    FUSEDMOE_COMM_TIMEOUT_S makes the others' kernels print who they waited
//    for and trap (the CUDA context is then lost).
#pragma once

#include <cstdint>
#include <memory>

#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/parallel/ep_prepare_finalize.h"
#include "fusedmoe/parallel/expert_map.h"
#include "kernels/cuda/cuda_moe_layer.h"

namespace fusedmoe::cuda {

class CudaEpMoELayer {
 public:
  // layer: this rank's layer, built over map.local_experts(comm->rank()) with
  // max_num_tokens >= comm->size() * max_tokens_per_rank (it computes every
  // rank's rows for its experts); it must outlive this object. comm: the EP
  // group, device buffers, size map.ep_size(). max_tokens_per_rank: the
  // largest T any rank passes to forward(). Allocates the exchange buffers on
  // the current device. dispatch_dtype: the records' hidden states — auto
  // (and bf16 with bf16 experts): the experts' half type, exact; fp8: e4m3
  // with one f32 scale per 1 x 128 group (peer_dispatch), dequantised to the
  // half type by the receiver (about half the bytes). combine_dtype: the rows
  // sent back — f32, or bf16 (half the bytes; each rank's partial sum rounded
  // once). fp8 records and bf16 rows are payloads of the peer transport only;
  // every rank must pass the same (and the same expert dtype). Throws Error(kInvalidArgument) on
  // mismatched sizes, other dtypes, ranks of different payloads, and those payloads on nccl.
  CudaEpMoELayer(CudaMoELayer& layer, const MoEConfig& config, std::shared_ptr<Communicator> comm,
                 ExpertMap map, int64_t max_tokens_per_rank,
                 DispatchDType dispatch_dtype = DispatchDType::kAuto,
                 DType combine_dtype = DType::kF32);
  ~CudaEpMoELayer();
  CudaEpMoELayer(const CudaEpMoELayer&) = delete;
  CudaEpMoELayer& operator=(const CudaEpMoELayer&) = delete;

  // Collective. Arguments as CudaMoELayer::forward (device views, T <=
  // max_tokens_per_rank); returns with the output enqueued on `stream`.
  // num_valid_tokens (device i32 scalar, optional; peer transport only: the
  // graph replay of CudaGraphLayer): rows at and past it are padding, routed
  // to no expert and so dispatched to no rank.
  void forward(const TensorView& hidden_states, const TensorView& output,
               const TensorView* router_logits, const TensorView* token_ids,
               const ForwardOutputs* outputs, Stream stream,
               const int32_t* num_valid_tokens = nullptr);

  // Whether forward() can be captured in a CUDA graph (the peer transport).
  bool capturable() const;
  // The peer transport: bytes of the window this layer set up; 0 where it
  // reuses an earlier layer's (same SharedWorkspace, communicator and window
  // layout: their forwards run one at a time in stream order) or over nccl.
  size_t window_bytes() const;

  // Rows, bytes (logical: to / from other ranks) and times of the last
  // forward (NCCL: host wall clock; peer: CUDA events, after waiting for it).
  const EpStats& stats() const;
  // A CUDA graph that captured forward() (peer transport) was launched: stats()
  // reports that replay, from the counts its kernels wrote and the events it
  // recorded (a captured forward records its events as graph nodes).
  void replayed();
  const ExpertMap& expert_map() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fusedmoe::cuda
