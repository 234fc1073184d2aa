// Tests of MoEConfig: names, parsing, validate() and summary().
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "fusedmoe/config/moe_config.h"
#include "fusedmoe/core/error.h"

namespace fusedmoe {
namespace {

MoEConfig valid_config() {
  MoEConfig c;
  c.num_experts = 16;
  c.top_k = 4;
  c.hidden_size = 128;
  c.intermediate_size = 48;
  return c;
}

MoEConfig deepseek_v3_config() {
  MoEConfig c = valid_config();
  c.routing_method = RoutingMethod::kGroupedTopK;
  c.scoring_func = ScoringFunc::kSigmoid;
  c.renormalize = true;
  c.num_expert_group = 4;
  c.topk_group = 2;
  c.group_score = GroupScore::kSumTop2;
  c.has_e_score_correction_bias = true;
  c.routed_scaling_factor = 2.5f;
  c.shared_intermediate_size = 48;
  return c;
}

// Expects validate() to throw kInvalidArgument with every substring in the message.
void expect_invalid(const MoEConfig& c, std::initializer_list<std::string> substrings) {
  try {
    c.validate();
    ADD_FAILURE() << "validate() accepted an invalid config:\n" << c.summary();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    for (const std::string& s : substrings)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos)
          << "message \"" << e.what() << "\" lacks \"" << s << "\"";
  }
}

MoEConfig with(std::function<void(MoEConfig&)> edit, MoEConfig c = valid_config()) {
  edit(c);
  return c;
}

TEST(MoEConfig, ValidConfigsPass) {
  EXPECT_NO_THROW(valid_config().validate());
  EXPECT_NO_THROW(deepseek_v3_config().validate());
  MoEConfig llama4 = valid_config();
  llama4.routing_method = RoutingMethod::kLlama4;
  llama4.top_k = 1;
  llama4.apply_router_weight_on_input = true;
  EXPECT_NO_THROW(llama4.validate());
  // E/G = 1 with max group score is fine.
  EXPECT_NO_THROW(with(
                      [](MoEConfig& c) {
                        c.num_expert_group = 16;
                        c.topk_group = 4;
                        c.group_score = GroupScore::kMax;
                        c.has_e_score_correction_bias = false;
                      },
                      deepseek_v3_config())
                      .validate());
  // top_k may use zero experts.
  EXPECT_NO_THROW(with([](MoEConfig& c) {
                    c.num_experts = 4;
                    c.num_zero_experts = 2;
                    c.top_k = 6;
                  }).validate());
}

TEST(MoEConfig, RejectsNonPositiveSizes) {
  expect_invalid(with([](MoEConfig& c) { c.num_experts = 0; }), {"num_experts", "> 0", "got 0"});
  expect_invalid(with([](MoEConfig& c) { c.top_k = -1; }), {"top_k", "got -1"});
  expect_invalid(with([](MoEConfig& c) { c.hidden_size = 0; }), {"hidden_size", "got 0"});
  expect_invalid(with([](MoEConfig& c) { c.intermediate_size = -5; }),
                 {"intermediate_size", "got -5"});
}

// Enumerators cast from integers out of range (trial: accepted and run).
TEST(MoEConfig, RejectsUnknownEnumValues) {
  expect_invalid(with([](MoEConfig& c) { c.activation = static_cast<Activation>(77); }),
                 {"activation: not a known value (77)"});
  expect_invalid(with([](MoEConfig& c) { c.routing_method = static_cast<RoutingMethod>(77); }),
                 {"routing_method: not a known value (77)"});
  expect_invalid(with([](MoEConfig& c) { c.scoring_func = static_cast<ScoringFunc>(77); }),
                 {"scoring_func: not a known value (77)"});
  expect_invalid(with([](MoEConfig& c) { c.group_score = static_cast<GroupScore>(77); }),
                 {"group_score: not a known value (77)"});
  expect_invalid(with([](MoEConfig& c) { c.simulated = static_cast<SimulatedRouting>(77); }),
                 {"simulated: not a known value (77)"});
  expect_invalid(
      with([](MoEConfig& c) { c.parallel.expert_placement = static_cast<ExpertPlacement>(77); }),
      {"parallel.expert_placement: not a known value (77)"});
}

TEST(MoEConfig, RejectsAbsurdSizes) {
  // Named with the value, not left to fail as an allocation of the weights.
  expect_invalid(with([](MoEConfig& c) { c.num_experts = 100000000000; }),
                 {"num_experts", "expected <= 65536", "got 100000000000"});
  expect_invalid(with([](MoEConfig& c) { c.hidden_size = kMaxHiddenSize + 1; }),
                 {"hidden_size", "got 1048577"});
  expect_invalid(with([](MoEConfig& c) { c.intermediate_size = int64_t{1} << 40; }),
                 {"intermediate_size"});
  expect_invalid(with([](MoEConfig& c) { c.shared_intermediate_size = int64_t{1} << 40; }),
                 {"shared_intermediate_size"});
  expect_invalid(with([](MoEConfig& c) { c.num_zero_experts = int64_t{1} << 40; }),
                 {"num_zero_experts"});
  // The bounds themselves pass (real models: ~1k experts, H ~16k, I ~64k).
  MoEConfig big = valid_config();
  big.num_experts = kMaxNumExperts;
  big.hidden_size = kMaxHiddenSize;
  big.intermediate_size = kMaxIntermediateSize;
  EXPECT_NO_THROW(big.validate());
}

TEST(MoEConfig, RejectsTopKAboveExperts) {
  expect_invalid(with([](MoEConfig& c) { c.top_k = 17; }), {"top_k", "16", "got 17"});
  expect_invalid(with([](MoEConfig& c) {
                   c.num_zero_experts = 2;
                   c.top_k = 19;
                 }),
                 {"top_k", "18", "got 19"});
  expect_invalid(with([](MoEConfig& c) { c.num_zero_experts = -1; }),
                 {"num_zero_experts", "got -1"});
}

TEST(MoEConfig, RejectsBadGrouping) {
  expect_invalid(with([](MoEConfig& c) { c.num_expert_group = 3; }, deepseek_v3_config()),
                 {"num_expert_group", "divisor", "16", "got 3"});
  expect_invalid(with([](MoEConfig& c) { c.topk_group = 5; }, deepseek_v3_config()),
                 {"topk_group", "4", "got 5"});
  expect_invalid(with([](MoEConfig& c) { c.topk_group = 0; }, deepseek_v3_config()),
                 {"topk_group", "got 0"});
  // 1 group of 4 experts kept, top_k 5.
  expect_invalid(with(
                     [](MoEConfig& c) {
                       c.topk_group = 1;
                       c.top_k = 5;
                     },
                     deepseek_v3_config()),
                 {"top_k", "topk_group", "4", "got 5"});
  // sum of top-2 needs two experts per group.
  expect_invalid(with(
                     [](MoEConfig& c) {
                       c.num_expert_group = 16;
                       c.topk_group = 4;
                     },
                     deepseek_v3_config()),
                 {"group_score", "sum_top2", "got 1"});
  expect_invalid(with([](MoEConfig& c) { c.num_zero_experts = 2; }, deepseek_v3_config()),
                 {"num_zero_experts", "grouped", "got 2"});
}

TEST(MoEConfig, RejectsBadScalingAndWeightOnInput) {
  expect_invalid(with([](MoEConfig& c) { c.routed_scaling_factor = 0.0f; }),
                 {"routed_scaling_factor", "got 0"});
  expect_invalid(with([](MoEConfig& c) { c.routed_scaling_factor = -1.0f; }),
                 {"routed_scaling_factor", "got -1"});
  expect_invalid(
      with([](MoEConfig& c) { c.routed_scaling_factor = std::numeric_limits<float>::quiet_NaN(); }),
      {"routed_scaling_factor", "nan"});
  expect_invalid(
      with([](MoEConfig& c) { c.routed_scaling_factor = std::numeric_limits<float>::infinity(); }),
      {"routed_scaling_factor", "inf"});
  expect_invalid(with([](MoEConfig& c) { c.apply_router_weight_on_input = true; }),
                 {"top_k", "apply_router_weight_on_input", "got 4"});
}

TEST(MoEConfig, ParallelLayouts) {
  // Accepted: EP (E not a multiple of ep_size), TP, EP x TP, DP + EP, DP.
  for (auto [ep, tp, dp] :
       {std::array<int, 3>{3, 1, 1}, {1, 4, 1}, {2, 2, 1}, {4, 1, 4}, {1, 1, 2}, {16, 1, 1}}) {
    MoEConfig c = valid_config();
    c.parallel.ep_size = ep;
    c.parallel.tp_size = tp;
    c.parallel.dp_size = dp;
    c.parallel.ep_rank = ep - 1;
    c.parallel.tp_rank = tp - 1;
    c.parallel.dp_rank = dp > 1 && ep > 1 ? ep - 1 : dp - 1;
    EXPECT_NO_THROW(c.validate()) << ep << " " << tp << " " << dp;
  }
  expect_invalid(with([](MoEConfig& c) { c.parallel.ep_size = 0; }), {"ep_size", "got 0"});
  expect_invalid(with([](MoEConfig& c) { c.parallel.ep_size = 17; }),
                 {"ep_size: expected <= num_experts (16), got 17"});
  expect_invalid(with([](MoEConfig& c) { c.parallel.tp_size = 49; }),
                 {"tp_size: expected <= intermediate_size (48), got 49"});
  expect_invalid(with([](MoEConfig& c) {
                   c.shared_intermediate_size = 2;
                   c.parallel.tp_size = 4;
                 }),
                 {"tp_size", "shared_intermediate_size (2)", "got 4"});
  expect_invalid(with([](MoEConfig& c) {
                   c.parallel.dp_size = 2;
                   c.parallel.ep_size = 4;
                 }),
                 {"ep_size", "dp_size = 2", "got 4"});
  expect_invalid(with([](MoEConfig& c) {
                   c.parallel.dp_size = 2;
                   c.parallel.ep_size = 2;
                   c.parallel.ep_rank = 1;
                 }),
                 {"ep_rank: expected dp_rank (0)", "got 1"});
  expect_invalid(with([](MoEConfig& c) { c.parallel.ep_rank = 1; }),
                 {"ep_rank: expected in [0, ep_size = 1), got 1"});
  expect_invalid(with([](MoEConfig& c) { c.parallel.tp_rank = -1; }), {"tp_rank", "got -1"});
}

TEST(MoEConfig, RejectsSimulatorAndHashParameters) {
  MoEConfig sim = valid_config();
  sim.routing_method = RoutingMethod::kSimulated;
  sim.simulated = SimulatedRouting::kZipf;
  EXPECT_NO_THROW(sim.validate());
  expect_invalid(with([](MoEConfig& c) { c.zipf_s = 0.0; }, sim), {"zipf_s", "got 0"});
  expect_invalid(with([](MoEConfig& c) { c.zipf_s = -1.5; }, sim), {"zipf_s", "got -1.5"});
  MoEConfig hash = valid_config();
  hash.routing_method = RoutingMethod::kHash;
  expect_invalid(hash, {"hash_vocab_size", "got 0"});
  hash.hash_vocab_size = 100;
  EXPECT_NO_THROW(hash.validate());
}

TEST(MoEConfig, RejectsSharedExpertInconsistencies) {
  expect_invalid(with([](MoEConfig& c) { c.shared_intermediate_size = -1; }),
                 {"shared_intermediate_size", "got -1"});
  expect_invalid(with([](MoEConfig& c) { c.has_shared_expert_gate = true; }),
                 {"has_shared_expert_gate", "shared"});
  expect_invalid(with([](MoEConfig& c) {
                   c.has_e_score_correction_bias = true;
                   c.routing_method = RoutingMethod::kLlama4;
                   c.top_k = 1;
                 }),
                 {"has_e_score_correction_bias", "llama4"});
}

// swiglu_alpha / swiglu_limit are read by swiglu_oai alone (gpt-oss, whose
// config.json sets them): with another activation a value other than the
// default, which would be ignored, is an error naming the field and the activation.
TEST(MoEConfig, SwigluParametersOnlyWithSwigluOai) {
  MoEConfig oai = valid_config();
  oai.activation = Activation::kSwigluOai;
  oai.swiglu_alpha = 1.5f;
  oai.swiglu_limit = 5.5f;
  EXPECT_NO_THROW(oai.validate());
  expect_invalid(
      with([](MoEConfig& c) { c.swiglu_alpha = 1.5f; }),
      {"swiglu_alpha", "swiglu_oai", "expected the default 1.702", "activation silu", "got 1.5"});
  expect_invalid(
      with([](MoEConfig& c) {
        c.activation = Activation::kGeluGlu;
        c.swiglu_limit = 5.5f;
      }),
      {"swiglu_limit", "swiglu_oai", "expected the default 7", "activation gelu", "got 5.5"});
  expect_invalid(with([](MoEConfig& c) { c.swiglu_limit = std::nanf(""); }),
                 {"swiglu_limit", "activation silu", "got nan"});
  // The defaults (what every config.json but gpt-oss's leaves them at) pass.
  for (Activation a : {Activation::kSiluGlu, Activation::kGeluGlu, Activation::kGeluTanhGlu})
    EXPECT_NO_THROW(with([a](MoEConfig& c) { c.activation = a; }).validate());
}

TEST(MoEConfig, NamesRoundTrip) {
  for (Activation a : {Activation::kSiluGlu, Activation::kGeluGlu, Activation::kGeluTanhGlu,
                       Activation::kSwigluOai})
    EXPECT_EQ(parse_activation(to_string(a)), a);
  for (ScoringFunc f : {ScoringFunc::kSoftmax, ScoringFunc::kSigmoid, ScoringFunc::kSqrtSoftplus})
    EXPECT_EQ(parse_scoring_func(to_string(f)), f);
  for (SimulatedRouting s :
       {SimulatedRouting::kUniform, SimulatedRouting::kZipf, SimulatedRouting::kAllToOne})
    EXPECT_EQ(parse_simulated_routing(to_string(s)), s);
  EXPECT_EQ(parse_activation("silu"), Activation::kSiluGlu);
  EXPECT_EQ(parse_activation("gelu"), Activation::kGeluGlu);
  EXPECT_EQ(parse_activation("gelu_pytorch_tanh"), Activation::kGeluTanhGlu);
  // The aliases: "swiglu" is SiLU-gated, not gpt-oss's clamped swiglu_oai; gelu_fast
  // as HF's hidden_act takes it (a trial read the old message's list otherwise).
  EXPECT_EQ(parse_activation("swiglu"), Activation::kSiluGlu);
  EXPECT_EQ(parse_activation("gelu_fast"), Activation::kGeluTanhGlu);
  EXPECT_EQ(parse_activation("swigluoai"), Activation::kSwigluOai);
  try {
    parse_activation("swiglu_gptoss");
    ADD_FAILURE() << "swiglu_gptoss accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("silu (also swiglu, silu_glu, swish)"), std::string::npos) << m;
    EXPECT_NE(m.find("swiglu_oai (gpt-oss's clamped SwiGLU"), std::string::npos) << m;
  }
  EXPECT_EQ(parse_scoring_func("Sigmoid"), ScoringFunc::kSigmoid);
  try {
    parse_activation("relu");
    ADD_FAILURE() << "relu accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("relu"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_scoring_func("tanh"), Error);
  EXPECT_THROW(parse_simulated_routing("gauss"), Error);
  EXPECT_STREQ(to_string(RoutingMethod::kGroupedTopK), "grouped_topk");
  EXPECT_STREQ(to_string(GroupScore::kSumTop2), "sum_top2");
}

TEST(MoEConfig, SummaryListsFields) {
  const std::string s = deepseek_v3_config().summary();
  for (const char* needle : {"num_experts:", "16", "top_k:", "grouped_topk", "sigmoid",
                             "num_expert_group:", "topk_group:", "sum_top2",
                             "routed_scaling_factor:", "2.5", "shared_intermediate_size:"})
    EXPECT_NE(s.find(needle), std::string::npos) << "summary lacks " << needle << ":\n" << s;
  EXPECT_GT(std::count(s.begin(), s.end(), '\n'), 15);
}

TEST(MoEConfigJson, RoundTripAndErrors) {
  MoEConfig c;
  c.num_experts = 16;
  c.top_k = 4;
  c.hidden_size = 128;
  c.intermediate_size = 48;
  c.routing_method = RoutingMethod::kGroupedTopK;
  c.scoring_func = ScoringFunc::kSigmoid;
  c.renormalize = true;
  c.num_expert_group = 4;
  c.topk_group = 2;
  c.has_e_score_correction_bias = true;
  c.routed_scaling_factor = 2.5f;
  c.activation = Activation::kSwigluOai;
  c.shared_intermediate_size = 96;
  c.simulation_seed = 1234567890123ull;
  const MoEConfig r = MoEConfig::from_json(c.to_json());
  EXPECT_EQ(r.to_json(), c.to_json());
  EXPECT_EQ(r.routing_method, RoutingMethod::kGroupedTopK);
  EXPECT_EQ(r.activation, Activation::kSwigluOai);
  EXPECT_FLOAT_EQ(r.routed_scaling_factor, 2.5f);
  EXPECT_EQ(r.simulation_seed, 1234567890123ull);
  EXPECT_NE(c.to_json().find("\"e_score_correction_bias\":true"), std::string::npos);
  // f32 members in their shortest form that reads back as the same float.
  EXPECT_NE(c.to_json().find("\"swiglu_alpha\":1.702,"), std::string::npos) << c.to_json();
  c.routed_scaling_factor = 0.1f;
  EXPECT_NE(c.to_json().find("\"routed_scaling_factor\":0.1,"), std::string::npos);
  EXPECT_EQ(MoEConfig::from_json(c.to_json()).routed_scaling_factor, 0.1f);
  // A subset keeps the defaults.
  const MoEConfig s = MoEConfig::from_json(R"({"num_experts": 8, "top_k": 2})");
  EXPECT_EQ(s.num_experts, 8);
  EXPECT_EQ(s.hidden_size, 0);
  auto expect_error = [](const std::string& json, const std::string& part) {
    try {
      MoEConfig::from_json(json, "cfg");
      ADD_FAILURE() << "no error for " << json;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error(R"({"num_expertz": 8})", "cfg: unknown field \"num_expertz\" (the fields: ");
  expect_error(R"({"top_k": "2"})", "cfg.top_k: expected an integer");
  expect_error(R"({"top_k": 2.5})", "cfg.top_k: expected an integer");
  expect_error(R"({"renormalize": 1})", "cfg.renormalize: expected a boolean");
  expect_error(R"({"activation": "relu"})", "cfg.activation: expected one of");
  expect_error(R"({"simulation_seed": -1})", "cfg.simulation_seed: expected a non-negative");
  // A number beyond f32 is named as given (it was converted first: "got inf").
  expect_error(R"({"routed_scaling_factor": 1e39})",
               "cfg.routed_scaling_factor: expected a number within the f32 range (|x| <= "
               "3.40282e+38), got 1e+39, beyond the f32 range");
  expect_error(R"({"swiglu_limit": -1e39})",
               "cfg.swiglu_limit: expected a number within the f32 range");
  expect_error("[1, 2]", "cfg: expected a JSON object");
  expect_error("{oops", "cfg: not valid JSON");
}

}  // namespace
}  // namespace fusedmoe
