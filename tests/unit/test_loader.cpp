// Tests of load_moe_layer (io/loader.h) on every HF fixture: shapes, dtypes,
// every element of the canonical w13/w2 against the checkpoint's own tensors
// (gpt-oss de-interleave, Llama-4 halves, transposes), a float64 MoE forward
// from the loaded weights against transformers' output, and named errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "expect_error.h"
#include "fixtures.h"
#include "fusedmoe/io/loader.h"
#include "test_util.h"

namespace fusedmoe {
namespace {

namespace fs = std::filesystem;

using test::error_of;

// Element at `idx` (any strides) as double.
double elem(const TensorView& t, std::initializer_list<int64_t> idx) {
  EXPECT_EQ(static_cast<size_t>(t.ndim()), idx.size());
  int64_t off = 0;
  int d = 0;
  for (int64_t i : idx) off += i * t.stride(d++);
  const char* p =
      static_cast<const char*>(t.data()) + off * static_cast<int64_t>(dtype_size(t.dtype()));
  float f = 0;
  switch (t.dtype()) {
    case DType::kF64:
      return *reinterpret_cast<const double*>(p);
    case DType::kF32:
      std::memcpy(&f, p, 4);
      return f;
    default:
      convert_to_f32(p, t.dtype(), &f, 1);
      return f;
  }
}

std::string str(const std::optional<Tensor>& t) {
  return t ? t->view().str() : "none";
}

// Checks every element of the loaded layer against the checkpoint tensors,
// using the HF layouts of each architecture.
void check_against_checkpoint(const Checkpoint& ck, const ModelInfo& info, int64_t layer,
                              const MoELayerWeights& w) {
  const MoEConfig& c = info.layer_config(layer);
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.intermediate_size;
  const std::string p = info.moe_prefix(layer), mt = info.model_type;
  const TensorView w13 = w.experts.w13, w2 = w.experts.w2;
  int64_t checked = 0;
  auto same = [&](double got, double want, const char* what, int64_t e, int64_t r, int64_t col) {
    ++checked;
    if (got != want) {
      ADD_FAILURE() << what << " differs at expert " << e << " (" << r << ", " << col
                    << "): " << got << " vs " << want;
      return false;
    }
    return true;
  };
  if (mt == "gpt_oss" || mt == "llama4_text") {
    const Tensor gu = ck.get(p + "experts.gate_up_proj");  // [E, H, 2I]
    const Tensor dn = ck.get(p + "experts.down_proj");     // [E, I, H]
    const bool inter = mt == "gpt_oss";
    for (int64_t e = 0; e < E; ++e)
      for (int64_t j = 0; j < I; ++j)
        for (int64_t h = 0; h < H; ++h) {
          // gpt-oss: gate = gate_up[..., ::2], up = gate_up[..., 1::2]; Llama-4: chunk(2).
          if (!same(elem(w13, {e, j, h}), elem(gu, {e, h, inter ? 2 * j : j}), "w13 gate", e, j, h))
            return;
          if (!same(elem(w13, {e, I + j, h}), elem(gu, {e, h, inter ? 2 * j + 1 : I + j}), "w13 up",
                    e, j, h))
            return;
          if (!same(elem(w2, {e, h, j}), elem(dn, {e, j, h}), "w2", e, h, j)) return;
        }
    if (inter) {
      const Tensor b = ck.get(p + "experts.gate_up_proj_bias");
      const Tensor b2 = ck.get(p + "experts.down_proj_bias");
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t j = 0; j < I; ++j) {
          same(elem(*w.experts.w13_bias, {e, j}), elem(b, {e, 2 * j}), "w13_bias gate", e, 0, j);
          same(elem(*w.experts.w13_bias, {e, I + j}), elem(b, {e, 2 * j + 1}), "w13_bias up", e, 0,
               j);
        }
        for (int64_t h = 0; h < H; ++h)
          same(elem(*w.experts.w2_bias, {e, h}), elem(b2, {e, h}), "w2_bias", e, 0, h);
      }
    }
  } else {
    const bool mix = mt == "mixtral";
    for (int64_t e = 0; e < E; ++e) {
      const std::string ep = p + "experts." + std::to_string(e) + ".";
      const Tensor g = ck.get(ep + (mix ? "w1.weight" : "gate_proj.weight"));
      const Tensor u = ck.get(ep + (mix ? "w3.weight" : "up_proj.weight"));
      const Tensor d = ck.get(ep + (mix ? "w2.weight" : "down_proj.weight"));
      for (int64_t i = 0; i < I; ++i)
        for (int64_t h = 0; h < H; ++h) {
          if (!same(elem(w13, {e, i, h}), elem(g, {i, h}), "w13 gate", e, i, h)) return;
          if (!same(elem(w13, {e, I + i, h}), elem(u, {i, h}), "w13 up", e, i, h)) return;
          if (!same(elem(w2, {e, h, i}), elem(d, {h, i}), "w2", e, h, i)) return;
        }
    }
  }
  if (c.has_shared_expert()) {
    const std::string sp = p + (mt == "deepseek_v3" ? "shared_experts." : "shared_expert.");
    const Tensor g = ck.get(sp + "gate_proj.weight"), u = ck.get(sp + "up_proj.weight"),
                 d = ck.get(sp + "down_proj.weight");
    const int64_t S = c.shared_intermediate_size;
    for (int64_t i = 0; i < S; ++i)
      for (int64_t h = 0; h < H; ++h) {
        same(elem(w.shared_experts->w13, {0, i, h}), elem(g, {i, h}), "shared w13 gate", 0, i, h);
        same(elem(w.shared_experts->w13, {0, S + i, h}), elem(u, {i, h}), "shared w13 up", 0, i, h);
        same(elem(w.shared_experts->w2, {0, h, i}), elem(d, {h, i}), "shared w2", 0, h, i);
      }
  }
  EXPECT_GT(checked, 3 * E * I * H - 1);
}

