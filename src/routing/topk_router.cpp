// fusedmoe: top-k routers over the full expert row: scoring + top-k
// (Mixtral/Qwen/OLMoE, optional selection bias), top-k then softmax (gpt-oss),
// and Llama-4's sigmoid top-1.
#include <vector>

#include "routing/router_impl.h"

namespace fusedmoe::routing {
namespace {

// Per-chunk scratch: the k selected values/ids and (bias path) a row of scores.
struct Scratch {
  explicit Scratch(int64_t k, int64_t row = 0)
      : fvals(static_cast<size_t>(k)),
        dvals(static_cast<size_t>(k)),
        ids(static_cast<size_t>(k)),
        scores(static_cast<size_t>(row)),
        choice(static_cast<size_t>(row)) {}
  std::vector<float> fvals;
  std::vector<double> dvals;
  std::vector<int32_t> ids;
  std::vector<double> scores;
  std::vector<double> choice;
};

// Selects the top-k raw logits of one row (ties: lower column first).
inline TopKList<float> select_logits(const float* row, int64_t cols, int64_t k, Scratch& s) {
  TopKList<float> top(s.fvals.data(), s.ids.data(), k);
  top.scan(row, cols, 0);
  return top;
}

// scoring_func + top-k (+ renormalize) * routed_scaling_factor.
// Without a bias the scores are monotone in the logits, so selection runs on
// the raw f32 logits (exact order; no rounding ties) and only the k weights
// (plus the softmax denominator) are computed, in double.
// With e_score_correction_bias (vLLM's fused_topk_bias, LongCat-style zero
// experts): selection by score + bias, weights = unbiased scores.
class TopKRouter final : public RouterBase {
 public:
  TopKRouter(const MoEConfig& c, std::vector<double> bias)
      : RouterBase(c, true, false), bias_(std::move(bias)) {}
  const char* name() const override { return "topk"; }

 protected:
  void route(const RouteArgs& a, int64_t begin, int64_t end) const override {
    const int64_t cols = config_.num_router_logits(), k = config_.top_k;
    const double scale = config_.routed_scaling_factor;
    const ScoringFunc f = config_.scoring_func;
    Scratch s(k, bias_.empty() ? 0 : cols);
    double w[kMaxStackK];
    std::vector<double> wheap(k > kMaxStackK ? static_cast<size_t>(k) : 0);
    double* wk = k > kMaxStackK ? wheap.data() : w;
    for (int64_t t = begin; t < end; ++t) {
      const float* row = a.logits + t * a.logits_ld;
      int32_t* ids = a.ids + t * a.ids_ld;
      float* out = a.weights + t * a.weights_ld;
      const int32_t* sel;
      if (bias_.empty()) {
        TopKList<float> top = select_logits(row, cols, k, s);
        const double m = top.value(0);
        if (f == ScoringFunc::kSoftmax) {
          double denom = 0.0;
          if (config_.renormalize) {
            for (int64_t j = 0; j < k; ++j) denom += rel_exp(top.value(j), m);
          } else {
            for (int64_t c = 0; c < cols; ++c) denom += rel_exp(row[c], m);
          }
          for (int64_t j = 0; j < k; ++j) wk[j] = rel_exp(top.value(j), m) / denom;
        } else {
          for (int64_t j = 0; j < k; ++j) wk[j] = elementwise(f, top.value(j));
        }
        sel = s.ids.data();
      } else {
        double* sc = s.scores.data();
        if (f == ScoringFunc::kSoftmax) {
          double m = row[0];
          for (int64_t c = 1; c < cols; ++c) m = std::max<double>(m, row[c]);
          double denom = 0.0;
          for (int64_t c = 0; c < cols; ++c) denom += (sc[c] = rel_exp(row[c], m));
          for (int64_t c = 0; c < cols; ++c) sc[c] /= denom;
        } else {
          for (int64_t c = 0; c < cols; ++c) sc[c] = elementwise(f, row[c]);
        }
        double* choice = s.choice.data();
        for (int64_t c = 0; c < cols; ++c) choice[c] = sc[c] + bias_[static_cast<size_t>(c)];
        TopKList<double> top(s.dvals.data(), s.ids.data(), k);
        top.scan(choice, cols, 0);
        for (int64_t j = 0; j < k; ++j) wk[j] = sc[s.ids[static_cast<size_t>(j)]];
        sel = s.ids.data();
      }
      if (config_.renormalize && (f != ScoringFunc::kSoftmax || !bias_.empty())) {
        double sum = 0.0, infinite = 0.0;
        for (int64_t j = 0; j < k; ++j) sum += wk[j], infinite += wk[j] == HUGE_VAL;
        const double eps = f == ScoringFunc::kSoftmax ? 0.0 : 1e-20;
        for (int64_t j = 0; j < k; ++j) wk[j] = renormalized(wk[j], sum, eps, infinite);
      }
      for (int64_t j = 0; j < k; ++j) {
        ids[j] = out_id(sel[j]);
        out[j] = static_cast<float>(wk[j] * scale);
      }
    }
  }

