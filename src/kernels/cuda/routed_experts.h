// fusedmoe internal: the routed-expert pipeline of the functional
// cuda::fused_experts (kernels/cuda.h), the same launches as the mma.sync path
// of CudaMoELayer::forward:
//   align (group slots by expert) -> w13 grouped GEMM + activation ->
//   w2 grouped GEMM (x topk_weights, scattered by slot into y f32 [T*k, H]).
// The caller converts the input to bf16 before and runs finalize after.
// (CudaMoELayer::forward and ::experts kept their own copy of these launches
// when main gained the sm90 wgmma path beside them; moving both paths here so
// that the layer, expert parallelism and the functional entry share them is
// open work.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "fusedmoe/kernels/cuda.h"

namespace fusedmoe::cuda {

// The largest block_m of any GEMM tile: scratch sized for it fits every tile.
inline constexpr int kMaxBlockM = 128;

// Scratch of routed_experts, carved from one device allocation.
struct RoutedScratch {
  int32_t* counts = nullptr;       // [E]
  int32_t* cursor = nullptr;       // [E]
  int64_t* offsets = nullptr;      // [E + 1]
  int32_t* sorted_slot = nullptr;  // [max_padded_rows(T*k, E, kMaxBlockM)]
  uint16_t* inter = nullptr;       // bf16 [padded rows, I]
  float* y = nullptr;              // f32 [T*k, H]: the weighted expert outputs, by slot
};
// Bytes of the scratch for up to num_tokens tokens (a multiple of 256).
size_t routed_scratch_bytes(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden,
                            int64_t inter);
// Carves the scratch out of `base` (256-byte aligned, routed_scratch_bytes long).
RoutedScratch carve_routed_scratch(void* base, int64_t num_tokens, int64_t top_k,
                                   int64_t num_experts, int64_t hidden, int64_t inter);

// The GEMM tile for T tokens routed uniformly to k of E experts: from the
// expected rows per touched expert, E * (1 - (1 - k/E)^T) experts touched.
GemmTile routed_gemm_tile(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden,
                          int64_t inter);

struct RoutedExpertsArgs {
  const uint16_t* x = nullptr;  // bf16 [T, H] (already scaled when the weight is applied on
                                // the input), row stride ldx
  int64_t ldx = 0;              // 0: H; else >= H and a multiple of 8
  const int32_t* topk_ids = nullptr;
  const float* topk_weights = nullptr;  // scales y unless apply_router_weight_on_input
  int64_t num_tokens = 0, top_k = 0, num_experts = 0, hidden = 0, inter = 0;
  const uint16_t* w13 = nullptr;
  const uint16_t* w2 = nullptr;
  const float* w13_bias = nullptr;
  const float* w2_bias = nullptr;
  ActivationParams act;
  bool apply_router_weight_on_input = false;
  // The tile of both GEMMs; default routed_gemm_tile(T, k, E, H, I). Expert
  // parallelism passes the tile of the global batch (the same on every rank).
  std::optional<GemmTile> tile;
};
// Writes scratch.y (rows of slots whose id is -1 are left unwritten). T > 0.
void routed_experts(const RoutedExpertsArgs& args, const RoutedScratch& scratch, Stream stream);

}  // namespace fusedmoe::cuda
