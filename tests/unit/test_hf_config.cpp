// Tests of HF config.json -> ModelInfo / MoEConfig (io/hf_config.h).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "expect_error.h"
#include "fixtures.h"
#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/safetensors.h"

namespace fusedmoe {
namespace {

using json = nlohmann::json;

using test::error_of;

json fixture_json(const std::string& arch) {
  std::ifstream in(test::hf_fixture_dir(arch) + "/config.json");
  return json::parse(in);
}

ModelInfo parse(const json& j) {
  return parse_model_info(j.dump(), "test/config.json");
}

TEST(HfConfig, EveryFixtureParsesAndMatchesItsReference) {
  for (const std::string& arch : test::hf_fixture_archs()) {
    SCOPED_TRACE(arch);
    const ModelInfo info = load_model_info(test::hf_fixture_dir(arch));
    EXPECT_EQ(info.source, test::hf_fixture_dir(arch) + "/config.json");
    EXPECT_EQ(info.dtype, DType::kBF16);
    EXPECT_FALSE(info.architecture.empty());
    const std::vector<int64_t> expected =
        arch == "deepseek_v3" ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{0, 1};
    EXPECT_EQ(info.moe_layers, expected);
    ASSERT_EQ(info.layer_configs.size(), expected.size());
    auto ref = test::open_reference(arch);
    for (int64_t l : info.moe_layers) {
      const MoEConfig& c = info.layer_config(l);
      EXPECT_NO_THROW(c.validate());
      EXPECT_EQ(c.hidden_size, 128);
      EXPECT_EQ(c.intermediate_size, 48);
      // The reference file's router outputs agree with E and k.
      const Tensor logits = ref->get(test::reference_name(l, 5, "router_logits"));
      EXPECT_EQ(logits.shape_str(), "[5, " + std::to_string(c.num_experts) + "]");
      if (arch != "llama4") {
        EXPECT_EQ(ref->get(test::reference_name(l, 5, "topk_ids")).shape_str(),
                  "[5, " + std::to_string(c.top_k) + "]");
      }
    }
  }
}

TEST(HfConfig, FixtureFieldsPerArchitecture) {
  {
    const ModelInfo m = load_model_info(test::hf_fixture_dir("mixtral"));
    const MoEConfig& c = m.layer_config(0);
    EXPECT_EQ(m.model_type, "mixtral");
    EXPECT_EQ(m.architecture, "MixtralForCausalLM");
    EXPECT_EQ(c.num_experts, 8);
    EXPECT_EQ(c.top_k, 2);
    EXPECT_EQ(c.routing_method, RoutingMethod::kTopK);
    EXPECT_EQ(c.scoring_func, ScoringFunc::kSoftmax);
    EXPECT_TRUE(c.renormalize);
    EXPECT_EQ(c.activation, Activation::kSiluGlu);
    EXPECT_FALSE(c.has_shared_expert());
    EXPECT_EQ(m.moe_prefix(1), "model.layers.1.block_sparse_moe.");
  }
  {
    const ModelInfo m = load_model_info(test::hf_fixture_dir("qwen2_moe"));
    const MoEConfig& c = m.layer_config(1);
    EXPECT_EQ(c.num_experts, 12);
    EXPECT_EQ(c.top_k, 4);
    EXPECT_FALSE(c.renormalize);
    EXPECT_EQ(c.shared_intermediate_size, 96);
    EXPECT_TRUE(c.has_shared_expert_gate);
    EXPECT_EQ(m.moe_prefix(1), "model.layers.1.mlp.");
  }
  {
    const ModelInfo m = load_model_info(test::hf_fixture_dir("qwen3_moe"));
    const MoEConfig& c = m.layer_config(0);
    EXPECT_EQ(c.num_experts, 16);  // written as num_local_experts (attribute_map alias)
    EXPECT_TRUE(c.renormalize);
    EXPECT_FALSE(c.has_shared_expert());
  }
  {
    const ModelInfo m = load_model_info(test::hf_fixture_dir("olmoe"));
    const MoEConfig& c = m.layer_config(0);
    EXPECT_EQ(c.num_experts, 16);
    EXPECT_EQ(c.top_k, 4);
    EXPECT_FALSE(c.renormalize);
  }
  {
    const ModelInfo m = load_model_info(test::hf_fixture_dir("deepseek_v3"));
    const MoEConfig& c = m.layer_config(2);
    EXPECT_EQ(c.num_experts, 16);
    EXPECT_EQ(c.top_k, 4);
    EXPECT_EQ(c.routing_method, RoutingMethod::kGroupedTopK);
    EXPECT_EQ(c.scoring_func, ScoringFunc::kSigmoid);  // default: the config has no scoring_func
    EXPECT_EQ(c.group_score, GroupScore::kSumTop2);
    EXPECT_TRUE(c.has_e_score_correction_bias);
    EXPECT_EQ(c.num_expert_group, 4);
    EXPECT_EQ(c.topk_group, 2);
    EXPECT_TRUE(c.renormalize);
    EXPECT_FLOAT_EQ(c.routed_scaling_factor, 2.5f);
    EXPECT_EQ(c.shared_intermediate_size, 48);  // n_shared_experts (1) * moe_intermediate_size
    EXPECT_FALSE(c.has_shared_expert_gate);
    EXPECT_FALSE(m.is_moe_layer(0));
    const std::string msg = error_of([&] { m.layer_config(0); }, ErrorCode::kInvalidArgument);
    EXPECT_HAS(msg, "layer 0 is not an MoE layer of deepseek_v3 (MoE layers: 1, 2)");
    // A layer the model does not have: out of range, with the model's layer count.
    ASSERT_EQ(m.num_hidden_layers, 3);
    EXPECT_HAS(error_of([&] { m.layer_config(3); }, ErrorCode::kInvalidArgument),
               "layer 3: out of range, the model has 3 layers (0..2); MoE layers: 1, 2");
    EXPECT_HAS(error_of([&] { m.layer_config(-1); }, ErrorCode::kInvalidArgument),
               "layer -1: out of range, the model has 3 layers (0..2); MoE layers: 1, 2");
  }
  {
    const ModelInfo m = load_model_info(test::hf_fixture_dir("gpt_oss"));
    const MoEConfig& c = m.layer_config(0);
    EXPECT_EQ(c.num_experts, 8);
    EXPECT_EQ(c.top_k, 2);
    EXPECT_EQ(c.routing_method, RoutingMethod::kTopKSoftmax);
    EXPECT_TRUE(c.has_router_bias);
    EXPECT_TRUE(c.has_expert_bias);
    EXPECT_EQ(c.activation, Activation::kSwigluOai);
    EXPECT_FLOAT_EQ(c.swiglu_alpha, 1.702f);
    EXPECT_FLOAT_EQ(c.swiglu_limit, 7.0f);
    EXPECT_EQ(m.moe_prefix(0), "model.layers.0.mlp.");
  }
  {
    const ModelInfo m = load_model_info(test::hf_fixture_dir("llama4") + "/config.json");
    const MoEConfig& c = m.layer_config(1);
    EXPECT_EQ(m.model_type, "llama4_text");
    EXPECT_EQ(c.num_experts, 8);
    EXPECT_EQ(c.top_k, 1);
    EXPECT_EQ(c.routing_method, RoutingMethod::kLlama4);
    EXPECT_EQ(c.scoring_func, ScoringFunc::kSigmoid);
    EXPECT_TRUE(c.apply_router_weight_on_input);
    EXPECT_EQ(c.intermediate_size, 48);         // intermediate_size, not intermediate_size_mlp (96)
    EXPECT_EQ(c.shared_intermediate_size, 48);  // the shared expert uses intermediate_size too
    EXPECT_FALSE(c.has_shared_expert_gate);
    EXPECT_EQ(m.moe_prefix(1), "model.layers.1.feed_forward.");
  }
}

TEST(HfConfig, UnknownModelType) {
  json j = fixture_json("mixtral");
  j["model_type"] = "jamba";
  const std::string msg = error_of([&] { parse(j); }, ErrorCode::kUnsupported);
  EXPECT_HAS(msg, "'jamba'");
  EXPECT_HAS(msg, "mixtral");
  EXPECT_HAS(msg, "deepseek_v3");
  EXPECT_HAS(msg, "llama4");
  j.erase("model_type");
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument), "'model_type' is missing");
}

