// fusedmoe: HF config.json -> one MoEConfig per MoE layer.
//
// Supported model_type values: mixtral, qwen2_moe, qwen3_moe, olmoe,
// deepseek_v2, deepseek_v3, gpt_oss, llama4 / llama4_text (a multimodal
// config's `text_config` is used). Each model type's defaults for fields the
// file omits are those of its transformers configuration class (5.x). Which
// layers are MoE follows the modeling code: first_k_dense_replace and
// moe_layer_freq (DeepSeek), decoder_sparse_step and mlp_only_layers (Qwen),
// interleave_moe_layer_step / moe_layers (Llama-4); every layer otherwise.
// Shape fields (hidden_size, num_hidden_layers, expert count, num_experts_per_tok,
// intermediate sizes) are required even where transformers has a default.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fusedmoe/config/moe_config.h"
#include "fusedmoe/core/dtype.h"

namespace fusedmoe {

struct ModelInfo {
  std::string model_type;    // e.g. "deepseek_v3" (top level: "llama4" for a multimodal config)
  std::string architecture;  // architectures[0], or ""
  std::string source;        // path of the config.json
  int64_t num_hidden_layers = 0;
  DType dtype = DType::kBF16;                  // "dtype" / "torch_dtype" of the checkpoint
  bool dtype_given = false;                    // config.json names it (else bf16 assumed)
  std::vector<int64_t> moe_layers;             // sorted layer indices that are MoE
  std::map<int64_t, MoEConfig> layer_configs;  // one per MoE layer (validated)
  // quantization_config.quant_method: "fp8" (DeepSeek-V3's 128 x 128 block
  // format) or "mxfp4" (gpt-oss's MXFP4 experts, model_type gpt_oss only),
  // the two read; "" when config.json has no quantization_config: the loader
  // then refuses FP8 weights (block-scaled weights the config does not
  // declare) and MXFP4 blocks.
  std::string quant_method;
  // Weight-name prefix of layer L's MoE block, e.g. "model.layers.3.mlp."; Mixtral
  // "model.layers.L.block_sparse_moe.", llama4_text "model.layers.L.feed_forward.",
  // multimodal llama4 "language_model.model.layers.L.feed_forward.".
  std::string moe_prefix(int64_t layer) const;

  bool is_moe_layer(int64_t layer) const { return layer_configs.count(layer) != 0; }
  // Throws Error(kInvalidArgument) "layer L: out of range, the model has N layers
  // (0..N-1); MoE layers: ..." for L < 0 or L >= num_hidden_layers, else
  // "layer L is not an MoE layer of MODEL (MoE layers: ...)" for a dense layer.
  const MoEConfig& layer_config(int64_t layer) const;
};

// Reads `model_dir`/config.json (or a path to a .json file; or a checkpoint's
// .safetensors file or model.safetensors.index.json, standing for the
// config.json beside it, as Checkpoint::open takes that file for the weights).
// Any other file (not a .json: a .npy, a text file) is Error(kInvalidArgument)
// "expected a model directory, its config.json, ...", as `fusedmoe inspect` says.
// Throws Error(kIo) if unreadable / not JSON (or a checkpoint file's folder has
// no config.json), Error(kUnsupported) for an unknown model_type (naming it and
// listing the supported ones) or a hidden_act, scoring_func, topk_method or
// quantization_config fusedmoe does not implement, Error(kInvalidArgument) for
// missing or invalid fields (naming them). Fields are read as HF transformers'
// configuration classes read them (defaults included).
ModelInfo load_model_info(const std::string& model_dir);
// Throws Error(kInvalidArgument) "SHOWN: the model has no MoE layer fusedmoe can run
// (model_type 'T', N layers, none of them MoE by its config.json)" when `info` has no
// MoE layer (a dense model, or config.json's fields make every layer dense): what
// `fusedmoe run`, `fusedmoe inspect` and the Python module say of such a model.
// `shown`: how the caller names the model (e.g. "--model PATH", printable()).
void require_moe_layer(const ModelInfo& info, const std::string& shown);
// The same from the text of a config.json: `source` names it in messages and
// becomes ModelInfo::source. Reads no file; malformed JSON is Error(kIo).
ModelInfo parse_model_info(const std::string& json_text, const std::string& source);

}  // namespace fusedmoe