// y[H] = w2 . act(w13 . x (+ b13)) (+ b2) for expert e, float64.
std::vector<double> expert_f64(const ExpertWeights& w, const MoEConfig& c, int64_t e,
                               const std::vector<double>& x) {
  const int64_t H = w.hidden_size(), I = w.intermediate_size();
  std::vector<double> gu(static_cast<size_t>(2 * I)), a(static_cast<size_t>(I)),
      y(static_cast<size_t>(H));
  for (int64_t r = 0; r < 2 * I; ++r) {
    double s = w.w13_bias ? elem(*w.w13_bias, {e, r}) : 0.0;
    for (int64_t h = 0; h < H; ++h) s += elem(w.w13, {e, r, h}) * x[h];
    gu[r] = s;
  }
  for (int64_t i = 0; i < I; ++i) {
    double g = gu[i], u = gu[I + i];
    if (c.activation == Activation::kSwigluOai) {
      const double lim = c.swiglu_limit;
      g = std::min(g, lim);
      u = std::clamp(u, -lim, lim);
      a[i] = (u + 1.0) * g / (1.0 + std::exp(-static_cast<double>(c.swiglu_alpha) * g));
    } else {
      a[i] = g / (1.0 + std::exp(-g)) * u;
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    double s = w.w2_bias ? elem(*w.w2_bias, {e, h}) : 0.0;
    for (int64_t i = 0; i < I; ++i) s += elem(w.w2, {e, h, i}) * a[i];
    y[h] = s;
  }
  return y;
}

class LoaderFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(LoaderFixture, LoadsEveryMoELayer) {
  const std::string arch = GetParam();
  const ModelInfo info = load_model_info(test::hf_fixture_dir(arch));
  const Checkpoint ck = Checkpoint::open(test::hf_fixture_dir(arch));
  for (int64_t l : info.moe_layers) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const MoEConfig& c = info.layer_config(l);
    const int64_t E = c.num_experts, H = c.hidden_size, I = c.intermediate_size;
    const MoELayerWeights w = load_moe_layer(ck, info, l, {.progress = false});
    EXPECT_EQ(w.gate_weight.view().str(), "bf16 [" + std::to_string(E) + ", 128]");
    EXPECT_EQ(w.experts.w13.view().str(),
              "bf16 [" + std::to_string(E) + ", 96, 128]");  // bf16 stays bf16
    EXPECT_EQ(w.experts.w2.view().str(), "bf16 [" + std::to_string(E) + ", 128, 48]");
    EXPECT_TRUE(w.experts.w13.view().is_contiguous());
    EXPECT_TRUE(w.experts.w2.view().is_contiguous());
    if (arch == "gpt_oss") {
      EXPECT_EQ(str(w.gate_bias), "bf16 [8]");
      EXPECT_EQ(str(w.experts.w13_bias), "bf16 [8, 96]");
      EXPECT_EQ(str(w.experts.w2_bias), "bf16 [8, 128]");
    } else {
      EXPECT_FALSE(w.gate_bias || w.experts.w13_bias || w.experts.w2_bias);
    }
    EXPECT_EQ(str(w.router_params.e_score_correction_bias),
              arch == "deepseek_v3" ? "bf16 [16]" : "none");
    if (c.has_shared_expert()) {
      const int64_t S = c.shared_intermediate_size;
      ASSERT_TRUE(w.shared_experts.has_value());
      EXPECT_EQ(w.shared_experts->w13.view().str(), "bf16 [1, " + std::to_string(2 * S) + ", 128]");
      EXPECT_EQ(w.shared_experts->w2.view().str(), "bf16 [1, 128, " + std::to_string(S) + "]");
    } else {
      EXPECT_FALSE(w.shared_experts.has_value());
    }
    EXPECT_EQ(str(w.shared_expert_gate), arch == "qwen2_moe" ? "bf16 [1, 128]" : "none");
    check_against_checkpoint(ck, info, l, w);
  }
}

// The loaded weights, run through a plain float64 MoE forward with the
// reference's own routing choice, reproduce transformers' float64 output:
// this checks the layouts mean what the modeling code means.
TEST_P(LoaderFixture, Float64ForwardMatchesTransformers) {
  const std::string arch = GetParam();
  const ModelInfo info = load_model_info(test::hf_fixture_dir(arch));
  const Checkpoint ck = Checkpoint::open(test::hf_fixture_dir(arch));
  auto ref = test::open_reference(arch);
  for (int64_t l : info.moe_layers) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const MoEConfig& c = info.layer_config(l);
    const MoELayerWeights w = load_moe_layer(ck, info, l, {.progress = false});
    const int64_t T = 5, H = c.hidden_size;
    const Tensor x = test::load_tensor_f64(*ref, test::reference_name(l, T, "input"));
    const Tensor want = test::load_tensor_f64(*ref, test::reference_name(l, T, "output_f64"));
    double err2 = 0, ref2 = 0;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> xt(x.data_as<double>() + t * H, x.data_as<double>() + (t + 1) * H);
      std::vector<double> out(static_cast<size_t>(H), 0.0);
      if (arch == "llama4") {
        // Dense router_scores: sigmoid(top-1 logit) at the chosen expert; scales the input.
        const Tensor sc = test::load_tensor_f64(*ref, test::reference_name(l, T, "router_scores"));
        for (int64_t e = 0; e < c.num_experts; ++e) {
          const double s = sc.data_as<double>()[t * c.num_experts + e];
          if (s == 0.0) continue;
          std::vector<double> xs(xt);
          for (double& v : xs) v *= s;
          const auto y = expert_f64(w.experts, c, e, xs);
          for (int64_t h = 0; h < H; ++h) out[h] += y[h];
        }
      } else {
        const Tensor ids = test::load_tensor_i32(*ref, test::reference_name(l, T, "topk_ids"));
        const Tensor wts = test::load_tensor_f64(*ref, test::reference_name(l, T, "topk_weights"));
        for (int64_t k = 0; k < c.top_k; ++k) {
          const int32_t e = ids.data_as<int32_t>()[t * c.top_k + k];
          const double wk = wts.data_as<double>()[t * c.top_k + k];
          const auto y = expert_f64(w.experts, c, e, xt);
          for (int64_t h = 0; h < H; ++h) out[h] += wk * y[h];
        }
      }
      if (w.shared_experts) {
        auto y = expert_f64(*w.shared_experts, c, 0, xt);
        double gate = 1.0;
        if (w.shared_expert_gate) {
          double s = 0;
          for (int64_t h = 0; h < H; ++h) s += elem(*w.shared_expert_gate, {0, h}) * xt[h];
          gate = 1.0 / (1.0 + std::exp(-s));
        }
        for (int64_t h = 0; h < H; ++h) out[h] += gate * y[h];
      }
      for (int64_t h = 0; h < H; ++h) {
        const double r = want.data_as<double>()[t * H + h];
        err2 += (out[h] - r) * (out[h] - r);
        ref2 += r * r;
      }
    }
    ASSERT_GT(ref2, 0.0);
    // Same bf16 weights, float64 both sides; only the f32 router weights of the reference differ.
    EXPECT_LE(std::sqrt(err2 / ref2), 1e-5);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LoaderFixture, ::testing::ValuesIn(test::hf_fixture_archs()),
                         [](const auto& p) { return p.param; });

// Copies a fixture into `dir`, applying `edit` to the tensor list first.
void write_modified_fixture(
    const std::string& arch, const test::TempDir& dir,
    const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
  auto src = SafetensorsFile::open(test::hf_fixture_dir(arch) + "/model.safetensors");
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& n : src->names()) tensors.emplace_back(n, src->get(n));
  edit(tensors);
  std::vector<std::pair<std::string, TensorView>> views(tensors.begin(), tensors.end());
  save_safetensors(dir.file("model.safetensors"), views, src->metadata());
  fs::copy_file(test::hf_fixture_dir(arch) + "/config.json", dir.file("config.json"));
}

TEST(Loader, MissingExpertTensorIsNamed) {
  test::TempDir dir("loader_missing");
  const std::string victim = "model.layers.1.block_sparse_moe.experts.3.w3.weight";
  write_modified_fixture("mixtral", dir, [&](auto& ts) {
    for (auto& [n, t] : ts)
      if (n == victim) n += ".renamed";
  });
  const ModelInfo info = load_model_info(dir.path());
  const Checkpoint ck = Checkpoint::open(dir.path());
  EXPECT_NO_THROW(load_moe_layer(ck, info, 0, {.progress = false}));
  const std::string msg =
      error_of([&] { load_moe_layer(ck, info, 1, {.progress = false}); }, ErrorCode::kIo);
  EXPECT_HAS(msg, "'" + victim + "'");
  EXPECT_HAS(msg, "missing");
}

