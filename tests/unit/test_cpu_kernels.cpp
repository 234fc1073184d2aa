// CPU GEMM helper and the CPU modular kernel (prepare -> experts -> finalize)
// against plain float64 references, on fresh random inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "expect_error.h"
#include "fusedmoe/kernels/modular_kernel.h"
#include "kernels/cpu/gemm.h"
#include "random_layer.h"
#include "reference_moe.h"
#include "test_util.h"

namespace fusedmoe {
namespace {

using test::fresh_seed;

// ---------------------------------------------------------------- GEMM helper

struct GemmCase {
  int64_t M, N, K;
  DType w_dtype;
  int bias;  // 0 none, 1 f32, 2 bf16
};

// Runs gemm_nt with padded A / W / C and checks it against float64.
void check_gemm(std::mt19937_64& rng, const GemmCase& c) {
  const int64_t lda = c.K + 3, ldw = c.K + 5, ldc = c.N + 2;
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> A(c.M * lda), Wf(c.N * ldw), bias_f(c.N), C(c.M * ldc, NAN);
  for (auto& v : A) v = d(rng);
  for (auto& v : Wf) v = round_to_bf16(d(rng));  // bf16-representable: f32 and bf16 W agree
  for (auto& v : bias_f) v = round_to_bf16(d(rng));
  std::vector<uint16_t> Wb(Wf.size()), bias_b(c.N);
  for (size_t i = 0; i < Wf.size(); ++i) Wb[i] = f32_to_bf16(Wf[i]);
  for (int64_t i = 0; i < c.N; ++i) bias_b[i] = f32_to_bf16(bias_f[i]);
  const void* W = c.w_dtype == DType::kBF16 ? static_cast<const void*>(Wb.data()) : Wf.data();
  const void* bias = c.bias == 0   ? nullptr
                     : c.bias == 1 ? static_cast<const void*>(bias_f.data())
                                   : static_cast<const void*>(bias_b.data());
  const DType bias_dtype = c.bias == 2 ? DType::kBF16 : DType::kF32;
  cpu::gemm_nt(c.M, c.N, c.K, A.data(), lda, W, c.w_dtype, ldw, bias, bias_dtype, C.data(), ldc);
  double err2 = 0, ref2 = 0;
  for (int64_t m = 0; m < c.M; ++m) {
    for (int64_t n = 0; n < c.N; ++n) {
      double ref = bias ? bias_f[n] : 0.0, mag = std::fabs(ref);
      for (int64_t k = 0; k < c.K; ++k) {
        ref += static_cast<double>(A[m * lda + k]) * Wf[n * ldw + k];
        mag += std::fabs(static_cast<double>(A[m * lda + k]) * Wf[n * ldw + k]);
      }
      const float got = C[m * ldc + n];
      ASSERT_TRUE(std::isfinite(got)) << "C[" << m << ", " << n << "] not written";
      // f32 accumulation: |error| <= ~K eps sum|a w| (worst case); use a loose multiple.
      EXPECT_LE(std::fabs(got - ref), 1e-6 * mag * std::max<double>(1.0, std::sqrt(c.K)) + 1e-30)
          << "C[" << m << ", " << n << "]";
      err2 += (got - ref) * (got - ref);
      ref2 += ref * ref;
    }
    for (int64_t n = c.N; n < ldc; ++n)
      ASSERT_TRUE(std::isnan(C[m * ldc + n])) << "padding written";
  }
  // (A result of a few elements may cancel to near zero; the per-element bound
  // above covers those.)
  if (ref2 > 0 && c.M * c.N >= 50) EXPECT_LE(std::sqrt(err2 / ref2), 1e-5);
}

TEST(Gemm, MatchesFloat64) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (int64_t M : {1, 3, 17, 50})
    for (int64_t N : {1, 7, 70})
      for (int64_t K : {1, 15, 16, 17, 97, 300})
        for (DType wt : {DType::kF32, DType::kBF16})
          for (int bias = 0; bias < 3; ++bias) {
            SCOPED_TRACE(testing::Message() << "M=" << M << " N=" << N << " K=" << K << " W "
                                            << dtype_name(wt) << " bias " << bias);
            check_gemm(rng, {M, N, K, wt, bias});
          }
}

// Every row's result is bit-identical whatever the batch, the tile a row
// falls in, the weight dtype (for bf16-representable values) and the threading.
TEST(Gemm, FixedOrderBatchInvariantAndPathIndependent) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  const int64_t M = 131, N = 150, K = 333;
  std::vector<float> A(M * K), Wf(N * K), bias(N);
  for (auto& v : A) v = d(rng);
  for (auto& v : Wf) v = round_to_bf16(d(rng));
  for (auto& v : bias) v = d(rng);
  std::vector<uint16_t> Wb(Wf.size());
  for (size_t i = 0; i < Wf.size(); ++i) Wb[i] = f32_to_bf16(Wf[i]);