TEST(HfConfig, MissingAndInvalidFields) {
  for (const std::string& arch : test::hf_fixture_archs()) {
    SCOPED_TRACE(arch);
    json j = fixture_json(arch);
    j.erase("hidden_size");
    const std::string msg = error_of([&] { parse(j); }, ErrorCode::kInvalidArgument);
    EXPECT_HAS(msg, "test/config.json");
    EXPECT_HAS(msg, "'hidden_size' is missing");
  }
  json j = fixture_json("olmoe");
  j["hidden_size"] = "big";
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
             "field 'hidden_size': expected an integer, got \"big\"");
  // MoEConfig::validate() failures come back with the source named.
  j = fixture_json("olmoe");
  j["num_experts_per_tok"] = 17;
  std::string msg = error_of([&] { parse(j); }, ErrorCode::kInvalidArgument);
  EXPECT_HAS(msg, "test/config.json");
  // ... and the config.json field a failing value came from.
  EXPECT_HAS(msg, "field 'num_experts_per_tok' (top_k): expected <= ");
  j = fixture_json("deepseek_v3");
  j["n_group"] = 3;  // 16 routed experts
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
             "field 'n_group' (num_expert_group): expected a divisor of num_experts");
  // One expert a group: DeepSeek-V3's group score (the sum of a group's top 2)
  // has no second expert; named by n_group, not by group_score (no config.json
  // field) with "use max" advice a config cannot follow (session 29's trial).
  j["n_group"] = 16;
  j["topk_group"] = 8;
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
             "(deepseek_v3): field 'n_group' (num_expert_group): expected at most 8 groups (16 "
             "routed experts / 2: the router scores each group by the sum of its top 2 experts), "
             "got 16");
  // Unknown activation.
  j = fixture_json("mixtral");
  j["hidden_act"] = "relu2";
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kUnsupported),
             "hidden_act 'relu2' is not supported (supported: silu, swish, gelu, "
             "gelu_pytorch_tanh, gelu_new, gelu_fast)");
  for (const char* act : {"silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast"}) {
    j["hidden_act"] = act;  // every name the message lists is taken
    EXPECT_NO_THROW(parse(j)) << act;
  }
  j["hidden_act"] = "gelu_pytorch_tanh";
  EXPECT_EQ(parse(j).layer_config(0).activation, Activation::kGeluTanhGlu);
  j["hidden_act"] = "gelu";
  EXPECT_EQ(parse(j).layer_config(0).activation, Activation::kGeluGlu);
  // Not JSON / not there.
  EXPECT_HAS(error_of([] { parse_model_info("{\"model_type\": ", "x.json"); }, ErrorCode::kIo),
             "x.json");
  EXPECT_HAS(error_of([] { load_model_info("/nonexistent/dir/config.json"); }, ErrorCode::kIo),
             "/nonexistent/dir/config.json");
}

// An integer field given as a float, even a whole one (4.0), is refused naming
// the field and the value (it was read as 4): Python reads it as a float, which
// HF's torch.topk / range() refuse.
TEST(HfConfig, IntegerFieldsRefuseFloats) {
  const std::pair<const char*, const char*> cases[] = {
      {"mixtral", "num_experts_per_tok"}, {"mixtral", "num_local_experts"},
      {"mixtral", "hidden_size"},         {"mixtral", "intermediate_size"},
      {"mixtral", "num_hidden_layers"},   {"qwen2_moe", "decoder_sparse_step"},
      {"deepseek_v3", "n_group"},         {"deepseek_v3", "first_k_dense_replace"}};
  for (const auto& [arch, key] : cases) {
    SCOPED_TRACE(std::string(arch) + " " + key);
    json j = fixture_json(arch);
    ASSERT_TRUE(j.contains(key));
    j[key] = j[key].get<double>();
    EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
               std::string("test/config.json: field '") + key + "': expected an integer, got " +
                   j[key].dump());
  }
  json j = fixture_json("olmoe");
  j["num_experts_per_tok"] = 4.0;
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
             "test/config.json: field 'num_experts_per_tok': expected an integer, got 4.0");
}

