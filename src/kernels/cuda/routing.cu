// fusedmoe CUDA: routing kernels — router logits to (topk_ids, topk_weights).
//
// One warp per token; lane l holds the kN contiguous logit columns
// c = l * kN + i (float4 loads when rows are 16-byte aligned), kN = the
// smallest power of two with 32 * kN >= E + Z.
//
// Selection reproduces the CPU routers' order (value descending, then column
// ascending) exactly. Every candidate gets an order-preserving 64-bit key of
// its selection value:
//   logit variants (kTopK without bias, kTopKSoftmax, kLlama4): the f32 logit
//     (the CPU also selects on the raw f32 logits), the low word holding the
//     lane-local column so keys are unique;
//   score variants (kTopK with bias, kGroupedTopK): the double score + bias,
//     computed with the CPU's double formulas (see "Precision" below), ties
//     broken by the column kept beside the key.
// Each lane sorts its kN candidates (bitonic network in registers, ties by
// column), then k rounds take the warp's best head: two redux.sync max
// reductions (high, then low key word) and a ballot; the lowest lane holding the
// best key owns the lowest column (lanes hold contiguous columns), and pops it.
// Grouped top-k: group scores (max, or sum of the top two, of score + bias) by
// a butterfly inside each group's lanes when a group spans a power of two of
// whole lanes (DeepSeek-V3: 256 experts, 8 groups: 4 lanes per group), else by
// a loop over groups; the topk_group best groups (ties: lower group) by the same
// redux rounds; experts of the other groups are never selected.
// Weights: only the k chosen columns, lane j computing the j-th, in double with
// the CPU's formulas (the full-row softmax denominator too), stored as f32.
// Sigmoid / sqrtsoftplus score variants (DeepSeek-V3) first take a screened
// path (route_screened below): f32 scores with a proven error bound, double
// scores only for the few columns that can still be chosen, exact ranks among
// them; the path above is its fallback (ties, near ties, NaN, other layouts).
//
// Precision: scores are double, computed by the CPU routers' own code
// (routing/scores.h: the same bits on both), so ids equal the CPU's, exact ties
// (equal values, also sums of two) resolving to the lower column as there;
// logit variants compare the f32 logits exactly. Softmax scores divide by a
// row sum added in another order than the CPU's (a warp tree): group scores
// summed from them (kSumTop2 with softmax) can rank differently from the
// CPU's where two groups' sums agree to ~1e-16.
// Variants (same formulas as src/routing/):
//   kTopK        scoring (softmax/sigmoid/sqrtsoftplus) [+ selection bias],
//                renormalize, * routed_scaling_factor    (Mixtral, Qwen, OLMoE)
//   kTopKSoftmax top-k of logits, softmax over the k     (gpt-oss)
//   kGroupedTopK groups by max / sum of top-2 of score + bias, topk_group best
//                groups, top-k inside them                (DeepSeek-V2/V3)
//   kLlama4      top-k of logits, sigmoid weight          (Llama-4)
//   kHash        ids from a table indexed by token id
#include <cmath>
#include <cstdint>
#include <limits>

#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/pdl.cuh"
#include "routing/scores.h"

namespace fusedmoe::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr unsigned kFull = 0xffffffffu;

enum class Variant : int { kTopK, kTopKBias, kTopKSoftmax, kGrouped, kLlama4 };

struct RouteParams {
  Variant variant;
  ScoringFunc scoring;
  bool renormalize;
  bool vec_logits;  // logits rows 16-byte aligned: float4 loads
  bool vec_bias;    // bias 16-byte aligned
  int cols;         // E + Z
  int experts;      // E
  int top_k;
  int groups, per_group, topk_group;
  int group_lanes;      // > 0: each group is group_lanes whole lanes (a power of two)
  int group_shift;      // log2(group_lanes)
  int per_group_shift;  // log2(per_group) when group_lanes > 0
  bool sum_top2;
  double scale;
};

