// inspect_json: model info (io/hf_config.h) and the bytes, tensor counts and
// dtypes of each MoE layer's weights (io/safetensors.h), or the tensor list of
// one .safetensors file, as ordered JSON.
#include "fusedmoe/io/inspect.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "fusedmoe/core/error.h"
#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/loader.h"
#include "fusedmoe/io/safetensors.h"

namespace fusedmoe {
namespace {

using ojson = nlohmann::ordered_json;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}
bool is_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// fusedmoe's name of the tensor's dtype ("bf16"), or the header's string
// ("U32", "F8_E8M0") for one fusedmoe does not read.
std::string shown_dtype(const SafetensorsFile::Info& t) {
  return t.dtype ? dtype_name(*t.dtype) : t.dtype_name;
}

ojson inspect_safetensors(const std::string& path) {
  auto file = SafetensorsFile::open(path);
  size_t total = 0;
  ojson tensors = ojson::array();
  for (const auto& name : file->names()) {
    // From the header: a dtype fusedmoe does not read (U32, F8_E8M0, ...) is
    // listed by its safetensors name, marked "supported": false.
    const SafetensorsFile::Info t = file->info(name);
    total += t.nbytes;
    ojson entry = {{"name", name}, {"dtype", shown_dtype(t)}, {"shape", t.shape}};
    if (!t.dtype) entry["supported"] = false;
    tensors.push_back(std::move(entry));
  }
  ojson j;
  j["file"] = path;
  j["tensors"] = tensors;
  j["bytes"] = total;
  j["metadata"] = file->metadata();
  return j;
}

struct LayerBytes {
  std::string error;  // what check_moe_layer threw, if anything
  int64_t tensors = 0;
  size_t bytes = 0;
  std::map<std::string, int64_t> dtypes;  // dtype name -> tensor count
};

ojson inspect_model(const std::string& path) {
  // A FIFO, device or socket: named as `run --model` names it (a FIFO would
  // otherwise block the reader of config.json).
  if (!is_dir(path)) require_regular_file(path);
  if (!is_dir(path) && !is_file(path)) {
    // Why stat failed where it says more than "missing" (a symbolic-link
    // loop, a component that is no directory, no permission), as run names it.
    struct stat st {};
    const int err = ::stat(path.c_str(), &st) == 0 ? 0 : errno;
    if (err != 0 && err != ENOENT)
      FUSEDMOE_THROW(kIo, printable(path), ": cannot open: ", std::strerror(err));
    FUSEDMOE_THROW(kIo, printable(path), ": no such model directory or file");
  }
  // load_model_info names any other file (not a .json) as no model.
  const ModelInfo info = load_model_info(path);
  // A model without an MoE layer (a dense one, or config.json's fields make
  // every layer dense) is nothing fusedmoe can run (`run` and from_pretrained
  // refuse it): an error, as an unsupported model_type is, not a description
  // of no layers that reads as a model to run.
  require_moe_layer(info, printable(path));
  std::string dir = path;
  if (!is_dir(path)) {
    const auto slash = path.find_last_of('/');
    dir = slash == std::string::npos ? "." : path.substr(0, slash);
  }
  // A weights name that is there but no regular file (a directory, a FIFO, a
  // dangling link): Checkpoint::open below names what is wrong with it.
  const auto there = [](const std::string& p) {
    struct stat st {};
    return ::lstat(p.c_str(), &st) == 0;
  };
  // An index named by the path is the checkpoint (as `run --model` reads it),
  // whatever its name; else the folder's model.safetensors or index.
  const bool index_given =
      !is_dir(path) && std::string_view(path).ends_with(".safetensors.index.json");
  const bool has_weights = index_given || there(dir + "/model.safetensors") ||
                           there(dir + "/model.safetensors.index.json");

  std::map<int64_t, LayerBytes> bytes;
  size_t total_bytes = 0;
  if (has_weights) {
    const Checkpoint ck = Checkpoint::open(index_given ? path : dir);
    const auto names = ck.names();
    for (int64_t layer : info.moe_layers) {
      const std::string prefix = info.moe_prefix(layer);
      LayerBytes& lb = bytes[layer];
      try {
        check_moe_layer(ck, info, layer);
      } catch (const Error& e) {
        lb.error = e.what();
      }
      for (const auto& name : names) {
        if (name.compare(0, prefix.size(), prefix) != 0) continue;
        // A tensor that cannot be read (a missing or damaged shard) is the
        // layer's error, not the end of the description; it adds no bytes.
        // One of a dtype fusedmoe does not read counts, under its safetensors
        // name (check_moe_layer says whether the layer needs it).
        SafetensorsFile::Info t;
        try {
          t = ck.info(name);
        } catch (const Error& e) {
          if (lb.error.empty()) lb.error = e.what();
          continue;
        }
        ++lb.tensors;
        lb.bytes += t.nbytes;
        ++lb.dtypes[shown_dtype(t)];
      }
      total_bytes += lb.bytes;
    }
  }

  ojson j;
  j["path"] = path;
  j["model_type"] = info.model_type;
  j["architecture"] = info.architecture;
  j["num_hidden_layers"] = info.num_hidden_layers;
  j["dtype"] = dtype_name(info.dtype);
  j["dtype_given"] = info.dtype_given;
  j["quant_method"] = info.quant_method;
  j["moe_layers"] = info.moe_layers;
  j["weights"] = has_weights;
  ojson layers = ojson::array();
  for (int64_t layer : info.moe_layers) {
    ojson l;
    l["layer"] = layer;
    l["prefix"] = info.moe_prefix(layer);
    l["config"] = ojson::parse(info.layer_config(layer).to_json());
    if (has_weights) {
      l["tensors"] = bytes[layer].tensors;
      l["weight_dtypes"] = bytes[layer].dtypes;
      l["bytes"] = bytes[layer].bytes;
      l["weights_ok"] = bytes[layer].error.empty();
      if (!bytes[layer].error.empty()) l["weights_error"] = bytes[layer].error;
    }
    layers.push_back(l);
  }
  j["layers"] = layers;
  if (has_weights) j["moe_bytes_total"] = total_bytes;
  return j;
}

}  // namespace

std::string inspect_json(const std::string& path) {
  // A .safetensors file by its name or by its content (as `run --input` tells
  // files apart): its tensors.
  const bool tensors =
      is_file(path) && (ends_with(path, ".safetensors") || looks_like_safetensors(path));
  const ojson j = tensors ? inspect_safetensors(path) : inspect_model(path);
  // JSON is UTF-8 text: a path's bytes in another encoding are written as U+FFFD.
  return j.dump(2, ' ', false, ojson::error_handler_t::replace);
}

}  // namespace fusedmoe