// A UTF-8 byte-order mark before the JSON: refused, as Python's json.load
// (transformers' reader) refuses it; nlohmann's parser skipped it.
TEST(HfConfig, ByteOrderMarkIsRefused) {
  const std::string text = fixture_json("mixtral").dump();
  EXPECT_NO_THROW(parse_model_info(text, "test/config.json"));
  EXPECT_HAS(error_of([&] { parse_model_info("\xEF\xBB\xBF" + text, "test/config.json"); },
                      ErrorCode::kIo),
             "test/config.json: starts with a UTF-8 byte-order mark (bytes EF BB BF)");
}

// NaN, Infinity and -Infinity literals, which Python's json (so HF
// transformers' AutoConfig) reads: a field this library does not read may
// hold one; one it reads is refused naming the field and the literal. Inside
// strings the words are text; a literal glued to other letters is no JSON.
TEST(HfConfig, NonFiniteLiteralsAsPythonJsonReadsThem) {
  json j = fixture_json("mixtral");
  // The config's text with `key` set to `literal` (written into the text).
  const auto with = [&](const std::string& key, const std::string& literal) {
    json c = j;
    c[key] = "@literal@";
    std::string t = c.dump();
    t.replace(t.find("\"@literal@\""), 11, literal);
    return t;
  };
  const auto where = std::string("test/config.json");
  // Unread fields: the layer loads as without them.
  for (const char* lit : {"NaN", "Infinity", "-Infinity", "[1, NaN, {\"a\": -Infinity}]"}) {
    SCOPED_TRACE(lit);
    const ModelInfo m = parse_model_info(with("initializer_range", lit), where);
    EXPECT_EQ(m.layer_config(0).num_experts, 8);
  }
  // Read fields: named, the literal as written.
  EXPECT_HAS(error_of([&] { parse_model_info(with("num_local_experts", "Infinity"), where); },
                      ErrorCode::kInvalidArgument),
             "test/config.json: field 'num_local_experts': expected an integer, got Infinity");
  EXPECT_HAS(error_of([&] { parse_model_info(with("hidden_act", "NaN"), where); },
                      ErrorCode::kInvalidArgument),
             "test/config.json: field 'hidden_act': expected a string, got NaN");
  EXPECT_HAS(error_of([&] { parse_model_info(with("dtype", "-Infinity"), where); },
                      ErrorCode::kInvalidArgument),
             "field 'dtype': expected a string, got -Infinity");
  j = fixture_json("deepseek_v3");
  EXPECT_HAS(error_of([&] { parse_model_info(with("routed_scaling_factor", "NaN"), where); },
                      ErrorCode::kInvalidArgument),
             "test/config.json: field 'routed_scaling_factor': expected a finite number, got NaN");
  EXPECT_HAS(
      error_of(
          [&] { parse_model_info(with("quantization_config", "{\"quant_method\": NaN}"), where); },
          ErrorCode::kInvalidArgument),
      "quantization_config.quant_method: expected a string, got NaN");
  j = fixture_json("gpt_oss");
  EXPECT_HAS(error_of([&] { parse_model_info(with("swiglu_limit", "Infinity"), where); },
                      ErrorCode::kInvalidArgument),
             "field 'swiglu_limit': expected a finite number, got Infinity");
  // In strings: text, as ever.
  j = fixture_json("mixtral");
  EXPECT_HAS(error_of([&] { parse_model_info(with("hidden_act", "\"NaN\""), where); },
                      ErrorCode::kUnsupported),
             "hidden_act 'NaN' is not supported");
  EXPECT_NO_THROW(parse_model_info(with("note", "\"a \\\" NaN, Infinity\""), where));
  // Not literals: still invalid JSON, reported as nlohmann reports the text.
  for (const char* bad : {"NaNa", "nan", "+Infinity", "inf"}) {
    SCOPED_TRACE(bad);
    EXPECT_HAS(
        error_of([&] { parse_model_info(with("initializer_range", bad), where); }, ErrorCode::kIo),
        "test/config.json: not valid JSON");
  }
  EXPECT_HAS(error_of([&] { parse_model_info("NaN", where); }, ErrorCode::kIo),
             "test/config.json: not a JSON object (got NaN)");
  // A number beyond the double range is Python's inf: taken where unread.
  EXPECT_NO_THROW(parse_model_info(with("initializer_range", "-1e999"), where));
  EXPECT_HAS(error_of([&] { parse_model_info(with("num_local_experts", "1E400"), where); },
                      ErrorCode::kInvalidArgument),
             "field 'num_local_experts': expected an integer, got 1E400");
  // An integer of 400 digits (a Python int) too, named as written where read.
  const std::string digits(400, '9');
  EXPECT_NO_THROW(parse_model_info(with("initializer_range", digits), where));
  EXPECT_HAS(error_of([&] { parse_model_info(with("num_local_experts", digits), where); },
                      ErrorCode::kInvalidArgument),
             "field 'num_local_experts': expected an integer below 2^63, got " + digits);
  // 2^64 + 4: past nlohmann's integers (it read 1.8446744073709552e+19), as written.
  EXPECT_HAS(
      error_of(
          [&] { parse_model_info(with("num_experts_per_tok", "18446744073709551620"), where); },
          ErrorCode::kInvalidArgument),
      "field 'num_experts_per_tok': expected an integer below 2^63, got "
      "18446744073709551620");
  // More digits than Python's int reads from text (4300): refused, as HF refuses it.
  EXPECT_HAS(
      error_of([&] { parse_model_info(with("initializer_range", std::string(4301, '7')), where); },
               ErrorCode::kIo),
      "test/config.json: an integer of 4301 digits at byte ");
  // A lone UTF-16 surrogate escape (Python keeps it; nlohmann refused the text),
  // beside a NaN or alone, and a valid pair.
  EXPECT_NO_THROW(parse_model_info(with("note", "\"a\\ud800b\""), where));
  EXPECT_NO_THROW(parse_model_info(with("note", "[\"\\udc00\", NaN, \"\\ud83d\\ude00\"]"), where));
  EXPECT_HAS(error_of([&] { parse_model_info(with("hidden_act", "\"\\ud800\""), where); },
                      ErrorCode::kUnsupported),
             "hidden_act '\xEF\xBF\xBD' is not supported");
  // A literal as an object key: Python refuses it too.
  EXPECT_HAS(error_of([&] { parse_model_info(with("x", "{NaN: 1}"), where); }, ErrorCode::kIo),
             "test/config.json: not valid JSON");
  // A raw control byte in a string (Python refuses it too), quoted as every
  // message quotes one (the JSON library wrote it "<U+0001>"), with or without a NaN.
  for (const char* nan : {"1", "NaN"}) {
    const std::string ctl = error_of(
        [&] { parse_model_info(with("note", std::string("[") + nan + ", \"a\x01\"]"), where); },
        ErrorCode::kIo);
    EXPECT_HAS(ctl, "test/config.json: not valid JSON: ");
    EXPECT_HAS(ctl, "\"a\\x01");
    EXPECT_EQ(ctl.find("<U+"), std::string::npos) << ctl;
  }
  // A syntax error after a NaN is reported where it is, in the text as written.
  const std::string bad = "{\"a\": NaN,\n  \"b\": tru}";
  const std::string msg = error_of([&] { parse_model_info(bad, where); }, ErrorCode::kIo);
  EXPECT_HAS(msg, "test/config.json: not valid JSON: ");
  // As nlohmann places it with a number of the same length in the NaN's place.
  const std::string same =
      error_of([&] { parse_model_info("{\"a\": 1.0,\n  \"b\": tru}", where); }, ErrorCode::kIo);
  EXPECT_HAS(same, "at line 2, column 11:");
  EXPECT_HAS(msg, "at line 2, column 11:");
  EXPECT_EQ(msg.find("NaN"), std::string::npos) << msg;
}

