// fusedmoe internal: the sm_90a CUTLASS grouped-GEMM instantiations, one
// translation unit each (sm90_cutlass_grouped_gemm_<out>.cu): each is a heavy
// compile (CUTLASS templates, ~2 min and ~3.5 GB on one core). Two other
// configurations were measured and not kept (128 x 128 pingpong; 2 x 1
// clusters): see gemm_configs.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fusedmoe/kernels/cuda.h"

namespace fusedmoe::cuda::sm90 {

// D rows [off[e], off[e+1]) = A rows [off[e], off[e+1)) . W[e]^T for every e:
//   a: [rows, K] contiguous (expert-sorted), w: [E, N, K], both bf16 or both
//   f16, d: [rows, ldd] (the input type or f32: by the instantiation), K % 8 == 0, N % 8 == 0
//   (TMA: 16-byte aligned rows), ldd % 8 == 0.
struct Sm90GemmArgs {
  const uint16_t* a = nullptr;
  const uint16_t* w = nullptr;
  void* d = nullptr;
  int64_t ldd = 0;
  const int64_t* expert_offsets = nullptr;  // i64 [E + 1], on the device
  int64_t num_experts = 0;
  int64_t n = 0, k = 0;
  void* workspace = nullptr;  // device, workspace_bytes_*(num_experts) bytes
  size_t workspace_bytes = 0;
  // The grouped_gemm_glu_* instances only: w13 in W13Layout::kInterleaved128
  // (N = 2I, I % 128 == 0); d: [rows, ldd] of act(gate + b, up + b), I wide.
  const float* glu_bias = nullptr;  // f32 [E, 2I] (standard order) or null
  ActivationParams glu_act{};
  // kPrepare: write the per-expert group arrays (a one-block kernel reading
  // expert_offsets, launched with launch_pdl) into the front of the workspace;
  // kLaunch: the GEMM on the arrays a kPrepare call with the same arguments
  // wrote (so that the arrays of both GEMMs of a layer are written before the
  // first GEMM, none between the two).
  enum class Phase : uint8_t { kPrepare, kLaunch };
  Phase phase = Phase::kPrepare;
  // The contiguous instances only (contig_gemm_*): rows of expert e are
  // [off[e], off[e+1]), every off[e] a multiple of 64 (align with block_m = 64);
  // max_rows: the host's bound on off[E] (max_padded_rows(T*k, E, 64)), the rows of
  // a and d; tile_expert: device i32 [max_rows / 64], written by the kPrepare call.
  int32_t* tile_expert = nullptr;
  int64_t max_rows = 0;
  // The GEMM launched with PDL too (its CTAs placed over the previous
  // kernel's tail, waiting there): only where every expert has one m tile
  // (sm90_gemm_pdl), else plainly.
  bool pdl = false;
  // L2 eviction priority of the TMA loads of w (the weights) and of a: the
  // cp.async.bulk.tensor .L2::cache_hint operand, kL2Evict* or 0 (no hint).
  uint64_t cache_hint_w = 0, cache_hint_a = 0;
};

// L2 cache-policy operands (createpolicy.fractional.L2::evict_first / evict_last,
// fraction 1.0): CUTLASS's cute::TMA::CacheHintSm90 values.
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;
constexpr uint64_t kL2EvictLast = 0x14F0000000000000ull;

// Tile 128 x 256 x 64, cooperative (2 consumer warpgroups on one tile), cluster 1 x 1.
void grouped_gemm_bf16out(const Sm90GemmArgs& args, Stream stream);     // bf16 -> bf16 (w13)
void grouped_gemm_f32out(const Sm90GemmArgs& args, Stream stream);      // bf16 -> f32 (w2)
void grouped_gemm_f16_f16out(const Sm90GemmArgs& args, Stream stream);  // f16 -> f16 (w13)
void grouped_gemm_f16_f32out(const Sm90GemmArgs& args, Stream stream);  // f16 -> f32 (w2)
size_t workspace_bytes_bf16out(int64_t num_experts);
// Tile 64 x 256 x 64, pingpong (each consumer warpgroup on its own tile), cluster 1 x 1.
void grouped_gemm_bf16out_m64(const Sm90GemmArgs& args, Stream stream);  // bf16 -> bf16
size_t workspace_bytes_bf16out_m64(int64_t num_experts);
size_t workspace_bytes_f32out(int64_t num_experts);
// The w13 GEMM with the gated activation in its epilogue (sm90_cutlass_glu_epilogue.cuh):
// bf16 in 64 x 256 pingpong and 128 x 256 cooperative tiles, f16 in 128 x 256 cooperative.
void grouped_gemm_glu_bf16_m64(const Sm90GemmArgs& args, Stream stream);
void grouped_gemm_glu_bf16_m128(const Sm90GemmArgs& args, Stream stream);
void grouped_gemm_glu_f16_m128(const Sm90GemmArgs& args, Stream stream);
size_t workspace_bytes_glu_bf16_m64(int64_t num_experts);
size_t workspace_bytes_glu_bf16_m128(int64_t num_experts);
size_t workspace_bytes_glu_f16_m128(int64_t num_experts);
size_t workspace_bytes_f16_f16out(int64_t num_experts);
// The contiguous grouped GEMM (sm90_cutlass_contig_gemm.cuh: one TMA descriptor
// per operand, no per-group descriptor updates), bf16, 64 x 256 pingpong:
// bf16 out (w2; w13 without the activation) and the w13 GEMM with the gated
// activation in its epilogue.
void contig_gemm_bf16out_m64(const Sm90GemmArgs& args, Stream stream);
void contig_gemm_glu_bf16_m64(const Sm90GemmArgs& args, Stream stream);
size_t contig_workspace_bytes_bf16out_m64();
size_t contig_workspace_bytes_glu_bf16_m64();
size_t workspace_bytes_f16_f32out(int64_t num_experts);
}  // namespace fusedmoe::cuda::sm90
