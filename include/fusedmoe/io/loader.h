// fusedmoe: loading one MoE layer's weights from a HF checkpoint.
//
// Per-expert tensors (Mixtral's block_sparse_moe.experts.N.w1/w3/w2, Qwen /
// OLMoE / DeepSeek's experts.N.gate_proj/up_proj/down_proj) and packed ones
// (gpt-oss experts.gate_up_proj [E, H, 2I] with interleaved gate/up columns and
// biases, down_proj [E, I, H]; Llama-4 experts.gate_up_proj [E, H, 2I] with
// gate then up halves, down_proj [E, I, H]) are gathered once into the
// canonical layout of experts/expert_weights.h in the checkpoint's dtype (bf16
// stays bf16; f32 stays f32; f16/f64 become f32; experts stored in mixed dtypes
// all become f32). Only the layer's own tensors
// are read. Also accepted: the fused canonical names experts.gate_up_proj
// [E, 2I, H] / experts.down_proj [E, H, I] (zero copy), DeepSeek's FP8 format
// (F8_E4M3 weights + weight_scale_inv per 128x128 block), dequantized to f32, and
// gpt-oss's MXFP4 experts (experts.gate_up_proj_blocks / _scales, down_proj_blocks
// / _scales: U8 E2M1 pairs and one E8M0 scale per 32 values, under
// quantization_config quant_method "mxfp4"), dequantized to bf16 as HF
// transformers' convert_moe_packed_tensors does.
// Router weights and biases are zero-copy views of the checkpoint mapping
// when stored as f32 or bf16 (f16 / f64 ones are converted to f32 copies).
#pragma once

#include <cstdint>

#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/safetensors.h"
#include "fusedmoe/runner/moe_runner.h"

namespace fusedmoe {

struct LoadOptions {
  // Draw a progress bar on stderr when it is a terminal and loading takes long.
  bool progress = true;
  // Only this rank's share of the routed experts is read (parallel/expert_map.h):
  // the experts ExpertMap(E, ep_size, expert_placement) gives ep_rank, in local
  // id order, each narrowed to TP slice tp_rank of I, and the shared expert
  // narrowed likewise (shard_expert_weights). Default: everything.
  ParallelConfig parallel;
  // Every tensor read is checked for NaN/Inf (one parallel pass over it), an
  // f64 one also for finite values beyond the f32 range it loads as, FP8 block
  // scales (weight_scale_inv) for negative ones (0 is taken: an all-zero block),
  // and FP8 weights times their scales for values beyond f32, MXFP4 scales for
  // 255 (NaN in E8M0) and MXFP4 values for ones beyond bf16: an Error(kIo)
  // naming the tensor, the index (and for a scale the value and its block).
  bool check_finite = true;
};

// Throws Error(kInvalidArgument) if `layer` is not an MoE layer, for a bad
// LoadOptions::parallel, or MXFP4 experts with H or I not a multiple of 32;
// Error(kIo) naming the tensor if one is missing, has the wrong shape/dtype,
// or (with check_finite) holds a value it cannot load (see
// LoadOptions::check_finite); Error(kUnsupported) naming it for a dtype
// fusedmoe does not read, FP8 weights without weight_scale_inv, or packed FP8
// experts.
MoELayerWeights load_moe_layer(const Checkpoint& checkpoint, const ModelInfo& info, int64_t layer,
                               const LoadOptions& options = {});

// What load_moe_layer checks before it copies anything: every tensor the layer
// needs is present with the expected shape and a supported dtype (and FP8 ones
// with their block scales). Reads only the safetensors headers: no weight is
// copied or scanned for NaN/Inf. Throws what load_moe_layer throws for those.
// Used by inspect_json (io/inspect.h).
void check_moe_layer(const Checkpoint& checkpoint, const ModelInfo& info, int64_t layer);

}  // namespace fusedmoe
