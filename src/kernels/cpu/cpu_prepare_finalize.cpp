// fusedmoe: CPU PrepareFinalize — permute routed rows into expert-contiguous
// order and sum them back per token (vLLM's moe_align / permute / unpermute).
#include <algorithm>
#include <cstring>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/workspace_slots.h"

namespace fusedmoe::cpu {

PrepareResult CpuPrepareFinalize::prepare(const TensorView& hidden_states,
                                          const TensorView& topk_ids,
                                          const TensorView& topk_weights, int64_t num_experts,
                                          bool apply_router_weight_on_input, DType compute_dtype,
                                          Workspace& ws) {
  const int64_t T = hidden_states.size(0), H = hidden_states.size(1), k = topk_ids.size(1);
  const int64_t E = num_experts, slots = T * k;
  const int64_t ldh = T > 0 ? hidden_states.stride(0) : H;
  const int64_t ld_ids = T > 0 ? topk_ids.stride(0) : k;
  const int64_t ld_w = T > 0 ? topk_weights.stride(0) : k;
  const int32_t* ids = topk_ids.data_as<const int32_t>();

  // offsets [E + 1], then a cursor per expert.
  auto* offsets = static_cast<int64_t*>(
      ws.get(kWsExpertOffsets, "the expert offsets, i64 [2 * E + 1]", {2 * E + 1}, 8));
  int64_t* cursor = offsets + E + 1;
  std::fill(cursor, cursor + E, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t id = ids[t * ld_ids + j];
      if (id >= 0) ++cursor[id];
    }
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    offsets[e + 1] = offsets[e] + cursor[e];
    cursor[e] = offsets[e];
  }
  const int64_t M = offsets[E];

  auto* src_row =
      static_cast<int32_t*>(ws.get(kWsSrcRow, "the routed rows' slots, i32 [M]", {M}, 4));
  auto* slot_to_row =
      static_cast<int32_t*>(ws.get(kWsSlotToRow, "the slots' routed rows, i32 [T, k]", {T, k}, 4));
  // Stable scatter: rows of one expert keep slot order t * k + j.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t s = t * k + j;
      const int32_t id = ids[t * ld_ids + j];
      if (id >= 0) {
        const int64_t row = cursor[id]++;
        src_row[row] = static_cast<int32_t>(s);
        slot_to_row[s] = static_cast<int32_t>(row);
      } else {
        slot_to_row[s] = -1;
      }
    }

  auto* permuted = static_cast<float*>(
      ws.get(kWsPermuted, "the routed rows' hidden states, f32 [M, H]", {M, H}, 4));
  const float* x = hidden_states.data_as<const float>();
  const float* w = topk_weights.data_as<const float>();
  const bool round_bf16 = compute_dtype == DType::kBF16;
  pool().parallel_for(
      M,
      [&](int64_t begin, int64_t end, int) {
        for (int64_t m = begin; m < end; ++m) {
          const int64_t s = src_row[m], t = s / k, j = s % k;
          const float* src = x + t * ldh;
          float* dst = permuted + m * H;
          if (apply_router_weight_on_input) {
            const float scale = w[t * ld_w + j];
            for (int64_t h = 0; h < H; ++h) dst[h] = src[h] * scale;
          } else {
            std::memcpy(dst, src, H * sizeof(float));
          }
          if (round_bf16)
            for (int64_t h = 0; h < H; ++h) dst[h] = round_to_bf16(dst[h]);
        }
      },
      std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)));

  PrepareResult r;
  r.permuted = TensorView(permuted, DType::kF32, {M, H});
  r.expert_offsets = TensorView(offsets, DType::kI64, {E + 1});
  r.src_row = TensorView(src_row, DType::kI32, {M});
  r.slot_to_row = TensorView(slot_to_row, DType::kI32, {slots});
  return r;
}

void CpuPrepareFinalize::finalize(const TensorView& expert_output, const PrepareResult& prepared,
                                  const TensorView& topk_weights, bool apply_router_weight_on_input,
                                  const TensorView& output) {
  const int64_t T = output.size(0), H = output.size(1), k = topk_weights.size(1);
  if (T == 0) return;
  const int64_t ldo = output.stride(0), ld_w = topk_weights.stride(0);
  const int64_t lde = expert_output.size(0) > 0 ? expert_output.stride(0) : H;
  const float* eo = expert_output.data_as<const float>();
  const float* w = topk_weights.data_as<const float>();
  const int32_t* slot_to_row = prepared.slot_to_row.data_as<const int32_t>();
  float* out = output.data_as<float>();
  pool().parallel_for(
      T,
      [&](int64_t begin, int64_t end, int) {
        for (int64_t t = begin; t < end; ++t) {
          float* o = out + t * ldo;
          std::fill(o, o + H, 0.0f);
          // Fixed order j = 0..k-1: deterministic and independent of the batch.
          for (int64_t j = 0; j < k; ++j) {
            const int32_t row = slot_to_row[t * k + j];
            if (row < 0) continue;
            const float* e = eo + row * lde;
            if (apply_router_weight_on_input) {
              for (int64_t h = 0; h < H; ++h) o[h] += e[h];
            } else {
              const float s = w[t * ld_w + j];
              for (int64_t h = 0; h < H; ++h) o[h] += s * e[h];
            }
          }
        }
      },
      std::max<int64_t>(1, 8192 / std::max<int64_t>(H, 1)));
}

}  // namespace fusedmoe::cpu