// Nesting deeper than Python's json takes (RecursionError) is refused, with or
// without a NaN in it (a recursion over the nesting crashed the reader once).
TEST(HfConfig, NestingDeeperThanPythonTakesIsRefused) {
  std::string text = fixture_json("mixtral").dump();
  for (const char* leaf : {"1", "NaN"}) {
    SCOPED_TRACE(leaf);
    const int depth = 100000;
    const std::string deep = std::string(depth, '[') + leaf + std::string(depth, ']');
    std::string t = text;
    t.insert(1, "\"x\": " + deep + ", ");
    EXPECT_HAS(error_of([&] { parse_model_info(t, "test/config.json"); }, ErrorCode::kIo),
               "test/config.json: JSON nested deeper than 1500 levels");
    const std::string ok = std::string(1400, '[') + leaf + std::string(1400, ']');
    t = text;
    t.insert(1, "\"x\": " + ok + ", ");
    EXPECT_NO_THROW(parse_model_info(t, "test/config.json"));
  }
}

// A NUL byte (a binary or zero-filled file) is named with its offset, not
// reported as nlohmann's "unexpected end of input".
TEST(HfConfig, NulByteIsNamed) {
  const std::string text = fixture_json("mixtral").dump();
  EXPECT_HAS(error_of([&] { parse_model_info(std::string(1, '\0') + text, "test/config.json"); },
                      ErrorCode::kIo),
             "test/config.json: not JSON text: contains a NUL byte at offset 0");
  std::string mid = text;
  mid[5] = '\0';
  EXPECT_HAS(error_of([&] { parse_model_info(mid, "test/config.json"); }, ErrorCode::kIo),
             "contains a NUL byte at offset 5");
}

// A config string quoted in an error keeps its control characters as \xNN: a
// newline in it neither breaks the message in two nor reads as the CLI's "; ".
TEST(HfConfig, QuotedConfigStringsEscapeControlCharacters) {
  json j = fixture_json("mixtral");
  j["hidden_act"] = "si\nlu\x1b[31m";
  std::string msg = error_of([&] { parse(j); }, ErrorCode::kUnsupported);
  EXPECT_HAS(msg, "hidden_act 'si\\x0alu\\x1b[31m'");
  EXPECT_EQ(msg.find_first_of("\n\x1b"), std::string::npos) << msg;
  j = fixture_json("mixtral");
  j["model_type"] = "mix\ntral";
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kUnsupported), "model_type 'mix\\x0atral'");
  j = fixture_json("mixtral");
  j["dtype"] = "bf\t16";
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
             "field 'dtype': expected bfloat16, float16, float32 or float64, got 'bf\\x0916'");
  // A type that is no model dtype (session 29's trial: "int8" and "bool" were
  // taken and shown as the model's dtype); HF's names and the short ones are.
  for (const char* bad : {"int8", "bool", "float8_e4m3fn", "int4"}) {
    j["dtype"] = bad;
    EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
               std::string("field 'dtype': expected bfloat16, float16, float32 or float64, got '") +
                   bad + "'");
  }
  // ... named by the field the file has (torch_dtype in older configs).
  j.erase("dtype");
  j["torch_dtype"] = "int8";
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
             "field 'torch_dtype': expected bfloat16, float16, float32 or float64, got 'int8'");
  j.erase("torch_dtype");
  for (const char* good : {"bfloat16", "float16", "float32", "bf16", "f32"}) {
    j["dtype"] = good;
    EXPECT_NO_THROW(parse(j)) << good;
  }
  j = fixture_json("deepseek_v3");
  j["quantization_config"] = {{"quant_method", "fp\r8"}};
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kUnsupported), "quant_method 'fp\\x0d8'");
  // MoEConfig::from_json (the Python config dicts, --config files) quotes through it too.
  EXPECT_HAS(error_of([] { MoEConfig::from_json("{\"scoring_func\": \"soft\\nmax\"}", "c"); },
                      ErrorCode::kInvalidArgument),
             "got \"soft\\x0amax\"");
  EXPECT_HAS(
      error_of([] { MoEConfig::from_json("{\"top\\nk\": 1}", "c"); }, ErrorCode::kInvalidArgument),
      "unknown field \"top\\x0ak\"");
}

