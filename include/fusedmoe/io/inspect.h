// fusedmoe: what a model's MoE layers are and what their weights weigh, as
// JSON — the content of `fusedmoe inspect PATH --json` and of Python's
// fusedmoe.inspect(PATH).
#pragma once

#include <string>

namespace fusedmoe {

// `path` is a HF model directory, its config.json, or a safetensors file (told
// by its .safetensors name or by its content: looks_like_safetensors).
//
// Model (directory or config.json; layer configs from io/hf_config.h, weights
// from the checkpoint's safetensors headers, io/safetensors.h): an object with
// keys path, model_type, architecture, num_hidden_layers, dtype, dtype_given,
// quant_method ("fp8", "mxfp4" or ""), moe_layers, weights (whether
// model.safetensors or its index is next to config.json), layers (one per MoE
// layer: layer, prefix, config = MoEConfig::to_json, and with weights:
// tensors, weight_dtypes {dtype name: count}, bytes of the tensors under the
// layer's MoE prefix, weights_ok = whether every tensor the layer needs is
// there with the right shape and dtype (io/loader.h's check_moe_layer), and
// when not, weights_error = its message) and, with weights, moe_bytes_total.
// A .safetensors file: {file, tensors [{name, dtype, shape}], bytes, metadata}.
// A dtype is fusedmoe's name ("bf16", dtype_name); a tensor of a dtype that
// fusedmoe does not read (io/safetensors.h: U32, F8_E8M0, F4, ...) has the
// file's string ("U32") instead, counts in tensors and bytes, and in a file's
// list has "supported": false after its shape.
//
// Returns the object printed with 2-space indentation, keys in that order.
// Throws Error(kIo) if `path` does not exist or cannot be read, what
// load_model_info throws for a bad config.json, and Error(kInvalidArgument)
// for a model with no MoE layer (nothing fusedmoe can run).
std::string inspect_json(const std::string& path);

}  // namespace fusedmoe
