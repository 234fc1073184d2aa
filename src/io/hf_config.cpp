// fusedmoe: HF config.json -> ModelInfo (one MoEConfig per MoE layer).
//
// Field names, defaults and the MoE-layer rules come from transformers 5.x
// configuration_<arch>.py / modeling_<arch>.py. Shape fields (hidden_size,
// num_hidden_layers, expert count, top-k, intermediate sizes) are required: a
// config without them is not a usable checkpoint description. Other fields
// take the configuration class's default when absent, and when null too,
// except where transformers reads the None itself (README, "Supported
// models"): a boolean null is false (HF tests its truth: `if
// self.norm_topk_prob:`); DeepSeek's n_shared_experts null is no shared expert
// (DeepSeek's reference code and vLLM test `is not None`; HF's strict config
// class refuses it); a null that HF's configuration class refuses (hidden_act,
// routed_scaling_factor, Qwen / OLMoE's norm_topk_prob, decoder_sparse_step,
// shared_expert_intermediate_size, interleave_moe_layer_step) or that HF cannot
// build or run a layer with (DeepSeek's n_group, topk_group,
// first_k_dense_replace; gpt-oss's swiglu_limit) is an error naming the field.
#include "fusedmoe/io/hf_config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "fusedmoe/core/error.h"
#include "fusedmoe/io/safetensors.h"
#include "io/python_json.h"

