// Tests of inspect_json (io/inspect.h): the keys and their order for every HF
// fixture, each layer's config and weight bytes against the fixture's config
// and safetensors headers, a bare config.json, a .safetensors file, and errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fixtures.h"
#include "fusedmoe/core/error.h"
#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/inspect.h"
#include "fusedmoe/io/safetensors.h"

namespace fusedmoe {
namespace {

using ojson = nlohmann::ordered_json;
namespace fs = std::filesystem;

std::vector<std::string> keys(const ojson& j) {
  std::vector<std::string> k;
  for (const auto& [name, value] : j.items()) k.push_back(name);
  return k;
}

// A quantized checkpoint says how: quant_method as config.json names it.
TEST(InspectJson, QuantMethodOfAnFp8Checkpoint) {
  const ojson j = ojson::parse(inspect_json(test::test_data_dir() + "/fp8/deepseek_v3_fp8"));
  EXPECT_EQ(j["quant_method"], "fp8");
  EXPECT_TRUE(j["layers"][0]["weights_ok"].get<bool>());
}

TEST(InspectJson, EveryFixtureHasItsLayersAndWeightBytes) {
  for (const auto& arch : test::hf_fixture_archs()) {
    SCOPED_TRACE(arch);
    const std::string dir = test::hf_fixture_dir(arch);
    const ojson j = ojson::parse(inspect_json(dir));
    EXPECT_EQ(keys(j),
              (std::vector<std::string>{"path", "model_type", "architecture", "num_hidden_layers",
                                        "dtype", "dtype_given", "quant_method", "moe_layers",
                                        "weights", "layers", "moe_bytes_total"}));
    const ModelInfo info = load_model_info(dir);
    EXPECT_EQ(j["dtype_given"], info.dtype_given);
    EXPECT_EQ(j["quant_method"], "");
    EXPECT_EQ(j["path"], dir);
    EXPECT_EQ(j["model_type"], info.model_type);
    EXPECT_EQ(j["num_hidden_layers"], info.num_hidden_layers);
    EXPECT_EQ(j["moe_layers"].get<std::vector<int64_t>>(), info.moe_layers);
    EXPECT_TRUE(j["weights"].get<bool>());
    ASSERT_EQ(j["layers"].size(), info.moe_layers.size());

    // Bytes, counts and dtypes of the tensors under each layer's MoE prefix,
    // from the fixture's single model.safetensors.
    auto file = SafetensorsFile::open(dir + "/model.safetensors");
    size_t total = 0;
    for (size_t i = 0; i < info.moe_layers.size(); ++i) {
      const int64_t layer = info.moe_layers[i];
      const ojson& l = j["layers"][i];
      EXPECT_EQ(keys(l), (std::vector<std::string>{"layer", "prefix", "config", "tensors",
                                                   "weight_dtypes", "bytes", "weights_ok"}));
      EXPECT_TRUE(l["weights_ok"].get<bool>());
      EXPECT_EQ(l["layer"], layer);
      EXPECT_EQ(l["prefix"], info.moe_prefix(layer));
      EXPECT_EQ(l["config"], ojson::parse(info.layer_config(layer).to_json()));
      size_t bytes = 0;
      int64_t count = 0;
      for (const auto& name : file->names()) {
        if (name.rfind(info.moe_prefix(layer), 0) != 0) continue;
        bytes += file->get(name).nbytes();
        ++count;
      }
      EXPECT_GT(count, 0);
      EXPECT_EQ(l["tensors"], count);
      EXPECT_EQ(l["bytes"], bytes);
      EXPECT_EQ(l["weight_dtypes"], ojson({{"bf16", count}}));
      total += bytes;
    }
    EXPECT_EQ(j["moe_bytes_total"], total);
  }
}

TEST(InspectJson, ConfigJsonPathAndConfigWithoutWeights) {
  const std::string dir = test::hf_fixture_dir("olmoe");
  const ojson by_dir = ojson::parse(inspect_json(dir));
  ojson by_config = ojson::parse(inspect_json(dir + "/config.json"));
  EXPECT_EQ(by_config["path"], dir + "/config.json");
  by_config["path"] = dir;
  EXPECT_EQ(by_config, by_dir);

  test::TempDir tmp("inspect");
  fs::copy_file(dir + "/config.json", tmp.file("config.json"));
  const ojson bare = ojson::parse(inspect_json(tmp.path()));
  EXPECT_FALSE(bare["weights"].get<bool>());
  EXPECT_FALSE(bare.contains("moe_bytes_total"));
  ASSERT_FALSE(bare["layers"].empty());
  for (const auto& l : bare["layers"])
    EXPECT_EQ(keys(l), (std::vector<std::string>{"layer", "prefix", "config"}));
}

// A checkpoint whose expert tensor has the wrong shape: inspect still describes
// the model, and the layer says what load_moe_layer would throw.
TEST(InspectJson, WrongWeightShapeIsReportedPerLayer) {
  const std::string dir = test::hf_fixture_dir("olmoe");
  const ModelInfo info = load_model_info(dir);
  const int64_t layer = info.moe_layers.at(0);
  const std::string bad = info.moe_prefix(layer) + "experts.1.up_proj.weight";
  auto file = SafetensorsFile::open(dir + "/model.safetensors");
  std::vector<Tensor> keep;
  std::vector<std::pair<std::string, TensorView>> tensors;
  for (const auto& name : file->names()) {
    Tensor t = file->get(name);
    if (name == bad) {  // [I, H] -> [I / 2, 2 H]: same bytes, wrong shape
      const Tensor c = Tensor::copy_of(t.view());
      t = c;
      tensors.emplace_back(name, c.view().reshape({c.size(0) / 2, c.size(1) * 2}));
    } else {
      tensors.emplace_back(name, t.view());
    }
    keep.push_back(t);
  }
  test::TempDir tmp("inspect");
  fs::copy_file(dir + "/config.json", tmp.file("config.json"));
  save_safetensors(tmp.file("model.safetensors"), tensors);
  const ojson j = ojson::parse(inspect_json(tmp.path()));
  for (const auto& l : j["layers"]) {
    SCOPED_TRACE(l["layer"].dump());
    if (l["layer"] != layer) {
      EXPECT_TRUE(l["weights_ok"].get<bool>());
      EXPECT_FALSE(l.contains("weights_error"));
      continue;
    }
    EXPECT_FALSE(l["weights_ok"].get<bool>());
    const std::string msg = l["weights_error"].get<std::string>();
    EXPECT_NE(msg.find("'" + bad + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected shape"), std::string::npos) << msg;
  }
}

TEST(InspectJson, SafetensorsFileListsItsTensors) {
  const std::string path = test::hf_fixture_dir("mixtral") + "/reference.safetensors";
  const ojson j = ojson::parse(inspect_json(path));
  EXPECT_EQ(keys(j), (std::vector<std::string>{"file", "tensors", "bytes", "metadata"}));
  auto file = SafetensorsFile::open(path);
  const auto names = file->names();
  ASSERT_EQ(j["tensors"].size(), names.size());
  size_t bytes = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    const Tensor t = file->get(names[i]);
    const ojson& e = j["tensors"][i];
    EXPECT_EQ(e["name"], names[i]);
    EXPECT_EQ(e["dtype"], dtype_name(t.dtype()));
    EXPECT_EQ(e["shape"].get<std::vector<int64_t>>(),
              std::vector<int64_t>(t.shape().begin(), t.shape().end()));
    bytes += t.nbytes();
  }
  EXPECT_EQ(j["bytes"], bytes);
  EXPECT_EQ(j["metadata"], ojson(file->metadata()));
}

// Writes a safetensors file of one tensor: `dtype`, `shape`, `bytes` zero bytes.
void write_one(const std::string& path, const std::string& name, const std::string& dtype,
               const std::string& shape, size_t bytes) {
  const std::string header = "{\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
                             ",\"data_offsets\":[0," + std::to_string(bytes) + "]}}";
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(uint64_t{header.size()} >> (8 * i)));
  out << header << std::string(bytes, '\0');
}

// Tensors of a dtype fusedmoe does not read (HF's safetensors knows it: an
// MXFP4 checkpoint's F8_E8M0 scales, U32 tensors) are described, not the end
// of the description: listed by the file's dtype string, their bytes counted.
TEST(InspectJson, DtypesFusedmoeDoesNotReadAreListed) {
  test::TempDir tmp("inspect");
  write_one(tmp.file("u32.safetensors"), "idx", "U32", "[2,3]", 24);
  const ojson f = ojson::parse(inspect_json(tmp.file("u32.safetensors")));
  ASSERT_EQ(f["tensors"].size(), 1u);
  EXPECT_EQ(f["tensors"][0],
            ojson({{"name", "idx"}, {"dtype", "U32"}, {"shape", {2, 3}}, {"supported", false}}));
  EXPECT_EQ(f["bytes"], 24);

  // A model: layer 0's prefix gains an F8_E8M0 tensor from a second shard.
  const std::string dir = test::hf_fixture_dir("olmoe");
  const ModelInfo info = load_model_info(dir);
  const int64_t layer = info.moe_layers.at(0);
  const std::string extra = info.moe_prefix(layer) + "experts.scales";
  fs::copy_file(dir + "/config.json", tmp.file("config.json"));
  fs::copy_file(dir + "/model.safetensors", tmp.file("model-1.safetensors"));
  write_one(tmp.file("model-2.safetensors"), extra, "F8_E8M0", "[4,2]", 8);
  ojson index;
  for (const auto& name : SafetensorsFile::open(dir + "/model.safetensors")->names())
    index["weight_map"][name] = "model-1.safetensors";
  index["weight_map"][extra] = "model-2.safetensors";
  std::ofstream(tmp.file("model.safetensors.index.json")) << index.dump();
  const ojson before = ojson::parse(inspect_json(dir));
  const ojson j = ojson::parse(inspect_json(tmp.path()));
  ASSERT_EQ(j["layers"].size(), before["layers"].size());
  for (size_t i = 0; i < j["layers"].size(); ++i) {
    const ojson &l = j["layers"][i], &b = before["layers"][i];
    SCOPED_TRACE(l["layer"].dump());
    EXPECT_TRUE(l["weights_ok"].get<bool>());  // the layer does not need it
    const int64_t more = l["layer"] == layer ? 1 : 0;
    EXPECT_EQ(l["tensors"], b["tensors"].get<int64_t>() + more);
    EXPECT_EQ(l["bytes"], b["bytes"].get<int64_t>() + 8 * more);
    ojson dtypes = b["weight_dtypes"];
    if (more) dtypes["F8_E8M0"] = 1;
    // Compared as sets of keys (std::map's order: "F8_E8M0" before "bf16").
    EXPECT_EQ(nlohmann::json::parse(l["weight_dtypes"].dump()),
              nlohmann::json::parse(dtypes.dump()));
  }
  EXPECT_EQ(j["moe_bytes_total"], before["moe_bytes_total"].get<int64_t>() + 8);
}

// A model whose config.json makes no layer MoE: nothing fusedmoe can run, an
// error naming the path (it was described as "MoE layers: none", exit code 0).
TEST(InspectJson, ModelWithoutMoELayersIsAnError) {
  test::TempDir tmp("inspect");
  std::ifstream in(test::hf_fixture_dir("deepseek_v3") + "/config.json");
  ojson cfg = ojson::parse(in);
  cfg["first_k_dense_replace"] = cfg["num_hidden_layers"];
  std::ofstream(tmp.file("config.json")) << cfg.dump();
  try {
    inspect_json(tmp.path());
    FAIL() << "no error for a model without MoE layers";
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(ErrorCode::kInvalidArgument));
    EXPECT_EQ(std::string(e.what()),
              tmp.path() +
                  ": the model has no MoE layer fusedmoe can run (model_type "
                  "'deepseek_v3', 3 layers, none of them MoE by its config.json)");
  }
}

// Qwen2-MoE with num_experts 0 (HF builds every layer dense): the same error,
// not a complaint about the field (session 31's trial).
TEST(InspectJson, QwenWithoutExpertsHasNoMoELayer) {
  test::TempDir tmp("inspect");
  std::ifstream in(test::hf_fixture_dir("qwen2_moe") + "/config.json");
  ojson cfg = ojson::parse(in);
  cfg["num_experts"] = 0;
  std::ofstream(tmp.file("config.json")) << cfg.dump();
  try {
    inspect_json(tmp.path());
    FAIL() << "no error for a model without experts";
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(ErrorCode::kInvalidArgument));
    EXPECT_NE(std::string(e.what()).find(": the model has no MoE layer fusedmoe can run "
                                         "(model_type 'qwen2_moe', "),
              std::string::npos)
        << e.what();
  }
}

TEST(InspectJson, MissingPathIsAnIoError) {
  test::TempDir tmp("inspect");
  const std::string missing = tmp.file("nothing");
  try {
    inspect_json(missing);
    FAIL() << "no error for " << missing;
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(ErrorCode::kIo)) << e.what();
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fusedmoe