// The model's path in the loader's and the config reader's errors is written as
// printable() writes it: a newline in a folder name as \x0a, the message on one line.
TEST(Loader, PathsInErrorsEscapeControlCharacters) {
  test::TempDir dir("loader\nctrl");
  std::string shown;
  for (char c : dir.path()) shown += c == '\n' ? std::string("\\x0a") : std::string(1, c);
  const auto expect_escaped = [&](const std::string& msg, const std::string& part) {
    EXPECT_HAS(msg, shown + part);
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  // No config.json yet; then one that is not JSON.
  expect_escaped(error_of([&] { load_model_info(dir.path()); }, ErrorCode::kIo),
                 "/config.json: cannot open");
  { std::ofstream(dir.file("config.json")) << "{"; }
  expect_escaped(error_of([&] { load_model_info(dir.path()); }, ErrorCode::kIo),
                 "/config.json: not valid JSON");
  // A tensor missing from the checkpoint.
  const std::string victim = "model.layers.1.block_sparse_moe.experts.3.w3.weight";
  fs::remove(dir.file("config.json"));
  write_modified_fixture("mixtral", dir, [&](auto& ts) {
    for (auto& [n, t] : ts)
      if (n == victim) n += ".renamed";
  });
  const ModelInfo info = load_model_info(dir.path());
  const Checkpoint ck = Checkpoint::open(dir.path());
  expect_escaped(
      error_of([&] { load_moe_layer(ck, info, 1, {.progress = false}); }, ErrorCode::kIo),
      ": missing tensor '" + victim + "'");
  // A config.json field out of range: named with the file.
  {
    std::ifstream in(dir.file("config.json"));
    std::stringstream text;
    text << in.rdbuf();
    std::string j = text.str();
    const std::string field = "\"num_local_experts\": 8";
    const size_t at = j.find(field);
    ASSERT_NE(at, std::string::npos);
    j.replace(at, field.size(), "\"num_local_experts\": 0");
    std::ofstream(dir.file("config.json")) << j;
  }
  EXPECT_HAS(error_of([&] { load_model_info(dir.path()); }, ErrorCode::kInvalidArgument),
             shown + "/config.json (mixtral): field 'num_local_experts'");
}

// The kIo error of loading layer `layer` (check_only: of check_moe_layer).
std::string load_error(const Checkpoint& ck, const ModelInfo& info, int64_t layer,
                       bool check_only) {
  return error_of(
      [&] {
        if (check_only)
          check_moe_layer(ck, info, layer);
        else
          load_moe_layer(ck, info, layer, {.progress = false});
      },
      ErrorCode::kIo);
}

// A checkpoint with a shared expert whose config gives none (size 0, or
// DeepSeek's n_shared_experts null) is refused, naming the tensor and the
// config field, not run without it.
TEST(Loader, SharedExpertTheConfigLeavesOutIsNamed) {
  for (const auto& [arch, from, to, field, tensor] :
       std::vector<std::tuple<std::string, std::string, std::string, std::string, std::string>>{
           {"qwen2_moe", "\"shared_expert_intermediate_size\": 96",
            "\"shared_expert_intermediate_size\": 0", "shared_expert_intermediate_size 0 or absent",
            "model.layers.0.mlp.shared_expert.gate_proj.weight"},
           {"deepseek_v3", "\"n_shared_experts\": 1", "\"n_shared_experts\": null",
            "n_shared_experts 0, null or absent", ".mlp.shared_experts.gate_proj.weight"}}) {
    SCOPED_TRACE(arch);
    test::TempDir dir("loader_shared_" + arch);
    write_modified_fixture(arch, dir, [](auto&) {});
    std::string json;
    {
      std::ifstream in(dir.file("config.json"));
      std::stringstream ss;
      ss << in.rdbuf();
      json = ss.str();
    }
    const size_t at = json.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    json.replace(at, from.size(), to);
    std::ofstream(dir.file("config.json"), std::ios::trunc) << json;
    const ModelInfo info = load_model_info(dir.path());
    const Checkpoint ck = Checkpoint::open(dir.path());
    const int64_t layer = info.moe_layers.front();
    ASSERT_FALSE(info.layer_config(layer).has_shared_expert());
    for (const bool check_only : {false, true}) {
      const std::string msg = load_error(ck, info, layer, check_only);
      EXPECT_HAS(msg, tensor);
      EXPECT_HAS(msg, field);
    }
  }
}

// Per-expert tensors past the config's expert count (experts.E.* with E experts)
// are refused, naming the tensor and the count, as a shared expert the config
// leaves out is, not run without them (session 30's trial: they were ignored).
TEST(Loader, ExpertsPastTheConfigsCountAreNamed) {
  for (const auto& [arch, prefix, gate] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"mixtral", "model.layers.1.block_sparse_moe.experts.", "w1.weight"},
           {"qwen2_moe", "model.layers.0.mlp.experts.", "gate_proj.weight"}}) {
    SCOPED_TRACE(arch);
    const ModelInfo fixture = load_model_info(test::hf_fixture_dir(arch));
    const int64_t layer = arch == "mixtral" ? 1 : 0;
    const int64_t E = fixture.layer_config(layer).num_experts;
    const std::string extra = prefix + std::to_string(E) + "." + gate;
    test::TempDir dir("loader_extra_expert_" + arch);
    write_modified_fixture(arch, dir, [&](auto& ts) {
      Tensor copy;
      for (auto& [n, t] : ts)
        if (n == prefix + "0." + gate) copy = t;
      ASSERT_TRUE(copy.defined());
      ts.emplace_back(extra, copy);
    });
    const ModelInfo info = load_model_info(dir.path());
    const Checkpoint ck = Checkpoint::open(dir.path());
    for (const bool check_only : {false, true}) {
      const std::string msg = load_error(ck, info, layer, check_only);
      EXPECT_HAS(msg, "'" + extra + "' is expert " + std::to_string(E));
      EXPECT_HAS(msg, "config.json gives " + std::to_string(E) + " routed experts");
    }
  }
}

TEST(Loader, WrongShapeOrDtypeIsNamed) {
  test::TempDir dir("loader_shape");
  const std::string bad_shape = "model.layers.0.mlp.experts.5.down_proj.weight";
  const std::string bad_dtype = "model.layers.1.mlp.experts.2.up_proj.weight";
  write_modified_fixture("qwen2_moe", dir, [&](auto& ts) {
    for (auto& [n, t] : ts) {
      if (n == bad_shape) t = Tensor::zeros(DType::kBF16, {48, 128});  // transposed
      if (n == bad_dtype) t = Tensor::zeros(DType::kI32, {48, 128});   // no floating dtype
    }
  });
  const ModelInfo info = load_model_info(dir.path());
  const Checkpoint ck = Checkpoint::open(dir.path());
  std::string msg =
      error_of([&] { load_moe_layer(ck, info, 0, {.progress = false}); }, ErrorCode::kIo);
  EXPECT_HAS(msg, "'" + bad_shape + "'");
  EXPECT_HAS(msg, "expected shape [128, 48], got bf16 [48, 128]");
  msg = error_of([&] { load_moe_layer(ck, info, 1, {.progress = false}); }, ErrorCode::kIo);
  EXPECT_HAS(msg, "'" + bad_dtype + "': expected a floating dtype, got i32");
}