  std::vector<float> full_f32(M * N), full_bf16(M * N), full_par(M * N), row(N);
  cpu::gemm_nt(M, N, K, A.data(), K, Wf.data(), DType::kF32, K, bias.data(), DType::kF32,
               full_f32.data(), N);
  cpu::gemm_nt(M, N, K, A.data(), K, Wb.data(), DType::kBF16, K, bias.data(), DType::kF32,
               full_bf16.data(), N);
  ThreadPool pool(2);
  cpu::gemm_nt_parallel(pool, M, N, K, A.data(), K, Wb.data(), DType::kBF16, K, bias.data(),
                        DType::kF32, full_par.data(), N);
  EXPECT_EQ(0, std::memcmp(full_f32.data(), full_bf16.data(), full_f32.size() * 4));
  EXPECT_EQ(0, std::memcmp(full_f32.data(), full_par.data(), full_f32.size() * 4));
  for (int64_t m : {int64_t{0}, int64_t{5}, M - 1}) {
    cpu::gemm_nt(1, N, K, A.data() + m * K, K, Wb.data(), DType::kBF16, K, bias.data(), DType::kF32,
                 row.data(), N);
    EXPECT_EQ(0, std::memcmp(row.data(), full_f32.data() + m * N, N * 4)) << "row " << m;
    // A 3-row batch with the row in the middle, and a column subset.
    std::vector<float> three(3 * N);
    if (m >= 1 && m + 1 < M) {
      cpu::gemm_nt(3, N, K, A.data() + (m - 1) * K, K, Wf.data(), DType::kF32, K, bias.data(),
                   DType::kF32, three.data(), N);
      EXPECT_EQ(0, std::memcmp(three.data() + N, full_f32.data() + m * N, N * 4)) << "row " << m;
    }
    cpu::gemm_nt(1, 5, K, A.data() + m * K, K, Wf.data() + 37 * K, DType::kF32, K, bias.data() + 37,
                 DType::kF32, row.data(), 5);
    EXPECT_EQ(0, std::memcmp(row.data(), full_f32.data() + m * N + 37, 5 * 4)) << "row " << m;
  }
}

// ---------------------------------------------------------------- modular kernel

struct KernelCase {
  int64_t T, E, k, H, I;
  DType w_dtype;
  bool bias;
  Activation act;
  bool on_input;
  DType compute = DType::kF32;
};

std::string describe(const KernelCase& c) {
  std::ostringstream os;
  os << "T=" << c.T << " E=" << c.E << " k=" << c.k << " H=" << c.H << " I=" << c.I << " W "
     << dtype_name(c.w_dtype) << " bias=" << c.bias << " act=" << to_string(c.act)
     << " on_input=" << c.on_input << " compute " << dtype_name(c.compute);
  return os.str();
}

using test::random_weight;

// Like test::random_experts, but w2_bias is always f32.
ExpertWeights make_experts(std::mt19937_64& rng, int64_t E, int64_t H, int64_t I, DType dtype,
                           bool bias) {
  ExpertWeights w;
  w.w13 = random_weight(rng, {E, 2 * I, H}, 2.0f / std::sqrt(static_cast<float>(H)), dtype);
  w.w2 = random_weight(rng, {E, H, I}, 2.0f / std::sqrt(static_cast<float>(I)), dtype);
  if (bias) {
    w.w13_bias = random_weight(rng, {E, 2 * I}, 0.5f, dtype);
    w.w2_bias = random_weight(rng, {E, H}, 0.5f, DType::kF32);
  }
  return w;
}

// Distinct ids per token, some -1.
void random_routing(std::mt19937_64& rng, int64_t T, int64_t k, int64_t E, int32_t* ids,
                    float* weights, double p_none) {
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  std::bernoulli_distribution none(p_none);
  std::vector<int32_t> perm(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) perm[e] = static_cast<int32_t>(e);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < k; ++j) {
      ids[t * k + j] = none(rng) ? -1 : perm[j];
      weights[t * k + j] = u(rng);
    }
  }
}

