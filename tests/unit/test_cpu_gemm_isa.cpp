// CPU GEMM instruction-set dispatch: every path this CPU supports (AVX-512,
// AVX2 + FMA, scalar) gives bit-identical GEMM results and bit-identical
// expert forwards, on fresh random inputs; FUSEDMOE_CPU_ISA selects a path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "fusedmoe/core/error.h"
#include "fusedmoe/kernels/modular_kernel.h"
#include "kernels/cpu/gemm.h"
#include "test_util.h"

namespace fusedmoe {
namespace {

using cpu::CpuIsa;
using test::fresh_seed;

std::vector<CpuIsa> supported_isas() {
  std::vector<CpuIsa> v;
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2, CpuIsa::kScalar})
    if (cpu::cpu_isa_supported(isa)) v.push_back(isa);
  return v;
}

// Restores the GEMM's instruction set when a test ends.
struct IsaGuard {
  CpuIsa saved = cpu::gemm_isa();
  ~IsaGuard() { cpu::set_gemm_isa(saved); }
};

struct GemmInputs {
  int64_t M, N, K, lda, ldw, ldc;
  std::vector<float> A, Wf, bias_f;
  std::vector<uint16_t> Wb, bias_b;
};

GemmInputs make_inputs(std::mt19937_64& rng, int64_t M, int64_t N, int64_t K) {
  GemmInputs in{M, N, K, K + 3, K + 5, N + 2, {}, {}, {}, {}, {}};
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  in.A.resize(M * in.lda);
  in.Wf.resize(N * in.ldw);
  in.bias_f.resize(N);
  for (auto& v : in.A) v = d(rng);
  for (auto& v : in.Wf) v = round_to_bf16(d(rng));  // bf16-representable: both dtypes agree
  for (auto& v : in.bias_f) v = round_to_bf16(d(rng));
  in.Wb.resize(in.Wf.size());
  in.bias_b.resize(N);
  for (size_t i = 0; i < in.Wf.size(); ++i) in.Wb[i] = f32_to_bf16(in.Wf[i]);
  for (int64_t i = 0; i < N; ++i) in.bias_b[i] = f32_to_bf16(in.bias_f[i]);
  return in;
}

// C (poisoned first, every element checked written) for one (W dtype, bias) choice.
std::vector<float> run_gemm(const GemmInputs& in, DType wt, int bias) {
  std::vector<float> C(in.M * in.ldc, NAN);
  const void* W = wt == DType::kBF16 ? static_cast<const void*>(in.Wb.data()) : in.Wf.data();
  const void* b = bias == 0   ? nullptr
                  : bias == 1 ? static_cast<const void*>(in.bias_f.data())
                              : static_cast<const void*>(in.bias_b.data());
  cpu::gemm_nt(in.M, in.N, in.K, in.A.data(), in.lda, W, wt, in.ldw, b,
               bias == 2 ? DType::kBF16 : DType::kF32, C.data(), in.ldc);
  for (int64_t m = 0; m < in.M; ++m)
    for (int64_t n = 0; n < in.ldc; ++n)
      EXPECT_EQ(n < in.N, !std::isnan(C[m * in.ldc + n])) << "C[" << m << ", " << n << "]";
  return C;
}

TEST(GemmIsa, DefaultIsTheBestSupported) {
  const char* env = std::getenv("FUSEDMOE_CPU_ISA");
  if (env != nullptr && *env != '\0') GTEST_SKIP() << "FUSEDMOE_CPU_ISA is set";
  EXPECT_EQ(cpu::gemm_isa(), cpu::best_cpu_isa());
  EXPECT_TRUE(cpu::cpu_isa_supported(CpuIsa::kScalar));
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    EXPECT_EQ(cpu::gemm_isa(), CpuIsa::kAvx512);
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    EXPECT_EQ(cpu::gemm_isa(), CpuIsa::kAvx2);
#endif
  std::printf("CPU GEMM instruction set: %s\n", cpu::cpu_isa_name(cpu::gemm_isa()));
}

