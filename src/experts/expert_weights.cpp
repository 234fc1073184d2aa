// fusedmoe: expert weight validation.
#include "fusedmoe/experts/expert_weights.h"

#include <cmath>
#include <string>

#include "fusedmoe/core/error.h"

namespace fusedmoe {

size_t ExpertWeights::nbytes() const {
  size_t n = w13.nbytes() + w2.nbytes();
  if (w13_bias) n += w13_bias->nbytes();
  if (w2_bias) n += w2_bias->nbytes();
  return n;
}

namespace {

bool is_weight_dtype(DType d) {
  return d == DType::kF32 || d == DType::kBF16;
}

// Shape, dtype (f32/bf16) and contiguity of one tensor, named "<what>.<name>".
void check_weight(const Tensor& t, const std::string& name, std::initializer_list<int64_t> shape) {
  const TensorView& v = t.view();
  if (v.data() == nullptr && v.ndim() == 0) {
    std::string s;
    for (int64_t d : shape) s += (s.empty() ? "" : ", ") + std::to_string(d);
    FUSEDMOE_THROW(kInvalidArgument, name, ": missing (expected f32/bf16 [", s, "])");
  }
  FUSEDMOE_CHECK(is_weight_dtype(v.dtype()), name, ": expected dtype f32 or bf16, got ",
                 dtype_name(v.dtype()), " ", v.shape_str());
  check_tensor(v, name.c_str(), v.dtype(), shape);
  FUSEDMOE_CHECK(v.is_contiguous(), name, ": expected a contiguous tensor, got ", v.str(),
                 " with non-row-major strides");
}

}  // namespace

void ExpertWeights::validate(int64_t num_experts, int64_t hidden_size, int64_t intermediate_size,
                             bool has_bias, const char* what) const {
  const std::string w(what);
  const int64_t E = num_experts, H = hidden_size, I = intermediate_size;
  check_weight(w13, w + ".w13", {E, 2 * I, H});
  check_weight(w2, w + ".w2", {E, H, I});
  FUSEDMOE_CHECK(w13.dtype() == w2.dtype(), w, ": w13 and w2 must have the same dtype, got ",
                 dtype_name(w13.dtype()), " and ", dtype_name(w2.dtype()));
  if (has_bias) {
    FUSEDMOE_CHECK(w13_bias.has_value(), w, ".w13_bias: missing (expected f32/bf16 [", E, ", ",
                   2 * I, "]; the config has expert biases)");
    FUSEDMOE_CHECK(w2_bias.has_value(), w, ".w2_bias: missing (expected f32/bf16 [", E, ", ", H,
                   "]; the config has expert biases)");
    check_weight(*w13_bias, w + ".w13_bias", {E, 2 * I});
    check_weight(*w2_bias, w + ".w2_bias", {E, H});
  } else {
    FUSEDMOE_CHECK(!w13_bias.has_value(), w,
                   ".w13_bias: given, but the config has no expert biases (has_expert_bias = "
                   "false)");
    FUSEDMOE_CHECK(!w2_bias.has_value(), w,
                   ".w2_bias: given, but the config has no expert biases (has_expert_bias = "
                   "false)");
  }
}

ExpertSizes expert_sizes_from_w2(const ExpertWeights& w, const char* w13_name,
                                 const char* w2_name) {
  const TensorView &w13 = w.w13.view(), &w2 = w.w2.view();
  FUSEDMOE_CHECK(w13.ndim() == 3, w13_name, ": expected a 3-d tensor [E, 2I, H], got ", w13.str());
  FUSEDMOE_CHECK(w2.ndim() == 3, w2_name, ": expected a 3-d tensor [E, H, I], got ", w2.str());
  FUSEDMOE_CHECK(
      (w13.size(0) == w2.size(0) && w13.size(1) == 2 * w2.size(2)) || w13.size(1) % 2 != 0,
      w13_name, " ", w13.str(), " and ", w2_name, " ", w2.str(),
      " disagree: expected w13 [E, 2I, H] and w2 [E, H, I] with the same E and I");
  return {w2.size(0), w2.size(2)};
}

void ActivationParams::validate() const {
  if (activation != Activation::kSwigluOai) {
    // The clamped SwiGLU's parameters mean nothing to another activation: a
    // value other than the default would be ignored, so it is an error (a
    // gpt-oss config.json sets them, with swiglu_oai; no other model's does).
    const ActivationParams d;
    FUSEDMOE_CHECK(swiglu_alpha == d.swiglu_alpha,
                   "swiglu_alpha: a parameter of activation swiglu_oai only, expected the default ",
                   d.swiglu_alpha, " with activation ", to_string(activation), ", got ",
                   swiglu_alpha);
    FUSEDMOE_CHECK(swiglu_limit == d.swiglu_limit,
                   "swiglu_limit: a parameter of activation swiglu_oai only, expected the default ",
                   d.swiglu_limit, " with activation ", to_string(activation), ", got ",
                   swiglu_limit);
    return;
  }
  FUSEDMOE_CHECK(std::isfinite(swiglu_limit) && swiglu_limit > 0.0f,
                 "swiglu_limit: expected a finite value > 0, got ", swiglu_limit);
  FUSEDMOE_CHECK(std::isfinite(swiglu_alpha), "swiglu_alpha: expected a finite value, got ",
                 swiglu_alpha);
}

void check_router_weight_on_input(bool apply_router_weight_on_input, const TensorView& topk_ids) {
  const int64_t k = topk_ids.ndim() == 2 ? topk_ids.size(1) : -1;
  FUSEDMOE_CHECK(!apply_router_weight_on_input || k == 1,
                 "apply_router_weight_on_input: supported with top_k = 1 only (one expert per "
                 "token, as Llama-4; vLLM and HF transformers refuse it otherwise), got top_k = ",
                 k, " (topk_ids ", topk_ids.str(), ")");
}

void check_topk_shapes_agree(const TensorView& topk_ids, const TensorView& topk_weights) {
  if (topk_ids.ndim() != 2 || topk_weights.ndim() != 2) return;
  if (topk_ids.size(0) != topk_weights.size(0) || topk_ids.size(1) == topk_weights.size(1)) return;
  FUSEDMOE_THROW(kInvalidArgument, "topk_ids ", topk_ids.shape_str(), " and topk_weights ",
                 topk_weights.shape_str(), " disagree: expected the same [T, top_k]");
}

}  // namespace fusedmoe