namespace fusedmoe {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kSupported =
    "mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3, gpt_oss, llama4, llama4_text";

std::string join(const std::vector<int64_t>& v) {
  std::ostringstream os;
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  return os.str();
}

// A config value as config.json wrote it (NaN / Infinity as such: io/python_json.h).
std::string as_written(const json& v) {
  return detail::json_as_written(v);
}

// Typed access to a config object with aliases, defaults and named errors.
class Fields {
 public:
  Fields(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

  // The first present, non-null key among `keys`, or nullptr.
  const json* find(std::initializer_list<const char*> keys, const char** found = nullptr) const {
    for (const char* k : keys) {
      auto it = j_.find(k);
      if (it != j_.end() && !it->is_null()) {
        if (found) *found = k;
        return &*it;
      }
    }
    return nullptr;
  }

  int64_t get_int(std::initializer_list<const char*> keys, std::optional<int64_t> def = {}) const {
    const char* k = nullptr;
    const json* v = find(keys, &k);
    if (!v) {
      if (def) return *def;
      missing(keys);
    }
    // An unsigned value past 2^63 - 1 would wrap negative in int64_t; one past
    // 64 bits is kept as its text (io/python_json.h).
    const std::string text = v->is_binary() ? as_written(*v) : std::string();
    const bool big =
        !text.empty() &&
        text.find_first_not_of("0123456789", text[0] == '-' ? 1 : 0) == std::string::npos;
    if (big || (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)))
      FUSEDMOE_THROW(kInvalidArgument, where_, ": field '", k,
                     "': expected an integer below 2^63, got ", as_written(*v));
    // A float, even a whole one (4.0): not an integer field's value (Python
    // reads it as a float, which HF's torch.topk and range() refuse).
    if (v->is_number_integer()) return v->get<int64_t>();
    FUSEDMOE_THROW(kInvalidArgument, where_, ": field '", k, "': expected an integer, got ",
                   as_written(*v));
  }
  // A size field: at most `max`, the error naming the key as config.json spells it.
  int64_t get_size(std::initializer_list<const char*> keys, int64_t max,
                   std::optional<int64_t> def = {}) const {
    const int64_t v = get_int(keys, def);
    if (v > max) {
      const char* k = "";
      find(keys, &k);
      FUSEDMOE_THROW(kInvalidArgument, where_, ": field '", k, "': expected <= ", max,
                     " (far above any released model), got ", v);
    }
    return v;
  }
  // A count field: an integer in [0, max], the error naming the field (a
  // negative one was read on, to be named by a value derived from it).
  int64_t get_count(const char* key, int64_t max, int64_t def) const {
    const int64_t v = get_size({key}, max, def);
    if (v < 0)
      FUSEDMOE_THROW(kInvalidArgument, where_, ": field '", key,
                     "': expected an integer >= 0, got ", v);
    return v;
  }
  // A number stored as f32 (a scale, a clamp): beyond the f32 range it would
  // load as Inf, so it is named here.
  float get_float(std::initializer_list<const char*> keys, double def) const {
    const double v = get_double(keys, def);
    if (std::isfinite(v) && std::fabs(v) > std::numeric_limits<float>::max()) {
      const char* k = "";
      find(keys, &k);
      FUSEDMOE_THROW(kInvalidArgument, where_, ": field '", k,
                     "': expected a number within the f32 range (|x| <= 3.4028235e38), got ",
                     as_written(*find(keys)));
    }
    return static_cast<float>(v);
  }
  double get_double(std::initializer_list<const char*> keys, double def) const {
    const char* k = nullptr;
    const json* v = find(keys, &k);
    if (!v) return def;
    if (v->is_number()) return v->get<double>();
    if (v->is_binary())  // NaN, Infinity, 1e999, a 64-bit-plus integer (io/python_json.h)
      FUSEDMOE_THROW(kInvalidArgument, where_, ": field '", k, "': expected a finite number, got ",
                     as_written(*v));
    FUSEDMOE_THROW(kInvalidArgument, where_, ": field '", k, "': expected a number, got ",
                   as_written(*v));
  }
  // DeepSeek's shared experts as one MLP: n_shared_experts x the routed
  // width (0 for null: see the top of this file), bounded here so that the
  // error names both fields rather than the product only.
  int64_t shared_width(int64_t def_count, int64_t routed_width) const {
    if (is_null("n_shared_experts")) return 0;
    const int64_t n = get_count("n_shared_experts", kMaxNumExperts, def_count);
    if (routed_width > 0 && n > kMaxIntermediateSize / routed_width)
      FUSEDMOE_THROW(kInvalidArgument, where_,
                     ": fields 'n_shared_experts' x 'moe_intermediate_size' (the shared experts' "
                     "width): expected at most ",
                     kMaxIntermediateSize, ", got ", n, " x ", routed_width);
    return n * routed_width;
  }
  // True when `key` is present with the value null (Python's None).
  bool is_null(const char* key) const {
    const auto it = j_.find(key);
    return it != j_.end() && it->is_null();
  }
  // A field that HF transformers cannot build or run a layer with when None:
  // null is an error naming it (`want`: what it takes), not the default.
  void refuse_null(const char* key, const char* want, const char* why) const {
    if (is_null(key))
      FUSEDMOE_THROW(kInvalidArgument, where_, ": field '", key, "': expected ", want,
                     ", got null (", why, ")");
  }
  // A boolean: null is false, as HF's `if config.<field>:` reads None.
  bool get_bool(std::initializer_list<const char*> keys, bool def) const {
    for (const char* key : keys) {
      if (is_null(key)) return false;
      if (j_.contains(key)) break;
    }
    const char* k = nullptr;
    const json* v = find(keys, &k);
    if (!v) return def;
    if (v->is_boolean()) return v->get<bool>();
    FUSEDMOE_THROW(kInvalidArgument, where_, ": field '", k, "': expected true or false, got ",
                   as_written(*v));
  }
  std::string get_string(std::initializer_list<const char*> keys,
                         std::optional<std::string> def = {}) const {
    const char* k = nullptr;
    const json* v = find(keys, &k);
    if (!v) {
      if (def) return *def;
      missing(keys);
    }
    if (v->is_string()) return v->get<std::string>();
    FUSEDMOE_THROW(kInvalidArgument, where_, ": field '", k, "': expected a string, got ",
                   as_written(*v));
  }
  std::optional<std::vector<int64_t>> get_int_list(const char* key) const {
    const json* v = find({key});
    if (!v) return std::nullopt;
    std::vector<int64_t> out;
    if (v->is_array()) {
      for (const json& e : *v) {
        if (!e.is_number_integer()) break;
        out.push_back(e.get<int64_t>());
      }
      if (out.size() == v->size()) return out;
    }
    FUSEDMOE_THROW(kInvalidArgument, where_, ": field '", key,
                   "': expected a list of integers, got ", as_written(*v));
  }
  const std::string& where() const { return where_; }