// ---- scores (double): the CPU routers' code, the same bits (routing/scores.h) ----
__device__ __forceinline__ double sigmoid_d(double x) {
  return routing::sigmoid(x);
}
__device__ __forceinline__ double sqrt_softplus_d(double x) {
  return routing::sqrt_softplus(x);
}
__device__ __forceinline__ double rel_exp_d(double x, double m) {
  return routing::rel_exp(x, m);
}
__device__ __forceinline__ double elementwise_d(ScoringFunc f, double x) {
  return f == ScoringFunc::kSigmoid ? sigmoid_d(x) : sqrt_softplus_d(x);
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// renormalized() of this lane's weight over the warp's k (warp-uniform: every
// lane calls it): a +inf sum takes the limit (routing/scores.h).
__device__ __forceinline__ double warp_renormalized(double w, double eps) {
  const double sum = warp_sum(w);
  const double infinite = sum == HUGE_VAL ? warp_sum(w == HUGE_VAL ? 1.0 : 0.0) : 0.0;
  return routing::renormalized(w, sum, eps, infinite);
}

// ---- order-preserving keys: a > b (as numbers) <=> key(a) > key(b) ----
// -0 is folded into +0 (they compare equal on the CPU). Key 0 marks "no
// candidate"; live keys are at least 1. Every NaN maps to 1, below every
// number, so a NaN is never selected while a number remains (cuda.h's
// contract; the token is reported through nan_token).
__device__ __forceinline__ uint32_t key32(float v) {
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 1;  // NaN
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_key32(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ uint64_t key64(double v) {
  uint64_t u = static_cast<uint64_t>(__double_as_longlong(v));
  if ((u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) return 1;  // NaN
  if (u == 0x8000000000000000ull) u = 0;
  const uint64_t k = (u >> 63) ? ~u : (u | 0x8000000000000000ull);
  return k > 1 ? k : 1;
}

__device__ __forceinline__ double from_key64(uint64_t k) {
  return __longlong_as_double(static_cast<long long>((k >> 63) ? (k & 0x7fffffffffffffffull) : ~k));
}

// The top two keys of a multiset (0: none), pushed one by one or merged
// across lanes; the CPU's group score is the max or the sum of the two values.
__device__ __forceinline__ void top2_push(uint64_t& m1, uint64_t& m2, uint64_t v) {
  if (v > m1) {
    m2 = m1;
    m1 = v;
  } else if (v > m2) {
    m2 = v;
  }
}
__device__ __forceinline__ void top2_merge_xor(uint64_t& m1, uint64_t& m2, int o) {
  const uint64_t o1 = __shfl_xor_sync(kFull, m1, o);
  const uint64_t o2 = __shfl_xor_sync(kFull, m2, o);
  const uint64_t hi = max(m1, o1), lo = min(m1, o1);
  m2 = max(lo, max(m2, o2));
  m1 = hi;
}
__device__ __forceinline__ uint64_t group_key(uint64_t m1, uint64_t m2, bool sum_top2) {
  return sum_top2 ? key64(from_key64(m1) + from_key64(m2)) : m1;
}

// kN values of `src` from column c0 on (columns >= cols read as 0).
template <int kN>
__device__ __forceinline__ void load_cols(const float* __restrict__ src, int c0, int cols, bool vec,
                                          float (&v)[kN]) {
  if constexpr (kN % 4 == 0) {
    if (vec) {
#pragma unroll
      for (int q = 0; q < kN / 4; ++q) {
        const int c = c0 + 4 * q;
        if (c + 3 < cols) {
          const float4 f = __ldg(reinterpret_cast<const float4*>(src + c));
          v[4 * q] = f.x;
          v[4 * q + 1] = f.y;
          v[4 * q + 2] = f.z;
          v[4 * q + 3] = f.w;
        } else {
#pragma unroll
          for (int r = 0; r < 4; ++r) v[4 * q + r] = c + r < cols ? __ldg(src + c + r) : 0.0f;
        }
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) v[i] = c0 + i < cols ? __ldg(src + c0 + i) : 0.0f;
}

// The lane's selection-bias columns, or zeros without a bias.
template <int kN>
__device__ __forceinline__ void load_bias(const float* __restrict__ bias, int c0, int cols,
                                          bool vec, float (&b)[kN]) {
  if (bias != nullptr) {
    load_cols<kN>(bias, c0, cols, vec, b);
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) b[i] = 0.0f;
  }
}

// a before b in the selection order: larger key, then (wide keys) lower column.
template <bool kWide>
__device__ __forceinline__ bool before(uint64_t ka, int ia, uint64_t kb, int ib) {
  if constexpr (kWide) return ka > kb || (ka == kb && ia < ib);
  return ka > kb;  // narrow keys carry the column in their low word (unique)
}

// Sorts a lane's candidates best first (bitonic network, kN a power of two);
// idx follows the keys for wide keys only.
template <int kN, bool kWide>
__device__ __forceinline__ void sort_candidates(uint64_t (&key)[kN], int (&idx)[kN]) {
#pragma unroll
  for (int size = 2; size <= kN; size <<= 1)
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1)
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const int j = i ^ stride;
        if (j > i) {
          const bool best_first = (i & size) == 0;
          if (before<kWide>(key[j], idx[j], key[i], idx[i]) == best_first) {
            const uint64_t tk = key[i];
            key[i] = key[j];
            key[j] = tk;
            if constexpr (kWide) {  // narrow keys carry the index in their low word
              const int ti = idx[i];
              idx[i] = idx[j];
              idx[j] = ti;
            }
          }
        }
      }
}

// The best of the lanes' keys `h` (warp-uniform result) and the lowest lane
// holding it. Narrow keys (kWide = false) have equal low words for equal high
// words across lanes only if the lane-local index is equal, so the high word
// decides and the lowest lane wins; wide keys compare both words.
template <bool kWide>
__device__ __forceinline__ uint64_t warp_best(uint64_t h, int& owner) {
  const uint32_t hh = static_cast<uint32_t>(h >> 32), hl = static_cast<uint32_t>(h);
  const uint32_t mh = __reduce_max_sync(kFull, hh);
  uint32_t ml = 0;
  bool mine = hh == mh;
  if constexpr (kWide) {
    ml = __reduce_max_sync(kFull, mine ? hl : 0u);
    mine = mine && hl == ml;
  }
  owner = __ffs(__ballot_sync(kFull, mine)) - 1;
  return static_cast<uint64_t>(mh) << 32 | ml;
}

// ---- screened selection (sigmoid / sqrtsoftplus score + bias, kN <= 8) ----
// The double scores cost most of the wide kernel, so they are computed only
// where they can matter. Every column first gets an f32 choice c_f (score + bias)
// with a bound eps on |c_f - c_d|, c_d the double value the CPU compares:
//   f32 score: expf (<= 2 ulp) and a correctly rounded reciprocal (sigmoid:
//   relative error <= 1.5 * 2^-22) or log1pf (1 ulp) and sqrtf (sqrtsoftplus:
//   <= 2^-21.8), taken as 2^-21 of the score; the f32 bias add: 2^-24 of |c_f|, taken as 2^-23;
//   2^-62 absolute for underflow (sqrt of a subnormal softplus). eps = the row's largest bound.
// Groups (grouped top-k): f32 group scores (sum of the two best c_f, rounded
// to f32) are within 2 eps + 2^-23 relative of the exact ones; when the
// topk_group-th and the next differ by more than that twice over, the kept
// groups are the exact ones. Else (about 1 token in 10^4 on random logits) the
// exact group scores are computed from the columns that can be a group's top
// two (c_f >= its f32 second best - 2 eps), compacted as below.
// Experts: T = the k-th largest of the lanes' best c_f (k distinct columns have
// c_f >= T, so exact values >= T - eps); a column with c_f < T - 2 eps is below
// all k of them exactly and cannot be chosen. The others (typically ~k + 3) are
// compacted one per lane in column order, their double scores computed, and
// each one's rank among them (larger value, then lower column = lower lane)
// says which pick it is, exactly as on the CPU.
// More than 32 such columns (ties, near ties), NaN or infinity: full double path.
// Returns false when the token needs the full double path (nothing written).
__device__ __forceinline__ float score_f(ScoringFunc f, float x) {
  if (f == ScoringFunc::kSigmoid) return __frcp_rn(1.0f + expf(-x));
  return sqrtf(fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))));
}