TEST(HfConfig, AbsurdSizesNameTheField) {
  // As config.json spells the key (not MoEConfig's name), with the value.
  const struct {
    const char* arch;
    const char* field;
  } cases[] = {{"deepseek_v3", "n_routed_experts"},
               {"deepseek_v3", "moe_intermediate_size"},
               {"deepseek_v3", "n_shared_experts"},
               {"mixtral", "num_local_experts"},
               {"mixtral", "intermediate_size"},
               {"olmoe", "hidden_size"},
               {"qwen2_moe", "shared_expert_intermediate_size"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c.arch) + " " + c.field);
    json j = fixture_json(c.arch);
    ASSERT_TRUE(j.contains(c.field));
    j[c.field] = int64_t{100000000000};
    const std::string msg = error_of([&] { parse(j); }, ErrorCode::kInvalidArgument);
    EXPECT_HAS(msg, std::string("field '") + c.field + "': expected <= ");
    EXPECT_HAS(msg, "got 100000000000");
  }
  // Past 2^63 - 1 (an unsigned JSON integer): named as written, not wrapped negative.
  for (const char* field : {"num_experts_per_tok", "num_hidden_layers"}) {
    SCOPED_TRACE(field);
    json j = fixture_json("mixtral");
    j[field] = uint64_t{18446744073709551615u};
    EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
               std::string("field '") + field +
                   "': expected an integer below 2^63, got 18446744073709551615");
  }
  // A float field stored as f32: past its range, named (not "got inf" from the conversion).
  json d = fixture_json("deepseek_v3");
  d["routed_scaling_factor"] = 1e39;
  EXPECT_HAS(error_of([&] { parse(d); }, ErrorCode::kInvalidArgument),
             "field 'routed_scaling_factor': expected a number within the f32 range (|x| <= "
             "3.4028235e38), got 1e+39");
}

// n_shared_experts within its own bound but its product with
// moe_intermediate_size too wide: both fields named (trial finding; the
// error named the derived shared_intermediate_size only).
TEST(HfConfig, SharedExpertsWidthNamesBothFields) {
  json j = fixture_json("deepseek_v3");  // DeepSeek-V2 reads the fields through the same code
  j["n_shared_experts"] = 65536;
  const int64_t inter = j["moe_intermediate_size"].get<int64_t>();
  const std::string msg = error_of([&] { parse(j); }, ErrorCode::kInvalidArgument);
  EXPECT_HAS(msg, "fields 'n_shared_experts' x 'moe_intermediate_size'");
  EXPECT_HAS(msg, "expected at most 1048576, got 65536 x " + std::to_string(inter));
}

TEST(HfConfig, SafetensorsFileStandsForItsModel) {
  // A checkpoint's .safetensors file: the config.json beside it (as
  // Checkpoint::open takes the file for the weights).
  const std::string dir = test::hf_fixture_dir("deepseek_v3");
  const ModelInfo a = load_model_info(dir + "/model.safetensors");
  const ModelInfo b = load_model_info(dir);
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.moe_layers, b.moe_layers);
  EXPECT_EQ(a.layer_config(1).summary(), b.layer_config(1).summary());
  // No config.json beside it: named.
  test::TempDir tmp("hf_st");
  std::filesystem::copy_file(dir + "/model.safetensors", tmp.file("model.safetensors"));
  const std::string msg =
      error_of([&] { load_model_info(tmp.file("model.safetensors")); }, ErrorCode::kIo);
  EXPECT_HAS(msg, "no config.json");
  EXPECT_HAS(msg, tmp.file("config.json"));
}

// A file that is neither a .json nor a checkpoint (a .npy) is named as no model,
// not read as a config.json that is "not valid JSON".
TEST(HfConfig, OtherFileIsNoModel) {
  test::TempDir tmp;
  {
    std::ofstream f(tmp.file("x.npy"), std::ios::binary);
    f << "\x93NUMPY\x01 {'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
  }
  const std::string msg =
      error_of([&] { load_model_info(tmp.file("x.npy")); }, ErrorCode::kInvalidArgument);
  EXPECT_HAS(msg, tmp.file("x.npy") +
                      ": expected a model directory, its config.json, its "
                      "*.safetensors.index.json or a .safetensors file");
  EXPECT_EQ(msg.find("JSON"), std::string::npos) << msg;
  // A config under another name that ends in .json is still read.
  std::filesystem::copy_file(test::hf_fixture_dir("mixtral") + "/config.json", tmp.file("my.json"));
  EXPECT_EQ(load_model_info(tmp.file("my.json")).model_type, "mixtral");
}

TEST(HfConfig, DtypeFromTorchDtype) {
  json j = fixture_json("mixtral");
  j.erase("dtype");
  j["torch_dtype"] = "float32";
  EXPECT_EQ(parse(j).dtype, DType::kF32);
  j["dtype"] = "float16";
  EXPECT_EQ(parse(j).dtype, DType::kF16);
}

TEST(HfConfig, Llama4MultimodalTextConfig) {
  json text = fixture_json("llama4");
  text.erase("moe_layers");
  text["num_hidden_layers"] = 6;
  text["interleave_moe_layer_step"] = 2;  // moe_layers = range(1, 6, 2)
  json j = {{"model_type", "llama4"},
            {"architectures", {"Llama4ForConditionalGeneration"}},
            {"dtype", "bfloat16"},
            {"vision_config", {{"hidden_size", 768}}},
            {"text_config", text}};
  j["text_config"].erase("dtype");
  const ModelInfo m = parse(j);
  EXPECT_EQ(m.model_type, "llama4");
  EXPECT_EQ(m.architecture, "Llama4ForConditionalGeneration");
  EXPECT_EQ(m.num_hidden_layers, 6);
  EXPECT_EQ(m.dtype, DType::kBF16);
  EXPECT_EQ(m.moe_layers, (std::vector<int64_t>{1, 3, 5}));
  EXPECT_EQ(m.layer_config(3).num_experts, 8);
  EXPECT_EQ(m.layer_config(3).routing_method, RoutingMethod::kLlama4);
  EXPECT_EQ(m.moe_prefix(3), "language_model.model.layers.3.feed_forward.");
  // moe_layers overrides the step.
  j["text_config"]["moe_layers"] = {0, 4};
  EXPECT_EQ(parse(j).moe_layers, (std::vector<int64_t>{0, 4}));
  j["text_config"]["moe_layers"] = {0, 9};
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument), "layer 9 is outside [0, 6)");
  // interleave_moe_layer_step 0 (or below) is refused, with moe_layers given too
  // (where it was accepted: moe_layers takes precedence).
  for (const bool with_moe_layers : {false, true}) {
    SCOPED_TRACE(with_moe_layers);
    json t = j["text_config"];
    if (with_moe_layers)
      t["moe_layers"] = {0, 4};
    else
      t.erase("moe_layers");
    for (const int step : {0, -2}) {
      t["interleave_moe_layer_step"] = step;
      json m = j;
      m["text_config"] = t;
      EXPECT_HAS(error_of([&] { parse(m); }, ErrorCode::kInvalidArgument),
                 "test/config.json (text_config): field 'interleave_moe_layer_step': expected an "
                 "integer >= 1, got " +
                     std::to_string(step));
    }
  }
  j.erase("text_config");
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument), "text_config");
}

