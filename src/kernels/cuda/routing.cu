// fusedmoe CUDA: routing kernels — router logits to (topk_ids, topk_weights).
//
// One warp per token. Lane l holds logit columns c = l + 32 i (coalesced loads).
// Selection is k rounds of a warp arg-max over (value desc, id asc), the tie
// rule of the CPU routers (routing/router.h); scores and weights are computed
// in double like the CPU routers, so ids match exactly on tie-free inputs and
// weights agree to f32 rounding. Variants (same formulas as src/routing/):
//   kTopK        scoring (softmax/sigmoid/sqrtsoftplus) [+ selection bias],
//                renormalize, * routed_scaling_factor    (Mixtral, Qwen, OLMoE)
//   kTopKSoftmax top-k of logits, softmax over the k     (gpt-oss)
//   kGroupedTopK groups by max / sum of top-2 of score + bias, topk_group best
//                groups, top-k inside them                (DeepSeek-V2/V3)
//   kLlama4      top-k of logits, sigmoid weight          (Llama-4)
//   kHash        ids from a table indexed by token id
#include <cmath>
#include <limits>

#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/pdl.cuh"

namespace fusedmoe::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kNoId = 0x7fffffff;
constexpr unsigned kFull = 0xffffffffu;

enum class Variant : int { kTopK, kTopKBias, kTopKSoftmax, kGrouped, kLlama4 };

struct RouteParams {
  Variant variant;
  ScoringFunc scoring;
  bool renormalize;
  int cols;     // E + Z
  int experts;  // E
  int top_k;
  int groups, per_group, topk_group;
  bool sum_top2;
  double scale;
};

__device__ __forceinline__ double sigmoid_d(double x) {
  return 1.0 / (1.0 + exp(-x));
}
__device__ __forceinline__ double sqrt_softplus_d(double x) {
  return sqrt(fmax(x, 0.0) + log1p(exp(-fabs(x))));
}
__device__ __forceinline__ double rel_exp_d(double x, double m) {
  if (isinf(m)) return x == m ? 1.0 : 0.0;
  return exp(x - m);
}
__device__ __forceinline__ double elementwise_d(ScoringFunc f, double x) {
  return f == ScoringFunc::kSigmoid ? sigmoid_d(x) : sqrt_softplus_d(x);
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ double warp_max(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(kFull, v, o));
  return v;
}
// (v, id) -> the warp's best: larger value, then lower id; kNoId never wins.
__device__ __forceinline__ void warp_argmax(double& v, int& id) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const double ov = __shfl_xor_sync(kFull, v, o);
    const int oid = __shfl_xor_sync(kFull, id, o);
    const bool take = oid != kNoId && (id == kNoId || ov > v || (ov == v && oid < id));
    if (take) {
      v = ov;
      id = oid;
    }
  }
}