// Compacts the columns flagged in `band` (bit i: column c0 + i) one per lane
// in column order: lane q < total gets the q-th in `col`. Returns total (the
// caller gives up when it exceeds 32; then `col` is not set).
template <int kN>
__device__ __forceinline__ int compact_columns(uint32_t band, int lane, int c0, int* s_cols,
                                               int& col) {
  const int n = __popc(band);
  int incl = n;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += v;
  }
  const int total = __shfl_sync(kFull, incl, 31);
  if (total > 32) return total;
  const int base = incl - n;
#pragma unroll
  for (int i = 0; i < kN; ++i)
    if (band >> i & 1u) s_cols[base + __popc(band & ((1u << i) - 1u))] = c0 + i;
  __syncwarp();
  col = lane < total ? s_cols[lane] : 0;
  __syncwarp();  // s_cols may be written again
  return total;
}

// The CPU's double score of column col and the key of score + bias.
__device__ __forceinline__ uint64_t exact_choice(ScoringFunc f, const float* __restrict__ row,
                                                 const float* __restrict__ bias, int col,
                                                 double& score) {
  score = elementwise_d(f, __ldg(row + col));
  return key64(bias != nullptr ? score + static_cast<double>(__ldg(bias + col)) : score);
}

// c_f below this cannot be among the exact values of the columns holding the
// top f32 values down to t (t - 2 eps, rounded down to f32).
__device__ __forceinline__ float screen_floor(float t, float eps) {
  const double td = t;
  return __double2float_rd(td - 2.0 * eps - 0x1p-48 * fabs(td));
}

