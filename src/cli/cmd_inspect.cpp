// `fusedmoe inspect PATH [--json]`: what a model's MoE layers are and what
// their weights weigh (io/inspect.h's inspect_json, printed as is with --json;
// the text form renders it, with each layer's MoEConfig from io/hf_config.h).
// PATH may also be a single .safetensors file: then its tensors are listed.
#include <locale.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cwchar>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/inspect.h"

namespace fusedmoe::cli {
namespace {

using ojson = nlohmann::ordered_json;

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string dtypes_str(const ojson& dtypes) {  // {dtype name: tensor count}
  std::string s;
  for (const auto& [name, count] : dtypes.items()) {
    if (!s.empty()) s += ", ";
    s += name + " (" + std::to_string(count.get<int64_t>()) + ")";
  }
  return s.empty() ? "-" : s;
}

void print_config(const MoEConfig& c) {
  std::printf("  experts        %lld routed, top-k %lld", static_cast<long long>(c.num_experts),
              static_cast<long long>(c.top_k));
  if (c.num_zero_experts > 0) std::printf(", %lld zero experts", (long long)c.num_zero_experts);
  std::printf("\n  hidden size H  %lld\n", static_cast<long long>(c.hidden_size));
  std::printf("  expert I       %lld\n", static_cast<long long>(c.intermediate_size));
  std::printf("  routing        %s, scoring %s, renormalize %s%s\n", to_string(c.routing_method),
              to_string(c.scoring_func), c.renormalize ? "yes" : "no",
              c.has_router_bias ? ", router bias" : "");
  if (c.num_expert_group > 1)
    std::printf("  groups         %lld groups, top %lld kept, group score %s\n",
                static_cast<long long>(c.num_expert_group), static_cast<long long>(c.topk_group),
                to_string(c.group_score));
  else
    std::printf("  groups         none\n");
  std::printf("  score bias     %s\n",
              c.has_e_score_correction_bias ? "e_score_correction_bias (selection only)" : "none");
  std::printf("  scaling        routed_scaling_factor %g%s\n", c.routed_scaling_factor,
              c.apply_router_weight_on_input ? ", router weight applied on the expert input" : "");
  if (c.has_shared_expert())
    std::printf("  shared experts intermediate %lld%s\n",
                static_cast<long long>(c.shared_intermediate_size),
                c.has_shared_expert_gate ? ", sigmoid shared_expert_gate" : "");
  else
    std::printf("  shared experts none\n");
  std::printf("  activation     %s", to_string(c.activation));
  if (c.activation == Activation::kSwigluOai)
    std::printf(" (alpha %g, limit %g)", c.swiglu_alpha, c.swiglu_limit);
  std::printf("%s\n", c.has_expert_bias ? ", expert biases" : "");
}

// Terminal cells of UTF-8 text (printable()'s output): glibc's wcwidth() under
// its built-in C.UTF-8 locale (East Asian wide characters and emoji 2 cells,
// combining marks 0), whatever the user's locale; one cell a code point where
// that locale is missing.
size_t display_width(const std::string& s) {
  static const locale_t utf8 = newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(nullptr));
  size_t cells = 0;
  if (utf8 == nullptr) {
    for (const unsigned char c : s) cells += (c & 0xC0) != 0x80;
    return cells;
  }
  const locale_t old = uselocale(utf8);
  std::mbstate_t state{};
  for (size_t i = 0; i < s.size();) {
    wchar_t wc = 0;
    const size_t n = std::mbrtowc(&wc, s.data() + i, s.size() - i, &state);
    if (n == 0 || n > s.size() - i) {  // (no valid UTF-8 is left by printable(); kept safe)
      state = std::mbstate_t{};
      ++cells;
      ++i;
      continue;
    }
    const int w = wcwidth(wc);
    cells += w < 0 ? 1 : static_cast<size_t>(w);
    i += n;
  }
  uselocale(old);
  return cells;
}

// A tensor name as listed: printable(), quoted where it would print blank (empty
// or only spaces).
std::string listed_name(const std::string& raw) {
  std::string s = printable(raw);
  if (s.find_first_not_of(' ') == std::string::npos) s = "'" + s + "'";
  return s;
}

void print_safetensors(const std::string& path, const ojson& j) {
  const ojson& tensors = j["tensors"];
  const size_t total = j["bytes"].get<size_t>();
  std::printf("file: %s\n%s, %s\n", printable(path).c_str(),
              count_of(static_cast<long long>(tensors.size()), "tensor").c_str(),
              format_bytes(static_cast<double>(total)).c_str());
  // The name column as wide as the longest name in terminal cells (CJK and
  // emoji take two), up to kMaxNameCells (a longer name pushes its own row's
  // columns only); the dtype column as wide as its longest name (f8_e4m3fn: 9).
  constexpr size_t kMaxNameCells = 96;
  size_t name_width = 0;
  int dtype_width = 6;
  std::vector<std::string> names;
  for (const auto& t : tensors) {
    names.push_back(listed_name(t["name"].get<std::string>()));
    name_width = std::max(name_width, std::min(display_width(names.back()), kMaxNameCells));
    dtype_width = std::max(dtype_width, static_cast<int>(t["dtype"].get<std::string>().size()));
  }
  size_t row = 0;
  for (const auto& t : tensors) {
    std::string shape = "[";
    for (size_t i = 0; i < t["shape"].size(); ++i)
      shape += (i ? ", " : "") + std::to_string(t["shape"][i].get<int64_t>());
    shape += "]";
    std::string& name = names[row++];
    const size_t cells = display_width(name);
    if (cells < name_width) name.append(name_width - cells, ' ');
    std::printf("  %s %-*s %s%s\n", name.c_str(), dtype_width,
                t["dtype"].get<std::string>().c_str(), shape.c_str(),
                t.value("supported", true) ? "" : "  (dtype not supported by fusedmoe)");
  }
  for (const auto& [k, v] : j["metadata"].items())
    std::printf("  metadata %s = %s\n", printable(k).c_str(),
                printable(v.get<std::string>()).c_str());
}

}  // namespace