template <int kPerLane>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    route_topk_kernel(RouteParams p, const float* __restrict__ logits, int64_t ld,
                      const float* __restrict__ bias, int32_t* __restrict__ topk_ids,
                      float* __restrict__ topk_weights, int64_t num_tokens,
                      const int32_t* __restrict__ num_valid, int32_t* __restrict__ nan_token) {
  pdl_wait();  // logits from the router GEMM; ids and weights read by the kernels before
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= num_tokens) return;
  if (num_valid != nullptr && t >= *num_valid) {  // padding row: routed nowhere
    if (lane < p.top_k) {
      topk_ids[t * p.top_k + lane] = -1;
      topk_weights[t * p.top_k + lane] = 0.0f;
    }
    return;
  }
  const float* row = logits + t * ld;

  double x[kPerLane];      // raw logits (double)
  double score[kPerLane];  // what the weights are taken from (variants with scores)
  double sel[kPerLane];    // what is selected on
  uint32_t live = 0;       // bit i: column lane + 32 i exists and may still be chosen
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + 32 * i;
    x[i] = c < p.cols ? static_cast<double>(row[c]) : 0.0;
    if (c < p.cols) live |= 1u << i;
  }
  if (nan_token != nullptr) {  // the first token with a NaN logit, for check_errors()
    bool has_nan = false;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) has_nan |= isnan(x[i]);
    if (__any_sync(kFull, has_nan) && lane == 0) atomicMin(nan_token, static_cast<int32_t>(t));
  }

  // ---- scores and selection values ----
  double row_max = -INFINITY, row_denom = 1.0;
  const bool need_scores = p.variant == Variant::kTopKBias || p.variant == Variant::kGrouped;
  if (need_scores && p.scoring == ScoringFunc::kSoftmax) {
    double m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (live >> i & 1u) m = fmax(m, x[i]);
    m = warp_max(m);
    double d = 0.0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (live >> i & 1u) d += rel_exp_d(x[i], m);
    d = warp_sum(d);
    row_max = m;
    row_denom = d;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + 32 * i;
    if (need_scores) {
      score[i] = p.scoring == ScoringFunc::kSoftmax ? rel_exp_d(x[i], row_max) / row_denom
                                                    : elementwise_d(p.scoring, x[i]);
      sel[i] = score[i] + ((bias != nullptr && c < p.cols) ? static_cast<double>(bias[c]) : 0.0);
    } else {
      score[i] = 0.0;
      sel[i] = x[i];
    }
  }

  // ---- grouped top-k: keep the topk_group best groups ----
  if (p.variant == Variant::kGrouped) {
    double my_group = -INFINITY;  // lane g holds group g's score (groups <= 32)
    for (int g = 0; g < p.groups; ++g) {
      double m1 = -INFINITY, m2 = -INFINITY;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + 32 * i;
        if ((live >> i & 1u) && c / p.per_group == g) {
          const double v = sel[i];
          if (v > m1) {
            m2 = m1;
            m1 = v;
          } else if (v > m2) {
            m2 = v;
          }
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const double o1 = __shfl_xor_sync(kFull, m1, o);
        const double o2 = __shfl_xor_sync(kFull, m2, o);
        const double hi = fmax(m1, o1), lo = fmin(m1, o1);
        m2 = fmax(lo, fmax(m2, o2));
        m1 = hi;
      }
      const double gs = p.sum_top2 ? m1 + m2 : m1;
      if (lane == g) my_group = gs;
    }
    uint32_t kept = 0;
    double gv = lane < p.groups ? my_group : -INFINITY;
    int gid = lane < p.groups ? lane : kNoId;
    for (int r = 0; r < p.topk_group; ++r) {
      double v = gv;
      int id = gid;
      warp_argmax(v, id);
      kept |= 1u << id;
      if (lane == id) gid = kNoId;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      if ((live >> i & 1u) && !(kept >> (c / p.per_group) & 1u)) live &= ~(1u << i);
    }
  }

  // ---- k rounds of arg-max; lane j keeps the j-th pick ----
  int my_id = -1;
  double my_x = 0.0, my_score = 0.0;
  double top_value = 0.0;
  for (int j = 0; j < p.top_k; ++j) {
    double v = -INFINITY;
    int id = kNoId;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + 32 * i;
      if ((live >> i & 1u) && (id == kNoId || sel[i] > v)) {
        v = sel[i];
        id = c;
      }
    }
    warp_argmax(v, id);
    if (j == 0) top_value = v;
    // The owner lane removes the pick and hands its x / score to lane j.
    double px = 0.0, ps = 0.0;
    const int owner = id & 31, slot = id >> 5;
    if (lane == owner) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (i == slot) {
          px = x[i];
          ps = score[i];
          live &= ~(1u << i);
        }
    }
    px = __shfl_sync(kFull, px, owner);
    ps = __shfl_sync(kFull, ps, owner);
    if (lane == j) {
      my_id = id;
      my_x = px;
      my_score = ps;
    }
  }

  // ---- weights ----
  const bool in_k = lane < p.top_k;
  double w = 0.0;
  switch (p.variant) {
    case Variant::kTopK: {
      if (p.scoring == ScoringFunc::kSoftmax) {
        const double m = top_value;
        double denom;
        if (p.renormalize) {
          denom = warp_sum(in_k ? rel_exp_d(my_x, m) : 0.0);
        } else {
          double d = 0.0;
#pragma unroll
          for (int i = 0; i < kPerLane; ++i)
            if (lane + 32 * i < p.cols) d += rel_exp_d(x[i], m);
          denom = warp_sum(d);
        }
        w = rel_exp_d(my_x, m) / denom;
      } else {
        w = elementwise_d(p.scoring, my_x);
        if (p.renormalize) w /= warp_sum(in_k ? w : 0.0) + 1e-20;
      }
      break;
    }
    case Variant::kTopKBias:
      w = my_score;
      if (p.renormalize)
        w /= warp_sum(in_k ? w : 0.0) + (p.scoring == ScoringFunc::kSoftmax ? 0.0 : 1e-20);
      break;
    case Variant::kTopKSoftmax: {
      const double e = rel_exp_d(my_x, top_value);
      w = e / warp_sum(in_k ? e : 0.0);
      break;
    }
    case Variant::kGrouped:
      w = my_score;
      if (p.renormalize) w /= warp_sum(in_k ? w : 0.0) + 1e-20;
      break;
    case Variant::kLlama4:
      w = sigmoid_d(my_x);
      if (p.renormalize) w /= warp_sum(in_k ? w : 0.0) + 1e-20;
      break;
  }
  if (in_k) {
    topk_ids[t * p.top_k + lane] = my_id < p.experts ? my_id : -1;
    topk_weights[t * p.top_k + lane] = static_cast<float>(w * p.scale);
  }
}

