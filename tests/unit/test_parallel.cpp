// Single-process tests of the parallel part: expert placement, weight
// shards, the single-rank communicator and layouts, FP8 dispatch
// quantization, and the distributed experts on one rank. Multi-rank runs are
// in tests/parallel (mpirun).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>

#include "../parallel/parallel_test_util.h"
#include "fixtures.h"
#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/loader.h"
#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/parallel/distributed_experts.h"
#include "fusedmoe/parallel/ep_prepare_finalize.h"
#include "fusedmoe/parallel/expert_map.h"

namespace fusedmoe {
namespace {

TEST(ExpertMap, ContiguousAndRoundRobinCoverEveryExpertOnce) {
  for (int64_t E : {1, 5, 7, 8, 13, 64})
    for (int P = 1; P <= std::min<int64_t>(E, 6); ++P)
      for (ExpertPlacement pl : {ExpertPlacement::kContiguous, ExpertPlacement::kRoundRobin}) {
        SCOPED_TRACE(std::to_string(E) + " experts over " + std::to_string(P) + " " +
                     to_string(pl));
        const ExpertMap m(E, P, pl);
        std::vector<int> seen(E, 0);
        int64_t total = 0;
        for (int r = 0; r < P; ++r) {
          const std::vector<int64_t> mine = m.local_experts(r);
          const std::vector<int32_t> g2l = m.global_to_local(r);
          ASSERT_EQ(static_cast<int64_t>(mine.size()), m.num_local_experts(r));
          // Balanced: counts differ by at most one.
          EXPECT_GE(m.num_local_experts(r), E / P);
          EXPECT_LE(m.num_local_experts(r), (E + P - 1) / P);
          total += mine.size();
          for (size_t i = 0; i < mine.size(); ++i) {
            ++seen[mine[i]];
            EXPECT_EQ(m.rank_of(mine[i]), r);
            EXPECT_EQ(m.local_id(mine[i]), static_cast<int64_t>(i));
            EXPECT_EQ(g2l[mine[i]], static_cast<int32_t>(i));
          }
          int64_t local = 0;
          for (int64_t e = 0; e < E; ++e) local += g2l[e] >= 0;
          EXPECT_EQ(local, m.num_local_experts(r)) << "g2l has -1 for other ranks' experts";
        }
        EXPECT_EQ(total, E);
        for (int64_t e = 0; e < E; ++e) EXPECT_EQ(seen[e], 1);
      }
}

TEST(ExpertMap, PlacementsByExample) {
  const ExpertMap c(7, 3);  // 3, 2, 2
  EXPECT_EQ(c.local_experts(0), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(c.local_experts(1), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(c.local_experts(2), (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(c.global_to_local(1), (std::vector<int32_t>{-1, -1, -1, 0, 1, -1, -1}));
  const ExpertMap rr(7, 3, ExpertPlacement::kRoundRobin);
  EXPECT_EQ(rr.local_experts(0), (std::vector<int64_t>{0, 3, 6}));
  EXPECT_EQ(rr.local_experts(2), (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(rr.global_to_local(2), (std::vector<int32_t>{-1, -1, 0, -1, -1, 1, -1}));
  EXPECT_EQ(parse_expert_placement("round-robin"), ExpertPlacement::kRoundRobin);
  EXPECT_THROW(parse_expert_placement("random"), Error);
}

TEST(ExpertMap, RejectsBadSizes) {
  EXPECT_THROW(ExpertMap(0, 1), Error);
  EXPECT_THROW(ExpertMap(4, 0), Error);
  try {
    ExpertMap(4, 5);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ep_size: expected in [1, num_experts = 4], got 5"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ExpertMap(4, 2).local_experts(2), Error);
}

TEST(ShardExpertWeights, SlicesGateUpHalvesW2ColumnsAndBiasOnce) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const int64_t E = 5, H = 12, I = 10;
    const ExpertWeights full = test::random_experts(rng, E, H, I, dt, true);
    const std::vector<int64_t> experts{4, 1, 3};
    const int tp = 3;
    int64_t covered = 0;
    for (int r = 0; r < tp; ++r) {
      const auto [i0, It] = tp_slice(I, tp, r);
      EXPECT_EQ(i0, covered);
      covered += It;
      const ExpertWeights s = shard_expert_weights(full, experts, tp, r);
      s.validate(3, H, It, true, "shard");
      const std::vector<double> f13 = test::to_f64_vector(full.w13),
                                s13 = test::to_f64_vector(s.w13);
      const std::vector<double> f2 = test::to_f64_vector(full.w2), s2 = test::to_f64_vector(s.w2);
      const std::vector<double> fb13 = test::to_f64_vector(*full.w13_bias);
      const std::vector<double> sb13 = test::to_f64_vector(*s.w13_bias);
      const std::vector<double> fb2 = test::to_f64_vector(*full.w2_bias);
      const std::vector<double> sb2 = test::to_f64_vector(*s.w2_bias);
      for (int64_t n = 0; n < 3; ++n) {
        const int64_t e = experts[n];
        for (int64_t i = 0; i < It; ++i)
          for (int64_t h = 0; h < H; ++h) {
            ASSERT_EQ(s13[(n * 2 * It + i) * H + h], f13[(e * 2 * I + i0 + i) * H + h]);
            ASSERT_EQ(s13[(n * 2 * It + It + i) * H + h], f13[(e * 2 * I + I + i0 + i) * H + h]);
            ASSERT_EQ(s2[(n * H + h) * It + i], f2[(e * H + h) * I + i0 + i]);
          }
        for (int64_t i = 0; i < It; ++i) {
          EXPECT_EQ(sb13[n * 2 * It + i], fb13[e * 2 * I + i0 + i]);
          EXPECT_EQ(sb13[n * 2 * It + It + i], fb13[e * 2 * I + I + i0 + i]);
        }
        for (int64_t h = 0; h < H; ++h)
          EXPECT_EQ(sb2[n * H + h], r == 0 ? fb2[e * H + h] : 0.0) << "w2_bias only on tp_rank 0";
      }
    }
    EXPECT_EQ(covered, I);
    // A contiguous run without TP shares the storage.
    const std::vector<int64_t> run{2, 3};
    const ExpertWeights v = shard_expert_weights(full, run, 1, 0);
    EXPECT_EQ(v.w13.storage(), full.w13.storage());
    EXPECT_EQ(v.w13.size(0), 2);
  }
  EXPECT_THROW(tp_slice(4, 5, 0), Error);
}

TEST(SingleRankCommunicator, CollectivesAreLocalCopies) {
  auto c = make_single_rank_communicator();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->backend(), "single");
  std::vector<int64_t> n{3}, d{0};
  const char send[3] = {'a', 'b', 'c'};
  char recv[3] = {0, 0, 0};
  c->all_to_all_v(send, n, d, recv, n, d);
  EXPECT_EQ(std::string(recv, 3), "abc");
  float v[2] = {1.5f, -2.0f}, out[2] = {0, 0};
  c->all_reduce_sum(v, 2);
  EXPECT_EQ(v[0], 1.5f);
  std::vector<int64_t> two{2};
  c->reduce_scatter_sum(v, out, two);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(c->all_gather_int64(42), std::vector<int64_t>{42});
  EXPECT_THROW(c->broadcast(v, 4, 1), Error);
  std::vector<int64_t> wrong{3, 0}, wrong_d{0, 0};
  EXPECT_THROW(c->all_to_all_v(send, wrong, wrong_d, recv, wrong, wrong_d), Error);
}

TEST(ParallelGroups, LayoutAndErrors) {
  const ParallelConfig a = parallel_config_for_rank(5, 4, 2, 1);
  EXPECT_EQ(a.ep_rank, 2);
  EXPECT_EQ(a.tp_rank, 1);
  const ParallelConfig b = parallel_config_for_rank(3, 4, 1, 4);
  EXPECT_EQ(b.dp_rank, 3);
  EXPECT_EQ(b.ep_rank, 3);
  std::shared_ptr<Communicator> one = make_single_rank_communicator();
  const ParallelGroups g = ParallelGroups::create(one, 1, 1, 1);
  EXPECT_EQ(g.ep->size(), 1);
  try {
    ParallelGroups::create(one, 2, 1, 1);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("world size: expected 2 ranks"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ParallelGroups::create(one, 2, 1, 3), Error);  // ep not in {1, dp}
  EXPECT_THROW(ParallelGroups::create(one, 1, 0, 1), Error);
}

TEST(Communicator, TimeoutFromEnvironmentAndWorld) {
  ::unsetenv("FUSEDMOE_COMM_TIMEOUT_S");
  EXPECT_EQ(comm_timeout_seconds(), 60.0);
  ::setenv("FUSEDMOE_COMM_TIMEOUT_S", "2.5", 1);
  EXPECT_EQ(comm_timeout_seconds(), 2.5);
  ::setenv("FUSEDMOE_COMM_TIMEOUT_S", "1e9", 1);  // the largest: ~31 years
  EXPECT_EQ(comm_timeout_seconds(), 1e9);
  // 1e10 s is beyond the int64 nanoseconds of a deadline: it used to time out at once.
  // Plain decimal only (the CLI's numbers): no spaces, hexadecimal or other forms.
  for (const char* bad : {"0", "-1", "abc", "5s", "", " ", "1e10", "1e300", "inf", "nan", " 16",
                          "16 ", "0x10", "0x1p3", "1e999"}) {
    ::setenv("FUSEDMOE_COMM_TIMEOUT_S", bad, 1);
    if (!*bad) {
      EXPECT_EQ(comm_timeout_seconds(), 60.0);  // empty: the default
      continue;
    }
    try {
      comm_timeout_seconds();
      ADD_FAILURE() << "no error for \"" << bad << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "FUSEDMOE_COMM_TIMEOUT_S: expected a decimal number of seconds in (0, "
                    "1e+09], got \"" +
                    std::string(bad) + "\""),
                std::string::npos)
          << e.what();
    }
  }
  ::unsetenv("FUSEDMOE_COMM_TIMEOUT_S");
  if (!launched_by_mpi()) EXPECT_EQ(make_world_communicator()->backend(), "single");
  if (!mpi_built()) EXPECT_THROW(make_mpi_communicator(), Error);
}

TEST(Communicator, LauncherWorldSize) {
  const char* names[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS", "PMIX_RANK"};
  std::string saved[4];
  bool had[4];
  for (int i = 0; i < 4; ++i) {
    const char* v = std::getenv(names[i]);
    had[i] = v != nullptr;
    if (v) saved[i] = v;
    ::unsetenv(names[i]);
  }
  EXPECT_EQ(launcher_world_size(), -1);
  ::setenv("SLURM_STEP_NUM_TASKS", "5", 1);  // srun without MPI: not a launcher's size
  EXPECT_EQ(launcher_world_size(), -1);
  ::setenv("PMIX_RANK", "0", 1);  // srun --mpi=pmix
  EXPECT_EQ(launcher_world_size(), 5);
  ::setenv("PMI_SIZE", "3", 1);  // MPICH / Intel MPI
  EXPECT_EQ(launcher_world_size(), 3);
  ::setenv("OMPI_COMM_WORLD_SIZE", "4", 1);  // Open MPI first
  EXPECT_EQ(launcher_world_size(), 4);
  ::setenv("OMPI_COMM_WORLD_SIZE", "x", 1);
  EXPECT_EQ(launcher_world_size(), 3);
  for (int i = 0; i < 4; ++i) {
    if (had[i])
      ::setenv(names[i], saved[i].c_str(), 1);
    else
      ::unsetenv(names[i]);
  }
}

TEST(Communicator, SameOnAllRanksOnOneRank) {
  auto one = make_single_rank_communicator();
  check_same_on_all_ranks(*one, {{"--tokens", "8"}, {"--seed", ""}}, "test");
  check_same_on_all_ranks(*one, {}, "test");
}

TEST(Fp8Dispatch, GroupQuantizationRoundTrip) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t rows = 7, H = 300;  // groups of 128, 128, 44
  Tensor x = test::randn_f32(rng, {rows, H}, 3.0f);
  x.data_as<float>()[H + 5] = 1000.0f;  // one large value: its group's scale only
  std::vector<uint8_t> q(rows * H);
  std::vector<float> sc(rows * 3);
  quantize_fp8_groups(x.data_as<float>(), rows, H, H, 128, q.data(), sc.data());
  Tensor y = Tensor::empty(DType::kF32, {rows, H});
  dequantize_fp8_groups(q.data(), sc.data(), rows, H, 128, y.data_as<float>(), H);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < 3; ++g) {
      float amax = 0;
      for (int64_t h = g * 128; h < std::min<int64_t>(H, g * 128 + 128); ++h)
        amax = std::max(amax, std::fabs(x.data_as<float>()[r * H + h]));
      EXPECT_FLOAT_EQ(sc[r * 3 + g], amax / 448.0f);
      for (int64_t h = g * 128; h < std::min<int64_t>(H, g * 128 + 128); ++h) {
        const float a = x.data_as<float>()[r * H + h], b = y.data_as<float>()[r * H + h];
        // e4m3: 3 mantissa bits -> relative error <= 2^-4 for normal values.
        EXPECT_LE(std::fabs(a - b), std::fabs(a) / 16 + sc[r * 3 + g] * 0.002f) << r << "," << h;
      }
    }
  EXPECT_EQ(parse_dispatch_dtype("fp8"), DispatchDType::kFP8);
  EXPECT_THROW(parse_dispatch_dtype("int4"), Error);
}

// One rank: EpPrepareFinalize and DistributedExperts give the modular kernel's bits.
TEST(DistributedExperts, SingleRankMatchesModularKernelBitForBit) {
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (DType compute : {DType::kF32, DType::kBF16}) {
    const int64_t E = 9, k = 3, H = 40, I = 24, T = 23;
    const ExpertWeights full = test::random_experts(rng, E, H, I, DType::kBF16, true);
    Tensor hidden = test::randn_f32(rng, {T, H});
    Tensor ids, w;
    test::random_routing(rng, T, k, E, 0.2, ids, w);
    ExpertsParams params;
    params.compute_dtype = compute;
    const Tensor ref =
        test::single_rank_routed(hidden.view(), ids.view(), w.view(), full, params, false);
    MoEConfig config = test::base_config(E, k, H, I);
    config.has_expert_bias = true;
    DistributedExperts de(config, ParallelGroups::single(), full);
    Tensor out = Tensor::empty(DType::kF32, {T, H});
    test::poison(out.view());
    Workspace ws;
    de.forward(hidden.view(), ids.view(), w.view(), params, false, out.view(), ws);
    EXPECT_TRUE(test::bit_identical(out.view(), ref.view()));

    // The EP prepare/finalize itself over a one-rank group.
    EpPrepareFinalize ep(make_single_rank_communicator(), ExpertMap(E, 1));
    PrepareResult pr = ep.prepare(hidden.view(), ids.view(), w.view(), E, false, compute, ws);
    const int64_t M = pr.permuted.size(0);
    Tensor eo = Tensor::empty(DType::kF32, {M, H});
    make_cpu_modular_kernel()->experts().apply(pr, full, params, eo.view(), ws);
    Tensor out2 = Tensor::empty(DType::kF32, {T, H});
    test::poison(out2.view());
    ep.finalize(eo.view(), pr, w.view(), false, out2.view());
    EXPECT_TRUE(test::bit_identical(out2.view(), ref.view()));
    EXPECT_EQ(ep.stats().dispatch_bytes_sent, 0);  // nothing left the rank
    EXPECT_EQ(ep.stats().dispatch_rows_sent, ep.stats().dispatch_rows_received);

    // The router weight on the input takes one expert a token (k = 3 here).
    test::poison(out.view());
    try {
      de.forward(hidden.view(), ids.view(), w.view(), params, true, out.view(), ws);
      ADD_FAILURE() << "apply_router_weight_on_input with top_k = 3 was taken";
    } catch (const Error& e) {
      EXPECT_NE(
          std::string(e.what()).find("apply_router_weight_on_input: supported with top_k = 1 only"),
          std::string::npos)
          << e.what();
    }
    EXPECT_EQ(test::count_non_finite(out.view()), T * H);

    // Bad ids are rejected before anything is written.
    ids.data_as<int32_t>()[4] = static_cast<int32_t>(E);
    test::poison(out.view());
    EXPECT_THROW(de.forward(hidden.view(), ids.view(), w.view(), params, false, out.view(), ws),
                 Error);
    EXPECT_EQ(test::count_non_finite(out.view()), T * H);

    // No slot a token (k = 0) is refused as top_k = 0 is, not summed to zeros.
    Tensor ids0 = Tensor::empty(DType::kI32, {T, 0}), w0 = Tensor::empty(DType::kF32, {T, 0});
    try {
      de.forward(hidden.view(), ids0.view(), w0.view(), params, false, out.view(), ws);
      ADD_FAILURE() << "topk_ids with k = 0 was taken";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("topk_ids: expected [T, k] with k >= 1"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(test::count_non_finite(out.view()), T * H);
  }
}

TEST(DistributedExperts, RejectsWeightsOfTheWrongShard) {
  std::mt19937_64 rng(1);
  MoEConfig config = test::base_config(6, 2, 16, 8);
  const ExpertWeights five = test::random_experts(rng, 5, 16, 8, DType::kF32, false);
  EXPECT_THROW(DistributedExperts(config, ParallelGroups::single(), five), Error);
}

}  // namespace
}  // namespace fusedmoe

namespace fusedmoe {
namespace {

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape_str() == b.shape_str() &&
         std::memcmp(Tensor::copy_of(a.view()).data(), Tensor::copy_of(b.view()).data(),
                     a.nbytes()) == 0;
}

// The loader's per-rank read equals slicing the full layer, for every layout
// (per-expert, gpt-oss packed with biases, Llama-4 packed) and placement.
TEST(LoadMoELayer, ReadsOnlyThisRanksShare) {
  for (const std::string& arch : test::hf_fixture_archs()) {
    SCOPED_TRACE(arch);
    const std::string dir = test::hf_fixture_dir(arch);
    const ModelInfo info = load_model_info(dir);
    const Checkpoint ckpt = Checkpoint::open(dir);
    const int64_t layer = info.moe_layers.front();
    const MoEConfig& c = info.layer_config(layer);
    LoadOptions quiet;
    quiet.progress = false;
    const MoELayerWeights full = load_moe_layer(ckpt, info, layer, quiet);
    const int ep = static_cast<int>(std::min<int64_t>(3, c.num_experts));
    for (ExpertPlacement pl : {ExpertPlacement::kContiguous, ExpertPlacement::kRoundRobin})
      for (int tp : {1, 2})
        for (int r = 0; r < ep * tp; ++r) {
          LoadOptions o = quiet;
          o.parallel = parallel_config_for_rank(r, ep, tp, 1);
          o.parallel.expert_placement = pl;
          const MoELayerWeights part = load_moe_layer(ckpt, info, layer, o);
          const std::vector<int64_t> mine =
              ExpertMap(c.num_experts, ep, pl).local_experts(o.parallel.ep_rank);
          const ExpertWeights want =
              shard_expert_weights(full.experts, mine, tp, o.parallel.tp_rank);
          EXPECT_TRUE(same_bytes(part.experts.w13, want.w13)) << "rank " << r;
          EXPECT_TRUE(same_bytes(part.experts.w2, want.w2)) << "rank " << r;
          ASSERT_EQ(part.experts.w13_bias.has_value(), want.w13_bias.has_value());
          if (want.w13_bias) {
            EXPECT_TRUE(same_bytes(*part.experts.w13_bias, *want.w13_bias));
            EXPECT_TRUE(same_bytes(*part.experts.w2_bias, *want.w2_bias));
          }
          if (c.has_shared_expert()) {
            const std::vector<int64_t> zero{0};
            const ExpertWeights s =
                shard_expert_weights(*full.shared_experts, zero, tp, o.parallel.tp_rank);
            EXPECT_TRUE(same_bytes(part.shared_experts->w13, s.w13));
            EXPECT_TRUE(same_bytes(part.shared_experts->w2, s.w2));
          }
          EXPECT_TRUE(same_bytes(part.gate_weight, full.gate_weight));
        }
  }
}

}  // namespace
}  // namespace fusedmoe
