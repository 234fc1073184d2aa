// MoERunner end to end on random layers of each architecture's shape, against
// the float64 reference of the whole layer (given the router's choice, which
// the runner reports through ForwardOutputs).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "fusedmoe/runner/moe_runner.h"
#ifdef FUSEDMOE_WITH_CUDA
#include "fusedmoe/kernels/cuda.h"  // device_count
#endif
#include "random_layer.h"
#include "reference_moe.h"
#include "test_util.h"

namespace fusedmoe {
namespace {

using test::fresh_seed;

using test::base_config;
using test::random_experts;
using test::random_layer;
using test::random_weight;

// Layers shaped like each architecture (small sizes, H, I, 2I all different).
std::vector<std::pair<std::string, MoEConfig>> arch_configs() {
  std::vector<std::pair<std::string, MoEConfig>> v;
  for (const auto& [arch, E, k, H, I] :
       std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, int64_t>>{
           {"mixtral", 8, 2, 64, 48},
           {"qwen2_moe", 12, 4, 72, 40},
           {"deepseek_v3", 16, 4, 64, 24},
           {"gpt_oss", 8, 2, 80, 32},
           {"llama4", 8, 1, 64, 40},
           {"zero_experts", 10, 3, 48, 36},
       })
    v.emplace_back(arch, test::arch_config(arch, E, k, H, I));
  return v;
}

struct RunResult {
  Tensor out, logits, ids, weights;
};

RunResult run_with_outputs(MoERunner& r, const TensorView& hidden,
                           const TensorView* router_logits = nullptr) {
  const MoEConfig& c = r.config();
  const int64_t T = hidden.size(0);
  RunResult res;
  res.out = Tensor::empty(DType::kF32, {T, c.hidden_size});
  res.logits = Tensor::empty(DType::kF32, {T, c.num_router_logits()});
  res.ids = Tensor::empty(DType::kI32, {T, c.top_k});
  res.weights = Tensor::empty(DType::kF32, {T, c.top_k});
  test::poison(res.out);
  test::poison(res.logits);
  test::poison(res.weights);
  ForwardOutputs o{res.logits, res.ids, res.weights};
  r.forward(hidden, res.out, router_logits, nullptr, &o);
  return res;
}

TEST(MoERunner, MatchesFloat64LayerForEachArchitecture) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  ThreadPool pool(2);
  for (const auto& [name, config] : arch_configs())
    for (DType wt : {DType::kF32, DType::kBF16})
      for (int64_t T : {1, 7, 66}) {
        SCOPED_TRACE(name + " W " + dtype_name(wt) + " T=" + std::to_string(T));
        MoELayerWeights w = random_layer(rng, config, wt);
        MoERunner runner(config, w, {DType::kF32, &pool});
        Tensor hidden = test::random_f32(rng, {T, config.hidden_size}, -2.0f, 2.0f);
        RunResult r = run_with_outputs(runner, hidden);
        ASSERT_EQ(test::count_non_finite(r.out), 0);
        ASSERT_EQ(test::count_non_finite(r.logits), 0);
        ASSERT_EQ(test::count_non_finite(r.weights), 0);

        std::vector<double> ref_logits = test::reference_router_logits(config, w, hidden);
        EXPECT_LE(test::rel_l2(r.logits, TensorView(ref_logits.data(), DType::kF64,
                                                    {T, config.num_router_logits()})),
                  1e-5);
        std::vector<double> ref = test::reference_moe_layer(config, w, hidden, r.ids, r.weights);
        EXPECT_LE(test::rel_l2(r.out, TensorView(ref.data(), DType::kF64, {T, config.hidden_size})),
                  1e-5);

        // Router logits passed in: the same bits as computing them.
        RunResult given = run_with_outputs(runner, hidden, &r.logits.view());
        EXPECT_EQ(0, std::memcmp(given.out.data(), r.out.data(), r.out.nbytes()));
        EXPECT_EQ(0, std::memcmp(given.logits.data(), r.logits.data(), r.logits.nbytes()));

        // Convenience overload, and batch invariance of the last token.
        Tensor conv = runner.forward(hidden);
        EXPECT_EQ(0, std::memcmp(conv.data(), r.out.data(), r.out.nbytes()));
        Tensor last = runner.forward(hidden.view().narrow(0, T - 1, 1));
        EXPECT_EQ(0, std::memcmp(last.data(), r.out.data_as<float>() + (T - 1) * config.hidden_size,
                                 config.hidden_size * 4))
            << "last token differs when run alone";

        // compute_dtype bf16: within 1e-2 of the float64 layer.
        MoERunner bf(config, w, {DType::kBF16, &pool});
        RunResult rb = run_with_outputs(bf, hidden);
        std::vector<double> refb = test::reference_moe_layer(config, w, hidden, rb.ids, rb.weights);
        EXPECT_LE(
            test::rel_l2(rb.out, TensorView(refb.data(), DType::kF64, {T, config.hidden_size})),
            1e-2);
      }
}

TEST(MoERunner, StridedHiddenStatesAndStridedOutputs) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (const auto& [name, config] : arch_configs()) {
    SCOPED_TRACE(name);
    const int64_t T = 9, H = config.hidden_size, L = config.num_router_logits();
    MoERunner runner(config, random_layer(rng, config, DType::kBF16));
    Tensor buf = test::random_f32(rng, {T, H + 7});
    const int64_t shape[] = {T, H}, strides[] = {H + 7, 1};
    const TensorView strided(buf.data(), DType::kF32, shape, strides);
    Tensor contiguous = Tensor::copy_of(strided);
    RunResult a = run_with_outputs(runner, contiguous);
    // Strided output and router-logit buffers too.
    Tensor obuf = Tensor::empty(DType::kF32, {T, H + 3});
    Tensor lbuf = Tensor::empty(DType::kF32, {T, L + 2});
    test::poison(obuf);
    const int64_t oshape[] = {T, H}, ostr[] = {H + 3, 1}, lshape[] = {T, L}, lstr[] = {L + 2, 1};
    const TensorView out(obuf.data(), DType::kF32, oshape, ostr);
    const TensorView logits(lbuf.data(), DType::kF32, lshape, lstr);
    Tensor ids = Tensor::empty(DType::kI32, {T, config.top_k});
    Tensor tw = Tensor::empty(DType::kF32, {T, config.top_k});
    ForwardOutputs o{logits, ids, tw};
    runner.forward(strided, out, nullptr, nullptr, &o);
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(0, std::memcmp(obuf.data_as<float>() + t * (H + 3), a.out.data_as<float>() + t * H,
                               H * 4))
          << "row " << t;
      EXPECT_EQ(0, std::memcmp(lbuf.data_as<float>() + t * (L + 2),
                               a.logits.data_as<float>() + t * L, L * 4))
          << "row " << t;
      for (int64_t h = H; h < H + 3; ++h)
        EXPECT_TRUE(std::isnan(obuf.data_as<float>()[t * (H + 3) + h]));
    }
    EXPECT_EQ(0, std::memcmp(ids.data(), a.ids.data(), ids.nbytes()));
  }
}