ExpertsParams params_of(const KernelCase& c) {
  ExpertsParams p;
  p.activation = {c.act, 1.702f, 7.0f};
  p.compute_dtype = c.compute;
  return p;
}

void check_kernel(std::mt19937_64& rng, const KernelCase& c, ModularKernel& kernel, Workspace& ws) {
  SCOPED_TRACE(describe(c));
  const ExpertWeights w = make_experts(rng, c.E, c.H, c.I, c.w_dtype, c.bias);
  // Hidden states with a padded row stride.
  Tensor hbuf = test::random_f32(rng, {std::max<int64_t>(c.T, 1), c.H + 4}, -2.0f, 2.0f);
  const int64_t hshape[] = {c.T, c.H}, hstrides[] = {c.H + 4, 1};
  const TensorView hidden(hbuf.data(), DType::kF32, hshape, hstrides);
  Tensor ids = Tensor::empty(DType::kI32, {c.T, c.k});
  Tensor tw = Tensor::empty(DType::kF32, {c.T, c.k});
  random_routing(rng, c.T, c.k, c.E, ids.data_as<int32_t>(), tw.data_as<float>(), 0.1);
  Tensor out = Tensor::empty(DType::kF32, {c.T, c.H});
  test::poison(out);
  const ExpertsParams p = params_of(c);
  kernel.forward(hidden, ids, tw, w, p, c.on_input, out, ws);
  ASSERT_EQ(test::count_non_finite(out), 0) << "output not fully written";

  std::vector<double> ref = test::reference_experts(hidden, ids, tw, w, p.activation, c.on_input);
  const TensorView ref_view(ref.data(), DType::kF64, {c.T, c.H});
  const double tol = c.compute == DType::kBF16 ? 1e-2 : 1e-5;
  if (c.T > 0) EXPECT_LE(test::rel_l2(out, ref_view), tol);

  // Deterministic: a second run is bit-identical.
  Tensor out2 = Tensor::empty(DType::kF32, {c.T, c.H});
  test::poison(out2);
  kernel.forward(hidden, ids, tw, w, p, c.on_input, out2, ws);
  EXPECT_EQ(0, std::memcmp(out.data(), out2.data(), out.nbytes())) << "not deterministic";

  // Batch invariant: a few tokens run alone give the same bits.
  for (int64_t t : {int64_t{0}, c.T / 2, c.T - 1}) {
    if (t < 0 || t >= c.T) continue;
    Tensor one = Tensor::empty(DType::kF32, {1, c.H});
    kernel.forward(hidden.narrow(0, t, 1), ids.view().narrow(0, t, 1), tw.view().narrow(0, t, 1), w,
                   p, c.on_input, one, ws);
    EXPECT_EQ(0, std::memcmp(one.data(), out.data_as<float>() + t * c.H, c.H * 4))
        << "token " << t << " differs when run alone";
  }
}

TEST(CpuModularKernel, MatchesFloat64Reference) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  ThreadPool pool(2);
  auto kernel = make_cpu_modular_kernel(&pool);
  Workspace ws;
  const Activation acts[] = {Activation::kSiluGlu, Activation::kGeluGlu, Activation::kGeluTanhGlu,
                             Activation::kSwigluOai};
  const int64_t Ek[][2] = {{1, 1}, {8, 2}, {10, 6}, {60, 8}};
  int n = 0;
  for (int64_t T : {0, 1, 3, 17, 130})
    for (const auto& ek : Ek)
      for (DType wt : {DType::kF32, DType::kBF16}) {
        const Activation act = acts[n % 4];
        const bool bias = n % 3 == 1;
        ++n;
        check_kernel(rng, {T, ek[0], ek[1], 96, 80, wt, bias, act, false}, *kernel, ws);
      }
}