 private:
  static constexpr int64_t kMaxStackK = 64;
  static double elementwise(ScoringFunc f, double x) {
    return f == ScoringFunc::kSigmoid ? sigmoid(x) : sqrt_softplus(x);
  }
  std::vector<double> bias_;  // [E + Z] or empty
};

// Top-k over the raw logits (exact order), then weights from the k chosen
// logits only, * routed_scaling_factor:
//   kSoftmaxOverK: softmax over the k (gpt-oss, HF GptOssTopKRouter; equal to
//     softmax -> top-k -> renormalize, so scoring_func/renormalize are ignored);
//   kSigmoid: sigmoid of each, optionally renormalized with the 1e-20 guard
//     (Llama-4, HF Llama4Router; the runner applies it to the expert input when
//     apply_router_weight_on_input is set).
class LogitTopKRouter final : public RouterBase {
 public:
  enum class Weight { kSoftmaxOverK, kSigmoid };
  LogitTopKRouter(const MoEConfig& c, Weight weight, const char* name)
      : RouterBase(c, true, false), weight_(weight), name_(name) {}
  const char* name() const override { return name_; }

 protected:
  void route(const RouteArgs& a, int64_t begin, int64_t end) const override {
    const int64_t cols = config_.num_router_logits(), k = config_.top_k;
    const double scale = config_.routed_scaling_factor;
    Scratch s(k);
    std::vector<double> w(static_cast<size_t>(k));
    for (int64_t t = begin; t < end; ++t) {
      const float* row = a.logits + t * a.logits_ld;
      TopKList<float> top = select_logits(row, cols, k, s);
      double sum = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        w[j] = weight_ == Weight::kSoftmaxOverK ? rel_exp(top.value(j), top.value(0))
                                                : sigmoid(top.value(j));
        sum += w[j];
      }
      const double denom = weight_ == Weight::kSoftmaxOverK ? sum
                           : config_.renormalize            ? sum + 1e-20
                                                            : 1.0;
      int32_t* ids = a.ids + t * a.ids_ld;
      float* out = a.weights + t * a.weights_ld;
      for (int64_t j = 0; j < k; ++j) {
        ids[j] = out_id(top.id(j));
        out[j] = static_cast<float>(w[j] / denom * scale);
      }
    }
  }

 private:
  Weight weight_;
  const char* name_;
};

}  // namespace

std::unique_ptr<Router> make_topk_router(const MoEConfig& config, std::vector<double> bias) {
  return std::make_unique<TopKRouter>(config, std::move(bias));
}
std::unique_ptr<Router> make_topk_softmax_router(const MoEConfig& config) {
  return std::make_unique<LogitTopKRouter>(config, LogitTopKRouter::Weight::kSoftmaxOverK,
                                           "topk_softmax");
}
std::unique_ptr<Router> make_llama4_router(const MoEConfig& config) {
  return std::make_unique<LogitTopKRouter>(config, LogitTopKRouter::Weight::kSigmoid, "llama4");
}

}  // namespace fusedmoe::routing