TEST(MoERunner, HashRoutingUsesTokenIds) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = base_config(6, 2, 32, 24);
  c.routing_method = RoutingMethod::kHash;
  c.hash_vocab_size = 50;
  MoELayerWeights w = random_layer(rng, c, DType::kF32);
  MoERunner runner(c, w);
  const int64_t T = 11;
  Tensor hidden = test::random_f32(rng, {T, c.hidden_size});
  Tensor tok = Tensor::empty(DType::kI32, {T});
  std::uniform_int_distribution<int32_t> v(0, 49);
  for (int64_t t = 0; t < T; ++t) tok.data_as<int32_t>()[t] = v(rng);
  Tensor out = Tensor::empty(DType::kF32, {T, c.hidden_size});
  Tensor ids = Tensor::empty(DType::kI32, {T, c.top_k});
  Tensor tw = Tensor::empty(DType::kF32, {T, c.top_k});
  ForwardOutputs o{TensorView(), ids, tw};
  runner.forward(hidden, out, nullptr, &tok.view(), &o);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < c.top_k; ++j)
      EXPECT_EQ(
          ids.data_as<int32_t>()[t * c.top_k + j],
          w.router_params.hash_table->data_as<int32_t>()[tok.data_as<int32_t>()[t] * c.top_k + j]);
  std::vector<double> ref = test::reference_moe_layer(c, w, hidden, ids, tw);
  EXPECT_LE(test::rel_l2(out, TensorView(ref.data(), DType::kF64, {T, c.hidden_size})), 1e-5);
}

