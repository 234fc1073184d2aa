// fusedmoe: router boundary checks and the create_router factory.
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "fusedmoe/core/thread_pool.h"
#include "routing/router_impl.h"

namespace fusedmoe {
namespace routing {
namespace {

constexpr int64_t kGrain = 64;  // tokens per parallel chunk (at least)

void atomic_min(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load(std::memory_order_relaxed);
  while (v < cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

}  // namespace

void RouterBase::select_experts(const TensorView& router_logits, const TensorView& topk_ids,
                                const TensorView& topk_weights, const TensorView* token_ids,
                                ThreadPool* given_pool) const {
  const int64_t cols = config_.num_router_logits();
  const int64_t k = config_.top_k;
  const bool have_logits = router_logits.ndim() != 0;
  int64_t T;
  if (uses_logits_ || have_logits) {
    check_tensor(router_logits, "router_logits", DType::kF32, {-1, cols});
    T = router_logits.size(0);
  } else {
    check_tensor(topk_ids, "topk_ids", DType::kI32, {-1, k});
    T = topk_ids.size(0);
  }
  check_tensor(topk_ids, "topk_ids", DType::kI32, {T, k});
  check_tensor(topk_weights, "topk_weights", DType::kF32, {T, k});
  RouteArgs args;
  if (uses_token_ids_) {
    // A default TensorView is "none"; a 0-d array given is named by check_tensor.
    FUSEDMOE_CHECK(token_ids != nullptr && (token_ids->ndim() != 0 || token_ids->data() != nullptr),
                   "token_ids: expected i32 [", T, "] (required by ", name(),
                   " routing), got none");
    check_tensor(*token_ids, "token_ids", DType::kI32, {T}, false);
    args.token_ids = token_ids->data_as<const int32_t>();
    args.token_ids_stride = T > 0 ? token_ids->stride(0) : 1;
  }
  if (T == 0) return;
  if (uses_logits_) {
    args.logits = router_logits.data_as<const float>();
    args.logits_ld = router_logits.stride(0);
  }
  args.ids = topk_ids.data_as<int32_t>();
  args.ids_ld = topk_ids.stride(0);
  args.weights = topk_weights.data_as<float>();
  args.weights_ld = topk_weights.stride(0);

  ThreadPool& pool = given_pool ? *given_pool : ThreadPool::global();
  // Check everything first so that nothing is written when the input is bad.
  if (uses_logits_) {
    std::atomic<int64_t> first_nan{std::numeric_limits<int64_t>::max()};
    pool.parallel_for(
        T,
        [&](int64_t begin, int64_t end, int) {
          for (int64_t t = begin; t < end; ++t) {
            const float* row = args.logits + t * args.logits_ld;
            bool any = false;
            for (int64_t c = 0; c < cols; ++c) any |= std::isnan(row[c]);
            if (!any) continue;
            for (int64_t c = 0; c < cols; ++c)
              if (std::isnan(row[c])) {
                atomic_min(first_nan, t * cols + c);
                return;
              }
          }
        },
        kGrain * 4);
    const int64_t bad = first_nan.load();
    FUSEDMOE_CHECK(bad == std::numeric_limits<int64_t>::max(),
                   "router_logits: expected no NaN, got NaN at token ", bad / cols, ", expert ",
                   bad % cols, " (of ", T, " tokens x ", cols, " logits)");
  }
  if (uses_token_ids_) {
    const int64_t vocab = config_.hash_vocab_size;
    for (int64_t t = 0; t < T; ++t) {
      const int32_t id = args.token_ids[t * args.token_ids_stride];
      FUSEDMOE_CHECK(id >= 0 && id < vocab,
                     "token_ids: expected values in [0, hash_vocab_size = ", vocab, "), got ", id,
                     " at token ", t);
    }
  }
  pool.parallel_for(
      T, [&](int64_t begin, int64_t end, int) { route(args, begin, end); }, kGrain);
}

namespace {

std::vector<double> read_bias(const MoEConfig& config, const RouterParams& params,
                              int64_t expected_len) {
  if (!config.has_e_score_correction_bias) {
    FUSEDMOE_CHECK(!params.e_score_correction_bias.has_value(),
                   "e_score_correction_bias: given, but config.has_e_score_correction_bias is "
                   "false (it would be ignored)");
    return {};
  }
  FUSEDMOE_CHECK(params.e_score_correction_bias.has_value(),
                 "e_score_correction_bias: expected f32 or bf16 [", expected_len,
                 "] (config.has_e_score_correction_bias is true), got none");
  const Tensor& b = *params.e_score_correction_bias;
  const DType dt = b.dtype() == DType::kBF16 ? DType::kBF16 : DType::kF32;
  check_tensor(b, "e_score_correction_bias", dt, {expected_len}, false);
  Tensor f = to_f32(b);  // contiguous f32 copy
  std::vector<double> out(static_cast<size_t>(expected_len));
  const float* p = f.data_as<const float>();
  for (int64_t i = 0; i < expected_len; ++i) {
    FUSEDMOE_CHECK(std::isfinite(p[i]), "e_score_correction_bias: expected finite values, got ",
                   p[i], " at expert ", i);
    out[static_cast<size_t>(i)] = p[i];
  }
  return out;
}

std::vector<int32_t> read_hash_table(const MoEConfig& config, const RouterParams& params) {
  const int64_t vocab = config.hash_vocab_size, k = config.top_k;
  const int64_t cols = config.num_router_logits();
  FUSEDMOE_CHECK(params.hash_table.has_value(), "hash_table: expected i32 [", vocab, ", ", k,
                 "] for hash routing, got none");
  const Tensor& tab = *params.hash_table;
  check_tensor(tab, "hash_table", DType::kI32, {vocab, k}, false);
  std::vector<int32_t> out(static_cast<size_t>(vocab * k));
  const TensorView& v = tab.view();
  for (int64_t r = 0; r < vocab; ++r)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t id = v.data_as<const int32_t>()[r * v.stride(0) + j * v.stride(1)];
      FUSEDMOE_CHECK(id >= 0 && id < cols, "hash_table: expected expert ids in [0, ", cols,
                     "), got ", id, " at [", r, ", ", j, "]");
      for (int64_t i = 0; i < j; ++i)
        FUSEDMOE_CHECK(out[static_cast<size_t>(r * k + i)] != id,
                       "hash_table: expected distinct expert ids per row, got ", id,
                       " twice in row ", r);
      out[static_cast<size_t>(r * k + j)] = id;
    }
  return out;
}

}  // namespace
}  // namespace routing

std::unique_ptr<Router> create_router(const MoEConfig& config, const RouterParams& params) {
  using namespace routing;
  config.validate();
  const RoutingMethod m = config.routing_method;
  const bool uses_bias = m == RoutingMethod::kTopK || m == RoutingMethod::kGroupedTopK ||
                         (m == RoutingMethod::kTopKSoftmax && config.num_expert_group > 1);
  FUSEDMOE_CHECK(uses_bias || !params.e_score_correction_bias.has_value(),
                 "e_score_correction_bias: given, but the ", to_string(m),
                 " router does not use one (it would be ignored)");
  if (m == RoutingMethod::kSimulated) return make_simulated_router(config);
  if (m == RoutingMethod::kHash) return make_hash_router(config, read_hash_table(config, params));
  if (m == RoutingMethod::kLlama4) return make_llama4_router(config);
  if (m == RoutingMethod::kGroupedTopK || config.num_expert_group > 1)
    return make_grouped_topk_router(config, read_bias(config, params, config.num_experts));
  if (m == RoutingMethod::kTopKSoftmax) return make_topk_softmax_router(config);
  return make_topk_router(config, read_bias(config, params, config.num_router_logits()));
}

}  // namespace fusedmoe
