// fusedmoe: routed experts over ranks (parallel/distributed_experts.h).
#include "fusedmoe/parallel/distributed_experts.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace fusedmoe {

namespace {

enum Slot : int {
  kGatherHidden,
  kGatherIds,
  kGatherWeights,
  kOwnHidden,
  kOwnIds,
  kOwnWeights,
  kPartial,
  kReduced,
  kExpertOutput,
  kTpBuffer,
};

// Copies a [rows, cols] view (any row stride) to contiguous memory.
void pack_rows(const TensorView& v, int64_t rows, int64_t cols, size_t elem, void* dst) {
  if (rows == 0) return;
  const int64_t ld = v.stride(0);
  const char* s = static_cast<const char*>(v.data());
  char* d = static_cast<char*>(dst);
  if (ld == cols) {
    std::memcpy(d, s, rows * cols * elem);
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(d + r * cols * elem, s + r * ld * elem, cols * elem);
}

}  // namespace

ExpertMap make_expert_map(const MoEConfig& config, const ParallelConfig& parallel,
                          ExpertPlacement placement) {
  return ExpertMap(config.num_experts, parallel.ep_size, placement);
}

DistributedExperts::DistributedExperts(const MoEConfig& config, ParallelGroups groups,
                                       ExpertWeights local_weights, DistributedOptions options)
    : config_(config),
      groups_(std::move(groups)),
      map_(make_expert_map(config, groups_.config, options.placement)),
      weights_(std::move(local_weights)),
      options_(options),
      local_(make_cpu_modular_kernel(options.pool)),
      own_ws_(std::make_unique<Workspace>()) {
  const ParallelConfig& pc = groups_.config;
  FUSEDMOE_CHECK(groups_.ep && groups_.tp, "DistributedExperts: groups have no communicators");
  const int64_t E_local = map_.num_local_experts(pc.ep_rank);
  const auto [i0, It] = tp_slice(config.intermediate_size, pc.tp_size, pc.tp_rank);
  (void)i0;
  weights_.validate(E_local, config.hidden_size, It, config.has_expert_bias, "local experts");
  global_to_local_ = map_.global_to_local(pc.ep_rank);
  FUSEDMOE_CHECK(
      options.dispatch_dtype == DispatchDType::kAuto || (pc.ep_size > 1 && pc.dp_size == 1),
      "dispatch_dtype: expected auto with ep_size ", pc.ep_size, " and dp_size ", pc.dp_size,
      " (the expert-parallel dispatch payload is taken with ep_size > 1 "
      "and dp_size 1 only; data parallelism gathers the hidden states in f32), got ",
      to_string(options.dispatch_dtype));
  if (pc.ep_size > 1 && pc.dp_size == 1)
    ep_ =
        std::make_unique<EpPrepareFinalize>(groups_.ep, map_, options.dispatch_dtype, options.pool);
  // What the exchanges rely on: the same layer shape, layout, placement and
  // payload on every rank (a rank built differently would send rows of other
  // sizes or to the wrong experts).
  if (groups_.world && groups_.world->size() > 1)
    check_same_on_all_ranks(*groups_.world,
                            {{"num_experts", std::to_string(config.num_experts)},
                             {"hidden_size", std::to_string(config.hidden_size)},
                             {"intermediate_size", std::to_string(config.intermediate_size)},
                             {"top_k", std::to_string(config.top_k)},
                             {"has_expert_bias", config.has_expert_bias ? "true" : "false"},
                             {"ep_size", std::to_string(pc.ep_size)},
                             {"tp_size", std::to_string(pc.tp_size)},
                             {"dp_size", std::to_string(pc.dp_size)},
                             {"placement", to_string(options.placement)},
                             {"dispatch_dtype", to_string(options.dispatch_dtype)}},
                            "DistributedExperts");
}

DistributedExperts::~DistributedExperts() = default;

void DistributedExperts::forward(const TensorView& hidden_states, const TensorView& topk_ids,
                                 const TensorView& topk_weights, const ExpertsParams& params,
                                 bool apply_router_weight_on_input, const TensorView& output,
                                 Workspace& ws) {
  const int64_t H = config_.hidden_size, E = config_.num_experts;
  check_tensor(hidden_states, "hidden_states", DType::kF32, {-1, H});
  const int64_t T = hidden_states.size(0);
  check_tensor(topk_ids, "topk_ids", DType::kI32, {T, -1});
  const int64_t k = topk_ids.size(1);
  FUSEDMOE_CHECK(k >= 1, "topk_ids: expected [T, k] with k >= 1 (top_k), got ",
                 topk_ids.shape_str());
  check_topk_shapes_agree(topk_ids, topk_weights);
  check_tensor(topk_weights, "topk_weights", DType::kF32, {T, k});
  check_router_weight_on_input(apply_router_weight_on_input, topk_ids);
  params.activation.validate();
  check_tensor(output, "output", DType::kF32, {T, H});
  FUSEDMOE_CHECK(params.compute_dtype == DType::kF32 || params.compute_dtype == DType::kBF16,
                 "compute_dtype: expected f32 or bf16, got ", dtype_name(params.compute_dtype));
  const int32_t* ids = topk_ids.data_as<const int32_t>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t id = ids[t * topk_ids.stride(0) + j];
      FUSEDMOE_CHECK(id >= -1 && id < E, "topk_ids: expected values in [-1, ", E, "), got ", id,
                     " at [", t, ", ", j, "]");
    }
  const ParallelConfig& pc = groups_.config;
  Workspace& own = *own_ws_;
  const int64_t E_local = weights_.num_experts();