TEST(MoERunner, SimulatedRoutingSkipsLogits) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = base_config(16, 4, 48, 32);
  c.routing_method = RoutingMethod::kSimulated;
  c.simulation_seed = seed;
  MoELayerWeights w = random_layer(rng, c, DType::kBF16);
  MoERunner runner(c, w);
  const int64_t T = 13;
  Tensor hidden = test::random_f32(rng, {T, c.hidden_size});
  Tensor out = Tensor::empty(DType::kF32, {T, c.hidden_size});
  test::poison(out);
  Tensor ids = Tensor::empty(DType::kI32, {T, c.top_k});
  Tensor tw = Tensor::empty(DType::kF32, {T, c.top_k});
  ForwardOutputs o{TensorView(), ids, tw};
  runner.forward(hidden, out, nullptr, nullptr, &o);
  std::vector<double> ref = test::reference_moe_layer(c, w, hidden, ids, tw);
  EXPECT_LE(test::rel_l2(out, TensorView(ref.data(), DType::kF64, {T, c.hidden_size})), 1e-5);
}

TEST(MoERunner, ZeroTokens) {
  const uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (const auto& [name, config] : arch_configs()) {
    SCOPED_TRACE(name);
    MoERunner runner(config, random_layer(rng, config, DType::kF32));
    Tensor hidden = Tensor::empty(DType::kF32, {0, config.hidden_size});
    Tensor out = runner.forward(hidden);
    EXPECT_EQ(out.size(0), 0);
    RunResult r = run_with_outputs(runner, hidden);
    EXPECT_EQ(r.out.numel(), 0);
  }
}

template <typename Fn>
void expect_error(Fn&& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown (expected one mentioning " << *parts.begin() << ")";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "message '" << e.what() << "' lacks '" << p << "'";
  }
}

// Several threads calling one runner: each call either runs alone (the same
// bits as a serial call) or is refused with the one-call-at-a-time error; never
// a crash or a torn output (session 26's trial: segfaults and heap aborts).
TEST(MoERunner, CallsFromSeveralThreadsRunOneAtATime) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const MoEConfig config = arch_configs()[0].second;
  ThreadPool pool(2);
  MoERunner runner(config, random_layer(rng, config, DType::kF32), {DType::kF32, &pool});
  const int64_t T = 64;
  Tensor hidden = test::random_f32(rng, {T, config.hidden_size}, -2.0f, 2.0f);
  Tensor want = runner.forward(hidden);
  std::atomic<int> refused{0}, ran{0}, wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      Tensor out = Tensor::empty(DType::kF32, {T, config.hidden_size});
      for (int i = 0; i < 200; ++i) {
        try {
          runner.forward(hidden, out);
          ++ran;
          if (std::memcmp(out.data(), want.data(), out.nbytes()) != 0) ++wrong;
        } catch (const Error& e) {
          if (std::string(e.what()).find("one call at a time") != std::string::npos)
            ++refused;
          else
            ++wrong;
        }
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(ran.load() + refused.load(), 800);
  EXPECT_GT(ran.load(), 0);
  Tensor again = runner.forward(hidden);  // the runner is free again
  EXPECT_EQ(std::memcmp(again.data(), want.data(), want.nbytes()), 0);
}