template <int kN>
__device__ __forceinline__ bool route_screened(const RouteParams& p, const float* __restrict__ row,
                                               const float* __restrict__ bias, int lane, int c0,
                                               const float (&x)[kN], int* s_cols,
                                               int32_t* __restrict__ ids,
                                               float* __restrict__ weights) {
  float b[kN];
  load_bias<kN>(bias, c0, p.cols, p.vec_bias, b);
  float cf[kN];
  uint32_t eps_bits = 0;  // bounds are >= 0 (or NaN: the largest bits), so bits order them
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const float sf = score_f(p.scoring, x[i]);
    const float c = bias != nullptr ? sf + b[i] : sf;
    const float e = fabsf(0x1p-21f * sf + 0x1p-23f * fabsf(c) + 0x1p-62f);
    const bool live = c0 + i < p.cols;
    cf[i] = live ? c : -INFINITY;
    if (live) eps_bits = max(eps_bits, __float_as_uint(e));
  }
  const float eps = __uint_as_float(__reduce_max_sync(kFull, eps_bits));
  if (!(eps < INFINITY)) return false;  // NaN or infinite scores / bias

  // ---- groups: f32 group scores; exact ones when too close to call ----
  if (p.variant == Variant::kGrouped) {
    const int gl = p.group_lanes;
    if (gl == 0) return false;  // groups not aligned to lanes: full path
    uint32_t k1 = 0, k2 = 0;    // the group's two best f32 keys (all its lanes)
#pragma unroll
    for (int i = 0; i < kN; ++i)
      if (c0 + i < p.cols) {
        const uint32_t k = key32(cf[i]);
        if (k > k1) {
          k2 = k1;
          k1 = k;
        } else if (k > k2) {
          k2 = k;
        }
      }
    for (int o = 1; o < gl; o <<= 1) {
      const uint32_t o1 = __shfl_xor_sync(kFull, k1, o), o2 = __shfl_xor_sync(kFull, k2, o);
      k2 = max(min(k1, o1), max(k2, o2));
      k1 = max(k1, o1);
    }
    // f32 group scores (rounded to f32: 2^-24 relative more) on the group's first lane.
    uint32_t gkey = 0;
    if ((lane & (gl - 1)) == 0 && (lane >> p.group_shift) < p.groups) {
      const double g1 = from_key32(k1);
      gkey = key32(static_cast<float>(p.sum_top2 ? g1 + static_cast<double>(from_key32(k2)) : g1));
    }
    bool kept = false;  // on the group's first lane
    int taken = 0;
    uint32_t last = 0;
    while (taken < p.topk_group) {  // equal scores taken together
      last = __reduce_max_sync(kFull, gkey);
      taken += __popc(__ballot_sync(kFull, gkey == last));
      if (gkey == last) {
        kept = true;
        gkey = 0;
      }
    }
    bool certain = taken == p.topk_group;
    if (certain && p.topk_group < p.groups) {
      const double tg = from_key32(last), ng = from_key32(__reduce_max_sync(kFull, gkey));
      certain = tg - ng > 4.0 * eps + 0x1p-21 * (fabs(tg) + fabs(ng));
    }
    uint32_t kept_groups = __reduce_or_sync(kFull, kept ? 1u << (lane >> p.group_shift) : 0u);
    if (!certain) {
      // Exact group scores: a group's exact top two are among its columns with
      // c_f >= (its f32 second best, or best for kMax) - 2 eps.
      const float lo = screen_floor(from_key32(p.sum_top2 ? k2 : k1), eps);
      uint32_t band = 0;
#pragma unroll
      for (int i = 0; i < kN; ++i)
        if (c0 + i < p.cols && cf[i] >= lo) band |= 1u << i;
      int col;
      const int total = compact_columns<kN>(band, lane, c0, s_cols, col);
      if (total > 32) return false;
      double sd;
      uint64_t m1 = lane < total ? exact_choice(p.scoring, row, bias, col, sd) : 0, m2 = 0;
      const int g =
          lane < total ? col >> p.per_group_shift : -1;  // lanes of a group are contiguous
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {  // segmented top two: the group's first lane gets it
        const uint64_t o1 = __shfl_down_sync(kFull, m1, o), o2 = __shfl_down_sync(kFull, m2, o);
        const int og = __shfl_down_sync(kFull, g, o);
        if (lane + o < 32 && og == g) {
          m2 = max(min(m1, o1), max(m2, o2));
          m1 = max(m1, o1);
        }
      }
      const int prev = __shfl_up_sync(kFull, g, 1);
      uint64_t ekey = 0;
      if (g >= 0 && (lane == 0 || prev != g))
        ekey = key64(p.sum_top2 ? from_key64(m1) + from_key64(m2) : from_key64(m1));
      kept = false;
      for (int r = 0; r < p.topk_group; ++r) {  // ties: lower group = lower lane
        int owner;
        warp_best<true>(ekey, owner);
        if (lane == owner) {
          kept = true;
          ekey = 0;
        }
      }
      kept_groups = __reduce_or_sync(kFull, kept ? 1u << g : 0u);
    }
    if (!(kept_groups >> (lane >> p.group_shift) & 1u))
#pragma unroll
      for (int i = 0; i < kN; ++i) cf[i] = -INFINITY;
  }

  // ---- T: the k-th largest of the lanes' best (equal ones taken together) ----
  uint32_t lane_best = 0;