TEST(CpuModularKernel, RouterWeightOnInputAndBF16Compute) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  ThreadPool pool(2);
  auto kernel = make_cpu_modular_kernel(&pool);
  Workspace ws;
  for (int64_t T : {1, 5, 70}) {
    // Llama-4: top-1, weight on the input.
    check_kernel(rng, {T, 8, 1, 64, 48, DType::kBF16, false, Activation::kSiluGlu, true}, *kernel,
                 ws);
    check_kernel(rng, {T, 16, 1, 72, 40, DType::kF32, true, Activation::kSwigluOai, true}, *kernel,
                 ws);
    // compute_dtype bf16 (inputs and intermediate rounded), within 1e-2.
    check_kernel(rng,
                 {T, 8, 2, 96, 80, DType::kBF16, false, Activation::kSiluGlu, false, DType::kBF16},
                 *kernel, ws);
    check_kernel(rng,
                 {T, 4, 1, 64, 32, DType::kF32, true, Activation::kSwigluOai, true, DType::kBF16},
                 *kernel, ws);
  }
}

TEST(CpuModularKernel, LargeExpertAndManyRowsPerExpert) {
  // All tokens on few experts: > 128 rows per expert (several row blocks).
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  ThreadPool pool(2);
  auto kernel = make_cpu_modular_kernel(&pool);
  Workspace ws;
  check_kernel(rng, {300, 2, 2, 136, 100, DType::kBF16, true, Activation::kSiluGlu, false}, *kernel,
               ws);
  check_kernel(rng, {200, 3, 1, 64, 200, DType::kF32, false, Activation::kGeluTanhGlu, false},
               *kernel, ws);
}

TEST(CpuModularKernel, NoExpertTokensGiveZeroAndWorkspaceStopsGrowing) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  auto kernel = make_cpu_modular_kernel();
  Workspace ws;
  const int64_t T = 9, E = 6, k = 2, H = 32, I = 24;
  const ExpertWeights w = make_experts(rng, E, H, I, DType::kF32, false);
  Tensor hidden = test::random_f32(rng, {T, H});
  Tensor ids = Tensor::empty(DType::kI32, {T, k});
  Tensor tw = test::random_f32(rng, {T, k}, 0.1f, 1.0f);
  for (int64_t i = 0; i < T * k; ++i) ids.data_as<int32_t>()[i] = -1;
  ids.data_as<int32_t>()[3 * k + 1] = 4;  // token 3 has one expert
  Tensor out = Tensor::empty(DType::kF32, {T, H});
  test::poison(out);
  kernel->forward(hidden, ids, tw, w, {}, false, out, ws);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float v = out.data_as<float>()[t * H + h];
      if (t == 3)
        EXPECT_TRUE(std::isfinite(v) && v != 0.0f);
      else
        EXPECT_EQ(v, 0.0f) << "token " << t;
    }
  // Warm: same and smaller batches allocate nothing more.
  random_routing(rng, T, k, E, ids.data_as<int32_t>(), tw.data_as<float>(), 0.0);
  kernel->forward(hidden, ids, tw, w, {}, false, out, ws);
  const size_t warm = ws.total_bytes();
  for (int rep = 0; rep < 3; ++rep) {
    random_routing(rng, T, k, E, ids.data_as<int32_t>(), tw.data_as<float>(), 0.2);
    kernel->forward(hidden.view().narrow(0, 0, T - rep), ids.view().narrow(0, 0, T - rep),
                    tw.view().narrow(0, 0, T - rep), w, {}, false, out.view().narrow(0, 0, T - rep),
                    ws);
    EXPECT_EQ(ws.total_bytes(), warm);
  }
}

// Expects fn to throw Error(kInvalidArgument) whose message contains every `parts`.
template <typename Fn>
void expect_error(Fn&& fn, std::initializer_list<const char*> parts) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown (expected one mentioning " << *parts.begin() << ")";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    for (const char* p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "message '" << e.what() << "' lacks '" << p << "'";
  }
}

// The inputs of a fused-experts call of T tokens too large to exist: every
// token is one row (zero row strides); out_row must stay unwritten (1234.5).
struct OneRowTokens {
  int64_t H;
  std::vector<float> row, out_row, tw_row = {0.5f, 0.5f};
  std::vector<int32_t> ids_row = {0, 1};  // k = 2
  explicit OneRowTokens(int64_t hidden) : H(hidden), row(hidden, 1.0f), out_row(hidden, 1234.5f) {}
  TensorView view(void* data, DType dtype, int64_t T, int64_t cols) const {
    const int64_t shape[] = {T, cols}, strides[] = {0, 1};
    return TensorView(data, dtype, shape, strides);
  }
  TensorView hidden(int64_t T) { return view(row.data(), DType::kF32, T, H); }
  TensorView out(int64_t T) { return view(out_row.data(), DType::kF32, T, H); }
  TensorView ids(int64_t T) { return view(ids_row.data(), DType::kI32, T, 2); }
  TensorView tw(int64_t T) { return view(tw_row.data(), DType::kF32, T, 2); }
  // kernel.forward of T such tokens (no biases, the weight on the output).
  void forward(ModularKernel& kernel, const ExpertWeights& w, int64_t T, Workspace& ws) {
    kernel.forward(hidden(T), ids(T), tw(T), w, {}, false, out(T), ws);
  }
};