json deepseek_v2_config() {
  return {{"model_type", "deepseek_v2"}, {"architectures", {"DeepseekV2ForCausalLM"}},
          {"hidden_size", 256},          {"num_hidden_layers", 6},
          {"n_routed_experts", 64},      {"num_experts_per_tok", 6},
          {"moe_intermediate_size", 96}, {"n_shared_experts", 2},
          {"first_k_dense_replace", 1},  {"routed_scaling_factor", 16.0},
          {"torch_dtype", "bfloat16"}};
}

TEST(HfConfig, DeepseekV2Routing) {
  json j = deepseek_v2_config();
  ModelInfo m = parse(j);  // topk_method absent: "greedy"
  EXPECT_EQ(m.moe_layers, (std::vector<int64_t>{1, 2, 3, 4, 5}));
  MoEConfig c = m.layer_config(1);
  EXPECT_EQ(c.routing_method, RoutingMethod::kTopK);
  EXPECT_EQ(c.scoring_func, ScoringFunc::kSoftmax);
  EXPECT_EQ(c.num_expert_group, 1);
  EXPECT_FALSE(c.renormalize);
  EXPECT_FALSE(c.has_e_score_correction_bias);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 16.0f);
  EXPECT_EQ(c.shared_intermediate_size, 192);
  EXPECT_EQ(m.moe_prefix(2), "model.layers.2.mlp.");

  j["topk_method"] = "group_limited_greedy";
  j["n_group"] = 8;
  j["topk_group"] = 3;
  j["moe_layer_freq"] = 2;
  m = parse(j);
  EXPECT_EQ(m.moe_layers, (std::vector<int64_t>{2, 4}));
  c = m.layer_config(4);
  EXPECT_EQ(c.routing_method, RoutingMethod::kGroupedTopK);
  EXPECT_EQ(c.group_score, GroupScore::kMax);
  EXPECT_EQ(c.scoring_func, ScoringFunc::kSoftmax);
  EXPECT_EQ(c.num_expert_group, 8);
  EXPECT_EQ(c.topk_group, 3);
  EXPECT_FALSE(c.has_e_score_correction_bias);

  j["topk_method"] = "noaux_tc";
  j["scoring_func"] = "sigmoid";
  c = parse(j).layer_config(2);
  EXPECT_EQ(c.group_score, GroupScore::kSumTop2);
  EXPECT_EQ(c.scoring_func, ScoringFunc::kSigmoid);
  EXPECT_TRUE(c.has_e_score_correction_bias);

  // Where HF's DeepseekV2Moe, DeepSeek's reference code and vLLM disagree
  // (norm_topk_prob true; a scoring_func other than softmax), refused naming the
  // field, for both HF topk methods; false and softmax (the released
  // checkpoints') load as above.
  for (const char* method : {"greedy", "group_limited_greedy"}) {
    SCOPED_TRACE(method);
    json v = j;
    v["topk_method"] = method;
    v.erase("scoring_func");
    v["norm_topk_prob"] = true;
    const std::string e = error_of([&] { parse(v); }, ErrorCode::kUnsupported);
    EXPECT_HAS(e, std::string("norm_topk_prob true is not supported for deepseek_v2 with "
                              "topk_method '") +
                      method + "'");
    EXPECT_HAS(e, "HF transformers' DeepseekV2Moe ignores it");
    v["norm_topk_prob"] = false;
    v["scoring_func"] = "sigmoid";
    EXPECT_HAS(error_of([&] { parse(v); }, ErrorCode::kUnsupported),
               std::string("scoring_func 'sigmoid' is not supported for deepseek_v2 with "
                           "topk_method '") +
                   method + "' (supported: softmax");
    v["scoring_func"] = "softmax";
    EXPECT_FALSE(parse(v).layer_config(2).renormalize);
  }
  // noaux_tc (V3's router under model_type deepseek_v2, as vLLM reads it) keeps
  // renormalizing when asked.
  j["topk_method"] = "noaux_tc";
  j["norm_topk_prob"] = true;
  EXPECT_TRUE(parse(j).layer_config(2).renormalize);
  j.erase("norm_topk_prob");

  j["topk_method"] = "magic";
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kUnsupported), "topk_method 'magic'");
  j["topk_method"] = "group_limited_greedy";
  j.erase("scoring_func");
  j["n_group"] = 7;  // 64 experts do not split into 7 groups
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument), "num_expert_group");
}

TEST(HfConfig, DeepseekV3Defaults) {
  json j = fixture_json("deepseek_v3");
  for (const char* k : {"n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                        "first_k_dense_replace"})
    j.erase(k);
  j["num_hidden_layers"] = 5;
  const ModelInfo m = parse(j);
  EXPECT_EQ(m.moe_layers, (std::vector<int64_t>{3, 4}));  // first_k_dense_replace = 3
  const MoEConfig& c = m.layer_config(3);
  EXPECT_EQ(c.num_expert_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 2.5f);
  EXPECT_TRUE(c.renormalize);
  j["topk_method"] = "greedy";
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kUnsupported), "topk_method 'greedy'");
}