#pragma unroll
  for (int i = 0; i < kN; ++i)
    if (cf[i] != -INFINITY) lane_best = max(lane_best, key32(cf[i]));
  uint32_t tk = 0;
  for (int taken = 0; taken < p.top_k;) {
    tk = __reduce_max_sync(kFull, lane_best);
    if (tk == 0) break;  // fewer than k lanes hold columns: all are candidates
    taken += __popc(__ballot_sync(kFull, lane_best == tk));
    if (lane_best == tk) lane_best = 0;
  }
  // Columns that can still be chosen: c_f >= T - 2 eps.
  const float lo = tk != 0 ? screen_floor(from_key32(tk), eps) : -INFINITY;
  uint32_t band = 0;
#pragma unroll
  for (int i = 0; i < kN; ++i)
    if (cf[i] != -INFINITY && cf[i] >= lo) band |= 1u << i;
  int col;
  const int total = compact_columns<kN>(band, lane, c0, s_cols, col);
  if (total > 32) return false;
  double sd = 0.0;
  const uint64_t key = lane < total ? exact_choice(p.scoring, row, bias, col, sd) : 0;

  // ---- exact ranks among the candidates: larger double value, then lower column
  // (= lower lane); rank j < k is the j-th pick ----
  int rank = 0;
  for (int q = 0; q < total; ++q) {
    const uint64_t kq = __shfl_sync(kFull, key, q);
    rank += kq > key || (kq == key && q < lane);
  }
  const bool picked = lane < total && rank < p.top_k;
  double w = picked ? sd : 0.0;
  if (p.renormalize) w = warp_renormalized(w, 1e-20);
  if (picked) {
    ids[rank] = col < p.experts ? col : -1;
    weights[rank] = static_cast<float>(w * p.scale);
  }
  return true;
}

