// fusedmoe: expert placement and per-rank weight slices (parallel/expert_map.h).
#include "fusedmoe/parallel/expert_map.h"

#include <cstring>
#include <string>

namespace fusedmoe {

const char* to_string(ExpertPlacement p) {
  return p == ExpertPlacement::kRoundRobin ? "round-robin" : "contiguous";
}

ExpertPlacement parse_expert_placement(const std::string& s) {
  if (s == "contiguous" || s == "linear") return ExpertPlacement::kContiguous;
  if (s == "round-robin" || s == "round_robin") return ExpertPlacement::kRoundRobin;
  FUSEDMOE_THROW(kInvalidArgument, "expert placement: expected contiguous or round-robin, got \"",
                 s, "\"");
}

ExpertMap::ExpertMap(int64_t num_experts, int ep_size, ExpertPlacement placement)
    : num_experts_(num_experts), ep_size_(ep_size), placement_(placement) {
  FUSEDMOE_CHECK(num_experts >= 1, "ExpertMap: num_experts: expected >= 1, got ", num_experts);
  FUSEDMOE_CHECK(ep_size >= 1 && ep_size <= num_experts,
                 "ExpertMap: ep_size: expected in [1, num_experts = ", num_experts, "], got ",
                 ep_size);
  rank_.resize(num_experts);
  local_.resize(num_experts);
  if (placement == ExpertPlacement::kRoundRobin) {
    for (int64_t e = 0; e < num_experts; ++e) {
      rank_[e] = static_cast<int32_t>(e % ep_size);
      local_[e] = e / ep_size;
    }
  } else {
    const int64_t base = num_experts / ep_size, extra = num_experts % ep_size;
    int64_t e = 0;
    for (int r = 0; r < ep_size; ++r) {
      const int64_t n = base + (r < extra ? 1 : 0);
      for (int64_t i = 0; i < n; ++i, ++e) {
        rank_[e] = r;
        local_[e] = i;
      }
    }
  }
}

int64_t ExpertMap::num_local_experts(int rank) const {
  FUSEDMOE_CHECK(rank >= 0 && rank < ep_size_, "ExpertMap: rank: expected in [0, ", ep_size_,
                 "), got ", rank);
  const int64_t base = num_experts_ / ep_size_, extra = num_experts_ % ep_size_;
  return base + (rank < extra ? 1 : 0);  // the same count for both placements
}

std::vector<int64_t> ExpertMap::local_experts(int rank) const {
  std::vector<int64_t> out(num_local_experts(rank));
  for (int64_t e = 0; e < num_experts_; ++e)
    if (rank_[e] == rank) out[local_[e]] = e;
  return out;
}

std::vector<int32_t> ExpertMap::global_to_local(int rank) const {
  num_local_experts(rank);  // checks rank
  std::vector<int32_t> out(num_experts_, -1);
  for (int64_t e = 0; e < num_experts_; ++e)
    if (rank_[e] == rank) out[e] = static_cast<int32_t>(local_[e]);
  return out;
}

std::pair<int64_t, int64_t> tp_slice(int64_t intermediate_size, int tp_size, int tp_rank) {
  FUSEDMOE_CHECK(tp_size >= 1 && tp_size <= intermediate_size,
                 "tp_size: expected in [1, intermediate_size = ", intermediate_size, "], got ",
                 tp_size);
  FUSEDMOE_CHECK(tp_rank >= 0 && tp_rank < tp_size, "tp_rank: expected in [0, ", tp_size, "), got ",
                 tp_rank);
  const int64_t base = intermediate_size / tp_size, extra = intermediate_size % tp_size;
  const int64_t start = tp_rank * base + std::min<int64_t>(tp_rank, extra);
  return {start, base + (tp_rank < extra ? 1 : 0)};
}

namespace {

// Copies rows [row0, row0 + rows) x columns [col0, col0 + cols) of each listed
// matrix of `src` [E, R, C] into dst [n, rows, cols].
void gather_block(const Tensor& src, std::span<const int64_t> experts, int64_t row0, int64_t rows,
                  int64_t col0, int64_t cols, int64_t dst_row0, Tensor* dst, int64_t dst_rows) {
  const size_t es = dtype_size(src.dtype());
  const int64_t R = src.size(1), C = src.size(2);
  const char* s = static_cast<const char*>(src.data());
  char* d = static_cast<char*>(dst->data());
  for (size_t i = 0; i < experts.size(); ++i)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(d + ((static_cast<int64_t>(i) * dst_rows + dst_row0 + r) * cols) * es,
                  s + ((experts[i] * R + row0 + r) * C + col0) * es, cols * es);
}

}  // namespace

ExpertWeights shard_expert_weights(const ExpertWeights& weights, std::span<const int64_t> experts,
                                   int tp_size, int tp_rank) {
  const int64_t E = weights.w13.size(0), H = weights.w13.size(2), I = weights.w13.size(1) / 2;
  const int64_t n = static_cast<int64_t>(experts.size());
  for (int64_t e : experts)
    FUSEDMOE_CHECK(e >= 0 && e < E, "shard_expert_weights: expert ", e, " out of range [0, ", E,
                   ")");
  const auto [i0, It] = tp_slice(I, tp_size, tp_rank);
  const bool has_bias = weights.w13_bias.has_value();

  bool contiguous_run = n > 0;
  for (int64_t i = 1; i < n; ++i) contiguous_run = contiguous_run && experts[i] == experts[0] + i;
  ExpertWeights out;
  if (tp_size == 1 && contiguous_run) {
    // Zero copy: views sharing the storage.
    auto narrow = [&](const Tensor& t) {
      return Tensor(t.view().narrow(0, experts[0], n), t.storage());
    };
    out.w13 = narrow(weights.w13);
    out.w2 = narrow(weights.w2);
    if (has_bias) {
      out.w13_bias = narrow(*weights.w13_bias);
      out.w2_bias = narrow(*weights.w2_bias);
    }
    return out;
  }

  out.w13 = Tensor::empty(weights.w13.dtype(), {n, 2 * It, H});
  gather_block(weights.w13, experts, i0, It, 0, H, 0, &out.w13, 2 * It);       // gate
  gather_block(weights.w13, experts, I + i0, It, 0, H, It, &out.w13, 2 * It);  // up
  out.w2 = Tensor::empty(weights.w2.dtype(), {n, H, It});
  gather_block(weights.w2, experts, 0, H, i0, It, 0, &out.w2, H);
  if (has_bias) {
    const Tensor& b13 = *weights.w13_bias;
    Tensor o13 = Tensor::empty(b13.dtype(), {n, 2 * It});
    for (size_t i = 0; i < experts.size(); ++i) {
      const size_t es = dtype_size(b13.dtype());
      const char* s = static_cast<const char*>(b13.data()) + experts[i] * 2 * I * es;
      char* d = static_cast<char*>(o13.data()) + i * 2 * It * es;
      std::memcpy(d, s + i0 * es, It * es);
      std::memcpy(d + It * es, s + (I + i0) * es, It * es);
    }
    out.w13_bias = o13;
    const Tensor& b2 = *weights.w2_bias;
    Tensor o2 = Tensor::empty(b2.dtype(), {n, H});
    const size_t es2 = dtype_size(b2.dtype());
    for (size_t i = 0; i < experts.size(); ++i) {
      char* d = static_cast<char*>(o2.data()) + i * H * es2;
      if (tp_rank == 0)
        std::memcpy(d, static_cast<const char*>(b2.data()) + experts[i] * H * es2, H * es2);
      else
        std::memset(d, 0, H * es2);  // +0.0 in f32 and bf16: added once, on tp_rank 0
    }
    out.w2_bias = o2;
  }
  return out;
}

}  // namespace fusedmoe
