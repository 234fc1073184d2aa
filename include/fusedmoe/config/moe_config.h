// fusedmoe: the validated description of one MoE layer.
//
// MoEConfig is the single source of truth every other part reads: routing,
// expert shapes, activation, shared experts, parallel layout. io/ builds one
// from a HF config.json (one per MoE layer); users may fill it by hand.
// validate() rejects configurations that cannot work, with a message naming
// the field, the expected and the actual value.
#pragma once

#include <cstdint>
#include <string>

namespace fusedmoe {

// How expert scores are computed from router logits.
enum class ScoringFunc : uint8_t {
  kSoftmax,       // softmax over all experts (Mixtral, Qwen, OLMoE)
  kSigmoid,       // sigmoid per expert (DeepSeek-V3, Llama-4)
  kSqrtSoftplus,  // sqrt(softplus(x)) per expert (vLLM's router factory)
};

// Which router the factory builds (create_router, see routing/router.h).
enum class RoutingMethod : uint8_t {
  kTopK,         // score, top-k over scores, optional renormalize
  kTopKSoftmax,  // top-k over raw logits, then softmax over the k (gpt-oss)
  kGroupedTopK,  // DeepSeek-V2/V3: groups, top groups, then top-k within them
  kLlama4,       // top-k logits, weight = sigmoid(logit) (Llama-4: k = 1, with
                 // apply_router_weight_on_input scaling the expert input)
  kHash,         // ids from a table indexed by token id
  kSimulated,    // benchmark routing: uniform / zipf / all-to-one, ignores logits
};

// How a group's score is formed in grouped top-k.
enum class GroupScore : uint8_t {
  kMax,      // DeepSeek-V2: max score in the group
  kSumTop2,  // DeepSeek-V3: sum of the two largest (biased) scores in the group
};

// Distribution of the routing simulator (RoutingMethod::kSimulated).
enum class SimulatedRouting : uint8_t {
  kUniform,   // k distinct experts uniformly at random per token
  kZipf,      // expert e drawn with probability ~ 1 / (e + 1)^zipf_s, distinct per token
  kAllToOne,  // every token picks experts 0..k-1 (expert 0 first): worst-case skew
};

// Gated activation between the two expert GEMMs. x = w13 output [.., 2I],
// gate = x[:, :I], up = x[:, I:] (the loaders de-interleave gpt-oss).
enum class Activation : uint8_t {
  kSiluGlu,      // silu(gate) * up                       (SwiGLU; "silu")
  kGeluGlu,      // gelu(gate) * up, erf form            ("gelu")
  kGeluTanhGlu,  // gelu_tanh(gate) * up                 ("gelu_pytorch_tanh")
  kSwigluOai,    // gpt-oss: g = min(gate, limit), u = clamp(up, -limit, limit),
                 //          (u + 1) * g * sigmoid(alpha * g)
};

const char* to_string(ScoringFunc v);
const char* to_string(RoutingMethod v);
const char* to_string(GroupScore v);
const char* to_string(SimulatedRouting v);
const char* to_string(Activation v);
// Parse the names printed by to_string (and HF spellings such as "silu",
// "gelu", "softmax", "sigmoid"), in any case; throw Error(kInvalidArgument)
// otherwise. Activations: silu (= swiglu, silu_glu, swish), gelu (= gelu_glu,
// geglu), gelu_pytorch_tanh (= gelu_tanh, gelu_new, gelu_fast, gelu_tanh_glu),
// swiglu_oai (gpt-oss's clamped SwiGLU; = swigluoai, swiglu_oai_clamped).
Activation parse_activation(const std::string& s);
ScoringFunc parse_scoring_func(const std::string& s);
SimulatedRouting parse_simulated_routing(const std::string& s);

// Which EP rank holds which expert (parallel/expert_map.h): blocks of
// consecutive experts (vLLM's default), or expert e on rank e % ep_size.
enum class ExpertPlacement : uint8_t { kContiguous, kRoundRobin };

// How one layer is spread over ranks (parallel/communicator.h, ParallelGroups):
// experts over ep_size ranks, each expert's intermediate size over tp_size
// ranks; dp_size > 1 = data-parallel token groups (ep_size 1 or dp_size).
// World size = (dp_size > 1 ? dp_size : ep_size) * tp_size.
struct ParallelConfig {
  int ep_size = 1, ep_rank = 0;
  int tp_size = 1, tp_rank = 0;
  int dp_size = 1, dp_rank = 0;
  ExpertPlacement expert_placement = ExpertPlacement::kContiguous;
  bool is_parallel() const { return ep_size > 1 || tp_size > 1 || dp_size > 1; }
};

// Upper bounds validate() puts on the shape fields: far above any released
// model (~1k experts, H ~16k, I ~64k), low enough that a corrupt or mistyped
// size (num_experts = 1e11) is an error naming the field, not an allocation
// failure.
inline constexpr int64_t kMaxNumExperts = int64_t{1} << 16;        // E, zero experts, top_k
inline constexpr int64_t kMaxHiddenSize = int64_t{1} << 20;        // H
inline constexpr int64_t kMaxIntermediateSize = int64_t{1} << 20;  // I, shared I

struct MoEConfig {
  // --- shapes ---
  int64_t num_experts = 0;        // E: routed experts (global)
  int64_t top_k = 0;              // k: experts per token
  int64_t hidden_size = 0;        // H
  int64_t intermediate_size = 0;  // I: per routed expert (w13 is [E, 2I, H], w2 [E, H, I])