// One warp per token. kWide: selection on double score + bias (kTopKBias,
// kGrouped); otherwise on the f32 logits. Up to 256 columns, at most 64
// registers so that 8 blocks (32 warps) fit an SM: T = 4096 runs in one wave.
template <int kN, bool kWide>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, kN <= 8 ? 8 : 1)
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
  const int c0 = lane * kN;

  float x[kN];
  load_cols<kN>(row, c0, p.cols, p.vec_logits, x);
  if (nan_token != nullptr) {  // the first token with a NaN logit, for check_errors()
    bool has_nan = false;
#pragma unroll
    for (int i = 0; i < kN; ++i) has_nan |= isnan(x[i]);
    if (__any_sync(kFull, has_nan) && lane == 0) atomicMin(nan_token, static_cast<int32_t>(t));
  }

  if constexpr (kWide && kN <= 8) {
    __shared__ int s_cols[kWarpsPerBlock][32];
    if (p.scoring != ScoringFunc::kSoftmax &&
        route_screened<kN>(p, row, bias, lane, c0, x, s_cols[threadIdx.x >> 5],
                           topk_ids + t * p.top_k, topk_weights + t * p.top_k))
      return;
  }

  // ---- selection keys ----
  uint64_t key[kN];
  int idx[kN];
  double row_max = 0.0, row_denom = 1.0;  // softmax scores (wide)
#pragma unroll
  for (int i = 0; i < kN; ++i) idx[i] = i;
  if constexpr (!kWide) {
#pragma unroll
    for (int i = 0; i < kN; ++i)
      key[i] = c0 + i < p.cols
                   ? static_cast<uint64_t>(key32(x[i])) << 32 | static_cast<uint32_t>(kN - i)
                   : 0;
  } else {
    if (p.scoring == ScoringFunc::kSoftmax) {
      uint32_t mk = 0;
#pragma unroll
      for (int i = 0; i < kN; ++i)
        if (c0 + i < p.cols) mk = max(mk, key32(x[i]));
      row_max = from_key32(__reduce_max_sync(kFull, mk));
      double d = 0.0;
#pragma unroll
      for (int i = 0; i < kN; ++i)
        if (c0 + i < p.cols) d += rel_exp_d(x[i], row_max);
      row_denom = warp_sum(d);
    }
    float b[kN];
    load_bias<kN>(bias, c0, p.cols, p.vec_bias, b);
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const double sc = p.scoring == ScoringFunc::kSoftmax ? rel_exp_d(x[i], row_max) / row_denom
                                                           : elementwise_d(p.scoring, x[i]);
      key[i] = c0 + i < p.cols ? key64(bias != nullptr ? sc + static_cast<double>(b[i]) : sc) : 0;
    }

    // ---- grouped top-k: keep the topk_group best groups ----
    // Group scores from the keys (order-preserving, so the top two keys are the
    // top two values; from_key64 gives the values back exactly).
    if (p.variant == Variant::kGrouped) {
      const int gl = p.group_lanes;
      uint64_t gkey = 0;  // the group score key on the lane that stands for the group
      int gi[kN];         // group of each column (loop layout only)
      if (gl > 0) {
        uint64_t m1 = 0, m2 = 0;
#pragma unroll
        for (int i = 0; i < kN; ++i) top2_push(m1, m2, key[i]);
        for (int o = 1; o < gl; o <<= 1) top2_merge_xor(m1, m2, o);
        if ((lane & (gl - 1)) == 0 && (lane >> p.group_shift) < p.groups)
          gkey = group_key(m1, m2, p.sum_top2);
      } else {
#pragma unroll
        for (int i = 0; i < kN; ++i) gi[i] = c0 + i < p.cols ? (c0 + i) / p.per_group : -1;
        for (int g = 0; g < p.groups; ++g) {
          uint64_t m1 = 0, m2 = 0;
#pragma unroll
          for (int i = 0; i < kN; ++i)
            if (gi[i] == g) top2_push(m1, m2, key[i]);
#pragma unroll
          for (int o = 1; o < 32; o <<= 1) top2_merge_xor(m1, m2, o);
          if (lane == g) gkey = group_key(m1, m2, p.sum_top2);
        }
      }
      uint32_t kept = 0;
      for (int r = 0; r < p.topk_group; ++r) {
        int owner;
        warp_best<true>(gkey, owner);
        kept |= 1u << (gl > 0 ? owner >> p.group_shift : owner);
        if (lane == owner) gkey = 0;
      }
      if (gl > 0) {
        if (!(kept >> (lane >> p.group_shift) & 1u))
#pragma unroll
          for (int i = 0; i < kN; ++i) key[i] = 0;
      } else {
#pragma unroll
        for (int i = 0; i < kN; ++i)
          if (gi[i] < 0 || !(kept >> gi[i] & 1u)) key[i] = 0;
      }
    }
  }

  // ---- k rounds over the lanes' sorted candidates; lane j keeps the j-th ----
  sort_candidates<kN, kWide>(key, idx);
  int my_c = 0;
  uint64_t my_key = 0, top_key = 0;
  for (int j = 0; j < p.top_k; ++j) {
    int owner;
    const uint64_t best = warp_best<kWide>(key[0], owner);
    const int head = kWide ? idx[0] : kN - static_cast<int>(static_cast<uint32_t>(key[0]));
    const int c = __shfl_sync(kFull, c0 + head, owner);
    if (j == 0) top_key = best;
    if (lane == j) {
      my_c = c;
      my_key = best;
    }
    if (lane == owner) {  // pop the head
#pragma unroll
      for (int i = 0; i + 1 < kN; ++i) {
        key[i] = key[i + 1];
        if constexpr (kWide) idx[i] = idx[i + 1];
      }
      key[kN - 1] = 0;
    }
  }

  // ---- weights of the k chosen columns (double, the CPU's formulas) ----
  const bool in_k = lane < p.top_k;
  double w = 0.0;
  if constexpr (!kWide) {
    const double xj =
        in_k ? static_cast<double>(from_key32(static_cast<uint32_t>(my_key >> 32))) : 0.0;
    const double top = from_key32(static_cast<uint32_t>(top_key >> 32));  // the row maximum
    if (p.variant == Variant::kTopKSoftmax ||
        (p.variant == Variant::kTopK && p.scoring == ScoringFunc::kSoftmax && p.renormalize)) {
      const double e = in_k ? rel_exp_d(xj, top) : 0.0;
      w = e / warp_sum(e);
    } else if (p.variant == Variant::kTopK && p.scoring == ScoringFunc::kSoftmax) {
      double d = 0.0;
#pragma unroll
      for (int i = 0; i < kN; ++i)
        if (c0 + i < p.cols) d += rel_exp_d(x[i], top);
      const double denom = warp_sum(d);
      w = in_k ? rel_exp_d(xj, top) / denom : 0.0;
    } else {  // sigmoid / sqrtsoftplus of the logit (kTopK), sigmoid (kLlama4)
      const ScoringFunc f = p.variant == Variant::kLlama4 ? ScoringFunc::kSigmoid : p.scoring;
      w = in_k ? elementwise_d(f, xj) : 0.0;
      if (p.renormalize) w = warp_renormalized(w, 1e-20);
    }
  } else {
    const float xf = in_k && my_c < p.cols ? __ldg(row + my_c) : 0.0f;
    if (in_k)
      w = p.scoring == ScoringFunc::kSoftmax ? rel_exp_d(xf, row_max) / row_denom
                                             : elementwise_d(p.scoring, xf);
    if (p.renormalize)
      w = warp_renormalized(
          w, p.variant == Variant::kTopKBias && p.scoring == ScoringFunc::kSoftmax ? 0.0 : 1e-20);
  }
  if (in_k) {
    topk_ids[t * p.top_k + lane] = my_c < p.experts ? my_c : -1;
    topk_weights[t * p.top_k + lane] = static_cast<float>(w * p.scale);
  }
}

