// fusedmoe internal: device kernels of GPU expert-parallel dispatch / combine
// (used by CudaEpMoELayer). Raw device pointers, sizes, a stream; no host sync.
//
// A dispatch record (one per token and destination rank) is rec_bytes =
// ep_record_bytes(H, k) bytes: x bf16 [H], local topk_ids i32 [k] (-1 where
// another rank holds slot j), topk_weights f32 [k], the token's index i32 on
// its source rank (the peer transport's combine writes by it), padded to 16 bytes, so the
// received records are directly the rows (row stride rec_bytes / 2 bf16
// elements) of the expert GEMM. The peer transport's fp8 records carry e4m3
// [H] then f32 scales [ceil(H / 128)] in place of x (ep_record_bytes(H, k, true)).
#pragma once

#include <cstdint>

#include "fusedmoe/kernels/cuda.h"

namespace fusedmoe::cuda {

// Bytes of a record's hidden state, and of the whole record.
inline int64_t ep_payload_bytes(int64_t hidden, bool fp8 = false) {
  return fp8 ? hidden + 4 * ((hidden + 127) / 128) : 2 * hidden;
}
inline int64_t ep_record_bytes(int64_t hidden, int64_t top_k, bool fp8 = false) {
  return (ep_payload_bytes(hidden, fp8) + 8 * top_k + 4 + 15) / 16 * 16;
}

// Per destination rank r (one block each), in token order:
//   row_pos[t * P + r]  = position of token t among the tokens sent to r, or -1
//                         when none of its k experts lives on r;
//   slot_pos[t * k + j] = position of slot (t, j) among the slots sent to
//                         rank_of[ids[t, j]] (in (t, j) order), -1 for id -1;
//   counts[r * 3 + {0, 1, 2}] = rows to r, slots to r, T.
// topk_ids i32 [T, k] global ids in [-1, E); rank_of i32 [E].
void ep_layout(const int32_t* topk_ids, int64_t num_tokens, int top_k, const int32_t* rank_of,
               int ep_size, int32_t* row_pos, int32_t* slot_pos, int64_t* counts, Stream stream);

// Writes the records of every (token, destination) pair: rank r's records
// start at record sum_{q < r} counts[q * 3], in token order. x bf16 [T, H]
// contiguous; topk_weights f32 [T, k]; local_of i32 [E] (id on its rank).
void ep_pack(const uint16_t* x, const int32_t* topk_ids, const float* topk_weights,
             int64_t num_tokens, int top_k, int64_t hidden, const int32_t* rank_of,
             const int32_t* local_of, int ep_size, const int32_t* row_pos, const int64_t* counts,
             void* send, Stream stream);

// Receiver: M records -> local topk_ids i32 [M, k], topk_weights f32 [M, k],
// and combine_pos[m * k + j] = position of slot (m, j) among all valid
// (id != -1) slots in (m, j) order, -1 otherwise (one block: a fixed order).
void ep_unpack(const void* recv, int64_t num_rows, int top_k, int64_t hidden, int32_t* topk_ids,
               float* topk_weights, int32_t* combine_pos, Stream stream);

// send[combine_pos[s] * H + h] = y[s * H + h] for the M * k slots with a position.
void ep_combine_pack(const float* y, const int32_t* combine_pos, int64_t num_rows, int top_k,
                     int64_t hidden, float* send, Stream stream);

// Source: y[(t*k + j) * H + h] = recv[(sdispl[r] + slot_pos[t*k + j]) * H + h]
// with r = rank_of[topk_ids[t, j]], sdispl[r] = sum_{q < r} counts[q * 3 + 1],
// for the slots with id != -1.
void ep_combine_unpack(const float* recv, const int32_t* topk_ids, const int32_t* slot_pos,
                       const int32_t* rank_of, const int64_t* counts, int ep_size,
                       int64_t num_tokens, int top_k, int64_t hidden, float* y, Stream stream);

}  // namespace fusedmoe::cuda