// Out of memory: an allocation that fails, or whose size overflows 63 bits, is
// Error(kOutOfMemory) naming what was allocated and how many bytes (it was a bare
// std::bad_alloc, the Python module's "MemoryError: std::bad_alloc").
TEST(CpuModularKernel, OutOfMemoryNamesTheBufferAndItsBytes) {
  const auto oom_message = [](auto&& fn) { return test::error_of(fn, ErrorCode::kOutOfMemory); };
  Workspace ws;
  // 2^60 bytes, beyond any address space: the allocation fails at once, nothing is touched.
  std::string msg = oom_message([&] {
    ws.get(0, "the test's rows, f32 [M, H]", {int64_t{1} << 40, int64_t{1} << 18}, 4);
  });
  EXPECT_HAS(msg,
             "out of memory: cannot allocate 1152921504606846976 bytes (1 EiB) of workspace "
             "for the test's rows, f32 [M, H] = [1099511627776, 262144]");
  msg = oom_message([&] { ws.get(1, size_t{1} << 60, "the test's items"); });
  EXPECT_HAS(msg,
             "cannot allocate 1152921504606846976 bytes (1 EiB) of workspace for the test's "
             "items");
  msg = oom_message([&] { ws.get(1, "x", {int64_t{1} << 40, int64_t{1} << 40}, 4); });
  EXPECT_HAS(msg,
             "out of memory: x = [1099511627776, 1099511627776] of 4-byte elements would "
             "take 2^63 bytes or more");
  EXPECT_EQ(ws.total_bytes(), 0u);  // a failed slot holds nothing
  // A later, possible request of the same slot still works.
  EXPECT_NE(ws.get(0, "x", {16}, 4), nullptr);

  // The fused experts of T tokens whose routed rows would take 2^63 bytes: refused
  // before anything reads the inputs (views of one row, repeated by a zero stride).
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  auto kernel = make_cpu_modular_kernel();
  const int64_t T = int64_t{1} << 56, E = 2, H = 16, I = 8;
  const ExpertWeights w = make_experts(rng, E, H, I, DType::kF32, false);
  OneRowTokens x(H);
  msg = oom_message([&] { x.forward(*kernel, w, T, ws); });
  EXPECT_HAS(msg,
             "out of memory: the routed rows' hidden states, f32 [T, k, H] = "
             "[72057594037927936, 2, 16] of 4-byte elements would take 2^63 bytes or more");
  EXPECT_EQ(x.out_row, std::vector<float>(H, 1234.5f));

  // 2^31 routed slots (their rows would fit in 64-bit sizes): more than prepare's
  // i32 row indices hold, refused before anything reads the inputs.
  const int64_t T31 = int64_t{1} << 30;
  msg = test::error_of([&] { x.forward(*kernel, w, T31, ws); }, ErrorCode::kUnsupported);
  EXPECT_HAS(msg,
             "topk_ids: the CPU backend takes at most 2147483647 routed slots (T * k, i32 row "
             "indices), got 1073741824 * 2 = 2147483648");
  EXPECT_EQ(x.out_row, std::vector<float>(H, 1234.5f));
}