// A token id outside [0, vocab) reads no table row: the token is routed
// nowhere (ids -1, weights 0) and recorded in bad_token (atomicMin) when given.
__global__ void route_hash_kernel(const int32_t* __restrict__ table,
                                  const int32_t* __restrict__ token_ids, int64_t num_tokens,
                                  int top_k, int experts, int64_t vocab, float weight,
                                  int32_t* __restrict__ topk_ids, float* __restrict__ topk_weights,
                                  const int32_t* __restrict__ num_valid,
                                  int32_t* __restrict__ bad_token) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_tokens * top_k) return;
  const int64_t t = i / top_k, j = i % top_k;
  if (num_valid != nullptr && t >= *num_valid) {  // padding row: routed nowhere
    topk_ids[i] = -1;
    topk_weights[i] = 0.0f;
    return;
  }
  const int32_t tok = token_ids[t];
  if (tok < 0 || tok >= vocab) {
    topk_ids[i] = -1;
    topk_weights[i] = 0.0f;
    if (bad_token != nullptr && j == 0) atomicMin(bad_token, static_cast<int32_t>(t));
    return;
  }
  const int32_t id = table[static_cast<int64_t>(tok) * top_k + j];
  topk_ids[i] = id < experts ? id : -1;
  topk_weights[i] = weight;
}