// Experts whose gate is f16 (loaded as f32) and whose up is bf16 (kept): the
// message names both stored dtypes, not the f32 that f16 loads as.
// Routed experts stored in mixed dtypes (gate_proj f16, the rest bf16) load
// together as f32, every value as stored, as HF casts a checkpoint's tensors
// to one dtype (they were refused).
TEST(Loader, MixedExpertDtypesLoadAsF32) {
  test::TempDir dir("loader_mixed_dtype");
  write_modified_fixture("qwen2_moe", dir, [&](auto& ts) {
    for (auto& [n, t] : ts)
      if (n.rfind("model.layers.1.mlp.experts.", 0) == 0 &&
          n.find(".gate_proj.weight") != std::string::npos) {
        const Tensor f = to_f32(t);
        Tensor h = Tensor::empty(DType::kF16, t.shape());
        convert_from_f32(f.data_as<float>(), h.data(), DType::kF16, static_cast<size_t>(f.numel()));
        t = h;
      }
  });
  const ModelInfo info = load_model_info(dir.path());
  const Checkpoint ck = Checkpoint::open(dir.path());
  const MoELayerWeights w = load_moe_layer(ck, info, 1, {.progress = false});
  EXPECT_EQ(w.experts.w13.dtype(), DType::kF32);
  EXPECT_EQ(w.experts.w2.dtype(), DType::kF32);
  check_against_checkpoint(ck, info, 1, w);
}

// A NaN or Inf weight is named at load time (it would make every token routed
// there NaN); check_finite = false loads it anyway.
TEST(Loader, NonFiniteWeightIsNamed) {
  test::TempDir dir("loader_nonfinite");
  const std::string nan_name = "model.layers.1.block_sparse_moe.experts.3.w1.weight";
  const std::string inf_name = "model.layers.0.block_sparse_moe.gate.weight";
  // Element [r, c] of a 2-D tensor set to a non-finite value of its dtype.
  auto poke = [](Tensor& t, int64_t r, int64_t c, bool nan) {
    Tensor copy = Tensor::empty(t.dtype(), t.shape());
    std::memcpy(copy.data(), t.data(), t.view().nbytes());
    char* p = static_cast<char*>(copy.data()) +
              static_cast<size_t>(r * t.size(1) + c) * dtype_size(t.dtype());
    const float v =
        nan ? std::numeric_limits<float>::quiet_NaN() : -std::numeric_limits<float>::infinity();
    convert_from_f32(&v, p, t.dtype(), 1);
    t = copy;
  };
  write_modified_fixture("mixtral", dir, [&](auto& ts) {
    for (auto& [n, t] : ts) {
      if (n == nan_name) poke(t, 2, 5, true);
      if (n == inf_name) poke(t, 1, 7, false);
    }
  });
  const ModelInfo info = load_model_info(dir.path());
  const Checkpoint ck = Checkpoint::open(dir.path());
  std::string msg =
      error_of([&] { load_moe_layer(ck, info, 1, {.progress = false}); }, ErrorCode::kIo);
  EXPECT_HAS(msg, "'" + nan_name + "'");
  EXPECT_HAS(msg, "NaN at [2, 5]");
  msg = error_of([&] { load_moe_layer(ck, info, 0, {.progress = false}); }, ErrorCode::kIo);
  EXPECT_HAS(msg, "'" + inf_name + "'");
  EXPECT_HAS(msg, "Inf at [1, 7]");
  const MoELayerWeights w = load_moe_layer(ck, info, 1, {.progress = false, .check_finite = false});
  EXPECT_EQ(w.experts.num_experts(), info.layer_config(1).num_experts);
}

// Finite stored values whose f32 weight is not: an FP8 value times a huge block
// scale, an f64 value beyond f32. Named at load, as a NaN or Inf weight is (they
// surfaced as a non-finite output of every token routed there).
TEST(Loader, WeightBeyondF32OnceConvertedIsNamed) {
  {
    test::TempDir dir("loader_fp8_range");
    const std::string src = test::test_data_dir() + "/fp8/deepseek_v3_fp8";
    const std::string scale = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv";
    auto file = SafetensorsFile::open(src + "/model.safetensors");
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const auto& n : file->names()) tensors.emplace_back(n, file->get(n));
    for (auto& [n, t] : tensors)
      if (n == scale) {
        t = Tensor::copy_of(t.view());
        t.data_as<float>()[1] = 3e38f;  // block [0, 1]: rows 0-127, columns 128-255
      }
    std::vector<std::pair<std::string, TensorView>> views(tensors.begin(), tensors.end());
    save_safetensors(dir.file("model.safetensors"), views, file->metadata());
    fs::copy_file(src + "/config.json", dir.file("config.json"));
    const ModelInfo info = load_model_info(dir.path());
    const Checkpoint ck = Checkpoint::open(dir.path());
    const std::string msg =
        error_of([&] { load_moe_layer(ck, info, 1, {.progress = false}); }, ErrorCode::kIo);
    // The checkpoint first, as every other error of the loader names it.
    EXPECT_HAS(msg,
               ck.path() + ": tensor 'model.layers.1.mlp.experts.2.down_proj.weight': element [");
    EXPECT_HAS(msg,
               "is beyond the f32 range once dequantized (times its block's "
               "weight_scale_inv 3e+38)");
    EXPECT_NO_THROW(load_moe_layer(ck, info, 1, {.progress = false, .check_finite = false}));
  }
  {
    test::TempDir dir("loader_f64_range");
    const std::string bad = "model.layers.1.block_sparse_moe.experts.3.w1.weight";
    write_modified_fixture("mixtral", dir, [&](auto& ts) {
      for (auto& [n, t] : ts) {  // layer 1's experts as f64, one value beyond f32
        if (n.find("layers.1.block_sparse_moe.experts.") == std::string::npos) continue;
        Tensor d = Tensor::empty(DType::kF64, t.shape());
        std::vector<float> f(static_cast<size_t>(t.numel()));
        convert_to_f32(t.data(), t.dtype(), f.data(), f.size());
        for (size_t i = 0; i < f.size(); ++i) d.data_as<double>()[i] = f[i];
        if (n == bad) d.data_as<double>()[2 * t.size(1) + 5] = 1e300;
        t = d;
      }
    });
    const ModelInfo info = load_model_info(dir.path());
    const Checkpoint ck = Checkpoint::open(dir.path());
    const std::string msg =
        error_of([&] { load_moe_layer(ck, info, 1, {.progress = false}); }, ErrorCode::kIo);
    EXPECT_HAS(msg, "tensor '" + bad +
                        "': element [2, 5] is beyond the f32 range once "
                        "converted from f64");
  }
}