TEST(MoERunner, AMovedFromRunnerIsAnError) {
  std::mt19937_64 rng(fresh_seed());
  const MoEConfig config = arch_configs()[0].second;
  MoERunner a(config, random_layer(rng, config, DType::kF32));
  MoERunner b(std::move(a));
  Tensor hidden = test::random_f32(rng, {3, config.hidden_size}, -2.0f, 2.0f);
  Tensor out = Tensor::empty(DType::kF32, {3, config.hidden_size});
  Tensor logits = Tensor::empty(DType::kF32, {3, config.num_router_logits()});
  expect_error([&] { a.forward(hidden, out); }, {"MoERunner::forward", "moved from"});
  expect_error([&] { a.forward(hidden); }, {"MoERunner::forward", "moved from"});
  expect_error([&] { a.compute_router_logits(hidden, logits); },
               {"compute_router_logits", "moved from"});
  expect_error([&] { a.check_errors(); }, {"check_errors", "moved from"});
  expect_error([&] { (void)a.router(); }, {"MoERunner::router", "moved from"});
  EXPECT_EQ(b.forward(hidden).size(0), 3);
}

// A finite input that overflows f32 inside the experts: an error naming the
// output's first bad element, not NaN / Inf rows (with and without a shared expert).
TEST(MoERunner, OverflowingInputIsAnError) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int a : {0, 1}) {  // mixtral (no shared expert), qwen2_moe (shared expert)
    const MoEConfig c = arch_configs()[a].second;
    SCOPED_TRACE(arch_configs()[a].first);
    const int64_t T = 4, H = c.hidden_size;
    MoERunner runner(c, random_layer(rng, c, DType::kF32));
    Tensor hidden = test::random_f32(rng, {T, H});
    for (int64_t h = 0; h < H; ++h) hidden.data_as<float>()[2 * H + h] *= 1e30f;  // token 2
    Tensor out = Tensor::empty(DType::kF32, {T, H});
    expect_error([&] { runner.forward(hidden, out); },
                 {"output: non-finite value at token 2", "overflow f32"});
  }
}

// Weights built by the caller (not loaded: the loader rejects them) may hold
// NaN or Inf: the message names that cause too, not only an overflow.
TEST(MoERunner, NonFiniteWeightsAreNamedInTheOutputError) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const MoEConfig c = arch_configs()[0].second;  // mixtral
  const int64_t T = 3, H = c.hidden_size;
  for (const float bad : {std::nanf(""), INFINITY}) {
    SCOPED_TRACE(bad);
    MoELayerWeights w = random_layer(rng, c, DType::kF32);
    float* w2 = w.experts.w2.data_as<float>();
    std::fill(w2, w2 + w.experts.w2.numel(), bad);  // every expert, every token
    MoERunner runner(c, std::move(w));
    Tensor hidden = test::random_f32(rng, {T, H});
    Tensor out = Tensor::empty(DType::kF32, {T, H});
    expect_error([&] { runner.forward(hidden, out); },
                 {"output: non-finite value at token 0, column 0",
                  "the weights hold NaN or Inf, or the input or the weights overflow f32"});
  }
}