// A null field takes the configuration class's default, except where HF
// transformers reads the None itself: a boolean is false (DeepSeek-V3's
// `if self.norm_topk_prob:` does not renormalize), n_shared_experts null is no
// shared expert (DeepSeek's reference code and vLLM; the default would ask for
// tensors such a checkpoint does not have), and what HF's configuration class
// refuses (transformers 5.17's strict fields), or cannot build or run with
// None, is refused naming the field.
TEST(HfConfig, NullFieldsAsHfReadsThem) {
  json j = fixture_json("deepseek_v3");
  ASSERT_TRUE(parse(j).layer_config(1).renormalize);
  j["norm_topk_prob"] = nullptr;
  EXPECT_FALSE(parse(j).layer_config(1).renormalize);
  j.erase("norm_topk_prob");  // absent: the class default, true
  EXPECT_TRUE(parse(j).layer_config(1).renormalize);
  for (const char* arch : {"qwen2_moe", "qwen3_moe", "olmoe"}) {
    SCOPED_TRACE(arch);
    json q = fixture_json(arch);
    q["norm_topk_prob"] = true;
    ASSERT_TRUE(parse(q).layer_config(1).renormalize);
    q["norm_topk_prob"] = nullptr;  // a strict bool there: refused
    EXPECT_HAS(error_of([&] { parse(q); }, ErrorCode::kInvalidArgument),
               "test/config.json: field 'norm_topk_prob': expected true or false, got null (HF "
               "transformers' configuration refuses None for it)");
  }
  // The other fields transformers' configuration classes refuse as None.
  for (const auto& [arch, key] : std::vector<std::pair<const char*, const char*>>{
           {"qwen2_moe", "decoder_sparse_step"},
           {"qwen3_moe", "decoder_sparse_step"},
           {"qwen2_moe", "shared_expert_intermediate_size"},
           {"deepseek_v3", "routed_scaling_factor"},
           {"llama4", "interleave_moe_layer_step"}}) {
    SCOPED_TRACE(std::string(arch) + " " + key);
    json a = fixture_json(arch);
    (a.contains("text_config") ? a["text_config"] : a)[key] = nullptr;
    EXPECT_HAS(error_of([&] { parse(a); }, ErrorCode::kInvalidArgument),
               std::string("test/config.json: field '") + key + "': expected ");
    EXPECT_HAS(error_of([&] { parse(a); }, ErrorCode::kInvalidArgument),
               ", got null (HF transformers' configuration refuses None for it)");
  }
  {
    json v2 = deepseek_v2_config();
    v2["routed_scaling_factor"] = nullptr;
    EXPECT_HAS(error_of([&] { parse(v2); }, ErrorCode::kInvalidArgument),
               "field 'routed_scaling_factor': expected a number, got null");
  }

  for (json d : {fixture_json("deepseek_v3"), deepseek_v2_config()}) {
    SCOPED_TRACE(d["model_type"].get<std::string>());
    const int64_t l = parse(d).moe_layers.front();
    ASSERT_TRUE(parse(d).layer_config(l).has_shared_expert());
    d["n_shared_experts"] = nullptr;
    EXPECT_FALSE(parse(d).layer_config(l).has_shared_expert());
    EXPECT_EQ(parse(d).layer_config(l).shared_intermediate_size, 0);
    d["first_k_dense_replace"] = nullptr;
    EXPECT_HAS(error_of([&] { parse(d); }, ErrorCode::kInvalidArgument),
               "test/config.json: field 'first_k_dense_replace': expected an integer >= 0, got "
               "null");
  }
  // Negative counts: named by their field (first_k_dense_replace -1 was taken as 0;
  // n_shared_experts -1 was named as the derived shared_intermediate_size).
  for (const char* k : {"first_k_dense_replace", "n_shared_experts"}) {
    SCOPED_TRACE(k);
    json d = fixture_json("deepseek_v3");
    d[k] = -1;
    EXPECT_HAS(
        error_of([&] { parse(d); }, ErrorCode::kInvalidArgument),
        std::string("test/config.json: field '") + k + "': expected an integer >= 0, got -1");
  }
  for (const char* k : {"n_group", "topk_group"}) {
    json d = fixture_json("deepseek_v3");
    d[k] = nullptr;
    EXPECT_HAS(error_of([&] { parse(d); }, ErrorCode::kInvalidArgument),
               std::string("test/config.json: field '") + k + "': expected an integer, got null");
  }
  // hidden_act: every configuration class refuses None (gpt-oss's too, whose
  // experts never read it); gpt-oss's swiglu_limit None passes the class but
  // fails in its experts' clamp.
  for (const char* arch : {"mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "llama4", "gpt_oss"}) {
    SCOPED_TRACE(arch);
    json a = fixture_json(arch);
    (a.contains("text_config") ? a["text_config"] : a)["hidden_act"] = nullptr;
    EXPECT_HAS(error_of([&] { parse(a); }, ErrorCode::kInvalidArgument),
               "test/config.json: field 'hidden_act': expected an activation name, got null");
  }
  json g = fixture_json("gpt_oss");
  g["swiglu_limit"] = nullptr;
  EXPECT_HAS(error_of([&] { parse(g); }, ErrorCode::kInvalidArgument),
             "test/config.json: field 'swiglu_limit': expected a number, got null");
  // Required fields: null is named as such, not as missing.
  json o = fixture_json("olmoe");
  o["hidden_size"] = nullptr;
  EXPECT_HAS(error_of([&] { parse(o); }, ErrorCode::kInvalidArgument),
             "required field 'hidden_size': expected a value, got null");
  // Other nulls: the class default (moe_layer_freq: 1; the class keeps None).
  json d = fixture_json("deepseek_v3");
  d["moe_layer_freq"] = nullptr;
  EXPECT_EQ(parse(d).moe_layers, parse(fixture_json("deepseek_v3")).moe_layers);
}

// moe_layer_freq (DeepSeek's reference code: layer % freq == 0) is honoured
// when > 0; HF transformers ignores it, so 0, which the reference code divides
// by, reads as HF builds the model: every layer from first_k_dense_replace on.
// A negative one is refused, naming the field, what it takes and the value.
TEST(HfConfig, DeepseekMoeLayerFreqZeroIsEveryLayerAsHf) {
  for (json d : {fixture_json("deepseek_v3"), deepseek_v2_config()}) {
    SCOPED_TRACE(d["model_type"].get<std::string>());
    d["num_hidden_layers"] = 6;
    d["first_k_dense_replace"] = 1;
    d["moe_layer_freq"] = 2;
    EXPECT_EQ(parse(d).moe_layers, (std::vector<int64_t>{2, 4}));
    d["moe_layer_freq"] = 0;
    EXPECT_EQ(parse(d).moe_layers, (std::vector<int64_t>{1, 2, 3, 4, 5}));
    d["moe_layer_freq"] = -2;
    EXPECT_HAS(error_of([&] { parse(d); }, ErrorCode::kInvalidArgument),
               "test/config.json: field 'moe_layer_freq': expected an integer >= 0 (1: every "
               "layer from first_k_dense_replace on; 0 reads the same, as HF transformers ignores "
               "the field), got -2");
  }
}

// HF's DeepseekV3TopkRouter always takes the sigmoid (its config has no
// scoring_func); vLLM reads the field. "sigmoid" is accepted, anything else is
// refused rather than computed one way or the other.
TEST(HfConfig, DeepseekV3ScoringFuncSigmoidOnly) {
  json j = fixture_json("deepseek_v3");
  j["scoring_func"] = "sigmoid";
  EXPECT_EQ(parse(j).layer_config(1).scoring_func, ScoringFunc::kSigmoid);
  j["scoring_func"] = "softmax";
  const std::string e = error_of([&] { parse(j); }, ErrorCode::kUnsupported);
  EXPECT_HAS(e, "scoring_func 'softmax' is not supported for deepseek_v3 (supported: sigmoid");
  EXPECT_HAS(e, "config.json");
}

// Only DeepSeek's FP8 format (128 x 128 weight blocks) is read; any other
// quantization would be loaded as if the weights were plain.
TEST(HfConfig, QuantizationConfigOnlyFp8With128Blocks) {
  json j = fixture_json("deepseek_v3");
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  EXPECT_NO_THROW(parse(j));
  j["quantization_config"]["weight_block_size"] = {64, 64};
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kUnsupported),
             "quantization_config.weight_block_size: expected [128,128], got [64,64]");
  j["quantization_config"] = {{"quant_method", "awq"}, {"bits", 4}};
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kUnsupported),
             "quantization_config.quant_method 'awq' is not supported");
  // fmt and activation_scheme: DeepSeek-V3's e4m3 / dynamic (or absent); any
  // other value was ignored, the weights read as e4m3 with dynamic activations.
  j["quantization_config"] = {{"quant_method", "fp8"},
                              {"fmt", "e4m3"},
                              {"activation_scheme", "dynamic"},
                              {"weight_block_size", {128, 128}}};
  EXPECT_NO_THROW(parse(j));
  j["quantization_config"]["fmt"] = "e5m2";
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kUnsupported),
             "quantization_config.fmt: expected 'e4m3' (the FP8 format this library reads, as "
             "DeepSeek-V3 ships), got 'e5m2'");
  j["quantization_config"]["fmt"] = 5;
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
             "quantization_config.fmt: expected a string, got 5");
  j["quantization_config"]["fmt"] = nullptr;
  j["quantization_config"]["activation_scheme"] = "static";
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kUnsupported),
             "quantization_config.activation_scheme: expected 'dynamic' (the FP8 format this "
             "library reads, as DeepSeek-V3 ships), got 'static'");
  j["quantization_config"].erase("activation_scheme");
  EXPECT_NO_THROW(parse(j));
  // Not an object, or without a quant_method string: named as such (each was
  // "quant_method '' is not supported").
  j["quantization_config"] = {1};
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
             "quantization_config: expected an object with a 'quant_method', got [1]");
  j["quantization_config"] = {{"bits", 4}};
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
             "quantization_config.quant_method: expected a string, got none");
  j["quantization_config"] = {{"quant_method", 8}};
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
             "quantization_config.quant_method: expected a string, got 8");
}

