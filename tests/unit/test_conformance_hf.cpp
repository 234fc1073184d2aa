// Conformance with HF transformers: every architecture of tests/data/hf, every
// MoE layer, T = 1, 5, 64. The fixtures were written by transformers' own MoE
// blocks (see tests/data/hf and ../shared/fixtures/README.md); we load the
// checkpoint exactly as a user would (config.json -> MoEConfig, safetensors ->
// weights) and compare:
//   - router logits with HF's (f32, 1e-5 relative L2),
//   - top-k id sets per token (exact) and weights (1e-5 absolute),
//   - the block output with the float64 output: f32 compute <= 1e-5, bf16 <= 1e-2,
// once with our gate GEMM and once with HF's router logits passed in.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/loader.h"
#include "fusedmoe/io/safetensors.h"
#include "fusedmoe/runner/moe_runner.h"
#include "test_util.h"

using namespace fusedmoe;

namespace {

const std::vector<std::string> kArchs = {"mixtral",     "qwen2_moe", "qwen3_moe", "olmoe",
                                         "deepseek_v3", "gpt_oss",   "llama4"};
const int kTokens[] = {1, 5, 64};

std::string fixture_dir(const std::string& arch) {
  return std::string(FUSEDMOE_TEST_DATA_DIR) + "/hf/" + arch;
}

// (expert id, weight) pairs of one token, sorted by id; -1 slots dropped.
std::vector<std::pair<int, double>> token_choice(const std::vector<double>& ids,
                                                 const std::vector<double>& weights, int64_t t,
                                                 int64_t k) {
  std::vector<std::pair<int, double>> r;
  for (int64_t j = 0; j < k; ++j) {
    const int id = static_cast<int>(ids[t * k + j]);
    if (id >= 0) r.emplace_back(id, weights[t * k + j]);
  }
  std::sort(r.begin(), r.end());
  return r;
}

// HF's choice per token: from topk_ids/topk_weights, or llama4's dense router_scores.
std::vector<std::pair<int, double>> hf_choice(const SafetensorsFile& ref, const std::string& key,
                                              int64_t t, int64_t k) {
  if (ref.contains(key + ".router_scores")) {
    const Tensor scores = ref.get(key + ".router_scores");
    const auto s = test::to_f64_vector(scores);
    const int64_t E = scores.size(1);
    std::vector<std::pair<int, double>> r;
    for (int64_t e = 0; e < E; ++e)
      if (s[t * E + e] != 0.0) r.emplace_back(static_cast<int>(e), s[t * E + e]);
    return r;
  }
  return token_choice(test::to_f64_vector(ref.get(key + ".topk_ids")),
                      test::to_f64_vector(ref.get(key + ".topk_weights")), t, k);
}

class HfConformance : public ::testing::TestWithParam<std::string> {};

void check_layer(const std::string& arch, const ModelInfo& info, const Checkpoint& ckpt,
                 const SafetensorsFile& ref, int64_t layer, DType compute_dtype) {
  const MoEConfig& cfg = info.layer_config(layer);
  RunnerOptions opts;
  opts.compute_dtype = compute_dtype;
  MoERunner runner(cfg, load_moe_layer(ckpt, info, layer, LoadOptions{false}), opts);
  const int64_t H = cfg.hidden_size, k = cfg.top_k, EL = cfg.num_router_logits();
  const double tol = compute_dtype == DType::kF32 ? 1e-5 : 1e-2;

  for (int T : kTokens) {
    const std::string key = "layers." + std::to_string(layer) + ".T" + std::to_string(T);
    SCOPED_TRACE(arch + " " + key + " compute " + dtype_name(compute_dtype));
    const Tensor input = to_f32(ref.get(key + ".input"));
    ASSERT_EQ(input.size(0), T);
    ASSERT_EQ(input.size(1), H);
    const Tensor want = ref.get(key + ".output_f64");
    const Tensor hf_logits = to_f32(ref.get(key + ".router_logits"));

    // 1) Our gate GEMM and router.
    Tensor out = Tensor::empty(DType::kF32, {T, H});
    Tensor logits = Tensor::empty(DType::kF32, {T, EL});
    Tensor ids = Tensor::empty(DType::kI32, {T, k});
    Tensor weights = Tensor::empty(DType::kF32, {T, k});
    for (const Tensor* t : {&out, &logits, &ids, &weights}) test::poison(*t);
    ForwardOutputs fo{logits, ids, weights};
    runner.forward(input, out, nullptr, nullptr, &fo);
    EXPECT_EQ(test::count_non_finite(out), 0);
    EXPECT_LE(test::rel_l2(logits, hf_logits), 1e-5) << "router_logits";
    const auto our_ids = test::to_f64_vector(ids), our_w = test::to_f64_vector(weights);
    for (int64_t t = 0; t < T; ++t) {
      const auto ours = token_choice(our_ids, our_w, t, k);
      const auto theirs = hf_choice(ref, key, t, k);
      ASSERT_EQ(ours.size(), theirs.size()) << "token " << t;
      for (size_t j = 0; j < ours.size(); ++j) {
        EXPECT_EQ(ours[j].first, theirs[j].first) << "token " << t << " slot " << j;
        EXPECT_NEAR(ours[j].second, theirs[j].second, 1e-5)
            << "token " << t << " expert " << ours[j].first;
      }
    }
    const double err = test::rel_l2(out, want);
    EXPECT_LE(err, tol) << "output vs HF output_f64";

    // 2) HF's router logits passed in: same result within tolerance.
    Tensor out2 = Tensor::empty(DType::kF32, {T, H});
    test::poison(out2);
    runner.forward(input, out2, &hf_logits.view());
    EXPECT_EQ(test::count_non_finite(out2), 0);
    EXPECT_LE(test::rel_l2(out2, want), tol) << "output with HF router_logits";
  }
}

TEST_P(HfConformance, EveryMoELayerMatchesTransformers) {
  const std::string arch = GetParam();
  const std::string dir = fixture_dir(arch);
  const ModelInfo info = load_model_info(dir);
  const Checkpoint ckpt = Checkpoint::open(dir);
  const auto ref = SafetensorsFile::open(dir + "/reference.safetensors");
  ASSERT_FALSE(info.moe_layers.empty());
  for (int64_t layer : info.moe_layers) {
    check_layer(arch, info, ckpt, *ref, layer, DType::kF32);
    check_layer(arch, info, ckpt, *ref, layer, DType::kBF16);
  }
}

INSTANTIATE_TEST_SUITE_P(AllArchitectures, HfConformance, ::testing::ValuesIn(kArchs),
                         [](const auto& p) { return p.param; });

}  // namespace