CLI::App* add_inspect_command(CLI::App& app, InspectOptions& opts) {
  CLI::App* cmd = app.add_subcommand(
      "inspect",
      "Describe a model's MoE layers (config.json + checkpoint), or list a .safetensors file");
  cmd->add_option("PATH", opts.path,
                  "HF model directory (config.json + model.safetensors), a config.json, a "
                  "*.safetensors.index.json, or a .safetensors file")
      ->required()
      ->check(kNonEmpty);
  add_bool_flag(*cmd, "--json", opts.json, "Print JSON instead of text");
  return cmd;
}

// The exit status of a model's report, said on stderr too when it is 1 (as
// every error is): the layers whose tensors cannot be loaded.
int layers_status(int bad_layers, int layers) {
  if (bad_layers == 0) return 0;
  std::fprintf(stderr,
               "fusedmoe: error: inspect: %d of %d MoE layers cannot be loaded (the report names "
               "each one's error)\n",
               bad_layers, layers);
  return 1;
}

int run_inspect(const InspectOptions& opts) {
  const std::string& path = opts.path;
  const std::string text = inspect_json(path);
  const ojson j = ojson::parse(text);
  if (opts.json) {
    // Non-ASCII characters as \uXXXX escapes (as Python's json.dumps does): the
    // same JSON, but a name's bidi overrides or zero-width characters cannot
    // reorder or hide what a terminal shows.
    std::cout << j.dump(2, ' ', true, ojson::error_handler_t::replace) << "\n";
    int bad = 0, layers = 0;
    if (j.contains("layers"))
      for (const auto& l : j["layers"]) ++layers, bad += l.value("weights_ok", true) ? 0 : 1;
    return layers_status(bad, layers);
  }
  if (j.contains("file")) {
    print_safetensors(path, j);
    return 0;
  }

  const ModelInfo info = load_model_info(path);
  std::string dir = path;
  if (!is_dir(path)) {
    const auto slash = path.find_last_of('/');
    dir = slash == std::string::npos ? "." : path.substr(0, slash);
  }
  const bool has_weights = j["weights"].get<bool>();

  std::printf("model          %s\n", printable(path).c_str());
  std::printf("model type     %s%s%s\n", printable(info.model_type).c_str(),
              info.architecture.empty() ? "" : ", ", printable(info.architecture).c_str());
  std::printf("dtype          %s%s\n", dtype_name(info.dtype),
              info.dtype_given ? ""
                               : " (config.json names no dtype: fusedmoe's default; the weights' "
                                 "own types are listed below)");
  // config.json's fp8 over a checkpoint whose MoE weights hold no fp8 tensor
  // (e.g. one dequantized and saved again): said so, not "e4m3 weights".
  bool any_fp8 = false;
  if (has_weights)
    for (const auto& l : j["layers"])
      for (const auto& [name, count] : l["weight_dtypes"].items())
        any_fp8 = any_fp8 || name.rfind("f8_", 0) == 0;
  if (info.quant_method == "fp8" && has_weights && !any_fp8)
    std::printf(
        "quantization   fp8 in config.json, but the MoE weights hold no fp8 tensor (they load "
        "as their own types, below)\n");
  else if (info.quant_method == "fp8")
    std::printf(
        "quantization   fp8: e4m3 weights, 128 x 128 block scales (dequantized to f32 "
        "on load)\n");
  else if (info.quant_method == "mxfp4")
    std::printf(
        "quantization   mxfp4: experts in E2M1 with an E8M0 scale per 32 (dequantized to "
        "bf16 on load)\n");
  std::string moe;
  for (int64_t l : info.moe_layers) moe += (moe.empty() ? "" : ", ") + std::to_string(l);
  std::printf("layers         %lld, MoE layers: %s\n",
              static_cast<long long>(info.num_hidden_layers), moe.empty() ? "none" : moe.c_str());
  std::string previous;
  for (int64_t layer : info.moe_layers) {
    const MoEConfig& c = info.layer_config(layer);
    const std::string summary = c.summary();
    if (summary == previous) continue;
    std::string same;
    for (int64_t other : info.moe_layers)
      if (other > layer && info.layer_config(other).summary() == summary)
        same += (same.empty() ? "" : ", ") + std::to_string(other);
    std::printf("MoE layer %lld%s\n", static_cast<long long>(layer),
                same.empty() ? "" : (" (same for layers " + same + ")").c_str());
    print_config(c);
    previous = summary;
  }
  int bad_layers = 0;
  if (has_weights) {
    std::printf("weights (MoE blocks only)\n");
    for (const auto& l : j["layers"]) {
      const long long n = l["tensors"].get<int64_t>();
      std::printf("  layer %-4lld %4lld %-7s  %-12s %s\n",
                  static_cast<long long>(l["layer"].get<int64_t>()), n,
                  n == 1 ? "tensor" : "tensors", format_bytes(l["bytes"].get<double>()).c_str(),
                  dtypes_str(l["weight_dtypes"]).c_str());
      if (!l["weights_ok"].get<bool>()) {
        ++bad_layers;
        // (an error message: the names it quotes are printable() already)
        std::printf(
            "    error: %s\n",
            printable(l["weights_error"].get<std::string>(), /*escape_backslash=*/false).c_str());
      }
    }
    std::printf("  total       %s\n", format_bytes(j["moe_bytes_total"].get<double>()).c_str());
    std::printf("  check       %s\n", bad_layers == 0
                                          ? "every MoE layer's tensors have the expected shapes"
                                          : "some MoE layers cannot be loaded (errors above)");
  } else {
    std::printf("weights        none found (no model.safetensors or index in %s)\n",
                printable(dir).c_str());
  }
  return layers_status(bad_layers, static_cast<int>(j.value("layers", ojson::array()).size()));
}

}  // namespace fusedmoe::cli
