// mpirun -np N: routed experts spread over N CPU ranks (EP, TP, EP x TP,
// DP + EP) against the single-rank modular kernel on the same tokens.
// Random layers: E not a multiple of ep_size, k up to 8, uneven T per rank,
// T = 0 on some ranks, "no expert" slots, f32/bf16 weights and compute,
// biases, every activation, both placements, FP8 dispatch, weight on input.
// EP alone must be bit-identical; layouts that split sums (TP, DP + EP)
// within 1e-6 relative.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <thread>

#include "expect_error.h"
#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/parallel/distributed_experts.h"
#include "parallel_test_util.h"

namespace fusedmoe {
namespace {

std::shared_ptr<Communicator> g_world;

struct Layout {
  int ep, tp, dp;
};

// Layouts of world size W.
std::vector<Layout> layouts(int W) {
  std::vector<Layout> v;
  v.push_back({W, 1, 1});  // EP
  v.push_back({1, W, 1});  // TP
  v.push_back({W, 1, W});  // DP + EP (naive)
  if (W % 2 == 0 && W > 2) {
    v.push_back({W / 2, 2, 1});      // EP x TP
    v.push_back({W / 2, 2, W / 2});  // DP + EP, TP inside
  }
  v.push_back({1, 1, W});  // DP, experts replicated
  return v;
}

// One random layer and batch; returns after comparing this rank's tokens.
void run_case(std::mt19937_64& rng, const Layout& L, const ParallelGroups& groups, bool force_fp8) {
  const int W = g_world->size();
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  const int k = std::vector<int>{1, 2, 3, 4, 6, 8}[pick(rng) % 6];
  // E >= max(k, ep_size), and not a multiple of ep_size where ep_size > 1.
  int64_t E = std::max<int64_t>(k, L.ep) + pick(rng) % 9;
  if (L.ep > 1 && E % L.ep == 0) ++E;
  const int64_t H = std::vector<int64_t>{32, 72, 136, 200}[pick(rng) % 4];
  const int64_t I = std::max<int64_t>(L.tp, std::vector<int64_t>{8, 24, 40}[pick(rng) % 3]);
  const DType wdt = pick(rng) % 2 ? DType::kBF16 : DType::kF32;
  ExpertsParams params;
  params.compute_dtype = pick(rng) % 3 == 0 ? DType::kBF16 : DType::kF32;
  params.activation.activation =
      std::vector<Activation>{Activation::kSiluGlu, Activation::kGeluGlu, Activation::kGeluTanhGlu,
                              Activation::kSwigluOai}[pick(rng) % 4];
  const bool bias = pick(rng) % 3 == 0;
  const bool on_input = k == 1 && pick(rng) % 2 == 0;
  DistributedOptions opts;
  opts.placement = pick(rng) % 2 ? ExpertPlacement::kRoundRobin : ExpertPlacement::kContiguous;
  const bool ep_a2a = L.ep > 1 && L.dp == 1;
  // A payload dtype only where there is a dispatch (else auto: DistributedExperts refuses it).
  opts.dispatch_dtype = !ep_a2a ? DispatchDType::kAuto
                        : force_fp8
                            ? DispatchDType::kFP8
                            : std::vector<DispatchDType>{DispatchDType::kAuto, DispatchDType::kF32,
                                                         DispatchDType::kFP8}[pick(rng) % 3];
  const bool fp8 = ep_a2a && opts.dispatch_dtype == DispatchDType::kFP8;

  // Tokens of each token group (EP rank or DP rank), some groups empty.
  const int G = L.dp > 1 ? L.dp : L.ep;
  std::vector<int64_t> Tg(G), off(G + 1, 0);
  for (int g = 0; g < G; ++g) {
    Tg[g] = std::vector<int64_t>{0, 1, 2, 5, 13, 31, 47}[pick(rng) % 7];
    off[g + 1] = off[g] + Tg[g];
  }
  const int64_t T = off[G];
  const ExpertWeights full = test::random_experts(rng, E, H, I, wdt, bias);
  Tensor hidden = test::randn_f32(rng, {T, H});
  Tensor ids, weights;
  test::random_routing(rng, T, k, E, pick(rng) % 2 ? 0.15 : 0.0, ids, weights);

  // Single-rank reference (FP8: on the hidden states the dispatch delivers).
  Tensor ref_in = hidden;
  if (fp8) {
    ref_in = Tensor::empty(DType::kF32, {T, H});
    std::vector<uint8_t> q(T * H);
    std::vector<float> sc(T * ((H + 127) / 128));
    quantize_fp8_groups(hidden.data_as<float>(), T, H, H, 128, q.data(), sc.data());
    dequantize_fp8_groups(q.data(), sc.data(), T, H, 128, ref_in.data_as<float>(), H);
  }
  const Tensor ref =
      test::single_rank_routed(ref_in.view(), ids.view(), weights.view(), full, params, on_input);

  // This rank's part.
  const ParallelConfig& pc = groups.config;
  const int g = g_world->rank() / L.tp;
  const ExpertMap map(E, pc.ep_size, opts.placement);
  const std::vector<int64_t> mine = map.local_experts(pc.ep_rank);
  ExpertWeights local = shard_expert_weights(full, mine, pc.tp_size, pc.tp_rank);
  MoEConfig config = test::base_config(E, k, H, I);
  config.has_expert_bias = bias;
  DistributedExperts de(config, groups, std::move(local), opts);
  Tensor out = Tensor::empty(DType::kF32, {Tg[g], H});
  test::poison(out.view());
  Workspace ws;
  de.forward(test::rows_of(hidden, off[g], Tg[g]), test::rows_of(ids, off[g], Tg[g]),
             test::rows_of(weights, off[g], Tg[g]), params, on_input, out.view(), ws);
  de.reduce_tp(out.view());

  char what[320];
  std::snprintf(what, sizeof what,
                "world %d, ep %d tp %d dp %d, rank %d: E %lld k %d H %lld I %lld w %s compute %s "
                "bias %d on_input %d %s dispatch %s, T %lld of %lld",
                W, L.ep, L.tp, L.dp, g_world->rank(), (long long)E, k, (long long)H, (long long)I,
                dtype_name(wdt), dtype_name(params.compute_dtype), bias, on_input,
                to_string(opts.placement), to_string(opts.dispatch_dtype), (long long)Tg[g],
                (long long)T);
  SCOPED_TRACE(what);
  const TensorView want = test::rows_of(ref, off[g], Tg[g]);
  EXPECT_EQ(test::count_non_finite(out.view()), 0);
  if (Tg[g] == 0) return;
  const bool exact = L.tp == 1 && !(L.dp > 1 && L.ep > 1);
  if (exact) {
    EXPECT_TRUE(test::bit_identical(out.view(), want))
        << "max |diff| " << test::max_abs_diff(out.view(), want);
  } else {
    EXPECT_LE(test::rel_l2(out.view(), want), 1e-6);
  }
  if (ep_a2a) {
    const EpStats* st = de.ep_stats();
    ASSERT_NE(st, nullptr);
    // One row per (token, destination rank), not one per expert.
    int64_t rows = 0;
    for (int64_t t = off[g]; t < off[g + 1]; ++t) {
      std::vector<bool> hit(pc.ep_size, false);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t id = ids.data_as<int32_t>()[t * k + j];
        if (id >= 0 && !hit[map.rank_of(id)]) hit[map.rank_of(id)] = true, ++rows;
      }
    }
    EXPECT_EQ(st->dispatch_rows_sent, rows);
  }
}

TEST(ParallelMoE, EveryLayoutMatchesSingleRank) {
  const uint64_t seed = test::shared_seed(*g_world);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (FUSEDMOE_TEST_SEED to replay)");
  std::mt19937_64 rng(seed);
  for (const Layout& L : layouts(g_world->size())) {
    const ParallelGroups groups = ParallelGroups::create(g_world, L.ep, L.tp, L.dp);
    for (int c = 0; c < 6; ++c) run_case(rng, L, groups, false);
    if (L.ep > 1 && L.dp == 1) run_case(rng, L, groups, true);
  }
}

// Every rank has no tokens: collectives still meet, nothing is written.
TEST(ParallelMoE, AllRanksEmpty) {
  const int W = g_world->size();
  for (const Layout& L : {Layout{W, 1, 1}, Layout{W, 1, W}}) {
    const ParallelGroups groups = ParallelGroups::create(g_world, L.ep, L.tp, L.dp);
    std::mt19937_64 rng(test::shared_seed(*g_world));
    MoEConfig config = test::base_config(W + 1, 2, 16, 8);
    const ExpertWeights full = test::random_experts(rng, W + 1, 16, 8, DType::kF32, false);
    const ExpertMap map(W + 1, W);
    DistributedExperts de(
        config, groups, shard_expert_weights(full, map.local_experts(groups.config.ep_rank), 1, 0));
    Tensor h = Tensor::empty(DType::kF32, {0, 16}), ids = Tensor::empty(DType::kI32, {0, 2});
    Tensor w = Tensor::empty(DType::kF32, {0, 2}), out = Tensor::empty(DType::kF32, {0, 16});
    Workspace ws;
    ExpertsParams params;
    EXPECT_NO_THROW(de.forward(h.view(), ids.view(), w.view(), params, false, out.view(), ws));
  }
}

// All tokens of all ranks routed to the experts of one rank (worst-case skew).
TEST(ParallelMoE, AllTokensToOneRank) {
  const int W = g_world->size();
  const ParallelGroups groups = ParallelGroups::create(g_world, W, 1, 1);
  const uint64_t seed = test::shared_seed(*g_world);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t E = 2 * W + 1, H = 48, I = 16, k = 2, Tr = 9;
  const ExpertWeights full = test::random_experts(rng, E, H, I, DType::kF32, false);
  Tensor hidden = test::randn_f32(rng, {Tr * W, H});
  Tensor ids = Tensor::empty(DType::kI32, {Tr * W, k});
  Tensor w = test::random_f32(rng, {Tr * W, k}, 0.1f, 1.0f);
  const ExpertMap map(E, W);
  const std::vector<int64_t> last = map.local_experts(W - 1);  // >= 2 experts
  for (int64_t t = 0; t < Tr * W; ++t) {
    ids.data_as<int32_t>()[t * k] = static_cast<int32_t>(last[1]);
    ids.data_as<int32_t>()[t * k + 1] = static_cast<int32_t>(last[0]);
  }
  ExpertsParams params;
  const Tensor ref =
      test::single_rank_routed(hidden.view(), ids.view(), w.view(), full, params, false);
  MoEConfig config = test::base_config(E, k, H, I);
  DistributedExperts de(config, groups,
                        shard_expert_weights(full, map.local_experts(groups.config.ep_rank), 1, 0));
  Tensor out = Tensor::empty(DType::kF32, {Tr, H});
  test::poison(out.view());
  Workspace ws;
  const int r = g_world->rank();
  de.forward(test::rows_of(hidden, r * Tr, Tr), test::rows_of(ids, r * Tr, Tr),
             test::rows_of(w, r * Tr, Tr), params, false, out.view(), ws);
  EXPECT_TRUE(test::bit_identical(out.view(), test::rows_of(ref, r * Tr, Tr)));
  const EpStats& st = *de.ep_stats();
  EXPECT_EQ(st.dispatch_rows_sent, Tr);
  EXPECT_EQ(st.dispatch_rows_received, r == W - 1 ? Tr * W : 0);
}

// A dispatch payload dtype where nothing is dispatched (data parallelism with
// EP, or one rank): an error naming it, not a silently ignored option.
TEST(ParallelMoE, DispatchDtypeWithoutDispatchIsRefused) {
  const int W = g_world->size(), me = g_world->rank();
  std::mt19937_64 rng(test::shared_seed(*g_world));
  const MoEConfig config = test::base_config(2 * W, 2, 16, 8);
  const ExpertWeights full = test::random_experts(rng, 2 * W, 16, 8, DType::kF32, false);
  DistributedOptions opts;
  opts.dispatch_dtype = DispatchDType::kFP8;
  {
    const ParallelGroups groups = ParallelGroups::create(g_world, W, 1, W);  // DP + EP
    const ExpertMap map(2 * W, W);
    EXPECT_HAS(test::error_of(
                   [&] {
                     DistributedExperts de(config, groups,
                                           shard_expert_weights(full, map.local_experts(me), 1, 0),
                                           opts);
                   },
                   ErrorCode::kInvalidArgument),
               "dispatch_dtype: expected auto with ep_size " + std::to_string(W) + " and dp_size " +
                   std::to_string(W));
  }
  {
    const ParallelGroups groups = ParallelGroups::single();
    const ExpertMap map(2 * W, 1);
    EXPECT_HAS(test::error_of(
                   [&] {
                     DistributedExperts de(config, groups,
                                           shard_expert_weights(full, map.local_experts(0), 1, 0),
                                           opts);
                   },
                   ErrorCode::kInvalidArgument),
               "got fp8");
  }
  // The world is still usable.
  EXPECT_EQ(g_world->all_gather_int64(me)[W - 1], W - 1);
}

// Ranks built with another dispatch dtype (or placement): an error on every
// rank naming it, at construction, before any exchange of rows of other sizes.
TEST(ParallelMoE, RanksThatDisagreeFailAtConstruction) {
  const int W = g_world->size(), me = g_world->rank();
  const ParallelGroups groups = ParallelGroups::create(g_world, W, 1, 1);
  std::mt19937_64 rng(test::shared_seed(*g_world));
  const MoEConfig config = test::base_config(2 * W, 2, 16, 8);
  const ExpertWeights full = test::random_experts(rng, 2 * W, 16, 8, DType::kF32, false);
  const ExpertMap map(2 * W, W);
  DistributedOptions opts;
  opts.dispatch_dtype = me == 0 ? DispatchDType::kFP8 : DispatchDType::kF32;
  try {
    DistributedExperts de(config, groups, shard_expert_weights(full, map.local_experts(me), 1, 0),
                          opts);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string others = W > 2 ? "f32 on ranks 1,2" : "f32 on rank 1";
    EXPECT_NE(
        std::string(e.what()).find(
            "DistributedExperts: the ranks disagree on dispatch_dtype: fp8 on rank 0, " + others),
        std::string::npos)
        << e.what();
  }
  // The world is still usable.
  EXPECT_EQ(g_world->all_gather_int64(me)[W - 1], W - 1);
}

}  // namespace
}  // namespace fusedmoe

int main(int argc, char** argv) {
  return fusedmoe::test::run_mpi_tests(argc, argv, fusedmoe::g_world);
}