  // --- routing ---
  RoutingMethod routing_method = RoutingMethod::kTopK;
  ScoringFunc scoring_func = ScoringFunc::kSoftmax;
  bool renormalize = false;      // divide the k weights by their sum (norm_topk_prob)
  int64_t num_expert_group = 1;  // grouped top-k: number of groups (1 = no grouping)
  int64_t topk_group = 1;        // grouped top-k: groups kept per token
  GroupScore group_score = GroupScore::kSumTop2;
  bool has_e_score_correction_bias = false;   // DeepSeek-V3: bias added for selection only
                                              // ([E] grouped top-k, [E + Z] kTopK)
  float routed_scaling_factor = 1.0f;         // multiplies topk_weights once, in the router
  bool apply_router_weight_on_input = false;  // Llama-4: scale the expert input, not output
  bool has_router_bias = false;               // gate linear has a bias [E] (gpt-oss)
  int64_t num_zero_experts = 0;  // extra logits [E, E+Z) that route to "no expert" (-1)
  SimulatedRouting simulated = SimulatedRouting::kUniform;  // kSimulated only
  double zipf_s = 1.0;           // kSimulated + kZipf: skew exponent (> 0)
  uint64_t simulation_seed = 0;  // kSimulated: RNG seed
  int64_t hash_vocab_size = 0;   // kHash: rows of the hash table [vocab, k]

  // --- experts ---
  Activation activation = Activation::kSiluGlu;
  float swiglu_alpha = 1.702f;   // kSwigluOai
  float swiglu_limit = 7.0f;     // kSwigluOai
  bool has_expert_bias = false;  // w13_bias [E, 2I], w2_bias [E, H] (gpt-oss)

  // --- shared experts (added to every token's output) ---
  int64_t shared_intermediate_size = 0;  // 0 = no shared expert; else the shared MLP's I
                                         // (DeepSeek: n_shared_experts * moe_intermediate_size)
  bool has_shared_expert_gate = false;   // Qwen2-MoE: out *= sigmoid(x . shared_expert_gate)

  ParallelConfig parallel;

  // Derived.
  bool has_shared_expert() const { return shared_intermediate_size > 0; }
  int64_t num_router_logits() const { return num_experts + num_zero_experts; }

  // Throws Error(kInvalidArgument) for configurations that cannot work:
  // non-positive sizes, sizes above the kMax* bounds, top_k > num_experts +
  // num_zero_experts, num_experts % num_expert_group != 0, topk_group >
  // num_expert_group, top_k > topk_group * experts per group, kSumTop2 with
  // fewer than 2 experts a group, zero experts with grouped top-k,
  // apply_router_weight_on_input with top_k != 1, a bias with a router other
  // than topk / grouped_topk, hash_vocab_size <= 0 for kHash, a shared expert
  // gate without a shared expert, parallel sizes < 1, ranks out of range,
  // ep_size > num_experts, tp_size > intermediate sizes, dp_size > 1 with
  // ep_size not 1 or dp_size (and ep_rank != dp_rank when experts are spread
  // over DP), routed_scaling_factor not finite and > 0, zipf_s <= 0 (kSimulated
  // + kZipf), swiglu_alpha / swiglu_limit other than their defaults with an
  // activation other than swiglu_oai (which alone reads them), ...
  void validate() const;

  // One line per field, for `fusedmoe inspect` and messages.
  std::string summary() const;

  // The layer's fields as one JSON object (parallel layout excluded), with the
  // keys `fusedmoe inspect --json` and the Python module use: the field names,
  // with "has_" dropped (e.g. "e_score_correction_bias": true) and enums as
  // their to_string() names. from_json() reads any subset of those keys (the
  // rest keep their defaults) and does not validate; it throws
  // Error(kInvalidArgument) naming `source` and the key for an unknown key, a
  // value of the wrong JSON type or an unknown enum name, and for malformed JSON.
  std::string to_json() const;
  static MoEConfig from_json(const std::string& json, const std::string& source = "config");
};

}  // namespace fusedmoe