__global__ void route_hash_kernel(const int32_t* __restrict__ table,
                                  const int32_t* __restrict__ token_ids, int64_t num_tokens,
                                  int top_k, int experts, float weight,
                                  int32_t* __restrict__ topk_ids, float* __restrict__ topk_weights,
                                  const int32_t* __restrict__ num_valid) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_tokens * top_k) return;
  const int64_t t = i / top_k, j = i % top_k;
  if (num_valid != nullptr && t >= *num_valid) {  // padding row: routed nowhere
    topk_ids[i] = -1;
    topk_weights[i] = 0.0f;
    return;
  }
  const int32_t id = table[static_cast<int64_t>(token_ids[t]) * top_k + j];
  topk_ids[i] = id < experts ? id : -1;
  topk_weights[i] = weight;
}

}  // namespace

// kSimulated: simulated_routing.cu.
void route_simulated(const MoEConfig& c, const RouteArgs& a, int64_t num_tokens, Stream stream);

void route(const MoEConfig& c, const RouteArgs& a, int64_t num_tokens, Stream stream) {
  const int64_t cols = c.num_router_logits(), k = c.top_k;
  FUSEDMOE_CHECK(a.topk_ids != nullptr && a.topk_weights != nullptr,
                 "route: topk_ids and topk_weights are required");
  if (num_tokens == 0) return;
  if (c.routing_method == RoutingMethod::kSimulated)
    return route_simulated(c, a, num_tokens, stream);
  if (c.routing_method == RoutingMethod::kHash) {
    FUSEDMOE_CHECK(a.hash_table && a.token_ids,
                   "route: hash routing needs hash_table and token_ids");
    const float w =
        static_cast<float>(static_cast<double>(c.routed_scaling_factor) / static_cast<double>(k));
    const int64_t n = num_tokens * k;
    route_hash_kernel<<<static_cast<unsigned>(ceil_div(n, 256)), 256, 0, stream>>>(
        a.hash_table, a.token_ids, num_tokens, static_cast<int>(k), static_cast<int>(c.num_experts),
        w, a.topk_ids, a.topk_weights, a.num_valid_tokens);
    FUSEDMOE_CUDA_CHECK_LAUNCH();
    return;
  }
  FUSEDMOE_CHECK(a.router_logits != nullptr && a.logits_ld >= cols,
                 "route: router_logits: expected f32 [", num_tokens, ", ", cols,
                 "] with row stride >= ", cols, ", got row stride ", a.logits_ld);
  if (cols > 1024)
    FUSEDMOE_THROW(kUnsupported, "route: at most 1024 logit columns on CUDA, got ", cols);
  if (k > 32) FUSEDMOE_THROW(kUnsupported, "route: top_k at most 32 on CUDA, got ", k);

  RouteParams p{};
  p.scoring = c.scoring_func;
  p.renormalize = c.renormalize;
  p.cols = static_cast<int>(cols);
  p.experts = static_cast<int>(c.num_experts);
  p.top_k = static_cast<int>(k);
  p.scale = c.routed_scaling_factor;
  p.groups = 1;
  p.per_group = static_cast<int>(cols);
  p.topk_group = 1;
  p.sum_top2 = false;
  const float* bias = nullptr;
  const RoutingMethod m = c.routing_method;
  if (m == RoutingMethod::kLlama4) {
    p.variant = Variant::kLlama4;
  } else if (m == RoutingMethod::kGroupedTopK || c.num_expert_group > 1) {
    p.variant = Variant::kGrouped;
    p.groups = static_cast<int>(c.num_expert_group);
    p.per_group = static_cast<int>(c.num_experts / c.num_expert_group);
    p.topk_group = static_cast<int>(c.topk_group);
    p.sum_top2 = c.group_score == GroupScore::kSumTop2;
    if (p.groups > 32)
      FUSEDMOE_THROW(kUnsupported, "route: at most 32 expert groups on CUDA, got ", p.groups);
    if (p.sum_top2 && p.per_group < 2)
      FUSEDMOE_THROW(kUnsupported, "route: sum-of-top-2 group scores need >= 2 experts per group");
    FUSEDMOE_CHECK(!c.has_e_score_correction_bias || a.bias != nullptr,
                   "route: e_score_correction_bias required by the config, got none");
    bias = c.has_e_score_correction_bias ? a.bias : nullptr;
  } else if (m == RoutingMethod::kTopKSoftmax) {
    p.variant = Variant::kTopKSoftmax;
  } else if (c.has_e_score_correction_bias) {
    FUSEDMOE_CHECK(a.bias != nullptr, "route: e_score_correction_bias required by the config");
    p.variant = Variant::kTopKBias;
    bias = a.bias;
  } else {
    p.variant = Variant::kTopK;
  }
  const unsigned blocks = static_cast<unsigned>(ceil_div(num_tokens, kWarpsPerBlock));
  const int threads = kWarpsPerBlock * 32;
  auto kernel = cols <= 128   ? route_topk_kernel<4>
                : cols <= 256 ? route_topk_kernel<8>
                              : route_topk_kernel<32>;
  launch_pdl(kernel, blocks, threads, 0, stream, p, a.router_logits, a.logits_ld, bias, a.topk_ids,
             a.topk_weights, num_tokens, a.num_valid_tokens, a.nan_token);
}

}  // namespace fusedmoe::cuda
