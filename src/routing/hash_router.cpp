// fusedmoe: hash routing (Roller et al. 2021, "Hash Layers For Large Sparse
// Models"): a fixed table maps each token id to its experts; no learned gate.
// topk_ids[t] = hash_table[token_ids[t]] (ids >= E are zero experts -> -1);
// topk_weights = routed_scaling_factor / k (the paper's Hash layer with k = 1
// uses the expert output unweighted; for k > 1 the outputs are averaged).
// router_logits are ignored (they may be empty or [T, E + Z]).
#include <vector>

#include "routing/router_impl.h"

namespace fusedmoe::routing {
namespace {

class HashRouter final : public RouterBase {
 public:
  HashRouter(const MoEConfig& c, std::vector<int32_t> table)
      : RouterBase(c, false, true), table_(std::move(table)) {}
  const char* name() const override { return "hash"; }

 protected:
  void route(const RouteArgs& a, int64_t begin, int64_t end) const override {
    const int64_t k = config_.top_k;
    const float w = static_cast<float>(static_cast<double>(config_.routed_scaling_factor) /
                                       static_cast<double>(k));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t tok = a.token_ids[t * a.token_ids_stride];
      const int32_t* src = table_.data() + tok * k;
      int32_t* ids = a.ids + t * a.ids_ld;
      float* out = a.weights + t * a.weights_ld;
      for (int64_t j = 0; j < k; ++j) {
        ids[j] = out_id(src[j]);
        out[j] = w;
      }
    }
  }

 private:
  std::vector<int32_t> table_;  // [hash_vocab_size, k], checked by create_router
};

}  // namespace

std::unique_ptr<Router> make_hash_router(const MoEConfig& config, std::vector<int32_t> table) {
  return std::make_unique<HashRouter>(config, std::move(table));
}

}  // namespace fusedmoe::routing