// Shapes cover both kernel paths (M < 8, M >= 8), several row and column
// blocks (M > 128, N > 64), K blocks with a tail (K > 512, K % 16 != 0), and
// both weight and bias dtypes; every supported path must give the bits of the
// scalar definition, and bf16 weights the bits of their f32 values.
TEST(GemmIsa, AllPathsBitIdentical) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  IsaGuard guard;
  const int64_t shapes[][3] = {{1, 70, 300}, {3, 9, 17},   {7, 130, 33},  {8, 64, 16},
                               {9, 13, 1},   {33, 70, 97}, {50, 17, 530}, {140, 66, 1100},
                               {1, 1, 2048}, {16, 200, 0}, {6, 5, 1040}};
  int n = 0;
  for (const auto& sh : shapes) {
    const GemmInputs in = make_inputs(rng, sh[0], sh[1], sh[2]);
    const int bias = n++ % 3;
    SCOPED_TRACE(testing::Message()
                 << "M=" << sh[0] << " N=" << sh[1] << " K=" << sh[2] << " bias " << bias);
    cpu::set_gemm_isa(CpuIsa::kScalar);
    const std::vector<float> ref = run_gemm(in, DType::kF32, bias);
    for (CpuIsa isa : supported_isas()) {
      cpu::set_gemm_isa(isa);
      for (DType wt : {DType::kF32, DType::kBF16}) {
        SCOPED_TRACE(testing::Message() << cpu::cpu_isa_name(isa) << " W " << dtype_name(wt));
        const std::vector<float> got = run_gemm(in, wt, bias);
        for (int64_t m = 0; m < in.M; ++m)
          ASSERT_EQ(0, std::memcmp(got.data() + m * in.ldc, ref.data() + m * in.ldc, in.N * 4))
              << "row " << m;
      }
    }
    // A sanity check of the definition itself against float64.
    for (int64_t m = 0; m < in.M; ++m)
      for (int64_t j = 0; j < in.N; ++j) {
        double r = bias ? in.bias_f[j] : 0.0, mag = std::fabs(r);
        for (int64_t k = 0; k < in.K; ++k) {
          const double p = static_cast<double>(in.A[m * in.lda + k]) * in.Wf[j * in.ldw + k];
          r += p;
          mag += std::fabs(p);
        }
        ASSERT_LE(std::fabs(ref[m * in.ldc + j] - r), 1e-6 * mag * (1 + std::sqrt(in.K)) + 1e-30);
      }
  }
}

// A row of a large batch equals the same row computed alone, on every path,
// including when the batch takes the large-M kernel and the row the small one.
TEST(GemmIsa, BatchInvariantAcrossPathsAndBlocks) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  IsaGuard guard;
  const GemmInputs in = make_inputs(rng, 150, 90, 777);
  for (CpuIsa isa : supported_isas()) {
    SCOPED_TRACE(cpu::cpu_isa_name(isa));
    cpu::set_gemm_isa(isa);
    const std::vector<float> full = run_gemm(in, DType::kBF16, 2);
    ThreadPool pool(2);
    std::vector<float> par(in.M * in.ldc, NAN);
    cpu::gemm_nt_parallel(pool, in.M, in.N, in.K, in.A.data(), in.lda, in.Wb.data(), DType::kBF16,
                          in.ldw, in.bias_b.data(), DType::kBF16, par.data(), in.ldc);
    for (int64_t m = 0; m < in.M; ++m)
      ASSERT_EQ(0, std::memcmp(par.data() + m * in.ldc, full.data() + m * in.ldc, in.N * 4));
    for (int64_t m : {int64_t{0}, int64_t{7}, int64_t{131}, in.M - 1}) {
      for (int64_t rows : {int64_t{1}, int64_t{9}}) {
        if (m + rows > in.M) continue;
        std::vector<float> part(rows * in.N, NAN);
        cpu::gemm_nt(rows, in.N - 3, in.K, in.A.data() + m * in.lda, in.lda,
                     in.Wb.data() + 3 * in.ldw, DType::kBF16, in.ldw, in.bias_b.data() + 3,
                     DType::kBF16, part.data(), in.N);
        for (int64_t r = 0; r < rows; ++r)
          ASSERT_EQ(0, std::memcmp(part.data() + r * in.N, full.data() + (m + r) * in.ldc + 3,
                                   (in.N - 3) * 4))
              << "row " << m + r << " in a batch of " << rows;
      }
    }
  }
}