// A routing output over `output` came back holding output values, one over
// hidden_states changed the input mid-call: each tensor forward writes must have
// memory of its own, named before anything is written. The router_logits given may
// come back in the same tensor.
TEST(MoERunner, RejectsWrittenTensorsThatOverlap) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const MoEConfig c = arch_configs()[1].second;  // qwen2_moe: shared expert with gate
  const int64_t T = 5, H = c.hidden_size, L = c.num_router_logits(), k = c.top_k;
  ASSERT_GE(H, L);
  MoERunner runner(c, random_layer(rng, c, DType::kF32));
  Tensor hidden = test::random_f32(rng, {T, H});
  const Tensor hidden_before = Tensor::copy_of(hidden);
  Tensor out = Tensor::empty(DType::kF32, {T, H});
  std::fill(out.data_as<float>(), out.data_as<float>() + T * H, 42.0f);
  Tensor logits = Tensor::empty(DType::kF32, {T, L}), ids = Tensor::empty(DType::kI32, {T, k}),
         weights = Tensor::empty(DType::kF32, {T, k});
  // Views of T x L floats at the start of `out` and of `hidden`, of T x k ints in `logits`.
  const TensorView in_out(out.data(), DType::kF32, {T, L}),
      in_hidden(hidden.data(), DType::kF32, {T, L}),
      ids_in_logits(logits.data(), DType::kI32, {T, k});
  const struct {
    ForwardOutputs outputs;
    std::string message;
  } cases[] = {
      {{in_out, ids.view(), weights.view()}, "outputs.router_logits: must not overlap output"},
      {{logits.view(), ids.view(), TensorView(out.data(), DType::kF32, {T, k})},
       "outputs.topk_weights: must not overlap output"},
      {{in_hidden, ids.view(), weights.view()},
       "outputs.router_logits: must not overlap hidden_states"},
      {{logits.view(), ids_in_logits, weights.view()},
       "outputs.topk_ids: must not overlap outputs.router_logits"},
  };
  for (const auto& [outputs, message] : cases) {
    expect_error([&] { runner.forward(hidden, out, nullptr, nullptr, &outputs); }, {message});
    for (int64_t i = 0; i < T * H; ++i) {
      ASSERT_EQ(out.data_as<float>()[i], 42.0f) << i;
      ASSERT_EQ(hidden.data_as<float>()[i], hidden_before.data_as<float>()[i]) << i;
    }
  }
  // An output whose rows overlap each other (row stride 0, or H / 2 for rows of H).
  const std::vector<int64_t> shape_th{T, H}, shape_tk{T, k}, strides_0{0, 1};
  for (int64_t row_stride : {int64_t{0}, H / 2}) {
    const std::vector<int64_t> strides{row_stride, 1};
    const TensorView rows_over(out.data(), DType::kF32, shape_th, strides);
    expect_error([&] { runner.forward(hidden, rows_over); },
                 {"output: its rows overlap (row stride " + std::to_string(row_stride)});
    const ForwardOutputs w_over{logits.view(), ids.view(),
                                TensorView(weights.data(), DType::kF32, shape_tk, strides_0)};
    expect_error([&] { runner.forward(hidden, out, nullptr, nullptr, &w_over); },
                 {"outputs.topk_weights: its rows overlap (row stride 0"});
    for (int64_t i = 0; i < T * H; ++i) ASSERT_EQ(out.data_as<float>()[i], 42.0f) << i;
  }
  // The router_logits given, overlapping an output: named too.
  Tensor given = test::random_f32(rng, {T, L});
  const ForwardOutputs ids_over_given{TensorView(), TensorView(given.data(), DType::kI32, {T, k}),
                                      weights.view()};
  expect_error([&] { runner.forward(hidden, out, &given.view(), nullptr, &ids_over_given); },
               {"outputs.topk_ids: must not overlap router_logits"});
  // ... while the same tensor as outputs.router_logits is taken, as before.
  const Tensor given_before = Tensor::copy_of(given);
  const ForwardOutputs same{given.view(), ids.view(), weights.view()};
  runner.forward(hidden, out, &given.view(), nullptr, &same);
  EXPECT_EQ(std::memcmp(given.data(), given_before.data(), given.nbytes()), 0);
}

