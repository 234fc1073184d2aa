// fusedmoe: MoEConfig names, parsing, validation and summary.
#include "fusedmoe/config/moe_config.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

#include "core/json_error.h"
#include "fusedmoe/core/error.h"
#include "fusedmoe/experts/expert_weights.h"  // ActivationParams

namespace fusedmoe {

const char* to_string(ScoringFunc v) {
  switch (v) {
    case ScoringFunc::kSoftmax:
      return "softmax";
    case ScoringFunc::kSigmoid:
      return "sigmoid";
    case ScoringFunc::kSqrtSoftplus:
      return "sqrtsoftplus";
  }
  return "?";
}

const char* to_string(RoutingMethod v) {
  switch (v) {
    case RoutingMethod::kTopK:
      return "topk";
    case RoutingMethod::kTopKSoftmax:
      return "topk_softmax";
    case RoutingMethod::kGroupedTopK:
      return "grouped_topk";
    case RoutingMethod::kLlama4:
      return "llama4";
    case RoutingMethod::kHash:
      return "hash";
    case RoutingMethod::kSimulated:
      return "simulated";
  }
  return "?";
}

const char* to_string(GroupScore v) {
  switch (v) {
    case GroupScore::kMax:
      return "max";
    case GroupScore::kSumTop2:
      return "sum_top2";
  }
  return "?";
}

const char* to_string(SimulatedRouting v) {
  switch (v) {
    case SimulatedRouting::kUniform:
      return "uniform";
    case SimulatedRouting::kZipf:
      return "zipf";
    case SimulatedRouting::kAllToOne:
      return "all_to_one";
  }
  return "?";
}

const char* to_string(Activation v) {
  switch (v) {
    case Activation::kSiluGlu:
      return "silu";
    case Activation::kGeluGlu:
      return "gelu";
    case Activation::kGeluTanhGlu:
      return "gelu_pytorch_tanh";
    case Activation::kSwigluOai:
      return "swiglu_oai";
  }
  return "?";
}

namespace {

std::string lower(const std::string& s) {
  std::string r = s;
  std::transform(r.begin(), r.end(), r.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return r;
}

}  // namespace

Activation parse_activation(const std::string& s) {
  const std::string v = lower(s);
  if (v == "silu" || v == "swiglu" || v == "silu_glu" || v == "swish") return Activation::kSiluGlu;
  if (v == "gelu" || v == "gelu_glu" || v == "geglu") return Activation::kGeluGlu;
  if (v == "gelu_pytorch_tanh" || v == "gelu_tanh" || v == "gelu_new" || v == "gelu_fast" ||
      v == "gelu_tanh_glu")
    return Activation::kGeluTanhGlu;
  if (v == "swiglu_oai" || v == "swigluoai" || v == "swiglu_oai_clamped")
    return Activation::kSwigluOai;
  // Each name with its aliases: "swiglu" is SiLU-gated (SwiGLU, Shazeer 2020),
  // not gpt-oss's clamped variant, which only swiglu_oai names.
  FUSEDMOE_THROW(kInvalidArgument,
                 "activation: expected one of silu (also swiglu, silu_glu, swish), gelu (also "
                 "gelu_glu, geglu), gelu_pytorch_tanh (also gelu_tanh, gelu_new, gelu_fast, "
                 "gelu_tanh_glu), swiglu_oai (gpt-oss's clamped SwiGLU; also swigluoai, "
                 "swiglu_oai_clamped), in any case, got \"",
                 printable(s), "\"");
}

ScoringFunc parse_scoring_func(const std::string& s) {
  const std::string v = lower(s);
  if (v == "softmax") return ScoringFunc::kSoftmax;
  if (v == "sigmoid") return ScoringFunc::kSigmoid;
  if (v == "sqrtsoftplus" || v == "sqrt_softplus") return ScoringFunc::kSqrtSoftplus;
  FUSEDMOE_THROW(kInvalidArgument,
                 "scoring_func: expected one of softmax, sigmoid, sqrtsoftplus, got \"",
                 printable(s), "\"");
}

SimulatedRouting parse_simulated_routing(const std::string& s) {
  const std::string v = lower(s);
  if (v == "uniform" || v == "random") return SimulatedRouting::kUniform;
  if (v == "zipf") return SimulatedRouting::kZipf;
  if (v == "all_to_one" || v == "all-to-one" || v == "alltoone") return SimulatedRouting::kAllToOne;
  FUSEDMOE_THROW(kInvalidArgument,
                 "simulated routing: expected one of uniform, zipf, all_to_one, got \"",
                 printable(s), "\"");
}

void MoEConfig::validate() const {
  auto positive = [](int64_t v, const char* name, int64_t max) {
    FUSEDMOE_CHECK(v > 0, name, ": expected > 0, got ", v);
    FUSEDMOE_CHECK(v <= max, name, ": expected <= ", max, " (far above any released model), got ",
                   v);
  };
  // Enumerators out of range (a cast from an integer): named, not run as something else.
  auto known = [](const char* name, const char* value, int raw) {
    FUSEDMOE_CHECK(std::strcmp(value, "?") != 0, name, ": not a known value (", raw, ")");
  };
  known("routing_method", to_string(routing_method), static_cast<int>(routing_method));
  known("scoring_func", to_string(scoring_func), static_cast<int>(scoring_func));
  known("group_score", to_string(group_score), static_cast<int>(group_score));
  known("simulated", to_string(simulated), static_cast<int>(simulated));
  known("activation", to_string(activation), static_cast<int>(activation));
  FUSEDMOE_CHECK(parallel.expert_placement == ExpertPlacement::kContiguous ||
                     parallel.expert_placement == ExpertPlacement::kRoundRobin,
                 "parallel.expert_placement: not a known value (",
                 static_cast<int>(parallel.expert_placement), ")");
  positive(num_experts, "num_experts", kMaxNumExperts);
  positive(top_k, "top_k", kMaxNumExperts);
  positive(hidden_size, "hidden_size", kMaxHiddenSize);
  positive(intermediate_size, "intermediate_size", kMaxIntermediateSize);
  FUSEDMOE_CHECK(num_zero_experts >= 0 && num_zero_experts <= kMaxNumExperts,
                 "num_zero_experts: expected 0 to ", kMaxNumExperts, ", got ", num_zero_experts);
  FUSEDMOE_CHECK(top_k <= num_router_logits(),
                 "top_k: expected <= num_experts + num_zero_experts (", num_experts, " + ",
                 num_zero_experts, " = ", num_router_logits(), "), got ", top_k);

  // Grouping (always consistent, even when unused: num_expert_group = 1 means none).
  FUSEDMOE_CHECK(num_expert_group >= 1, "num_expert_group: expected >= 1, got ", num_expert_group);
  FUSEDMOE_CHECK(num_experts % num_expert_group == 0,
                 "num_expert_group: expected a divisor of num_experts (", num_experts, "), got ",
                 num_expert_group);
  FUSEDMOE_CHECK(topk_group >= 1 && topk_group <= num_expert_group,
                 "topk_group: expected in [1, num_expert_group = ", num_expert_group, "], got ",
                 topk_group);
  const bool grouped = routing_method == RoutingMethod::kGroupedTopK || num_expert_group > 1;
  const bool uses_grouped_router = grouped && routing_method != RoutingMethod::kSimulated &&
                                   routing_method != RoutingMethod::kHash &&
                                   routing_method != RoutingMethod::kLlama4;
  if (uses_grouped_router) {
    const int64_t per_group = num_experts / num_expert_group;
    FUSEDMOE_CHECK(top_k <= topk_group * per_group,
                   "top_k: expected <= topk_group * experts per group (", topk_group, " * ",
                   per_group, " = ", topk_group * per_group, ") for grouped top-k, got ", top_k);
    FUSEDMOE_CHECK(group_score != GroupScore::kSumTop2 || per_group >= 2,
                   "group_score: sum_top2 needs >= 2 experts per group (num_experts / "
                   "num_expert_group), got ",
                   per_group, " (use max)");
    FUSEDMOE_CHECK(num_zero_experts == 0,
                   "num_zero_experts: expected 0 with grouped top-k routing, got ",
                   num_zero_experts);
  }
  if (has_e_score_correction_bias) {
    FUSEDMOE_CHECK(uses_grouped_router || routing_method == RoutingMethod::kTopK,
                   "has_e_score_correction_bias: only used by the topk and grouped_topk routers, "
                   "got routing_method ",
                   to_string(routing_method));
  }

  FUSEDMOE_CHECK(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0.0f,
                 "routed_scaling_factor: expected a finite value > 0, got ", routed_scaling_factor);
  FUSEDMOE_CHECK(!apply_router_weight_on_input || top_k == 1,
                 "top_k: expected 1 with apply_router_weight_on_input, got ", top_k);

  if (routing_method == RoutingMethod::kSimulated && simulated == SimulatedRouting::kZipf) {
    FUSEDMOE_CHECK(std::isfinite(zipf_s) && zipf_s > 0.0,
                   "zipf_s: expected a finite value > 0 for zipf simulated routing, got ", zipf_s);
  }
  if (routing_method == RoutingMethod::kHash) {
    FUSEDMOE_CHECK(hash_vocab_size > 0, "hash_vocab_size: expected > 0 for hash routing, got ",
                   hash_vocab_size);
  }

  ActivationParams::from_config(*this).validate();

  FUSEDMOE_CHECK(shared_intermediate_size >= 0 && shared_intermediate_size <= kMaxIntermediateSize,
                 "shared_intermediate_size: expected 0 (no shared expert) to ",
                 kMaxIntermediateSize, ", got ", shared_intermediate_size);
  FUSEDMOE_CHECK(!has_shared_expert_gate || has_shared_expert(),
                 "has_shared_expert_gate: expected false without a shared expert "
                 "(shared_intermediate_size = 0), got true");

  auto sized = [](int size, int rank, const char* size_name, const char* rank_name) {
    FUSEDMOE_CHECK(size >= 1, size_name, ": expected >= 1, got ", size);
    FUSEDMOE_CHECK(rank >= 0 && rank < size, rank_name, ": expected in [0, ", size_name, " = ",
                   size, "), got ", rank);
  };
  sized(parallel.ep_size, parallel.ep_rank, "ep_size", "ep_rank");
  sized(parallel.tp_size, parallel.tp_rank, "tp_size", "tp_rank");
  sized(parallel.dp_size, parallel.dp_rank, "dp_size", "dp_rank");
  FUSEDMOE_CHECK(parallel.ep_size <= num_experts, "ep_size: expected <= num_experts (", num_experts,
                 "), got ", parallel.ep_size);
  FUSEDMOE_CHECK(parallel.tp_size <= intermediate_size, "tp_size: expected <= intermediate_size (",
                 intermediate_size, "), got ", parallel.tp_size);
  FUSEDMOE_CHECK(!has_shared_expert() || parallel.tp_size <= shared_intermediate_size,
                 "tp_size: expected <= shared_intermediate_size (", shared_intermediate_size,
                 "), got ", parallel.tp_size);
  FUSEDMOE_CHECK(
      parallel.dp_size == 1 || parallel.ep_size == 1 || parallel.ep_size == parallel.dp_size,
      "ep_size: with dp_size = ", parallel.dp_size,
      " expected 1 or dp_size (experts spread over the DP group), got ", parallel.ep_size);
  FUSEDMOE_CHECK(
      parallel.dp_size == 1 || parallel.ep_size == 1 || parallel.ep_rank == parallel.dp_rank,
      "ep_rank: expected dp_rank (", parallel.dp_rank,
      ") when experts are spread over the DP group, got ", parallel.ep_rank);
}

std::string MoEConfig::summary() const {
  std::ostringstream os;
  os << "num_experts:                  " << num_experts << "\n"
     << "top_k:                        " << top_k << "\n"
     << "hidden_size:                  " << hidden_size << "\n"
     << "intermediate_size:            " << intermediate_size << "\n"
     << "routing_method:               " << to_string(routing_method) << "\n"
     << "scoring_func:                 " << to_string(scoring_func) << "\n"
     << "renormalize:                  " << (renormalize ? "true" : "false") << "\n"
     << "num_expert_group:             " << num_expert_group << "\n"
     << "topk_group:                   " << topk_group << "\n"
     << "group_score:                  " << to_string(group_score) << "\n"
     << "e_score_correction_bias:      " << (has_e_score_correction_bias ? "yes" : "no") << "\n"
     << "routed_scaling_factor:        " << routed_scaling_factor << "\n"
     << "apply_router_weight_on_input: " << (apply_router_weight_on_input ? "true" : "false")
     << "\n"
     << "router_bias:                  " << (has_router_bias ? "yes" : "no") << "\n"
     << "num_zero_experts:             " << num_zero_experts << "\n";
  if (routing_method == RoutingMethod::kSimulated) {
    os << "simulated:                    " << to_string(simulated) << "\n";
    if (simulated == SimulatedRouting::kZipf)
      os << "zipf_s:                       " << zipf_s << "\n";
    os << "simulation_seed:              " << simulation_seed << "\n";
  }
  if (routing_method == RoutingMethod::kHash)
    os << "hash_vocab_size:              " << hash_vocab_size << "\n";
  os << "activation:                   " << to_string(activation) << "\n";
  if (activation == Activation::kSwigluOai)
    os << "swiglu_alpha:                 " << swiglu_alpha << "\n"
       << "swiglu_limit:                 " << swiglu_limit << "\n";
  os << "expert_bias:                  " << (has_expert_bias ? "yes" : "no") << "\n"
     << "shared_intermediate_size:     " << shared_intermediate_size << "\n"
     << "shared_expert_gate:           " << (has_shared_expert_gate ? "yes" : "no") << "\n"
     << "parallel:                     ep " << parallel.ep_rank << "/" << parallel.ep_size
     << ", tp " << parallel.tp_rank << "/" << parallel.tp_size << ", dp " << parallel.dp_rank << "/"
     << parallel.dp_size
     << (parallel.expert_placement == ExpertPlacement::kRoundRobin ? ", round-robin experts" : "")
     << "\n";
  return os.str();
}

// ---- JSON ----------------------------------------------------------------------

namespace {

using ojson = nlohmann::ordered_json;

// One table drives both directions: key, writer, reader.
struct JsonField {
  const char* key;
  void (*write)(const MoEConfig&, ojson&, const char*);
  void (*read)(MoEConfig&, const ojson&, const std::string&);
};

template <typename T>
T json_value(const ojson& v, const std::string& where) {
  if constexpr (std::is_same_v<T, bool>) {
    FUSEDMOE_CHECK(v.is_boolean(), where, ": expected a boolean, got ", v.dump());
  } else if constexpr (std::is_integral_v<T>) {
    FUSEDMOE_CHECK(v.is_number_integer(), where, ": expected an integer, got ", v.dump());
    if constexpr (std::is_unsigned_v<T>)
      FUSEDMOE_CHECK(v.is_number_unsigned(), where, ": expected a non-negative integer, got ",
                     v.dump());
  } else if constexpr (std::is_floating_point_v<T>) {
    FUSEDMOE_CHECK(v.is_number(), where, ": expected a number, got ", v.dump());
    // A finite number that T cannot hold: named as given (converted first, it
    // read "got inf").
    if constexpr (std::is_same_v<T, float>) {
      const double d = v.get<double>();
      FUSEDMOE_CHECK(
          !std::isfinite(d) || std::fabs(d) <= std::numeric_limits<float>::max(), where,
          ": expected a number within the f32 range (|x| <= ", std::numeric_limits<float>::max(),
          "), got ", v.dump(), ", beyond the f32 range");
    }
  } else {
    FUSEDMOE_CHECK(v.is_string(), where, ": expected a string, got ", v.dump());
  }
  return v.get<T>();
}

template <typename E, size_t N>
E json_enum(const ojson& v, const std::string& where, const E (&values)[N]) {
  const std::string s = json_value<std::string>(v, where);
  std::string known;
  for (E e : values) {
    if (s == to_string(e)) return e;
    known += std::string(known.empty() ? "" : ", ") + to_string(e);
  }
  FUSEDMOE_THROW(kInvalidArgument, where, ": expected one of ", known, ", got \"", printable(s),
                 "\"");
}

constexpr RoutingMethod kRoutingMethods[] = {
    RoutingMethod::kTopK,   RoutingMethod::kTopKSoftmax, RoutingMethod::kGroupedTopK,
    RoutingMethod::kLlama4, RoutingMethod::kHash,        RoutingMethod::kSimulated};
constexpr ScoringFunc kScoringFuncs[] = {ScoringFunc::kSoftmax, ScoringFunc::kSigmoid,
                                         ScoringFunc::kSqrtSoftplus};
constexpr GroupScore kGroupScores[] = {GroupScore::kMax, GroupScore::kSumTop2};
constexpr SimulatedRouting kSimulated[] = {SimulatedRouting::kUniform, SimulatedRouting::kZipf,
                                           SimulatedRouting::kAllToOne};
constexpr Activation kActivations[] = {Activation::kSiluGlu, Activation::kGeluGlu,
                                       Activation::kGeluTanhGlu, Activation::kSwigluOai};

// A float member is written as the double nearest its shortest decimal form
// that reads back as the same float (1.702f as 1.702, not 1.7020000219345093).
template <class T>
T json_number(T v) {
  return v;
}
double json_number(float v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest float round trip
  double d = v;
  std::from_chars(buf, r.ptr, d);  // as printed (no locale); inf and nan as they were
  return d;
}

#define FUSEDMOE_JSON_FIELD(key, member)                                                    \
  JsonField {                                                                               \
    key, [](const MoEConfig& c, ojson& j, const char* k) { j[k] = json_number(c.member); }, \
        [](MoEConfig& c, const ojson& v, const std::string& w) {                            \
          c.member = json_value<std::decay_t<decltype(c.member)>>(v, w);                    \
        }                                                                                   \
  }
#define FUSEDMOE_JSON_ENUM(key, member, values)                                           \
  JsonField {                                                                             \
    key, [](const MoEConfig& c, ojson& j, const char* k) { j[k] = to_string(c.member); }, \
        [](MoEConfig& c, const ojson& v, const std::string& w) {                          \
          c.member = json_enum(v, w, values);                                             \
        }                                                                                 \
  }

const JsonField kJsonFields[] = {
    FUSEDMOE_JSON_FIELD("num_experts", num_experts),
    FUSEDMOE_JSON_FIELD("top_k", top_k),
    FUSEDMOE_JSON_FIELD("hidden_size", hidden_size),
    FUSEDMOE_JSON_FIELD("intermediate_size", intermediate_size),
    FUSEDMOE_JSON_ENUM("routing_method", routing_method, kRoutingMethods),
    FUSEDMOE_JSON_ENUM("scoring_func", scoring_func, kScoringFuncs),
    FUSEDMOE_JSON_FIELD("renormalize", renormalize),
    FUSEDMOE_JSON_FIELD("num_expert_group", num_expert_group),
    FUSEDMOE_JSON_FIELD("topk_group", topk_group),
    FUSEDMOE_JSON_ENUM("group_score", group_score, kGroupScores),
    FUSEDMOE_JSON_FIELD("e_score_correction_bias", has_e_score_correction_bias),
    FUSEDMOE_JSON_FIELD("routed_scaling_factor", routed_scaling_factor),
    FUSEDMOE_JSON_FIELD("apply_router_weight_on_input", apply_router_weight_on_input),
    FUSEDMOE_JSON_FIELD("router_bias", has_router_bias),
    FUSEDMOE_JSON_FIELD("num_zero_experts", num_zero_experts),
    FUSEDMOE_JSON_ENUM("activation", activation, kActivations),
    FUSEDMOE_JSON_FIELD("swiglu_alpha", swiglu_alpha),
    FUSEDMOE_JSON_FIELD("swiglu_limit", swiglu_limit),
    FUSEDMOE_JSON_FIELD("expert_bias", has_expert_bias),
    FUSEDMOE_JSON_FIELD("shared_intermediate_size", shared_intermediate_size),
    FUSEDMOE_JSON_FIELD("shared_expert_gate", has_shared_expert_gate),
    FUSEDMOE_JSON_FIELD("hash_vocab_size", hash_vocab_size),
    FUSEDMOE_JSON_ENUM("simulated", simulated, kSimulated),
    FUSEDMOE_JSON_FIELD("zipf_s", zipf_s),
    FUSEDMOE_JSON_FIELD("simulation_seed", simulation_seed),
};

#undef FUSEDMOE_JSON_FIELD
#undef FUSEDMOE_JSON_ENUM

}  // namespace

std::string MoEConfig::to_json() const {
  ojson j = ojson::object();
  for (const JsonField& f : kJsonFields) f.write(*this, j, f.key);
  return j.dump();
}

MoEConfig MoEConfig::from_json(const std::string& json, const std::string& source) {
  ojson j;
  try {
    j = ojson::parse(json);
  } catch (const nlohmann::json::exception& e) {
    FUSEDMOE_THROW(kInvalidArgument, source, ": not valid JSON (", printable_json_error(e.what()),
                   ")");
  }
  FUSEDMOE_CHECK(j.is_object(), source, ": expected a JSON object, got ", j.type_name());
  MoEConfig c;
  for (const auto& [key, value] : j.items()) {
    const JsonField* field = nullptr;
    for (const JsonField& f : kJsonFields)
      if (key == f.key) field = &f;
    if (field == nullptr) {
      std::string known;
      for (const JsonField& f : kJsonFields)
        known += (known.empty() ? "" : ", ") + std::string(f.key);
      FUSEDMOE_THROW(kInvalidArgument, source, ": unknown field \"", printable(key),
                     "\" (the fields: ", known, ")");
    }
    field->read(c, value, source + "." + key);
  }
  return c;
}

}  // namespace fusedmoe