// The whole CPU expert forward (w13 GEMM, activation, w2 GEMM, combine) gives
// the same bits through every path.
TEST(GemmIsa, ExpertForwardBitIdenticalAcrossPaths) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  IsaGuard guard;
  ThreadPool pool(2);
  auto kernel = make_cpu_modular_kernel(&pool);
  Workspace ws;
  const int64_t E = 6, k = 2, H = 80, I = 72;
  for (DType wt : {DType::kF32, DType::kBF16}) {
    ExpertWeights w;
    w.w13 = test::random_f32(rng, {E, 2 * I, H}, -0.2f, 0.2f);
    w.w2 = test::random_f32(rng, {E, H, I}, -0.2f, 0.2f);
    w.w13_bias = test::random_f32(rng, {E, 2 * I}, -0.5f, 0.5f);
    w.w2_bias = test::random_f32(rng, {E, H}, -0.5f, 0.5f);
    if (wt == DType::kBF16) {
      w.w13 = test::to_bf16(w.w13);
      w.w2 = test::to_bf16(w.w2);
    }
    for (int64_t T : {1, 5, 90}) {
      SCOPED_TRACE(testing::Message() << "W " << dtype_name(wt) << " T=" << T);
      Tensor hidden = test::random_f32(rng, {T, H}, -2.0f, 2.0f);
      Tensor ids = Tensor::empty(DType::kI32, {T, k});
      Tensor tw = test::random_f32(rng, {T, k}, 0.1f, 1.0f);
      std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(E - 2));
      for (int64_t t = 0; t < T; ++t) {
        const int32_t a = pick(rng);
        ids.data_as<int32_t>()[t * k] = a;
        ids.data_as<int32_t>()[t * k + 1] = a + 1;
      }
      ExpertsParams p;
      p.activation = {Activation::kSiluGlu, 1.702f, 7.0f};
      Tensor ref;
      for (CpuIsa isa : supported_isas()) {
        cpu::set_gemm_isa(isa);
        Tensor out = Tensor::empty(DType::kF32, {T, H});
        test::poison(out);
        kernel->forward(hidden, ids, tw, w, p, false, out, ws);
        ASSERT_EQ(test::count_non_finite(out), 0) << cpu::cpu_isa_name(isa);
        if (isa == supported_isas().front())
          ref = std::move(out);
        else
          EXPECT_EQ(0, std::memcmp(out.data(), ref.data(), ref.nbytes()))
              << cpu::cpu_isa_name(isa) << " differs from "
              << cpu::cpu_isa_name(supported_isas().front());
      }
    }
  }
}

TEST(GemmIsa, SetUnsupportedOrUnknownThrows) {
  IsaGuard guard;
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2}) {
    if (cpu::cpu_isa_supported(isa)) continue;
    try {
      cpu::set_gemm_isa(isa);
      ADD_FAILURE() << "no error for " << cpu::cpu_isa_name(isa);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    }
  }
}

// FUSEDMOE_CPU_ISA is read at the first GEMM of a process: run in a fresh one.
class GemmIsaEnvironment : public testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

[[noreturn]] void exit_with_isa_of_env(const char* value) {
  test::exit_with_env("FUSEDMOE_CPU_ISA", value, [] { return static_cast<int>(cpu::gemm_isa()); });
}

TEST_F(GemmIsaEnvironment, SelectsForcedPath) {
  EXPECT_EXIT(exit_with_isa_of_env("scalar"), testing::ExitedWithCode(0), "");
  if (cpu::cpu_isa_supported(CpuIsa::kAvx2))
    EXPECT_EXIT(exit_with_isa_of_env("avx2"), testing::ExitedWithCode(1), "");
  else
    EXPECT_EXIT(exit_with_isa_of_env("avx2"), testing::ExitedWithCode(20), "does not support");
  if (cpu::cpu_isa_supported(CpuIsa::kAvx512))
    EXPECT_EXIT(exit_with_isa_of_env("avx512"), testing::ExitedWithCode(2), "");
  else
    EXPECT_EXIT(exit_with_isa_of_env("avx512"), testing::ExitedWithCode(20), "does not support");
  EXPECT_EXIT(exit_with_isa_of_env("sse9"), testing::ExitedWithCode(21),
              "FUSEDMOE_CPU_ISA: expected one of auto, avx512, avx2, scalar, got 'sse9'");
}

}  // namespace
}  // namespace fusedmoe