// Outputs interleaved in one buffer (column blocks of the same rows) share no
// byte: taken, with the values of separate tensors. Blocks that do share
// bytes (one column) are still refused, and so is a view whose row span
// reaches into the next row's block.
TEST(MoERunner, TakesOutputsInterleavedInOneBuffer) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const MoEConfig c = arch_configs()[1].second;  // qwen2_moe: shared expert with gate
  const int64_t T = 7, H = c.hidden_size, L = c.num_router_logits(), k = c.top_k;
  MoERunner runner(c, random_layer(rng, c, DType::kF32));
  Tensor hidden = test::random_f32(rng, {T, H});
  Tensor out = Tensor::empty(DType::kF32, {T, H}), out2 = Tensor::empty(DType::kF32, {T, H});
  Tensor logits = Tensor::empty(DType::kF32, {T, L}), ids = Tensor::empty(DType::kI32, {T, k}),
         weights = Tensor::empty(DType::kF32, {T, k});
  const ForwardOutputs separate{logits.view(), ids.view(), weights.view()};
  runner.forward(hidden, out, nullptr, nullptr, &separate);
  // One [T, L + 2k] buffer of 4-byte cells: logits | weights | ids in each row.
  const int64_t W = L + 2 * k;
  Tensor buf = Tensor::empty(DType::kF32, {T + 1, W});
  std::fill(buf.data_as<float>(), buf.data_as<float>() + (T + 1) * W, 42.0f);
  float* b = buf.data_as<float>();
  const std::vector<int64_t> row{W, 1}, shape_tl{T, L}, shape_tk{T, k};
  const TensorView lg(b, DType::kF32, shape_tl, row), wt(b + L, DType::kF32, shape_tk, row),
      id(b + L + k, DType::kI32, shape_tk, row);
  const ForwardOutputs interleaved{lg, id, wt};
  runner.forward(hidden, out2, nullptr, nullptr, &interleaved);
  EXPECT_EQ(std::memcmp(out.data(), out2.data(), out.nbytes()), 0);
  for (int64_t t = 0; t < T; ++t) {
    EXPECT_EQ(std::memcmp(b + t * W, logits.data_as<float>() + t * L, L * 4), 0) << t;
    EXPECT_EQ(std::memcmp(b + t * W + L, weights.data_as<float>() + t * k, k * 4), 0) << t;
    EXPECT_EQ(std::memcmp(b + t * W + L + k, ids.data_as<int32_t>() + t * k, k * 4), 0) << t;
  }
  // The weights one column to the left: their first column is the logits' last.
  const ForwardOutputs wt_over{lg, id, TensorView(b + L - 1, DType::kF32, shape_tk, row)};
  expect_error([&] { runner.forward(hidden, out2, nullptr, nullptr, &wt_over); },
               {"outputs.topk_weights: must not overlap outputs.router_logits"});
  // The ids in the last column and the next row's first ones: row t's ids
  // reach into row t + 1's logits (a spare row at the end keeps it in the buffer).
  const ForwardOutputs id_cross{lg, TensorView(b + W - 1, DType::kI32, shape_tk, row), wt};
  expect_error([&] { runner.forward(hidden, out2, nullptr, nullptr, &id_cross); },
               {"outputs.topk_ids: must not overlap outputs.router_logits"});
  for (int64_t i = 0; i < W; ++i) EXPECT_EQ(b[T * W + i], 42.0f) << i;
}

