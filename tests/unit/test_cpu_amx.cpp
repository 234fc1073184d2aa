// The CPU experts' AMX path (bf16 weights, bf16 compute; gemm_amx.h): the GEMM
// against plain float64 on fresh random inputs with odd M, N, K, only its
// output written, rows batch-invariant; the expert forward against the AVX-512
// path and token by token; FUSEDMOE_CPU_AMX. Skipped where the CPU or OS has no AMX.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fusedmoe/core/error.h"
#include "fusedmoe/kernels/modular_kernel.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_amx.h"
#include "test_util.h"

namespace fusedmoe {
namespace {

using test::fresh_seed;

#define SKIP_WITHOUT_AMX()   \
  if (!cpu::amx_supported()) \
  GTEST_SKIP() << "skipped: no AMX (AMX-TILE, AMX-BF16) on this CPU or OS"

#if defined(FUSEDMOE_GEMM_X86) && defined(FUSEDMOE_AMX)
// X [rows, K] packed tile by tile as amx_gemm_packed reads it.
std::vector<uint16_t> pack(const std::vector<float>& X, int64_t ldx, int64_t rows, int64_t K) {
  const int64_t kb = (K + 31) / 32, tiles = (rows + 15) / 16;
  std::vector<uint16_t> xp(static_cast<size_t>(tiles * kb * cpu::kAmxBlock), 0xffff);
  for (int64_t t = 0; t < tiles; ++t)
    cpu::amx_pack_rows(X.data() + t * 16 * ldx, ldx, std::min<int64_t>(16, rows - 16 * t), K,
                       xp.data() + t * kb * cpu::kAmxBlock);
  return xp;
}

TEST(AmxGemm, MatchesFloat64AndWritesOnlyItsOutput) {
  SKIP_WITHOUT_AMX();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  for (int64_t rows : {1, 3, 16, 17, 33, 47})
    for (int64_t N : {1, 15, 16, 17, 33, 64, 80})
      for (int64_t K : {1, 31, 32, 33, 100, 768}) {
        SCOPED_TRACE(testing::Message() << "rows " << rows << " N " << N << " K " << K);
        const int64_t ldx = K + 3, ldw = K + 5, ldc = N + 2;
        std::vector<float> X(rows * ldx);
        std::vector<uint16_t> W(N * ldw);
        std::vector<float> bias(N);
        for (auto& v : X) v = round_to_bf16(d(rng));
        for (auto& v : W) v = f32_to_bf16(d(rng));
        for (auto& v : bias) v = d(rng);
        const std::vector<uint16_t> xp = pack(X, ldx, rows, K);
        for (bool with_bias : {false, true}) {
          std::vector<float> C(rows * ldc, NAN);
          cpu::amx_gemm_packed(xp.data(), rows, N, K, W.data(), ldw,
                               with_bias ? bias.data() : nullptr, false, C.data(), ldc);
          for (int64_t m = 0; m < rows; ++m) {
            for (int64_t n = 0; n < N; ++n) {
              double ref = with_bias ? bias[n] : 0.0, mag = std::fabs(ref);
              for (int64_t k = 0; k < K; ++k) {
                const double p = static_cast<double>(X[m * ldx + k]) * bf16_to_f32(W[n * ldw + k]);
                ref += p;
                mag += std::fabs(p);
              }
              // f32 accumulation over K: a few ulps of the magnitude per step.
              ASSERT_NEAR(C[m * ldc + n], ref, 1e-6 * (K + 2) * mag + 1e-30)
                  << "C[" << m << ", " << n << "]";
            }
            for (int64_t n = N; n < ldc; ++n)
              ASSERT_TRUE(std::isnan(C[m * ldc + n])) << "wrote C[" << m << ", " << n << "]";
          }
        }
      }
}

// A row's result is the same alone as in a batch (the order depends on K only).
TEST(AmxGemm, RowsAreBatchInvariant) {
  SKIP_WITHOUT_AMX();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  const int64_t rows = 37, N = 48, K = 300;
  std::vector<float> X(rows * K);
  std::vector<uint16_t> W(N * K);
  for (auto& v : X) v = round_to_bf16(d(rng));
  for (auto& v : W) v = f32_to_bf16(d(rng));
  std::vector<float> batch(rows * N);
  cpu::amx_gemm_packed(pack(X, K, rows, K).data(), rows, N, K, W.data(), K, nullptr, false,
                       batch.data(), N);
  for (int64_t m = 0; m < rows; ++m) {
    const std::vector<float> one(X.begin() + m * K, X.begin() + (m + 1) * K);
    std::vector<float> alone(N);
    cpu::amx_gemm_packed(pack(one, K, 1, K).data(), 1, N, K, W.data(), K, nullptr, false,
                         alone.data(), N);
    ASSERT_EQ(0, std::memcmp(alone.data(), batch.data() + m * N, N * sizeof(float))) << "row " << m;
  }
}

// K = 0 (an expert with I = 0, or H = 0): C = bias, on a thread that never
// ran the kernel before (its weight buffer not yet allocated: it threw bad_alloc).
TEST(AmxGemm, EmptyKGivesTheBias) {
  SKIP_WITHOUT_AMX();
  const std::vector<float> bias = {0.5f, -1.0f, 2.0f};
  const std::vector<uint16_t> xp(cpu::kAmxBlock, 0), W(3, 0);
  std::vector<float> C(2 * 4, NAN);
  std::string error;
  std::thread([&] {
    try {
      cpu::amx_gemm_packed(xp.data(), 2, 3, 0, W.data(), 0, bias.data(), false, C.data(), 4);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }).join();
  ASSERT_EQ(error, "");
  for (int m = 0; m < 2; ++m) {
    for (int n = 0; n < 3; ++n) EXPECT_EQ(C[m * 4 + n], bias[n]) << m << ", " << n;
    EXPECT_TRUE(std::isnan(C[m * 4 + 3]));
  }
}

// Values that are not bf16 values are rounded to the nearest even bf16; NaN
// stays NaN (a NaN with its payload in the low 16 bits became +Inf).
TEST(AmxGemm, PackRoundsToNearestEvenAndKeepsNaN) {
  SKIP_WITHOUT_AMX();
  const auto bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  const std::vector<float> X = {
      bits(0x3f808000u), bits(0x3f818000u), bits(0x3f808001u), bits(0x7f800001u), 1.0f, -2.5f};
  std::vector<uint16_t> xp(cpu::kAmxBlock, 0xffff);
  cpu::amx_pack_rows(X.data(), 6, 1, 6, xp.data());
  // Row 0's pairs are xp[32 p], xp[32 p + 1].
  EXPECT_EQ(xp[0], 0x3f80);   // tie, even stays
  EXPECT_EQ(xp[1], 0x3f82);   // tie, odd rounds up
  EXPECT_EQ(xp[32], 0x3f81);  // above the tie
  EXPECT_EQ(xp[33] & 0x7f80, 0x7f80);
  EXPECT_NE(xp[33] & 0x007f, 0);  // NaN, not Inf
  EXPECT_EQ(xp[64], 0x3f80);
  EXPECT_EQ(xp[65], 0xc020);
  EXPECT_EQ(xp[96], 0);  // k >= K: zero
}
#endif

// Restores the GEMM instruction set and AMX's setting when a test ends; the
// AMX tests run at avx512 (AMX is used only there).
struct AmxGuard {
  cpu::CpuIsa isa = cpu::gemm_isa();
  bool saved = cpu::amx_in_use();
  AmxGuard() {
    if (cpu::cpu_isa_supported(cpu::CpuIsa::kAvx512)) cpu::set_gemm_isa(cpu::CpuIsa::kAvx512);
  }
  ~AmxGuard() {
    cpu::set_gemm_isa(isa);
    cpu::set_amx(saved);
  }
};

struct Layer {
  ExpertWeights w;
  int64_t E, k, H, I;
};

Layer make_layer(std::mt19937_64& rng, int64_t E, int64_t k, int64_t H, int64_t I) {
  Layer l{{}, E, k, H, I};
  l.w.w13 = test::to_bf16(test::random_f32(rng, {E, 2 * I, H}, -0.2f, 0.2f));
  l.w.w2 = test::to_bf16(test::random_f32(rng, {E, H, I}, -0.2f, 0.2f));
  l.w.w13_bias = test::random_f32(rng, {E, 2 * I}, -0.5f, 0.5f);
  l.w.w2_bias = test::to_bf16(test::random_f32(rng, {E, H}, -0.5f, 0.5f));
  return l;
}

Tensor forward(const Layer& l, const Tensor& hidden, const Tensor& ids, const Tensor& tw) {
  ThreadPool pool(2);
  auto kernel = make_cpu_modular_kernel(&pool);
  Workspace ws;
  ExpertsParams p;
  p.activation = {Activation::kSiluGlu, 1.702f, 7.0f};
  p.compute_dtype = DType::kBF16;
  Tensor out = Tensor::empty(DType::kF32, {hidden.size(0), l.H});
  test::poison(out);
  kernel->forward(hidden, ids, tw, l.w, p, false, out, ws);
  return out;
}

void routing(std::mt19937_64& rng, int64_t T, int64_t E, int64_t k, Tensor& ids, Tensor& tw) {
  ids = Tensor::empty(DType::kI32, {T, k});
  tw = test::random_f32(rng, {T, k}, 0.1f, 1.0f);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(E - 1));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      int32_t e = pick(rng);  // distinct ids per token; some -1
      for (int64_t i = 0; i < j; ++i)
        if (ids.data_as<int32_t>()[t * k + i] == e) e = -1;
      ids.data_as<int32_t>()[t * k + j] = e;
    }
}

// bf16 compute through AMX against the AVX-512 path (the same bf16 operands,
// f32 accumulation in another order), with expert row counts past one
// 128-row block and odd H, I.
TEST(AmxExperts, Bf16ComputeMatchesTheAvx512Path) {
  SKIP_WITHOUT_AMX();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  AmxGuard guard;
  const Layer l = make_layer(rng, 6, 3, 80, 72);
  for (int64_t T : {1, 5, 90, 400}) {
    SCOPED_TRACE(testing::Message() << "T=" << T);
    Tensor hidden = test::random_f32(rng, {T, l.H}, -2.0f, 2.0f), ids, tw;
    routing(rng, T, l.E, l.k, ids, tw);
    cpu::set_amx(true);
    const Tensor amx = forward(l, hidden, ids, tw);
    cpu::set_amx(false);
    const Tensor avx = forward(l, hidden, ids, tw);
    ASSERT_EQ(test::count_non_finite(amx), 0);
    // The w13 sums differ by f32 rounding (~1e-7), which now and then moves an
    // activation across a bf16 rounding boundary (a step of 2^-8): ~1e-4 apart
    // (measured up to 6.6e-5), where a wrong tile or pair is ~1.
    EXPECT_LE(test::rel_l2(amx, avx), 1e-3);
  }
}

TEST(AmxExperts, TokenAloneEqualsTokenInBatch) {
  SKIP_WITHOUT_AMX();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  AmxGuard guard;
  cpu::set_amx(true);
  const Layer l = make_layer(rng, 4, 2, 64, 48);
  const int64_t T = 70;
  Tensor hidden = test::random_f32(rng, {T, l.H}, -2.0f, 2.0f), ids, tw;
  routing(rng, T, l.E, l.k, ids, tw);
  const Tensor batch = forward(l, hidden, ids, tw);
  for (int64_t t : {int64_t{0}, int64_t{33}, T - 1}) {
    Tensor h1 = Tensor::empty(DType::kF32, {1, l.H}), i1 = Tensor::empty(DType::kI32, {1, l.k}),
           w1 = Tensor::empty(DType::kF32, {1, l.k});
    std::memcpy(h1.data(), hidden.data_as<float>() + t * l.H, l.H * 4);
    std::memcpy(i1.data(), ids.data_as<int32_t>() + t * l.k, l.k * 4);
    std::memcpy(w1.data(), tw.data_as<float>() + t * l.k, l.k * 4);
    const Tensor one = forward(l, h1, i1, w1);
    EXPECT_EQ(0, std::memcmp(one.data(), batch.data_as<float>() + t * l.H, l.H * 4))
        << "token " << t;
  }
}

TEST(AmxExperts, SetAmxWithoutSupportThrows) {
  if (cpu::amx_supported()) GTEST_SKIP() << "skipped: this CPU has AMX";
  try {
    cpu::set_amx(true);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
  }
  EXPECT_FALSE(cpu::amx_in_use());
}

// FUSEDMOE_CPU_AMX is read at the first use in a process: run in a fresh one.
class AmxEnvironment : public testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

[[noreturn]] void exit_with_amx_of_env(const char* value) {
  test::exit_with_env("FUSEDMOE_CPU_AMX", value, [] { return cpu::amx_in_use() ? 1 : 0; });
}

TEST_F(AmxEnvironment, ZeroOneAutoAndBadValues) {
  const bool on = cpu::amx_supported() && cpu::best_cpu_isa() == cpu::CpuIsa::kAvx512;
  EXPECT_EXIT(exit_with_amx_of_env("0"), testing::ExitedWithCode(0), "");
  EXPECT_EXIT(exit_with_amx_of_env("auto"), testing::ExitedWithCode(on ? 1 : 0), "");
  if (cpu::amx_supported())
    EXPECT_EXIT(exit_with_amx_of_env("1"), testing::ExitedWithCode(on ? 1 : 0), "");
  else
    EXPECT_EXIT(exit_with_amx_of_env("1"), testing::ExitedWithCode(20),
                "FUSEDMOE_CPU_AMX=1: this CPU or OS does not support AMX");
  EXPECT_EXIT(exit_with_amx_of_env("yes"), testing::ExitedWithCode(21),
              "FUSEDMOE_CPU_AMX: expected 0, 1 or auto, got 'yes'");
}

}  // namespace
}  // namespace fusedmoe