// Every f64 tensor is checked for values beyond f32, whichever path loads it:
// packed gpt-oss / Llama-4 experts, expert biases, router bias and weight,
// e_score_correction_bias (only per-expert 2-D weights were, as row_to_f32
// converted them; the others became Inf silently).
TEST(Loader, F64BeyondF32IsNamedForEveryTensor) {
  struct Case {
    const char* arch;
    int64_t layer;
    std::vector<std::string> as_f64;  // relative to the layer's MoE prefix (same target dtype)
    std::string bad;                  // one of them: element 1 set to 1e300
  };
  const std::vector<Case> cases = {
      {"gpt_oss", 0, {"experts.gate_up_proj", "experts.down_proj"}, "experts.gate_up_proj"},
      {"gpt_oss",
       0,
       {"experts.gate_up_proj_bias", "experts.down_proj_bias"},
       "experts.down_proj_bias"},
      {"gpt_oss", 1, {"router.bias"}, "router.bias"},
      {"gpt_oss", 1, {"router.weight"}, "router.weight"},
      {"llama4", 1, {"experts.gate_up_proj", "experts.down_proj"}, "experts.down_proj"},
      {"deepseek_v3", 1, {"gate.e_score_correction_bias"}, "gate.e_score_correction_bias"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.arch) + " " + c.bad);
    const ModelInfo fixture = load_model_info(test::hf_fixture_dir(c.arch));
    ASSERT_NO_THROW(fixture.layer_config(c.layer));
    const std::string prefix = fixture.moe_prefix(c.layer);
    for (const bool in_range : {true, false}) {
      test::TempDir dir("loader_f64_every");
      int64_t converted = 0;
      write_modified_fixture(c.arch, dir, [&](auto& ts) {
        for (auto& [n, t] : ts) {
          if (n.rfind(prefix, 0) != 0) continue;
          const std::string rel = n.substr(prefix.size());
          if (std::find(c.as_f64.begin(), c.as_f64.end(), rel) == c.as_f64.end()) continue;
          Tensor d = Tensor::empty(DType::kF64, t.shape());
          std::vector<float> f(static_cast<size_t>(t.numel()));
          convert_to_f32(t.data(), t.dtype(), f.data(), f.size());
          for (size_t i = 0; i < f.size(); ++i) d.data_as<double>()[i] = f[i];
          if (!in_range && rel == c.bad) d.data_as<double>()[1] = 1e300;
          t = d;
          ++converted;
        }
      });
      ASSERT_EQ(converted, static_cast<int64_t>(c.as_f64.size()));
      const ModelInfo info = load_model_info(dir.path());
      const Checkpoint ck = Checkpoint::open(dir.path());
      if (in_range) {  // f64 within f32: loads (as f32)
        EXPECT_NO_THROW(load_moe_layer(ck, info, c.layer, {.progress = false}));
        continue;
      }
      const std::string msg =
          error_of([&] { load_moe_layer(ck, info, c.layer, {.progress = false}); }, ErrorCode::kIo);
      EXPECT_HAS(msg, "tensor '" + prefix + c.bad + "': element [");
      EXPECT_HAS(msg, "] is beyond the f32 range once converted from f64 (its value 1e+300)");
      EXPECT_NO_THROW(
          load_moe_layer(ck, info, c.layer, {.progress = false, .check_finite = false}));
    }
  }
}

// FP8 weights with their block scales, but a config.json without
// quantization_config: refused, naming the scale tensor and the missing field
// (they loaded, dequantized, and `fusedmoe inspect` reported a bf16 model).
TEST(Loader, Fp8WithoutQuantizationConfigIsRefused) {
  const std::string src = test::test_data_dir() + "/fp8/deepseek_v3_fp8";
  test::TempDir dir("loader_fp8_noquant");
  std::ifstream in(src + "/config.json");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t q = text.find(",\n  \"quantization_config\"");
  ASSERT_NE(q, std::string::npos);
  text = text.substr(0, q) + "\n}\n";
  std::ofstream(dir.file("config.json")) << text;
  fs::copy_file(src + "/model.safetensors", dir.file("model.safetensors"));
  const ModelInfo info = load_model_info(dir.path());
  EXPECT_EQ(info.quant_method, "");
  EXPECT_EQ(load_model_info(src).quant_method, "fp8");
  const Checkpoint ck = Checkpoint::open(dir.path());
  for (const bool check_only : {false, true}) {
    SCOPED_TRACE(check_only);
    const std::string msg = error_of(
        [&] {
          if (check_only)
            check_moe_layer(ck, info, 1);
          else
            load_moe_layer(ck, info, 1, {.progress = false});
        },
        ErrorCode::kIo);
    EXPECT_HAS(msg, "tensor 'model.layers.1.mlp.experts.0.gate_proj.weight' is f8_e4m3fn");
    EXPECT_HAS(msg, "with a block scale 'model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv'");
    EXPECT_HAS(msg, "but config.json has no quantization_config: expected quantization_config");
  }
}

// FP8 block scales: negative, NaN or Inf is refused, naming the scale tensor,
// the value, its index and its block; zero (an all-zero block) is taken.
TEST(Loader, Fp8NegativeOrNonFiniteScaleIsNamed) {
  const std::string src = test::test_data_dir() + "/fp8/deepseek_v3_fp8";
  const std::string weight = "model.layers.1.mlp.experts.2.down_proj.weight";
  const std::string scale = weight + "_scale_inv";
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  for (const float v : {-0.5f, nan, inf, -inf, 0.0f, -0.0f}) {
    SCOPED_TRACE(v);
    test::TempDir dir("loader_fp8_scale");
    auto file = SafetensorsFile::open(src + "/model.safetensors");
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const auto& n : file->names()) tensors.emplace_back(n, file->get(n));
    bool found = false;
    for (auto& [n, t] : tensors)
      if (n == scale) {
        ASSERT_GE(t.size(1), 2);
        t = Tensor::copy_of(t.view());
        t.data_as<float>()[1] = v;  // block [0, 1]: rows 0-127, columns 128-255
        found = true;
      }
    ASSERT_TRUE(found);
    std::vector<std::pair<std::string, TensorView>> views(tensors.begin(), tensors.end());
    save_safetensors(dir.file("model.safetensors"), views, file->metadata());
    fs::copy_file(src + "/config.json", dir.file("config.json"));
    const ModelInfo info = load_model_info(dir.path());
    const Checkpoint ck = Checkpoint::open(dir.path());
    if (v == 0.0f) {  // 0 and -0: the scale of an all-zero block
      EXPECT_NO_THROW(load_moe_layer(ck, info, 1, {.progress = false}));
      continue;
    }
    const std::string msg =
        error_of([&] { load_moe_layer(ck, info, 1, {.progress = false}); }, ErrorCode::kIo);
    std::ostringstream shown;
    shown << v;
    EXPECT_HAS(msg, "tensor '" + scale + "': expected finite scales >= 0, got " + shown.str() +
                        " at [0, 1] (the scale of the 128x128 block of rows 0-127, columns "
                        "128-255 of '" +
                        weight + "')");
  }
}

TEST(Loader, FindNonFiniteReadsEveryFloatingDtype) {
  for (DType d :
       {DType::kF64, DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3FN, DType::kF8E5M2}) {
    std::vector<float> vals(37);
    for (size_t i = 0; i < vals.size(); ++i) vals[i] = 0.25f * static_cast<float>(i) - 3.0f;
    Tensor t = Tensor::empty(d, {37});
    convert_from_f32(vals.data(), t.data(), d, vals.size());
    EXPECT_EQ(find_non_finite(t.data(), d, 37), -1) << dtype_name(d);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    convert_from_f32(&nan, static_cast<char*>(t.data()) + 29 * dtype_size(d), d, 1);
    EXPECT_EQ(find_non_finite(t.data(), d, 37), 29) << dtype_name(d);
  }
  const int32_t ints[3] = {-1, 0x7f800000, 5};
  EXPECT_EQ(find_non_finite(ints, DType::kI32, 3), -1);
}

TEST(Loader, MissingBiasAndRouterAreNamed) {
  test::TempDir dir("loader_bias");
  write_modified_fixture("gpt_oss", dir, [&](auto& ts) {
    std::erase_if(ts, [](const auto& p) {
      return p.first == "model.layers.0.mlp.experts.gate_up_proj_bias" ||
             p.first == "model.layers.1.mlp.router.weight";
    });
  });
  const ModelInfo info = load_model_info(dir.path());
  const Checkpoint ck = Checkpoint::open(dir.path());
  EXPECT_HAS(error_of([&] { load_moe_layer(ck, info, 0, {.progress = false}); }, ErrorCode::kIo),
             "'model.layers.0.mlp.experts.gate_up_proj_bias'");
  EXPECT_HAS(error_of([&] { load_moe_layer(ck, info, 1, {.progress = false}); }, ErrorCode::kIo),
             "'model.layers.1.mlp.router.weight'");
}