TEST(MoERunner, RejectsBadShapesBeforeWriting) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  MoEConfig c = arch_configs()[1].second;  // qwen2_moe: shared expert with gate
  const int64_t T = 5, H = c.hidden_size, L = c.num_router_logits(), k = c.top_k;
  MoELayerWeights w = random_layer(rng, c, DType::kBF16);
  MoERunner runner(c, w);
  Tensor hidden = test::random_f32(rng, {T, H});
  Tensor out = Tensor::empty(DType::kF32, {T, H});
  for (int64_t i = 0; i < T * H; ++i) out.data_as<float>()[i] = 42.0f;
  auto untouched = [&] {
    for (int64_t i = 0; i < T * H; ++i)
      if (out.data_as<float>()[i] != 42.0f) return false;
    return true;
  };
  Tensor h_bad = test::random_f32(rng, {T, H + 1});
  expect_error([&] { runner.forward(h_bad, out); }, {"hidden_states"});
  Tensor o_bad = Tensor::empty(DType::kF32, {T + 1, H});
  expect_error([&] { runner.forward(hidden, o_bad); }, {"output"});
  expect_error([&] { runner.forward(hidden, hidden); }, {"output", "alias"});
  Tensor lg_bad = test::random_f32(rng, {T, L + 1});
  expect_error([&] { runner.forward(hidden, out, &lg_bad.view()); }, {"router_logits"});
  Tensor lg_nan = test::random_f32(rng, {T, L});
  lg_nan.data_as<float>()[2 * L + 1] = NAN;
  expect_error([&] { runner.forward(hidden, out, &lg_nan.view()); }, {});
  Tensor h_inf = Tensor::copy_of(hidden);
  h_inf.data_as<float>()[1 * H + 3] = INFINITY;
  expect_error([&] { runner.forward(h_inf, out); },
               {"hidden_states", "finite", "Inf at token 1, column 3"});
  h_inf.data_as<float>()[1 * H + 3] = NAN;
  expect_error([&] { runner.forward(h_inf, out); }, {"hidden_states", "NaN at token 1, column 3"});
  Tensor ids_bad = Tensor::empty(DType::kI32, {T, k + 1});
  ForwardOutputs o{TensorView(), ids_bad, TensorView()};
  expect_error([&] { runner.forward(hidden, out, nullptr, nullptr, &o); }, {"topk_ids"});
  Tensor tw_bad = Tensor::empty(DType::kI32, {T, k});
  ForwardOutputs o2{TensorView(), TensorView(), tw_bad};
  expect_error([&] { runner.forward(hidden, out, nullptr, nullptr, &o2); }, {"topk_weights"});
  // token_ids belong to hash routing: given to another router, they were ignored.
  Tensor tok = Tensor::empty(DType::kI32, {T});
  for (int64_t t = 0; t < T; ++t) tok.data_as<int32_t>()[t] = static_cast<int32_t>(t);
  expect_error([&] { runner.forward(hidden, out, nullptr, &tok.view()); },
               {"token_ids", "hash routing only"});
  EXPECT_TRUE(untouched()) << "output written although forward threw";

  // Options: a negative max_num_tokens; the CUDA backend without a CUDA device.
  RunnerOptions neg;
  neg.max_num_tokens = -5;
  expect_error([&] { MoERunner r(c, w, neg); }, {"max_num_tokens", ">= 0", "-5"});
#ifdef FUSEDMOE_WITH_CUDA
  if (cuda::device_count() == 0) {
    RunnerOptions gpu;
    gpu.device = Device{DeviceType::kCUDA, 0};
    gpu.compute_dtype = DType::kBF16;
    expect_error([&] { MoERunner r(c, w, gpu); }, {"device", "cuda:0", "no CUDA device"});
  }
#endif

  // Constructor: weights that do not match the config.
  MoELayerWeights no_shared = w;
  no_shared.shared_experts.reset();
  expect_error([&] { MoERunner r(c, no_shared); }, {"shared_experts"});
  MoELayerWeights no_gate = w;
  no_gate.shared_expert_gate.reset();
  expect_error([&] { MoERunner r(c, no_gate); }, {"shared_expert_gate"});
  MoELayerWeights bad_gate = w;
  bad_gate.gate_weight = random_weight(rng, {L, H + 1}, 0.1f, DType::kF32);
  expect_error([&] { MoERunner r(c, bad_gate); }, {"gate_weight"});
  MoELayerWeights bad_shared = w;
  bad_shared.shared_experts =
      random_experts(rng, 1, H, c.shared_intermediate_size + 1, DType::kBF16, false);
  expect_error([&] { MoERunner r(c, bad_shared); }, {"shared_experts.w13"});
  MoELayerWeights bad_experts = w;
  bad_experts.experts =
      random_experts(rng, c.num_experts - 1, H, c.intermediate_size, DType::kBF16, false);
  expect_error([&] { MoERunner r(c, bad_experts); }, {"experts.w13"});
  MoELayerWeights extra_bias = w;
  extra_bias.gate_bias = random_weight(rng, {L}, 0.1f, DType::kF32);
  expect_error([&] { MoERunner r(c, extra_bias); }, {"gate_bias"});
  MoEConfig bad_config = c;
  bad_config.top_k = c.num_experts + 1;
  expect_error([&] { MoERunner r(bad_config, w); }, {"top_k"});
  expect_error([&] { MoERunner r(c, w, {DType::kF16, nullptr}); }, {"compute_dtype"});
}

}  // namespace
}  // namespace fusedmoe