template <int kN, bool kWide>
void launch_topk(const RouteParams& p, const RouteArgs& a, const float* bias, int64_t num_tokens,
                 Stream stream) {
  const unsigned blocks = static_cast<unsigned>(ceil_div(num_tokens, kWarpsPerBlock));
  launch_pdl(route_topk_kernel<kN, kWide>, blocks, kWarpsPerBlock * 32, 0, stream, p,
             a.router_logits, a.logits_ld, bias, a.topk_ids, a.topk_weights, num_tokens,
             a.num_valid_tokens, a.nan_token);
}

template <bool kWide>
void launch_topk(int per_lane, const RouteParams& p, const RouteArgs& a, const float* bias,
                 int64_t num_tokens, Stream stream) {
  switch (per_lane) {
    case 1:
      return launch_topk<1, kWide>(p, a, bias, num_tokens, stream);
    case 2:
      return launch_topk<2, kWide>(p, a, bias, num_tokens, stream);
    case 4:
      return launch_topk<4, kWide>(p, a, bias, num_tokens, stream);
    case 8:
      return launch_topk<8, kWide>(p, a, bias, num_tokens, stream);
    case 16:
      return launch_topk<16, kWide>(p, a, bias, num_tokens, stream);
    default:
      return launch_topk<32, kWide>(p, a, bias, num_tokens, stream);
  }
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
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
        c.hash_vocab_size, w, a.topk_ids, a.topk_weights, a.num_valid_tokens, a.bad_token);
    FUSEDMOE_CUDA_CHECK_LAUNCH();
    return;
  }
  FUSEDMOE_CHECK(a.router_logits != nullptr && a.logits_ld >= cols,
                 "route: router_logits: expected f32 [", num_tokens, ", ", cols,
                 "] with row stride >= ", cols, ", got row stride ", a.logits_ld);
  if (cols > 1024)
    FUSEDMOE_THROW(kUnsupported, "route: at most 1024 logit columns on CUDA, got ", cols);
  if (k > 32) FUSEDMOE_THROW(kUnsupported, "route: top_k at most 32 on CUDA, got ", k);
  FUSEDMOE_CHECK(k >= 1 && k <= cols, "route: top_k: expected 1..", cols, ", got ", k);

  int per_lane = 1;  // columns per lane: the smallest power of two with 32 * per_lane >= cols
  while (32 * per_lane < cols) per_lane *= 2;

  RouteParams p{};
  p.scoring = c.scoring_func;
  p.renormalize = c.renormalize;
  p.vec_logits = aligned16(a.router_logits) && a.logits_ld % 4 == 0;
  p.cols = static_cast<int>(cols);
  p.experts = static_cast<int>(c.num_experts);
  p.top_k = static_cast<int>(k);
  p.scale = c.routed_scaling_factor;
  p.groups = 1;
  p.per_group = static_cast<int>(cols);
  p.topk_group = 1;
  p.group_lanes = 0;
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
    FUSEDMOE_CHECK(p.groups >= 1 && p.topk_group >= 1 && p.topk_group <= p.groups &&
                       static_cast<int64_t>(p.groups) * p.per_group == cols &&
                       k <= static_cast<int64_t>(p.topk_group) * p.per_group,
                   "route: grouped top-k: expected E + Z = num_expert_group * experts per group "
                   "and top_k <= topk_group * experts per group, got E + Z ",
                   cols, ", num_expert_group ", p.groups, ", topk_group ", p.topk_group, ", top_k ",
                   k);
    // A group of whole lanes, a power of two of them: butterfly inside the group.
    if (p.per_group % per_lane == 0) {
      const int lanes = p.per_group / per_lane;
      if ((lanes & (lanes - 1)) == 0) {
        p.group_lanes = lanes;
        while ((1 << p.group_shift) < lanes) ++p.group_shift;
        while ((1 << p.per_group_shift) < p.per_group) ++p.per_group_shift;
      }
    }
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
  p.vec_bias = bias != nullptr && aligned16(bias);
  if (p.variant == Variant::kTopKBias || p.variant == Variant::kGrouped)
    launch_topk<true>(per_lane, p, a, bias, num_tokens, stream);
  else
    launch_topk<false>(per_lane, p, a, bias, num_tokens, stream);
  FUSEDMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace fusedmoe::cuda