// Routed rows whose workspace is beyond the machine's memory and swap together:
// refused at once, naming hidden_states and the bytes, before anything is
// allocated (the buffers were allocated and filled one by one until the largest
// failed, or the process was ended by the OOM killer, seconds later). 2^26
// routed rows of 256 KiB each (I = 2^16): 16 TiB, views of one row repeated.
TEST(CpuModularKernel, WorkspaceBeyondTheMachinesMemoryIsRefusedAtOnce) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  auto kernel = make_cpu_modular_kernel();
  Workspace ws;
  const int64_t T = int64_t{1} << 25, E = 2, H = 16, I = int64_t{1} << 16;
  const ExpertWeights w = make_experts(rng, E, H, I, DType::kF32, false);
  OneRowTokens x(H);
  const std::string msg =
      test::error_of([&] { x.forward(*kernel, w, T, ws); }, ErrorCode::kOutOfMemory);
  EXPECT_HAS(msg,
             "hidden_states: 33554432 tokens routed to M = 67108864 expert rows (topk_ids "
             "[33554432, 2]) need ");
  EXPECT_HAS(msg,
             " of workspace (f32 [M, H] twice and [M, I], H = 16, I = 65536), with the output's ");
  EXPECT_HAS(msg, " (f32 [T, H]) more than the machine's ");
  EXPECT_HAS(msg, " of memory and swap; pass fewer tokens a call");
  EXPECT_EQ(ws.total_bytes(), 0u);  // nothing allocated
  EXPECT_EQ(x.out_row, std::vector<float>(H, 1234.5f));
}