  // The local experts on rows x [n, H] with local ids [n, k]: out [n, H].
  auto run_local = [&](const TensorView& x, const TensorView& lids, const TensorView& w,
                       const TensorView& out) {
    const int64_t n = x.size(0);
    if (n == 0) return;
    PrepareResult pr = local_->prepare_finalize().prepare(
        x, lids, w, E_local, apply_router_weight_on_input, params.compute_dtype, ws);
    const int64_t M = pr.permuted.size(0);
    auto* eo = static_cast<float*>(own.get(kExpertOutput, std::max<int64_t>(M * H, 1) * 4));
    const TensorView expert_output(eo, DType::kF32, {M, H});
    local_->experts().apply(pr, weights_, params, expert_output, ws);
    local_->prepare_finalize().finalize(expert_output, pr, w, apply_router_weight_on_input, out);
  };
  // Global ids -> local ids (-1 for other ranks' experts), contiguous [n, k].
  auto to_local = [&](const int32_t* g, int64_t ldg, int64_t n, int32_t* l) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int32_t id = g[t * ldg + j];
        l[t * k + j] = id >= 0 ? global_to_local_[id] : -1;
      }
  };

  if (ep_) {
    // ---- EP all-to-all ----
    PrepareResult pr = ep_->prepare(hidden_states, topk_ids, topk_weights, E,
                                    apply_router_weight_on_input, params.compute_dtype, ws);
    const int64_t M = pr.permuted.size(0);
    auto* eo = static_cast<float*>(own.get(kExpertOutput, std::max<int64_t>(M * H, 1) * 4));
    const TensorView expert_output(eo, DType::kF32, {M, H});
    if (M > 0) local_->experts().apply(pr, weights_, params, expert_output, ws);
    ep_->finalize(expert_output, pr, topk_weights, apply_router_weight_on_input, output);
    return;
  }

  if (pc.dp_size > 1 && pc.ep_size > 1) {
    // ---- naive DP + EP: all-gather, local experts on everything, reduce-scatter ----
    Communicator& dp = *groups_.ep;
    const int P = dp.size();
    const std::vector<int64_t> counts = dp.all_gather_int64(T);
    std::vector<int64_t> off(P + 1, 0);
    for (int p = 0; p < P; ++p) off[p + 1] = off[p] + counts[p];
    const int64_t Ta = off[P];
    auto* gx = static_cast<float*>(own.get(kGatherHidden, std::max<int64_t>(Ta * H, 1) * 4));
    auto* gi = static_cast<int32_t*>(own.get(kGatherIds, std::max<int64_t>(Ta * k, 1) * 4));
    auto* gw = static_cast<float*>(own.get(kGatherWeights, std::max<int64_t>(Ta * k, 1) * 4));
    auto* ox = static_cast<float*>(own.get(kOwnHidden, std::max<int64_t>(T * H, 1) * 4));
    auto* oi = static_cast<int32_t*>(own.get(kOwnIds, std::max<int64_t>(T * k, 1) * 4));
    auto* ow = static_cast<float*>(own.get(kOwnWeights, std::max<int64_t>(T * k, 1) * 4));
    pack_rows(hidden_states, T, H, 4, ox);
    pack_rows(topk_ids, T, k, 4, oi);
    pack_rows(topk_weights, T, k, 4, ow);
    auto gather = [&](const void* src, void* dst, int64_t row_bytes) {
      std::vector<int64_t> c(P), d(P);
      for (int p = 0; p < P; ++p) {
        c[p] = counts[p] * row_bytes;
        d[p] = off[p] * row_bytes;
      }
      dp.all_gather_v(src, T * row_bytes, dst, c, d);
    };
    gather(ox, gx, H * 4);
    gather(oi, gi, k * 4);  // global ids; each rank maps them to its own local ids
    gather(ow, gw, k * 4);
    to_local(gi, k, Ta, gi);
    auto* partial = static_cast<float*>(own.get(kPartial, std::max<int64_t>(Ta * H, 1) * 4));
    if (Ta > 0) {
      const TensorView part(partial, DType::kF32, {Ta, H});
      run_local(TensorView(gx, DType::kF32, {Ta, H}), TensorView(gi, DType::kI32, {Ta, k}),
                TensorView(gw, DType::kF32, {Ta, k}), part);
    }
    std::vector<int64_t> rc(P);
    for (int p = 0; p < P; ++p) rc[p] = counts[p] * H;
    float* out = output.data_as<float>();
    const bool direct = T == 0 || output.stride(0) == H;
    auto* red = direct ? out : static_cast<float*>(own.get(kReduced, T * H * 4));
    dp.reduce_scatter_sum(partial, red, rc);
    if (!direct)
      for (int64_t t = 0; t < T; ++t) std::memcpy(out + t * output.stride(0), red + t * H, H * 4);
    return;
  }

  // ---- experts replicated over the DP group (or one rank): local only ----
  if (T == 0) return;
  auto* li = static_cast<int32_t*>(own.get(kOwnIds, T * k * 4));
  to_local(ids, topk_ids.stride(0), T, li);
  run_local(hidden_states, TensorView(li, DType::kI32, {T, k}), topk_weights, output);
}

void DistributedExperts::reduce_tp(const TensorView& output) {
  if (groups_.config.tp_size == 1) return;
  const int64_t H = config_.hidden_size;
  check_tensor(output, "output", DType::kF32, {-1, H});
  const int64_t T = output.size(0);
  if (T == 0) return;  // TP ranks hold the same tokens: all skip together
  float* out = output.data_as<float>();
  const int64_t ld = output.stride(0);
  if (ld == H) {
    groups_.tp->all_reduce_sum(out, T * H);
    return;
  }
  auto* buf = static_cast<float*>(own_ws_->get(kTpBuffer, T * H * 4));
  for (int64_t t = 0; t < T; ++t) std::memcpy(buf + t * H, out + t * ld, H * 4);
  groups_.tp->all_reduce_sum(buf, T * H);
  for (int64_t t = 0; t < T; ++t) std::memcpy(out + t * ld, buf + t * H, H * 4);
}

}  // namespace fusedmoe