TEST(HfConfig, QwenSparseStepAndMlpOnlyLayers) {
  json j = fixture_json("qwen2_moe");
  j["num_hidden_layers"] = 8;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  ModelInfo m = parse(j);
  EXPECT_EQ(m.moe_layers, (std::vector<int64_t>{1, 5, 7}));
  EXPECT_FALSE(m.is_moe_layer(3));
  EXPECT_TRUE(m.is_moe_layer(5));
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = {0, 7};
  m = parse(j);
  EXPECT_EQ(m.moe_layers, (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  j.erase("mlp_only_layers");
  j.erase("decoder_sparse_step");
  EXPECT_EQ(parse(j).moe_layers.size(), 8u);
  j.erase("norm_topk_prob");  // default false
  EXPECT_FALSE(parse(j).layer_config(0).renormalize);
  j = fixture_json("qwen3_moe");
  j["mlp_only_layers"] = {1};
  EXPECT_EQ(parse(j).moe_layers, (std::vector<int64_t>{0}));
  // A layer the model does not have is refused, as in Llama-4's moe_layers.
  for (const int64_t bad : {2, -1}) {
    j["mlp_only_layers"] = {1, bad};
    EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument),
               "field 'mlp_only_layers': layer " + std::to_string(bad) + " is outside [0, 2)");
  }
}

TEST(HfConfig, GptOssSwigluFields) {
  json j = fixture_json("gpt_oss");
  j["swiglu_limit"] = 5.5;
  j["swiglu_alpha"] = 1.5;
  const MoEConfig c = parse(j).layer_config(1);
  EXPECT_FLOAT_EQ(c.swiglu_limit, 5.5f);
  EXPECT_FLOAT_EQ(c.swiglu_alpha, 1.5f);
}

TEST(HfConfig, AbsurdLayerCountIsRejectedNotAllocated) {
  json j = fixture_json("mixtral");
  j["num_hidden_layers"] = 100000000;
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument), "num_hidden_layers");
  j["num_hidden_layers"] = 0;
  EXPECT_HAS(error_of([&] { parse(j); }, ErrorCode::kInvalidArgument), "num_hidden_layers");
}

}  // namespace
}  // namespace fusedmoe
