// mpirun -np N: MoERunner over N CPU ranks (EP, TP, EP x TP, DP + EP) against
// the single-rank MoERunner on the same tokens: random layers shaped like each
// architecture (shared experts, Qwen2 shared gate, Llama-4 weight on input,
// gpt-oss biases, DeepSeek grouped routing, zero experts), and the HF fixtures
// loaded per rank (LoadOptions.parallel). Uneven T per rank, T = 0 on some.
// EP alone: bit-identical; TP / DP + EP: within 1e-6 relative.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <thread>
#include <tuple>

#include "fixtures.h"
#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/loader.h"
#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/runner/moe_runner.h"
#include "parallel_test_util.h"

namespace fusedmoe {
namespace {

std::shared_ptr<Communicator> g_world;

struct Layout {
  int ep, tp, dp;
};

std::vector<Layout> layouts(int W) {
  std::vector<Layout> v{{W, 1, 1}, {1, W, 1}, {W, 1, W}};
  if (W % 2 == 0 && W > 2) {
    v.push_back({W / 2, 2, 1});
    v.push_back({W / 2, 2, W / 2});
  }
  return v;
}

using test::base_config;

std::vector<std::pair<std::string, MoEConfig>> arch_configs() {
  std::vector<std::pair<std::string, MoEConfig>> v;
  for (const auto& [arch, E, k, H, I] :
       std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, int64_t>>{
           {"mixtral", 9, 2, 64, 48},
           {"qwen2_moe", 11, 4, 72, 40},
           {"deepseek_v3", 16, 8, 64, 24},
           {"gpt_oss", 7, 2, 80, 32},
           {"llama4", 9, 1, 64, 40},
           {"zero_experts", 10, 3, 48, 36},
       })
    v.emplace_back(arch, test::arch_config(arch, E, k, H, I));
  return v;
}

// Runs `config` + `full` (or this rank's `local` share) over the layout and
// compares this rank's rows with the single-rank output `ref` of all tokens.
void check_layout(const Layout& L, const ParallelGroups& groups, MoEConfig config,
                  MoELayerWeights weights, DType compute, const Tensor& hidden,
                  const std::vector<int64_t>& off, const Tensor& ref, const std::string& what) {
  config.parallel = groups.config;
  RunnerOptions ro;
  ro.compute_dtype = compute;
  ro.communicator = g_world;
  MoERunner runner(config, std::move(weights), ro);
  const int g = g_world->rank() / L.tp;
  const int64_t T = off[g + 1] - off[g], H = config.hidden_size;
  Tensor out = Tensor::empty(DType::kF32, {T, H});
  test::poison(out.view());
  runner.forward(hidden.view().narrow(0, off[g], T), out.view());
  char buf[200];
  std::snprintf(buf, sizeof buf, "%s: world %d ep %d tp %d dp %d rank %d, %lld of %lld tokens",
                what.c_str(), g_world->size(), L.ep, L.tp, L.dp, g_world->rank(), (long long)T,
                (long long)ref.size(0));
  SCOPED_TRACE(buf);
  EXPECT_EQ(test::count_non_finite(out.view()), 0);
  if (T == 0) return;
  const TensorView want = ref.view().narrow(0, off[g], T);
  if (L.tp == 1 && !(L.dp > 1 && L.ep > 1))
    EXPECT_TRUE(test::bit_identical(out.view(), want))
        << "max |diff| " << test::max_abs_diff(out.view(), want);
  else
    EXPECT_LE(test::rel_l2(out.view(), want), 1e-6);
}

std::vector<int64_t> random_offsets(std::mt19937_64& rng, int G, int64_t max_t) {
  std::vector<int64_t> off(G + 1, 0);
  for (int g = 0; g < G; ++g)
    off[g + 1] = off[g] + (rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % (max_t + 1)));
  return off;
}

TEST(ParallelRunner, RandomLayersOfEachArchitecture) {
  const uint64_t seed = test::shared_seed(*g_world);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (FUSEDMOE_TEST_SEED to replay)");
  std::mt19937_64 rng(seed);
  for (const Layout& L : layouts(g_world->size())) {
    const ParallelGroups groups = ParallelGroups::create(g_world, L.ep, L.tp, L.dp);
    for (const auto& [name, c0] : arch_configs()) {
      MoEConfig c = c0;
      if (rng() % 2) c.parallel.expert_placement = ExpertPlacement::kRoundRobin;
      const DType wdt = rng() % 2 ? DType::kBF16 : DType::kF32;
      const DType compute = rng() % 3 == 0 ? DType::kBF16 : DType::kF32;
      const MoELayerWeights full = test::random_layer(rng, c, wdt);
      const int G = L.dp > 1 ? L.dp : L.ep;
      const std::vector<int64_t> off = random_offsets(rng, G, 29);
      Tensor hidden = test::randn_f32(rng, {off[G], c.hidden_size});
      RunnerOptions ro;
      ro.compute_dtype = compute;
      MoERunner single(c, full, ro);
      Tensor ref = Tensor::empty(DType::kF32, {off[G], c.hidden_size});
      single.forward(hidden.view(), ref.view());
      c.parallel.ep_size = L.ep;  // placement kept; check_layout sets the rest
      check_layout(L, groups, c, full, compute, hidden, off, ref,
                   name + " " + dtype_name(wdt) + "/" + dtype_name(compute) + " " +
                       to_string(c.parallel.expert_placement));
    }
  }
}

TEST(ParallelRunner, HfFixturesLoadedPerRank) {
  const uint64_t seed = test::shared_seed(*g_world);
  std::mt19937_64 rng(seed);
  for (const Layout& L : layouts(g_world->size())) {
    const ParallelGroups groups = ParallelGroups::create(g_world, L.ep, L.tp, L.dp);
    for (const std::string& arch : test::hf_fixture_archs()) {
      const std::string dir = test::hf_fixture_dir(arch);
      const ModelInfo info = load_model_info(dir);
      const Checkpoint ckpt = Checkpoint::open(dir);
      auto ref_file = test::open_reference(arch);
      const int64_t layer = info.moe_layers.front();
      const std::vector<int64_t> Ts = test::reference_token_counts(*ref_file, layer);
      const int64_t Tall = Ts.back();
      const Tensor hidden =
          test::load_tensor_f32(*ref_file, test::reference_name(layer, Tall, "input"));
      MoEConfig c = info.layer_config(layer);
      if (L.ep > c.num_experts || L.tp > c.intermediate_size) continue;
      LoadOptions quiet;
      quiet.progress = false;
      MoERunner single(c, load_moe_layer(ckpt, info, layer, quiet));
      Tensor ref = Tensor::empty(DType::kF32, {Tall, c.hidden_size});
      single.forward(hidden.view(), ref.view());
      // Same output as HF (the fixture's own check, loosely: f32 weights or bf16).
      const Tensor hf =
          test::load_tensor_f32(*ref_file, test::reference_name(layer, Tall, "output"));
      EXPECT_LE(test::rel_l2(ref.view(), hf.view()), 1e-2) << arch;

      const int G = L.dp > 1 ? L.dp : L.ep;
      // Uneven split, the first group empty.
      std::vector<int64_t> off(G + 1, 0);
      for (int g = 1; g < G; ++g) off[g + 1] = off[g] + (Tall * g) / (G * (G - 1) / 2 + 1);
      off[G] = Tall;
      c.parallel = parallel_config_for_rank(g_world->rank(), L.ep, L.tp, L.dp);
      LoadOptions mine = quiet;
      mine.parallel = c.parallel;
      check_layout(L, groups, c, load_moe_layer(ckpt, info, layer, mine), DType::kF32, hidden, off,
                   ref, "fixture " + arch);
    }
  }
}

}  // namespace
}  // namespace fusedmoe

int main(int argc, char** argv) {
  return fusedmoe::test::run_mpi_tests(argc, argv, fusedmoe::g_world);
}