 private:
  [[noreturn]] void missing(std::initializer_list<const char*> keys) const {
    for (const char* k : keys)
      if (is_null(k))
        FUSEDMOE_THROW(kInvalidArgument, where_, ": required field '", k,
                       "': expected a value, got null");
    std::string names;
    for (const char* k : keys) names += std::string(names.empty() ? "'" : " or '") + k + "'";
    FUSEDMOE_THROW(kInvalidArgument, where_, ": required field ", names, " is missing");
  }
  const json& j_;
  std::string where_;
};

// Why a null is refused where transformers' configuration class refuses it
// (its strict field validation, transformers 5.17: StrictDataclassFieldValidationError).
constexpr const char* kStrictNone = "HF transformers' configuration refuses None for it";

Activation activation_from_hf(const Fields& f) {
  const std::string act = f.get_string({"hidden_act"}, std::string("silu"));
  if (act == "silu" || act == "swish") return Activation::kSiluGlu;
  if (act == "gelu") return Activation::kGeluGlu;
  if (act == "gelu_pytorch_tanh" || act == "gelu_new" || act == "gelu_fast")
    return Activation::kGeluTanhGlu;
  FUSEDMOE_THROW(kUnsupported, f.where(), ": hidden_act '", printable(act),
                 "' is not supported (supported: silu, swish, gelu, gelu_pytorch_tanh, gelu_new, "
                 "gelu_fast)");
}

ScoringFunc scoring_from_hf(const Fields& f, const char* def) {
  const std::string s = f.get_string({"scoring_func"}, std::string(def));
  if (s == "softmax") return ScoringFunc::kSoftmax;
  if (s == "sigmoid") return ScoringFunc::kSigmoid;
  FUSEDMOE_THROW(kUnsupported, f.where(), ": scoring_func '", printable(s),
                 "' is not supported (supported: softmax, sigmoid)");
}

// Qwen2/Qwen3-MoE: Qwen2MoeDecoderLayer picks the sparse block when
// (layer not in mlp_only_layers) and num_experts > 0 and (layer + 1) % decoder_sparse_step == 0.
std::vector<int64_t> qwen_moe_layers(const Fields& f, int64_t n_layers, int64_t n_experts) {
  const int64_t step = f.get_int({"decoder_sparse_step"}, 1);
  if (step <= 0)
    FUSEDMOE_THROW(kInvalidArgument, f.where(), ": field 'decoder_sparse_step': expected > 0, got ",
                   step);
  const std::vector<int64_t> mlp_only =
      f.get_int_list("mlp_only_layers").value_or(std::vector<int64_t>{});
  // HF ignores entries the model does not have; like Llama-4's moe_layers they
  // are refused here (a config for another model, or a typo).
  for (int64_t l : mlp_only)
    if (l < 0 || l >= n_layers)
      FUSEDMOE_THROW(kInvalidArgument, f.where(), ": field 'mlp_only_layers': layer ", l,
                     " is outside [0, ", n_layers, ")");
  std::vector<int64_t> out;
  for (int64_t l = 0; l < n_layers; ++l) {
    bool dense = std::find(mlp_only.begin(), mlp_only.end(), l) != mlp_only.end();
    if (!dense && n_experts > 0 && (l + 1) % step == 0) out.push_back(l);
  }
  return out;
}

// DeepSeek: layer >= first_k_dense_replace and layer % moe_layer_freq == 0
// (DeepSeek's reference modeling code; HF's ignores moe_layer_freq, i.e. 1).
// moe_layer_freq 0, which the reference code divides by, is read as HF reads
// it: every layer from first_k_dense_replace on. first_k_dense_replace null:
// HF compares the layer index with None (a TypeError), refused.
std::vector<int64_t> deepseek_moe_layers(const Fields& f, int64_t n_layers,
                                         int64_t first_k_default) {
  f.refuse_null("first_k_dense_replace", "an integer >= 0",
                "HF transformers compares each layer index with it");
  const int64_t first_k =
      f.get_count("first_k_dense_replace", std::numeric_limits<int64_t>::max(), first_k_default);
  int64_t freq = f.get_int({"moe_layer_freq"}, 1);
  if (freq < 0)
    FUSEDMOE_THROW(kInvalidArgument, f.where(),
                   ": field 'moe_layer_freq': expected an integer >= 0 (1: every layer from "
                   "first_k_dense_replace on; 0 reads the same, as HF transformers ignores the "
                   "field), got ",
                   freq);
  if (freq == 0) freq = 1;
  std::vector<int64_t> out;
  for (int64_t l = 0; l < n_layers; ++l)
    if (l >= first_k && l % freq == 0) out.push_back(l);
  return out;
}

std::vector<int64_t> all_layers(int64_t n) {
  std::vector<int64_t> out(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (int64_t l = 0; l < n; ++l) out[static_cast<size_t>(l)] = l;
  return out;
}

}  // namespace

std::string ModelInfo::moe_prefix(int64_t layer) const {
  const std::string l = std::to_string(layer);
  if (model_type == "mixtral") return "model.layers." + l + ".block_sparse_moe.";
  // A multimodal Llama-4 checkpoint (Llama4ForConditionalGeneration) nests the text model.
  if (model_type == "llama4") return "language_model.model.layers." + l + ".feed_forward.";
  if (model_type == "llama4_text") return "model.layers." + l + ".feed_forward.";
  return "model.layers." + l + ".mlp.";
}

const MoEConfig& ModelInfo::layer_config(int64_t layer) const {
  auto it = layer_configs.find(layer);
  // A layer the model does not have at all is out of range, not "not MoE".
  if (layer < 0 || layer >= num_hidden_layers) {
    const int64_t n = num_hidden_layers;
    const std::string has = n == 1
                                ? std::string("1 layer (0)")
                                : std::to_string(n) + " layers (0.." + std::to_string(n - 1) + ")";
    FUSEDMOE_THROW(kInvalidArgument, "layer ", layer, ": out of range, the model has ", has,
                   "; MoE layers: ", moe_layers.empty() ? std::string("none") : join(moe_layers));
  }
  if (it == layer_configs.end())
    FUSEDMOE_THROW(kInvalidArgument, "layer ", layer, " is not an MoE layer of ", model_type,
                   " (MoE layers: ", join(moe_layers), ")");
  return it->second;
}

void require_moe_layer(const ModelInfo& info, const std::string& shown) {
  if (!info.moe_layers.empty()) return;
  FUSEDMOE_THROW(
      kInvalidArgument, shown, ": the model has no MoE layer fusedmoe can run (model_type '",
      printable(info.model_type), "', ", info.num_hidden_layers,
      info.num_hidden_layers == 1 ? " layer" : " layers", ", none of them MoE by its config.json)");
}

ModelInfo load_model_info(const std::string& model_dir) {
  std::error_code ec;
  fs::path p(model_dir);
  if (fs::is_directory(p, ec)) {
    p /= "config.json";
  } else if (const bool index = p.filename().string().ends_with(".safetensors.index.json");
             fs::is_regular_file(p, ec) &&
             (index || p.extension() == ".safetensors" || looks_like_safetensors(p.string()))) {
    // A checkpoint file or a sharded checkpoint's index (which Checkpoint::open
    // reads as the checkpoint) stands for its model: the config.json beside it.
    p = (p.has_parent_path() ? p.parent_path() : fs::path(".")) / "config.json";
    if (!fs::exists(p, ec))
      FUSEDMOE_THROW(kIo, printable(model_dir), ": a ",
                     index ? "safetensors index" : ".safetensors file",
                     ", whose folder has no config.json (", printable(p.string()),
                     "); expected a model directory, its config.json, or a ",
                     "checkpoint file or index beside its config.json");
  } else if (fs::is_regular_file(p, ec) && p.extension() != ".json") {
    // Another file (a .npy, a text file): named as such, not parsed as a
    // config.json to fail as "not valid JSON".
    FUSEDMOE_THROW(kInvalidArgument, printable(model_dir),
                   ": expected a model directory, its config.json, its *.safetensors.index.json "
                   "or a .safetensors file");
  }
  require_regular_file(p.string());
  std::ifstream in(p, std::ios::binary);
  if (!in) FUSEDMOE_THROW(kIo, printable(p.string()), ": cannot open: ", std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) FUSEDMOE_THROW(kIo, printable(p.string()), ": read error");
  return parse_model_info(ss.str(), p.string());
}

ModelInfo parse_model_info(const std::string& json_text, const std::string& source) {
  // The path as error messages quote it (control characters as \xNN).
  const std::string shown = printable(source);
  // As Python's json.load reads it (transformers' reader): a byte-order mark
  // refused, NaN / Infinity taken (refused by every typed read below), ...
  json root = detail::parse_python_json(json_text, shown, "the model's config.json");
  if (!root.is_object())
    FUSEDMOE_THROW(kIo, shown, ": not a JSON object (got ",
                   root.is_binary() ? as_written(root) : root.type_name(), ")");

  ModelInfo info;
  info.source = source;
  Fields top(root, shown);
  info.model_type = top.get_string({"model_type"});
  if (const json* a = top.find({"architectures"});
      a && a->is_array() && !a->empty() && (*a)[0].is_string())
    info.architecture = (*a)[0].get<std::string>();

  const std::string& mt = info.model_type;
  static const char* kTypes[] = {"mixtral", "qwen2_moe",   "qwen3_moe",
                                 "olmoe",   "deepseek_v2", "deepseek_v3",
                                 "gpt_oss", "llama4",      "llama4_text"};
  if (std::find_if(std::begin(kTypes), std::end(kTypes), [&](const char* t) { return mt == t; }) ==
      std::end(kTypes))
    FUSEDMOE_THROW(kUnsupported, shown, ": model_type '", printable(mt),
                   "' is not supported (supported: ", kSupported, ")");

  // Quantized checkpoints: DeepSeek-V3's FP8 format (e4m3 weights with one
  // f32 scale per 128 x 128 block) and gpt-oss's MXFP4 experts (io/loader.h)
  // are read; anything else would be loaded as if it were plain weights.
  if (const auto q = root.find("quantization_config"); q != root.end() && !q->is_null()) {
    // Not an object, or no quant_method string in it: said so (it read as quant_method '').
    if (!q->is_object())
      FUSEDMOE_THROW(kInvalidArgument, shown,
                     ": quantization_config: expected an object with a 'quant_method', got ",
                     as_written(*q));
    const auto m = q->find("quant_method");
    if (m == q->end() || !m->is_string())
      FUSEDMOE_THROW(kInvalidArgument, shown,
                     ": quantization_config.quant_method: expected a string, got ",
                     m == q->end() ? std::string("none") : as_written(*m));
    const std::string method = m->get<std::string>();
    // MXFP4 experts as gpt-oss ships them (the loader's gpt-oss path reads
    // them; any other model's loader would not).
    if (method == "mxfp4" && mt != "gpt_oss")
      FUSEDMOE_THROW(kUnsupported, shown,
                     ": quantization_config.quant_method 'mxfp4' is supported "
                     "for model_type gpt_oss only (its MXFP4 experts), got model_type '",
                     printable(mt), "'");
    if (method != "fp8" && method != "mxfp4")
      FUSEDMOE_THROW(kUnsupported, shown, ": quantization_config.quant_method '", printable(method),
                     "' is not supported (supported: unquantized weights, 'fp8' with 128 x 128 "
                     "weight blocks as DeepSeek-V3 ships, and 'mxfp4' experts as gpt-oss ships)");
    // The format DeepSeek-V3 ships and the loader reads: e4m3 weights, with
    // the activations quantized per call ("dynamic", as HF transformers'
    // FP8 layers take them: there are no activation scales to read). Another
    // value would be ignored, the weights read as if it were this one.
    for (const auto& [key, want] : {std::pair{"fmt", "e4m3"}, {"activation_scheme", "dynamic"}}) {
      if (method != "fp8") break;
      const auto v = q->find(key);
      if (v == q->end() || v->is_null()) continue;
      if (!v->is_string())
        FUSEDMOE_THROW(kInvalidArgument, shown, ": quantization_config.", key,
                       ": expected a string, got ", as_written(*v));
      if (v->get<std::string>() != want)
        FUSEDMOE_THROW(kUnsupported, shown, ": quantization_config.", key, ": expected '", want,
                       "' (the FP8 format this library reads, as DeepSeek-V3 ships), got '",
                       printable(v->get<std::string>()), "'");
    }
    info.quant_method = method;
    if (const auto b = q->find("weight_block_size");
        method == "fp8" && b != q->end() && !b->is_null()) {
      const bool ok = b->is_array() && b->size() == 2 && (*b)[0].is_number_integer() &&
                      (*b)[1].is_number_integer() && (*b)[0].get<int64_t>() == 128 &&
                      (*b)[1].get<int64_t>() == 128;
      if (!ok)
        FUSEDMOE_THROW(kUnsupported, shown,
                       ": quantization_config.weight_block_size: expected [128,128], got ",
                       as_written(*b));
    }
  }

  // Multimodal Llama-4: the language model's settings live in text_config.
  const json* cfg = &root;
  std::string where = shown;
  if (mt == "llama4") {
    const json* tc = top.find({"text_config"});
    if (!tc || !tc->is_object())
      FUSEDMOE_THROW(kInvalidArgument, shown, ": model_type 'llama4' needs a 'text_config' object");
    cfg = tc;
    where = shown + " (text_config)";
  }
  Fields f(*cfg, where);

  // dtype: "dtype" (transformers >= 4.56) or "torch_dtype"; text_config first.
  const char* dtype_key = "dtype";  // the field found, named in errors
  const json* dt = f.find({"dtype", "torch_dtype"}, &dtype_key);
  if (!dt) dt = top.find({"dtype", "torch_dtype"}, &dtype_key);
  if (dt) {
    if (!dt->is_string())
      FUSEDMOE_THROW(kInvalidArgument, where, ": field '", dtype_key, "': expected a string, got ",
                     as_written(*dt));
    // The model's floating type (its activations and, unquantized, its
    // weights): HF's names and fusedmoe's short ones; an integer, bool or fp8
    // type is no model dtype (a trial's "int8" and "bool" were shown as one).
    const std::string name = dt->get<std::string>();
    std::optional<DType> d;
    try {
      d = parse_dtype(name);
    } catch (const Error&) {
    }
    if (!d || !(*d == DType::kF32 || *d == DType::kBF16 || *d == DType::kF16 || *d == DType::kF64))
      FUSEDMOE_THROW(kInvalidArgument, where, ": field '", dtype_key,
                     "': expected bfloat16, float16, float32 or float64, got '", printable(name),
                     "'");
    info.dtype = *d;
    info.dtype_given = true;
  }

  info.num_hidden_layers = f.get_int({"num_hidden_layers"});
  // One MoEConfig is built per MoE layer: bound the count so a corrupt config
  // cannot exhaust memory (the largest released models have < 200 layers).
  constexpr int64_t kMaxLayers = 100000;
  if (info.num_hidden_layers <= 0 || info.num_hidden_layers > kMaxLayers)
    FUSEDMOE_THROW(kInvalidArgument, where, ": field 'num_hidden_layers': expected 1..", kMaxLayers,
                   ", got ", info.num_hidden_layers);

  MoEConfig c;
  c.hidden_size = f.get_size({"hidden_size"}, kMaxHiddenSize);
  c.top_k = f.get_size({"num_experts_per_tok"}, kMaxNumExperts);
  f.refuse_null("hidden_act", "an activation name", kStrictNone);
  c.activation = activation_from_hf(f);
  std::vector<int64_t> layers;
  const int64_t L = info.num_hidden_layers;

  if (mt == "mixtral") {
    // MixtralSparseMoeBlock: softmax, top-k, always renormalized.
    c.num_experts = f.get_size({"num_local_experts", "num_experts"}, kMaxNumExperts);
    c.intermediate_size = f.get_size({"intermediate_size"}, kMaxIntermediateSize);
    c.routing_method = RoutingMethod::kTopK;
    c.scoring_func = ScoringFunc::kSoftmax;
    c.renormalize = true;
    layers = all_layers(L);
  } else if (mt == "qwen2_moe" || mt == "qwen3_moe") {
    c.num_experts = f.get_size({"num_experts", "num_local_experts"}, kMaxNumExperts);
    c.intermediate_size = f.get_size({"moe_intermediate_size"}, kMaxIntermediateSize);
    c.routing_method = RoutingMethod::kTopK;
    c.scoring_func = ScoringFunc::kSoftmax;
    f.refuse_null("norm_topk_prob", "true or false", kStrictNone);
    f.refuse_null("decoder_sparse_step", "an integer >= 1", kStrictNone);
    c.renormalize = f.get_bool({"norm_topk_prob"}, false);
    if (mt == "qwen2_moe") {
      f.refuse_null("shared_expert_intermediate_size", "an integer", kStrictNone);
      // Qwen2MoeSparseMoeBlock: shared_expert + sigmoid(shared_expert_gate).
      c.shared_intermediate_size =
          f.get_size({"shared_expert_intermediate_size"}, kMaxIntermediateSize);
      c.has_shared_expert_gate = c.shared_intermediate_size > 0;
    }
    layers = qwen_moe_layers(f, L, c.num_experts);
  } else if (mt == "olmoe") {
    c.num_experts = f.get_size({"num_experts", "num_local_experts"}, kMaxNumExperts);
    c.intermediate_size = f.get_size({"intermediate_size"}, kMaxIntermediateSize);
    c.routing_method = RoutingMethod::kTopK;
    c.scoring_func = ScoringFunc::kSoftmax;
    f.refuse_null("norm_topk_prob", "true or false", kStrictNone);
    c.renormalize = f.get_bool({"norm_topk_prob"}, false);
    layers = all_layers(L);
  } else if (mt == "deepseek_v2") {
    // DeepseekV2Moe: softmax; "greedy" = plain top-k, "group_limited_greedy" =
    // groups scored by their max, top topk_group groups, then top-k; the weights
    // times routed_scaling_factor, never renormalized. "noaux_tc" (which HF's V2
    // cannot run) routes as deepseek_v3, as vLLM does.
    c.num_experts = f.get_size({"n_routed_experts", "num_experts"}, kMaxNumExperts);
    c.intermediate_size = f.get_size({"moe_intermediate_size"}, kMaxIntermediateSize);
    c.scoring_func = scoring_from_hf(f, "softmax");
    c.renormalize = f.get_bool({"norm_topk_prob"}, false);
    f.refuse_null("routed_scaling_factor", "a number", kStrictNone);
    c.routed_scaling_factor = f.get_float({"routed_scaling_factor"}, 1.0);
    const std::string method = f.get_string({"topk_method"}, std::string("greedy"));
    if (method == "greedy" || method == "group_limited_greedy") {
      // Where implementations disagree, refuse rather than pick one. With
      // norm_topk_prob true, HF's DeepseekV2Moe ignores the field (scales by
      // routed_scaling_factor), DeepSeek's reference modeling_deepseek.py
      // renormalizes instead of scaling, and vLLM does both. Another
      // scoring_func: HF takes the softmax anyway, DeepSeek's code raises
      // NotImplementedError, vLLM reads it. No released V2 checkpoint sets either.
      if (c.renormalize)
        FUSEDMOE_THROW(kUnsupported, where,
                       ": norm_topk_prob true is not supported for "
                       "deepseek_v2 with topk_method '",
                       printable(method),
                       "' (HF transformers' "
                       "DeepseekV2Moe ignores it and scales the weights by routed_scaling_"
                       "factor, DeepSeek's reference code renormalizes them instead of scaling, "
                       "vLLM does both; released DeepSeek-V2 checkpoints set false)");
      if (c.scoring_func != ScoringFunc::kSoftmax)
        FUSEDMOE_THROW(kUnsupported, where, ": scoring_func '",
                       printable(f.get_string({"scoring_func"}, std::string())),
                       "' is not supported for deepseek_v2 with topk_method '", printable(method),
                       "' (supported: softmax; HF transformers' DeepseekV2Moe always takes the "
                       "softmax, DeepSeek's reference code supports only it)");
    }
    if (method == "greedy") {
      c.routing_method = RoutingMethod::kTopK;
    } else if (method == "group_limited_greedy") {
      c.routing_method = RoutingMethod::kGroupedTopK;
      c.group_score = GroupScore::kMax;
      c.num_expert_group = f.get_int({"n_group"});
      c.topk_group = f.get_int({"topk_group"});
    } else if (method == "noaux_tc") {
      c.routing_method = RoutingMethod::kGroupedTopK;
      c.group_score = GroupScore::kSumTop2;
      c.has_e_score_correction_bias = true;
      c.num_expert_group = f.get_int({"n_group"}, 1);
      c.topk_group = f.get_int({"topk_group"}, 1);
    } else {
      FUSEDMOE_THROW(kUnsupported, where, ": topk_method '", printable(method),
                     "' is not supported (supported: greedy, group_limited_greedy, noaux_tc)");
    }
    c.shared_intermediate_size = f.shared_width(2, c.intermediate_size);
    layers = deepseek_moe_layers(f, L, 0);
  } else if (mt == "deepseek_v3") {
    // DeepseekV3TopkRouter (noaux_tc): sigmoid, + e_score_correction_bias for
    // selection, group score = sum of the top-2 biased scores per group.
    c.num_experts =
        f.get_size({"n_routed_experts", "num_local_experts", "num_experts"}, kMaxNumExperts);
    c.intermediate_size = f.get_size({"moe_intermediate_size"}, kMaxIntermediateSize);
    const std::string method = f.get_string({"topk_method"}, std::string("noaux_tc"));
    if (method != "noaux_tc")
      FUSEDMOE_THROW(kUnsupported, where, ": topk_method '", printable(method),
                     "' is not supported for deepseek_v3 (supported: noaux_tc)");
    c.routing_method = RoutingMethod::kGroupedTopK;
    // HF's DeepseekV3TopkRouter takes the sigmoid whatever config.json says
    // (DeepseekV3Config has no scoring_func), while vLLM and SGLang honour the
    // field: a config naming another function is refused, not read one way.
    c.scoring_func = scoring_from_hf(f, "sigmoid");
    if (c.scoring_func != ScoringFunc::kSigmoid)
      FUSEDMOE_THROW(kUnsupported, where, ": scoring_func '",
                     printable(f.get_string({"scoring_func"}, std::string())),
                     "' is not supported for deepseek_v3 (supported: sigmoid; HF transformers' "
                     "DeepseekV3 router always takes the sigmoid of the logits, other engines "
                     "read the field)");
    c.group_score = GroupScore::kSumTop2;
    c.has_e_score_correction_bias = true;
    // HF's router views the scores as [T, n_group, E / n_group] and takes the
    // top topk_group groups: None fails there.
    f.refuse_null("n_group", "an integer", "HF transformers' DeepseekV3 router groups by it");
    f.refuse_null("topk_group", "an integer",
                  "HF transformers' DeepseekV3 router keeps that many groups");
    c.num_expert_group = f.get_int({"n_group"}, 8);
    c.topk_group = f.get_int({"topk_group"}, 4);
    c.renormalize = f.get_bool({"norm_topk_prob"}, true);
    f.refuse_null("routed_scaling_factor", "a number", kStrictNone);
    c.routed_scaling_factor = f.get_float({"routed_scaling_factor"}, 2.5);
    c.shared_intermediate_size = f.shared_width(1, c.intermediate_size);
    layers = deepseek_moe_layers(f, L, 3);
  } else if (mt == "gpt_oss") {
    // GptOssTopKRouter: linear with bias, top-k over logits, softmax over the k.
    // GptOssExperts: interleaved gate/up, clamped SwiGLU (alpha, limit), biases.
    c.num_experts = f.get_size({"num_local_experts", "num_experts"}, kMaxNumExperts);
    c.intermediate_size = f.get_size({"intermediate_size"}, kMaxIntermediateSize);
    c.routing_method = RoutingMethod::kTopKSoftmax;
    c.scoring_func = ScoringFunc::kSoftmax;
    c.renormalize = false;
    c.has_router_bias = true;
    c.has_expert_bias = true;
    c.activation = Activation::kSwigluOai;
    // swiglu_limit: the clamp of HF transformers' MXFP4 experts
    // (getattr(config, "swiglu_limit", 7.0)) and of vLLM; HF's bf16
    // GptOssExperts fix it (and alpha) at 7.0 (1.702), the released configs' value.
    c.swiglu_alpha = f.get_float({"swiglu_alpha"}, 1.702);
    f.refuse_null("swiglu_limit", "a number",
                  "HF transformers' MXFP4 gpt-oss experts and vLLM clamp the gate and up halves "
                  "by it");
    c.swiglu_limit = f.get_float({"swiglu_limit"}, 7.0);
    layers = all_layers(L);
  } else {  // llama4 / llama4_text
    // Llama4TextMoe: top-1 logit, sigmoid, scales the expert input; experts and
    // the always-on shared expert both use intermediate_size (intermediate_size_mlp
    // is for the dense layers).
    c.num_experts = f.get_size({"num_local_experts", "num_experts"}, kMaxNumExperts);
    c.intermediate_size = f.get_size({"intermediate_size"}, kMaxIntermediateSize);
    c.routing_method = RoutingMethod::kLlama4;
    c.scoring_func = ScoringFunc::kSigmoid;
    c.renormalize = false;
    c.apply_router_weight_on_input = true;
    c.shared_intermediate_size = c.intermediate_size;
    // The step is checked even where moe_layers, which takes precedence, is
    // given: a step of 0 or below describes no model (HF's range() fails on it).
    f.refuse_null("interleave_moe_layer_step", "an integer >= 1", kStrictNone);
    const int64_t step = f.get_int({"interleave_moe_layer_step"}, 1);
    if (step <= 0)
      FUSEDMOE_THROW(kInvalidArgument, where,
                     ": field 'interleave_moe_layer_step': expected an integer >= 1, got ", step);
    if (auto ml = f.get_int_list("moe_layers")) {
      layers = *ml;
    } else {
      for (int64_t l = step - 1; l < L; l += step) layers.push_back(l);
    }
    std::sort(layers.begin(), layers.end());
    layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
    for (int64_t l : layers)
      if (l < 0 || l >= L)
        FUSEDMOE_THROW(kInvalidArgument, where, ": field 'moe_layers': layer ", l,
                       " is outside [0, ", L, ")");
  }

  // No layer is MoE (Qwen2-MoE's num_experts 0, say, which HF builds as a dense
  // model): the MoE fields describe nothing, so they are not checked, and
  // require_moe_layer names the model as one without an MoE layer.
  try {
    if (!layers.empty()) c.validate();
  } catch (const Error& e) {
    // validate() names MoEConfig's fields: say which config.json field each
    // came from ("field 'num_experts_per_tok' (top_k): ...").
    std::string msg = e.what();
    const std::string field = msg.substr(0, msg.find(": "));
    const char* key = nullptr;
    if (field == "top_k")
      f.find({"num_experts_per_tok"}, &key);
    else if (field == "num_experts")
      f.find({"n_routed_experts", "num_local_experts", "num_experts"}, &key);
    else if (field == "intermediate_size")
      f.find({"moe_intermediate_size", "intermediate_size"}, &key);
    else if (field == "hidden_size")
      f.find({"hidden_size"}, &key);
    else if (field == "num_expert_group")
      f.find({"n_group"}, &key);
    else if (field == "topk_group" || field == "routed_scaling_factor")
      f.find({field == "topk_group" ? "topk_group" : "routed_scaling_factor"}, &key);
    if (key != nullptr && field.size() < msg.size())
      msg = detail::concat("field '", key, "' (", field, ")", msg.substr(field.size()));
    // group_score is the model type's, not a config.json field: name the group
    // count that leaves a group too few experts (a trial's n_group = 16 of 16
    // experts was told to "use max", which no config.json can say).
    if (field == "group_score" && f.find({"n_group"}, &key))
      msg = detail::concat("field '", key, "' (num_expert_group): expected at most ",
                           c.num_experts / 2, c.num_experts / 2 == 1 ? " group (" : " groups (",
                           c.num_experts,
                           " routed experts / 2: the router scores each group by the sum of its "
                           "top 2 experts), got ",
                           c.num_expert_group);
    throw Error(e.code(), detail::concat(where, " (", mt, "): ", msg));
  }
  info.moe_layers = layers;
  for (int64_t l : layers) info.layer_configs.emplace(l, c);
  return info;
}

}  // namespace fusedmoe