TEST(Loader, NotAnMoELayer) {
  const ModelInfo info = load_model_info(test::hf_fixture_dir("deepseek_v3"));
  const Checkpoint ck = Checkpoint::open(test::hf_fixture_dir("deepseek_v3"));
  EXPECT_HAS(error_of([&] { load_moe_layer(ck, info, 0); }, ErrorCode::kInvalidArgument),
             "layer 0 is not an MoE layer");
}

// An f32 checkpoint loads as f32 with the same values (no conversion), from shards.
TEST(Loader, Float32ShardedCheckpointKeepsF32) {
  test::TempDir dir("loader_f32");
  auto src = SafetensorsFile::open(test::hf_fixture_dir("llama4") + "/model.safetensors");
  std::vector<std::pair<std::string, Tensor>> a, b;
  for (const auto& n : src->names())
    (n.find("layers.1.") != std::string::npos ? b : a).emplace_back(n, to_f32(src->get(n)));
  auto save = [&](const std::string& file, const std::vector<std::pair<std::string, Tensor>>& ts) {
    save_safetensors(dir.file(file),
                     std::vector<std::pair<std::string, TensorView>>(ts.begin(), ts.end()));
  };
  save("s1.safetensors", a);
  save("s2.safetensors", b);
  {
    std::ofstream idx(dir.file("model.safetensors.index.json"));
    idx << "{\"weight_map\": {";
    bool first = true;
    for (auto* v : {&a, &b})
      for (const auto& [n, t] : *v) {
        idx << (first ? "" : ",") << "\"" << n << "\": \"" << (v == &a ? "s1" : "s2")
            << ".safetensors\"";
        first = false;
      }
    idx << "}}";
  }
  fs::copy_file(test::hf_fixture_dir("llama4") + "/config.json", dir.file("config.json"));
  const ModelInfo info = load_model_info(dir.path());
  const Checkpoint ck = Checkpoint::open(dir.path());
  const MoELayerWeights w = load_moe_layer(ck, info, 1, {.progress = false});
  EXPECT_EQ(w.experts.w13.dtype(), DType::kF32);
  EXPECT_EQ(w.gate_weight.dtype(), DType::kF32);
  check_against_checkpoint(ck, info, 1, w);
  const Checkpoint orig = Checkpoint::open(test::hf_fixture_dir("llama4"));
  const MoELayerWeights wb = load_moe_layer(orig, info, 1, {.progress = false});
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int n = 0; n < 200; ++n) {
    const int64_t e = rng() % 8, r = rng() % 96, c = rng() % 128;
    EXPECT_EQ(elem(w.experts.w13, {e, r, c}), elem(wb.experts.w13, {e, r, c}));
  }
}

// DeepSeek FP8 checkpoint: block-quantized experts are dequantized to f32.
TEST(Loader, DeepseekFp8IsDequantized) {
  const std::string dir = test::test_data_dir() + "/fp8/deepseek_v3_fp8";
  const ModelInfo info = load_model_info(dir);
  const Checkpoint ck = Checkpoint::open(dir);
  const MoELayerWeights w = load_moe_layer(ck, info, 1, {.progress = false});
  const MoEConfig& c = info.layer_config(1);
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  ASSERT_EQ(w.experts.w13.view().str(),
            "f32 [16, " + std::to_string(2 * I) + ", " + std::to_string(H) + "]");
  ASSERT_EQ(w.experts.w2.view().str(),
            "f32 [16, " + std::to_string(H) + ", " + std::to_string(I) + "]");
  EXPECT_EQ(w.gate_weight.dtype(), DType::kBF16);
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int n = 0; n < 300; ++n) {
    const int64_t e = rng() % 16, i = rng() % I, h = rng() % H;
    const std::string p = "model.layers.1.mlp.experts." + std::to_string(e) + ".";
    const Tensor up = ck.get(p + "up_proj.weight"), ups = ck.get(p + "up_proj.weight_scale_inv");
    const Tensor dn = ck.get(p + "down_proj.weight"),
                 dns = ck.get(p + "down_proj.weight_scale_inv");
    EXPECT_FLOAT_EQ(elem(w.experts.w13, {e, I + i, h}),
                    elem(up, {i, h}) * elem(ups, {i / 128, h / 128}));
    EXPECT_FLOAT_EQ(elem(w.experts.w2, {e, h, i}),
                    elem(dn, {h, i}) * elem(dns, {h / 128, i / 128}));
  }
}

// ---- gpt-oss MXFP4 experts ---------------------------------------------------

// A gpt-oss layer 0 as gpt-oss ships its experts (the fixture's config with
// intermediate_size 64, E 8, H 128): U8 MXFP4 blocks and E8M0 scales
// (random bytes; scales 118-130), bf16 biases and router. `quant`: the
// config's quantization_config ("" for none). `edit` changes the tensors.
void write_mxfp4_gpt_oss(
    const test::TempDir& dir, uint64_t seed, const std::string& quant,
    const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit = {}) {
  std::ifstream in(test::hf_fixture_dir("gpt_oss") + "/config.json");
  std::string cfg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t at = cfg.find("\"intermediate_size\": 48");
  ASSERT_NE(at, std::string::npos);
  cfg.replace(at, 23, "\"intermediate_size\": 64");
  if (!quant.empty()) cfg.insert(cfg.find('{') + 1, "\"quantization_config\": " + quant + ", ");
  std::ofstream(dir.file("config.json")) << cfg;
  const int64_t E = 8, H = 128, I = 64;
  std::mt19937_64 rng(seed);
  const auto bytes = [&](std::vector<int64_t> shape, int lo, int hi) {
    Tensor t = Tensor::empty(DType::kU8, shape);
    uint8_t* p = t.data_as<uint8_t>();
    for (int64_t i = 0; i < t.view().numel(); ++i)
      p[i] = static_cast<uint8_t>(lo + rng() % (hi - lo + 1));
    return t;
  };
  const auto bf16 = [&](std::vector<int64_t> shape) {
    Tensor t = Tensor::empty(DType::kBF16, shape);
    std::normal_distribution<float> nd(0.0f, 0.5f);
    for (int64_t i = 0; i < t.view().numel(); ++i) t.data_as<uint16_t>()[i] = f32_to_bf16(nd(rng));
    return t;
  };
  const std::string p = "model.layers.0.mlp.";
  std::vector<std::pair<std::string, Tensor>> ts = {
      {p + "router.weight", bf16({E, H})},
      {p + "router.bias", bf16({E})},
      {p + "experts.gate_up_proj_blocks", bytes({E, 2 * I, H / 32, 16}, 0, 255)},
      {p + "experts.gate_up_proj_scales", bytes({E, 2 * I, H / 32}, 118, 130)},
      {p + "experts.gate_up_proj_bias", bf16({E, 2 * I})},
      {p + "experts.down_proj_blocks", bytes({E, H, I / 32, 16}, 0, 255)},
      {p + "experts.down_proj_scales", bytes({E, H, I / 32}, 118, 130)},
      {p + "experts.down_proj_bias", bf16({E, H})}};
  if (edit) edit(ts);
  std::vector<std::pair<std::string, TensorView>> views(ts.begin(), ts.end());
  save_safetensors(dir.file("model.safetensors"), views);
}

constexpr const char* kMxfp4Quant = R"({"quant_method": "mxfp4", "modules_to_not_convert": []})";

