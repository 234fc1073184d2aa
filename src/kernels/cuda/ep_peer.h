// fusedmoe internal: device-initiated expert-parallel dispatch / combine over
// peer GPU memory (NVLink / PCIe P2P stores), used by CudaEpMoELayer's peer
// transport. No host synchronisation and no communicator call per forward:
// every rank's kernels store straight into the other ranks' windows and
// signal with release / acquire flags at system scope (the scheme of DeepEP's
// intranode kernels and pplx-kernels, written anew here).
//
// Each rank owns one window (cudaMalloc, zeroed; the other ranks map it by
// CUDA IPC or, in the same process, use its pointer), laid out identically on
// every rank (PeerLayout):
//   signals: u64 dispatch_flag[P], u64 combine_flag[P], i64 rows[P];
//   recv:    P regions of capacity rows (max_tokens_per_rank each) of dispatch
//            records (ep_record_bytes): region p holds source rank p's rows in
//            its token order, row i valid for i < rows[p];
//   y:       f32 [capacity * P, H]: row t * P + r = the sum of token t's
//            slots held by rank r (in slot order), written by rank r (combine).
// A forward increments a device-side epoch on every rank; flags carry the
// epoch, so they are never reset, and a forward's writes into a peer's window
// happen only after that peer has finished with the previous forward's data
// (each rank's combine waits for every peer's, see ep_peer.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusedmoe/kernels/cuda.h"

namespace fusedmoe::cuda {

struct PeerLayout {
  int ep_size = 1, rank = 0, top_k = 1;
  int64_t hidden = 0, capacity = 0;  // capacity: rows per source region (max_tokens_per_rank)
  int64_t rec = 0;                   // record bytes: ep_record_bytes(hidden, top_k)
  size_t off_recv = 0, off_y = 0, bytes = 0;
};
PeerLayout peer_layout(int ep_size, int rank, int top_k, int64_t hidden, int64_t capacity);

// Dispatch: every (token, destination rank) record of this rank's T tokens
// into region `rank` of the destination's window at row row_pos[t * P + r]
// (ep_layout), then, by the last block: rows[rank] = counts[r * 3] on every
// destination r, a system-scope fence, dispatch_flag[rank] = ++epoch.
// peers: device array of the P windows (peers[rank] = own). done: a u32
// device counter, zero between calls. T = 0 still signals (0 rows).
void peer_dispatch(const uint16_t* x, const int32_t* topk_ids, const float* topk_weights,
                   int64_t num_tokens, const int32_t* rank_of, const int32_t* local_of,
                   const int32_t* row_pos, const int64_t* counts, char* const* peers,
                   const PeerLayout& layout, uint64_t* epoch, unsigned* done, Stream stream);

// Receive: waits until every source p has signalled this epoch, then writes the
// local topk_ids i32 [P * capacity, k] / topk_weights f32 (rows past rows[p] in
// region p: ids -1, weight 0) for the expert GEMM on the recv region rows.
// rows_seen i64 [P]: each source's row count of this forward (a copy: the
// window's may be overwritten by the next forward before the host reads it).
// Waits at most timeout_s (then prints which rank it waited for and traps).
void peer_receive(const char* own, const PeerLayout& layout, const uint64_t* epoch,
                  double timeout_s, int32_t* topk_ids, float* topk_weights, int64_t* rows_seen,
                  Stream stream);

// Combine: the local experts' output on the recv rows (CudaMoELayer::experts on
// the P * capacity received rows, as finalize's arguments `y`: y f32 by slot,
// weighted and biased (the mma / decode paths), or expert-sorted rows (the
// sm90 path: y_dtype f32 or bf16, slot_row, row_scale, bias, applied here as
// finalize applies them)) -> for each received row (row i < rows[p] of
// region p) the sum of its slots held here (local id != -1, in slot order,
// f32) into the source p's window y[(t * P + rank) * H] (t: the record's
// token index): one row a (token, rank) pair, not one a slot; then, by the
// last block, combine_flag[rank] = epoch on every rank. The source sums its
// token's rows in rank order (finalize over topk_ids = row_pos, top_k = P).
void peer_combine(const FinalizeArgs& y, const int32_t* topk_ids, const char* own,
                  char* const* peers, const PeerLayout& layout, const uint64_t* epoch,
                  unsigned* done, Stream stream);

// Waits until every rank's combine of this epoch has reached this rank's y.
void peer_wait_combine(const char* own, const PeerLayout& layout, const uint64_t* epoch,
                       double timeout_s, Stream stream);

}  // namespace fusedmoe::cuda
