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
//            records (ep_record_bytes, fp8 or not): region p holds source rank p's rows (in
//            the order they took them, see peer_dispatch), row i valid for
//            i < rows[p];
//   y:       f32 or bf16 (combine_bf16) [capacity * P, H]: row t * P + r =
//            the sum of token t's slots held by rank r (in slot order, f32,
//            then rounded), written by rank r (combine).
// A forward increments a device-side epoch on every rank; flags carry the
// epoch, so they are never reset, and a forward's writes into a peer's window
// happen only after that peer has finished with the previous forward's data
// (each rank's combine waits for every peer's, see ep_peer.cu).
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/ep_dispatch.h"  // the record format

namespace fusedmoe::cuda {

// At most this many ranks (the dispatch keeps a row position a destination in
// shared memory; finalize sums at most 32 rows a token).
inline constexpr int kPeerMaxRanks = 32;

struct PeerLayout {
  int ep_size = 1, rank = 0, top_k = 1;
  int64_t hidden = 0, capacity = 0;  // capacity: rows per source region (max_tokens_per_rank)
  bool x_f16 = false;                // the hidden states (and experts) are f16, else bf16
  bool fp8 = false;                  // records carry e4m3 values + f32 scales (1 x 128 groups)
  bool combine_bf16 = false;         // y rows are bf16, else f32
  int64_t payload = 0;               // bytes of a record's hidden state: ep_payload_bytes
  int64_t rec = 0;                   // record bytes: ep_record_bytes(hidden, top_k, fp8)
  int sms = 1;                       // multiprocessors of the device (persistent grids)
  size_t off_recv = 0, off_y = 0, bytes = 0;
};
PeerLayout peer_layout(int ep_size, int rank, int top_k, int64_t hidden, int64_t capacity,
                       bool x_f16, bool fp8, bool combine_bf16, int sms);

// Dispatch: every (token, destination rank) record of this rank's T tokens
// into region `rank` of the destination's window, at a row taken from
// cursor[r] (u32 [P], zero between calls; atomics: the rows' order on a
// destination varies, the outputs do not); row_pos[t * P + r] = that row, or
// -1 where none of t's experts lives on r (i32 [T * P], out); then, by the
// last block: counts[r * 3] = rows to r (counts[r * 3 + 2] = T; i64 [P * 3],
// out), the cursors reset, rows[rank] = that count on every destination r, a
// system-scope fence, dispatch_flag[rank] = ++epoch.
// x: the expert inputs, bf16 / f16 (layout.x_f16) [T, H]. With layout.fp8 each
// 128-column group of a row is sent as e4m3 (satfinite, round to nearest) of
// x / s with s = amax / 448 (1 for an all-zero group), and s (vLLM's
// per_token_group_quant_fp8, DeepSeek-V3's activation format).
// peers: device array of the P windows (peers[rank] = own). done: a u32
// device counter, zero between calls. T = 0 still signals (0 rows). At most
// 32 ranks.
void peer_dispatch(const uint16_t* x, const int32_t* topk_ids, const float* topk_weights,
                   int64_t num_tokens, const int32_t* rank_of, const int32_t* local_of,
                   int32_t* row_pos, int64_t* counts, unsigned* cursor, char* const* peers,
                   const PeerLayout& layout, uint64_t* epoch, unsigned* done, Stream stream);

// Receive: waits until every source p has signalled this epoch, then writes the
// local topk_ids i32 [P * capacity, k] / topk_weights f32 (rows past rows[p] in
// region p: ids -1, weight 0) for the expert GEMM on the recv region rows;
// with layout.fp8 also x_out (bf16 / f16 [P * capacity, H]): the received
// rows dequantised (e4m3 * scale, rounded to the half type; rows past a
// region's count not written).
// rows_seen i64 [P]: each source's row count of this forward (a copy: the
// window's may be overwritten by the next forward before the host reads it).
// Waits at most timeout_s (then prints which rank it waited for and traps).
void peer_receive(const char* own, const PeerLayout& layout, const uint64_t* epoch,
                  double timeout_s, int32_t* topk_ids, float* topk_weights, int64_t* rows_seen,
                  uint16_t* x_out, Stream stream);

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