// MXFP4 value j of row `row` of a [E, rows, G, 16] block tensor and its
// [E, rows, G] scales, in float64: OCP MX v1.0 (E2M1 nibbles, low first; E8M0
// scale 2^(s - 127)).
double mxfp4_ref(const Checkpoint& ck, const std::string& base, int64_t e, int64_t row, int64_t j) {
  static const double kE2M1[16] = {0,    0.5,  1,  1.5,  2,  3,  4,  6,
                                   -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  const Tensor b = ck.get(base + "_blocks"), s = ck.get(base + "_scales");
  const int64_t rows = b.size(1), G = b.size(2);
  const uint8_t byte = b.data_as<uint8_t>()[((e * rows + row) * G + j / 32) * 16 + (j % 32) / 2];
  const int scale = s.data_as<uint8_t>()[(e * rows + row) * G + j / 32];
  return kE2M1[j % 2 ? byte >> 4 : byte & 0x0F] * std::pow(2.0, scale - 127);
}

// Rewrites the header of safetensors file `path` with tensor `name`'s dtype
// string `dtype` (same element size), the data untouched.
void retag_dtype(const std::string& path, const std::string& name, const std::string& dtype) {
  std::ifstream in(path, std::ios::binary);
  std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  nlohmann::json h = nlohmann::json::parse(raw.substr(8, n));
  h[name]["dtype"] = dtype;
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t len = text.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << text << raw.substr(8 + n);
}

// Every element of w13 / w2 against the format, gate_up's rows de-interleaved
// (row 2i: gate row i, row 2i + 1: up row i, as HF's convert_moe_packed_tensors
// leaves them before its transpose), bf16 (exact for these scales), biases as
// in the unquantized layout; an expert-parallel rank's share the same experts.
TEST(Loader, GptOssMxfp4IsDequantized) {
  test::TempDir dir("loader_mxfp4");
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  write_mxfp4_gpt_oss(dir, seed, kMxfp4Quant);
  const ModelInfo info = load_model_info(dir.path());
  EXPECT_EQ(info.quant_method, "mxfp4");
  const Checkpoint ck = Checkpoint::open(dir.path());
  EXPECT_NO_THROW(check_moe_layer(ck, info, 0));
  const MoELayerWeights w = load_moe_layer(ck, info, 0, {.progress = false});
  const int64_t E = 8, H = 128, I = 64;
  ASSERT_EQ(w.experts.w13.view().str(), "bf16 [8, 128, 128]");
  ASSERT_EQ(w.experts.w2.view().str(), "bf16 [8, 128, 64]");
  const std::string p = "model.layers.0.mlp.experts.";
  const Tensor gub = ck.get(p + "gate_up_proj_bias");
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < I; ++i)
      for (int64_t h = 0; h < H; ++h) {
        ASSERT_EQ(elem(w.experts.w13, {e, i, h}), mxfp4_ref(ck, p + "gate_up_proj", e, 2 * i, h))
            << e << " " << i << " " << h;
        ASSERT_EQ(elem(w.experts.w13, {e, I + i, h}),
                  mxfp4_ref(ck, p + "gate_up_proj", e, 2 * i + 1, h));
      }
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < I; ++i)
        ASSERT_EQ(elem(w.experts.w2, {e, h, i}), mxfp4_ref(ck, p + "down_proj", e, h, i));
    for (int64_t i = 0; i < I; ++i) {
      EXPECT_EQ(elem(*w.experts.w13_bias, {e, i}), elem(gub, {e, 2 * i}));
      EXPECT_EQ(elem(*w.experts.w13_bias, {e, I + i}), elem(gub, {e, 2 * i + 1}));
    }
  }
  // Rank 1 of 2 (contiguous placement): experts 4..7, the same values.
  LoadOptions ep{.progress = false};
  ep.parallel.ep_size = 2;
  ep.parallel.ep_rank = 1;
  const MoELayerWeights r1 = load_moe_layer(ck, info, 0, ep);
  ASSERT_EQ(r1.experts.w13.view().str(), "bf16 [4, 128, 128]");
  EXPECT_EQ(std::memcmp(r1.experts.w13.data(),
                        static_cast<const char*>(w.experts.w13.data()) + 4 * 2 * I * H * 2,
                        4 * 2 * I * H * 2),
            0);
  EXPECT_EQ(
      std::memcmp(r1.experts.w2.data(),
                  static_cast<const char*>(w.experts.w2.data()) + 4 * H * I * 2, 4 * H * I * 2),
      0);
}

// MXFP4 gate_up with a bf16 down_proj (HF converts each `_blocks` pair it
// finds): the MXFP4 half dequantized, the bf16 half as in the unquantized layout.
TEST(Loader, GptOssMxfp4BesidePlainExperts) {
  test::TempDir dir("loader_mxfp4_mixed");
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::string p = "model.layers.0.mlp.experts.";
  Tensor down;
  write_mxfp4_gpt_oss(dir, seed, kMxfp4Quant, [&](auto& ts) {
    std::erase_if(ts, [&](const auto& t) { return t.first.starts_with(p + "down_proj_"); });
    down = Tensor::empty(DType::kBF16, {8, 64, 128});  // [E, I, H]
    for (int64_t i = 0; i < down.view().numel(); ++i)
      down.template data_as<uint16_t>()[i] = f32_to_bf16(static_cast<float>(i % 17) - 8.0f);
    ts.emplace_back(p + "down_proj", down);
    ts.emplace_back(p + "down_proj_bias", Tensor::zeros(DType::kBF16, {8, 128}));
  });
  const Checkpoint ck = Checkpoint::open(dir.path());
  const MoELayerWeights w = load_moe_layer(ck, load_model_info(dir.path()), 0, {.progress = false});
  for (int64_t e = 0; e < 8; e += 3)
    for (int64_t h = 0; h < 128; h += 5)
      for (int64_t i = 0; i < 64; i += 7) {
        ASSERT_EQ(elem(w.experts.w2, {e, h, i}), elem(down, {e, i, h}));
        ASSERT_EQ(elem(w.experts.w13, {e, i, h}), mxfp4_ref(ck, p + "gate_up_proj", e, 2 * i, h));
      }
}