TEST(CpuModularKernel, RejectsBadInputsWithoutWriting) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  auto kernel = make_cpu_modular_kernel();
  Workspace ws;
  const int64_t T = 4, E = 5, k = 2, H = 16, I = 8;
  const ExpertWeights w = make_experts(rng, E, H, I, DType::kBF16, false);
  Tensor hidden = test::random_f32(rng, {T, H});
  Tensor ids = Tensor::empty(DType::kI32, {T, k});
  Tensor tw = test::random_f32(rng, {T, k}, 0.1f, 1.0f);
  random_routing(rng, T, k, E, ids.data_as<int32_t>(), tw.data_as<float>(), 0.0);
  Tensor out = Tensor::empty(DType::kF32, {T, H});
  auto run = [&](const TensorView& h, const TensorView& i, const TensorView& wt,
                 const ExpertWeights& ew, const TensorView& o, ExpertsParams p = {}) {
    return [&, h, i, wt, o, p] { kernel->forward(h, i, wt, ew, p, false, o, ws); };
  };
  const auto sentinel = [&] {
    for (int64_t n = 0; n < T * H; ++n) out.data_as<float>()[n] = 1234.5f;
  };
  const auto untouched = [&] {
    for (int64_t n = 0; n < T * H; ++n)
      if (out.data_as<float>()[n] != 1234.5f) return false;
    return true;
  };

  sentinel();
  Tensor h_bad = test::random_f32(rng, {T, H + 1});
  expect_error(run(h_bad, ids, tw, w, out), {"hidden_states", "[*, 16]", "[4, 17]"});
  Tensor h_bf16 = test::to_bf16(hidden);
  expect_error(run(h_bf16, ids, tw, w, out), {"hidden_states", "bf16"});
  Tensor ids_f = test::random_f32(rng, {T, k});
  expect_error(run(hidden, ids_f, tw, w, out), {"topk_ids", "i32"});
  Tensor ids_rows = Tensor::empty(DType::kI32, {T + 1, k});
  expect_error(run(hidden, ids_rows, tw, w, out), {"topk_ids"});
  Tensor tw_bad = test::random_f32(rng, {T, k + 1});
  // topk_ids [4, 2] with topk_weights [4, 3]: which is wrong cannot be told, both are named.
  expect_error(run(hidden, ids, tw_bad, w, out),
               {"topk_ids [4, 2] and topk_weights [4, 3] disagree: expected the same [T, top_k]"});
  Tensor tw_rows = test::random_f32(rng, {T + 1, k});
  expect_error(run(hidden, ids, tw_rows, w, out), {"topk_weights: expected f32 [4, 2]"});
  Tensor ids_k0 = Tensor::empty(DType::kI32, {T, 0});  // top_k 0: it wrote zeros
  Tensor tw_k0 = Tensor::empty(DType::kF32, {T, 0});
  expect_error(run(hidden, ids_k0, tw_k0, w, out), {"topk_ids", "k >= 1", "[4, 0]"});
  Tensor h_nan = Tensor::copy_of(hidden);
  h_nan.data_as<float>()[2 * H + 7] = std::nanf("");
  expect_error(run(h_nan, ids, tw, w, out), {"hidden_states", "NaN at token 2, column 7"});
  Tensor tw_inf = Tensor::copy_of(tw);
  tw_inf.data_as<float>()[1 * k + 1] = INFINITY;
  expect_error(run(hidden, ids, tw_inf, w, out), {"topk_weights", "Inf at token 1, column 1"});
  Tensor out_bad = Tensor::empty(DType::kF32, {T, H - 1});
  expect_error(run(hidden, ids, tw, w, out_bad), {"output"});
  ExpertsParams p16;
  p16.compute_dtype = DType::kF16;
  expect_error(run(hidden, ids, tw, w, out, p16), {"compute_dtype"});
  // gpt-oss's clamp: a limit <= 0 zeroed every output, NaN disabled the clamp.
  ExpertsParams oai;
  oai.activation.activation = Activation::kSwigluOai;
  oai.activation.swiglu_limit = -1.0f;
  expect_error(run(hidden, ids, tw, w, out, oai), {"swiglu_limit", "> 0", "-1"});
  oai.activation.swiglu_limit = std::nanf("");
  expect_error(run(hidden, ids, tw, w, out, oai), {"swiglu_limit", "nan"});
  oai.activation.swiglu_limit = 7.0f;
  oai.activation.swiglu_alpha = INFINITY;
  expect_error(run(hidden, ids, tw, w, out, oai), {"swiglu_alpha", "inf"});
  // ... and another activation ignored them: a value other than the default is refused.
  ExpertsParams silu;
  silu.activation.swiglu_alpha = 1.5f;
  expect_error(run(hidden, ids, tw, w, out, silu),
               {"swiglu_alpha", "swiglu_oai only", "activation silu", "got 1.5"});
  silu.activation.swiglu_alpha = 1.702f;
  silu.activation.swiglu_limit = 10.0f;
  expect_error(run(hidden, ids, tw, w, out, silu),
               {"swiglu_limit", "swiglu_oai only", "activation silu", "got 10"});
  ExpertWeights w_bad = w;
  w_bad.w2 = random_weight(rng, {E, H, I + 1}, 0.1f, DType::kBF16);
  expect_error(run(hidden, ids, tw, w_bad, out), {"experts.w13", "experts.w2", "disagree"});
  // A wrong H is blamed on the weight that differs from hidden_states.
  ExpertWeights w13_bad_h = w;
  w13_bad_h.w13 = random_weight(rng, {E, 2 * I, H + 2}, 0.1f, DType::kBF16);
  expect_error(run(hidden, ids, tw, w13_bad_h, out), {"experts.w13", "[5, 16, 18]"});
  // A w13 that cannot be [E, 2I, H] (an odd middle size): named, with the
  // shape w2 [E, H, I] implies (it said [5, 14, 16], from w13's own 15 rows).
  ExpertWeights w13_odd = w;
  w13_odd.w13 = random_weight(rng, {E, 2 * I - 1, H}, 0.1f, DType::kBF16);
  expect_error(run(hidden, ids, tw, w13_odd, out),
               {"experts.w13: expected bf16 [5, 16, 16], got bf16 [5, 15, 16]"});
  // The router weight on the input takes one expert per token (it was applied
  // to each of the k inputs, then summed unscaled).
  expect_error([&] { kernel->forward(hidden, ids, tw, w, {}, true, out, ws); },
               {"apply_router_weight_on_input: supported with top_k = 1 only",
                "got top_k = 2 (topk_ids i32 [4, 2])"});
  ExpertWeights w2_bad_h = w;
  w2_bad_h.w2 = random_weight(rng, {E, H + 2, I}, 0.1f, DType::kBF16);
  expect_error(run(hidden, ids, tw, w2_bad_h, out), {"experts.w2", "[5, 18, 8]"});
  ExpertWeights w_mixed = w;
  w_mixed.w2 = random_weight(rng, {E, H, I}, 0.1f, DType::kF32);
  expect_error(run(hidden, ids, tw, w_mixed, out), {"experts", "same dtype"});
  ExpertWeights w_half_bias = w;
  w_half_bias.w13_bias = random_weight(rng, {E, 2 * I}, 0.1f, DType::kF32);
  expect_error(run(hidden, ids, tw, w_half_bias, out), {"experts.w2_bias"});

  for (int32_t bad : {static_cast<int32_t>(E), -2, 1000}) {
    Tensor ids2 = Tensor::copy_of(ids);
    ids2.data_as<int32_t>()[2 * k + 1] = bad;
    expect_error(run(hidden, ids2, tw, w, out),
                 {"topk_ids", std::to_string(bad).c_str(), "[2, 1]"});
  }
  EXPECT_TRUE(untouched()) << "output written although the call threw";
}

}  // namespace
}  // namespace fusedmoe
