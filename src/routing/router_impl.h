// fusedmoe: routing internals shared by the router implementations.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "fusedmoe/routing/router.h"
#include "routing/scores.h"

namespace fusedmoe::routing {

// Raw pointers and row strides (in elements) of one select_experts call,
// checked by RouterBase::select_experts.
struct RouteArgs {
  const float* logits = nullptr;  // [T, cols], row stride logits_ld; null when not used
  int64_t logits_ld = 0;
  int32_t* ids = nullptr;  // [T, k], row stride ids_ld
  int64_t ids_ld = 0;
  float* weights = nullptr;  // [T, k], row stride weights_ld
  int64_t weights_ld = 0;
  const int32_t* token_ids = nullptr;  // [T], stride token_ids_stride; kHash only
  int64_t token_ids_stride = 0;
};

// Does the boundary checks once (shapes, dtypes, NaN, token id range) and
// runs route() over token ranges on the given pool (ThreadPool::global() by default).
class RouterBase : public Router {
 public:
  void select_experts(const TensorView& router_logits, const TensorView& topk_ids,
                      const TensorView& topk_weights, const TensorView* token_ids = nullptr,
                      ThreadPool* pool = nullptr) const final;

 protected:
  RouterBase(const MoEConfig& config, bool uses_logits, bool uses_token_ids)
      : Router(config), uses_logits_(uses_logits), uses_token_ids_(uses_token_ids) {}
  // Routes tokens [begin, end). Inputs were checked; no NaN in the logits.
  virtual void route(const RouteArgs& args, int64_t begin, int64_t end) const = 0;

  // Id written for column c of the logits: c, or -1 for a zero expert (c >= E).
  int32_t out_id(int64_t c) const {
    return c < config_.num_experts ? static_cast<int32_t>(c) : int32_t{-1};
  }

 private:
  bool uses_logits_;
  bool uses_token_ids_;
};

// The k largest values pushed, sorted by (value descending, id ascending).
// Values must be pushed in increasing id order; then among equal values the
// lower id wins, and ids never repeat (even for all-equal or infinite values).
// Storage is external so no allocation happens per token.
template <typename V>
class TopKList {
 public:
  TopKList(V* values, int32_t* ids, int64_t k) : values_(values), ids_(ids), k_(k) {}
  void push(V v, int32_t id) {
    int64_t pos;
    if (n_ == k_) {
      if (!(v > values_[k_ - 1])) return;
      pos = k_ - 1;
    } else {
      pos = n_++;
    }
    while (pos > 0 && v > values_[pos - 1]) {
      values_[pos] = values_[pos - 1];
      ids_[pos] = ids_[pos - 1];
      --pos;
    }
    values_[pos] = v;
    ids_[pos] = id;
  }
  // Pushes v[0..n) with ids first_id, first_id + 1, ...; the common case
  // (value below the current k-th) costs one compare against a register.
  template <typename T>
  void scan(const T* v, int64_t n, int32_t first_id) {
    int64_t i = 0;
    for (; i < n && n_ < k_; ++i) push(static_cast<V>(v[i]), first_id + static_cast<int32_t>(i));
    if (i == n) return;
    V threshold = values_[k_ - 1];
    for (; i < n; ++i) {
      const V x = static_cast<V>(v[i]);
      if (x > threshold) {
        push(x, first_id + static_cast<int32_t>(i));
        threshold = values_[k_ - 1];
      }
    }
  }
  int64_t size() const { return n_; }
  V value(int64_t i) const { return values_[i]; }
  int32_t id(int64_t i) const { return ids_[i]; }

 private:
  V* values_;
  int32_t* ids_;
  int64_t k_;
  int64_t n_ = 0;
};

// Element-wise scores (sigmoid, sqrtsoftplus) and rel_exp in double: routing/scores.h.

// Factories of the concrete routers (config validated by create_router).
std::unique_ptr<Router> make_topk_router(const MoEConfig& config, std::vector<double> bias);
std::unique_ptr<Router> make_topk_softmax_router(const MoEConfig& config);
std::unique_ptr<Router> make_llama4_router(const MoEConfig& config);
std::unique_ptr<Router> make_grouped_topk_router(const MoEConfig& config, std::vector<double> bias);
std::unique_ptr<Router> make_hash_router(const MoEConfig& config, std::vector<int32_t> table);
std::unique_ptr<Router> make_simulated_router(const MoEConfig& config);

}  // namespace fusedmoe::routing