// What the MXFP4 path refuses, each named: blocks under a config without
// quantization_config or with another method, a wrong dtype or shape, an
// E8M0 scale of 255 (NaN), a value beyond bf16 (taken with check_finite
// off), mxfp4 for another model, sizes that are not whole groups; and what
// it takes: an mxfp4 config over plain bf16 experts, as HF's loader does.
TEST(Loader, GptOssMxfp4ErrorsAreNamed) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::string p = "model.layers.0.mlp.experts.";
  {
    test::TempDir dir("loader_mxfp4_noquant");
    write_mxfp4_gpt_oss(dir, seed, "");
    const ModelInfo info = load_model_info(dir.path());
    const Checkpoint ck = Checkpoint::open(dir.path());
    for (const bool check_only : {false, true}) {
      const std::string msg = error_of(
          [&] {
            if (check_only)
              check_moe_layer(ck, info, 0);
            else
              load_moe_layer(ck, info, 0, {.progress = false});
          },
          ErrorCode::kIo);
      EXPECT_HAS(msg, "tensor '" + p +
                          "gate_up_proj_blocks' holds MXFP4 blocks, but config.json "
                          "has no quantization_config: expected quantization_config "
                          "{\"quant_method\": \"mxfp4\"}");
    }
  }
  {
    test::TempDir dir("loader_mxfp4_dtype");
    write_mxfp4_gpt_oss(dir, seed, kMxfp4Quant, [&](auto& ts) {
      for (auto& [n, t] : ts)
        if (n == p + "down_proj_scales") t = Tensor::empty(DType::kI8, {8, 128, 2});
    });
    const Checkpoint ck = Checkpoint::open(dir.path());
    EXPECT_HAS(
        error_of([&] { check_moe_layer(ck, load_model_info(dir.path()), 0); }, ErrorCode::kIo),
        "tensor '" + p + "down_proj_scales': expected u8 [8, 128, 2], got i8 [8, 128, 2]");
  }
  {
    test::TempDir dir("loader_mxfp4_shape");
    write_mxfp4_gpt_oss(dir, seed, kMxfp4Quant, [&](auto& ts) {
      for (auto& [n, t] : ts)
        if (n == p + "gate_up_proj_blocks") t = Tensor::empty(DType::kU8, {8, 128, 4, 8});
    });
    const Checkpoint ck = Checkpoint::open(dir.path());
    EXPECT_HAS(
        error_of([&] { check_moe_layer(ck, load_model_info(dir.path()), 0); }, ErrorCode::kIo),
        "tensor '" + p +
            "gate_up_proj_blocks': expected u8 [8, 128, 4, 16], got u8 [8, 128, 4, 8]");
  }
  for (const int scale : {255, 254}) {
    SCOPED_TRACE(scale);
    test::TempDir dir("loader_mxfp4_nan");
    write_mxfp4_gpt_oss(dir, seed, kMxfp4Quant, [&](auto& ts) {
      for (auto& [n, t] : ts) {
        if (n == p + "down_proj_scales")
          t.template data_as<uint8_t>()[(3 * 128 + 5) * 2 + 1] = scale;
        if (n ==
            p + "down_proj_blocks") {  // group 1 zeros but element 7 (byte 3's high nibble): -6
          uint8_t* g = t.template data_as<uint8_t>() + ((3 * 128 + 5) * 2 + 1) * 16;
          std::memset(g, 0, 16);
          g[3] = 0xF0;
        }
      }
    });
    const ModelInfo info = load_model_info(dir.path());
    const Checkpoint ck = Checkpoint::open(dir.path());
    const std::string msg =
        error_of([&] { load_moe_layer(ck, info, 0, {.progress = false}); }, ErrorCode::kIo);
    if (scale == 255)
      EXPECT_HAS(msg, "tensor '" + p +
                          "down_proj_scales': element [3, 5, 1] is 255, which E8M0 "
                          "reserves for NaN");
    else
      EXPECT_HAS(msg, "tensor '" + p +
                          "down_proj_blocks': element [3, 5, 1, 3] (high nibble) is "
                          "beyond the bf16 range once scaled by its E8M0 scale 254 (2^127)");
    LoadOptions off{.progress = false};
    off.check_finite = false;
    const MoELayerWeights w = load_moe_layer(ck, info, 0, off);
    EXPECT_TRUE(std::isinf(elem(w.experts.w2, {3, 5, 32 + 7})));
  }
  {
    test::TempDir dir("loader_mxfp4_mixtral");
    std::ifstream in(test::hf_fixture_dir("mixtral") + "/config.json");
    std::string cfg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    cfg.insert(cfg.find('{') + 1, std::string("\"quantization_config\": ") + kMxfp4Quant + ", ");
    std::ofstream(dir.file("config.json")) << cfg;
    EXPECT_HAS(error_of([&] { load_model_info(dir.path()); }, ErrorCode::kUnsupported),
               "quantization_config.quant_method 'mxfp4' is supported for model_type gpt_oss only");
  }
  {
    // E8M0 scales stored as F8_E8M0 (HF's converter would read their values,
    // not their bytes): named with the file's dtype.
    test::TempDir dir("loader_mxfp4_e8m0");
    write_mxfp4_gpt_oss(dir, seed, kMxfp4Quant);
    retag_dtype(dir.file("model.safetensors"), p + "gate_up_proj_scales", "F8_E8M0");
    const Checkpoint ck = Checkpoint::open(dir.path());
    EXPECT_HAS(
        error_of([&] { check_moe_layer(ck, load_model_info(dir.path()), 0); }, ErrorCode::kIo),
        "tensor '" + p +
            "gate_up_proj_scales': expected u8 [8, 128, 4], got F8_E8M0 [8, "
            "128, 4]");
  }
  {
    // One projection in both forms.
    test::TempDir dir("loader_mxfp4_both");
    write_mxfp4_gpt_oss(dir, seed, kMxfp4Quant, [&](auto& ts) {
      ts.emplace_back(p + "down_proj", Tensor::zeros(DType::kBF16, {8, 64, 128}));
    });
    const Checkpoint ck = Checkpoint::open(dir.path());
    EXPECT_HAS(
        error_of([&] { check_moe_layer(ck, load_model_info(dir.path()), 0); }, ErrorCode::kIo),
        "the checkpoint holds both '" + p + "down_proj' and its MXFP4 blocks '" + p +
            "down_proj_blocks': expected one of them");
  }
  {
    // Blocks, but a config whose quantization_config names another method.
    test::TempDir dir("loader_mxfp4_fp8");
    write_mxfp4_gpt_oss(dir, seed, R"({"quant_method": "fp8"})");
    const Checkpoint ck = Checkpoint::open(dir.path());
    EXPECT_HAS(
        error_of([&] { check_moe_layer(ck, load_model_info(dir.path()), 0); }, ErrorCode::kIo),
        "holds MXFP4 blocks, but config.json's quantization_config.quant_method is "
        "'fp8': expected quantization_config {\"quant_method\": \"mxfp4\"}");
  }
  {
    // Blocks with an intermediate_size that is no whole number of groups.
    test::TempDir dir("loader_mxfp4_groups");
    write_mxfp4_gpt_oss(dir, seed, kMxfp4Quant);
    std::ifstream in(dir.file("config.json"));
    std::string cfg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    cfg.replace(cfg.find("\"intermediate_size\": 64"), 23, "\"intermediate_size\": 48");
    std::ofstream(dir.file("config.json")) << cfg;
    const Checkpoint ck = Checkpoint::open(dir.path());
    EXPECT_HAS(error_of([&] { check_moe_layer(ck, load_model_info(dir.path()), 0); },
                        ErrorCode::kInvalidArgument),
               "MXFP4 experts: hidden_size and intermediate_size must be multiples of 32 (the "
               "format's group), got 128 and 48");
  }
  {
    // quant_method "mxfp4" over plain bf16 experts (a re-upload that kept the
    // config): loaded as they are, as HF's loader takes them (I = 48 too).
    test::TempDir dir("loader_mxfp4_plain");
    std::ifstream in(test::hf_fixture_dir("gpt_oss") + "/config.json");
    std::string cfg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    cfg.insert(cfg.find('{') + 1, std::string("\"quantization_config\": ") + kMxfp4Quant + ", ");
    std::ofstream(dir.file("config.json")) << cfg;
    fs::copy_file(test::hf_fixture_dir("gpt_oss") + "/model.safetensors",
                  dir.file("model.safetensors"));
    const Checkpoint ck = Checkpoint::open(dir.path());
    const ModelInfo info = load_model_info(dir.path());
    EXPECT_EQ(info.quant_method, "mxfp4");
    const MoELayerWeights w = load_moe_layer(ck, info, 0, {.progress = false});
    const Checkpoint ref = Checkpoint::open(test::hf_fixture_dir("gpt_oss"));
    const MoELayerWeights want = load_moe_layer(
        ref, load_model_info(test::hf_fixture_dir("gpt_oss")), 0, {.progress = false});
    ASSERT_EQ(w.experts.w13.view().str(), want.experts.w13.view().str());
    EXPECT_EQ(std::memcmp(w.experts.w13.data(), want.experts.w13.data(), want.experts.w13.nbytes()),
              0);
  }
}

}  // namespace
}  // namespace fusedmoe
