// The functional cuda::fused_experts (kernels/cuda.h) against the float64
// reference: T / E / k / H / I grids, f32 and bf16 hidden states and outputs,
// biases with gpt-oss's clamped SwiGLU, -1 and out-of-range ids (add nothing),
// row-strided input and output, router weight on the input (k = 1), a
// poisoned workspace of exactly fused_experts_workspace_bytes, bit-identical
// reruns; and the argument checks, which need no device.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "expect_error.h"
#include "kernels/cuda/routed_experts.h"
#include "reference_moe.h"

namespace fusedmoe {
namespace {

using test::DeviceTensor;

struct Case {
  int64_t T, E, k, H, I;
  Activation act;
  bool bias;
  DType io;                      // hidden states and output
  bool repeats = false;          // ids drawn with replacement (an expert twice in a token)
  DType weights = DType::kBF16;  // w13 / w2
  cuda::W13Layout layout = cuda::W13Layout::kStandard;
};

std::string name(const Case& c) {
  return "T" + std::to_string(c.T) + " E" + std::to_string(c.E) + " k" + std::to_string(c.k) +
         " H" + std::to_string(c.H) + " I" + std::to_string(c.I) + " act" +
         std::to_string(static_cast<int>(c.act)) + (c.bias ? " bias" : "") + " " +
         dtype_name(c.io) + (c.repeats ? " repeats" : "") + " weights " + dtype_name(c.weights) +
         (c.layout == cuda::W13Layout::kInterleaved128 ? " w13 interleaved" : "");
}

void run_case(const Case& c, std::mt19937_64& rng, bool on_input = false) {
  SCOPED_TRACE(name(c) + (on_input ? " on-input" : ""));
  const int64_t T = c.T, E = c.E, k = c.k, H = c.H, I = c.I;
  const ExpertWeights w = test::random_experts(rng, E, H, I, c.weights, c.bias);
  Tensor x = test::randn_f32(rng, {T, H});
  if (c.io == DType::kBF16) x = to_f32(test::to_bf16(x));  // the values the kernel reads
  // ids: k distinct experts per token; some -1 and some >= E (both add nothing)
  Tensor ids = Tensor::empty(DType::kI32, {T, k}), ref_ids = Tensor::empty(DType::kI32, {T, k});
  Tensor tw = test::random_f32(rng, {T, k}, 0.1f, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) perm[e] = static_cast<int32_t>(e);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < k; ++j) {
      int32_t id = c.repeats ? static_cast<int32_t>(rng() % static_cast<uint64_t>(E)) : perm[j];
      int32_t ref = id;
      if (t % 7 == 3 && j == 0) id = ref = -1;
      if (t % 11 == 5 && j == k - 1) id = static_cast<int32_t>(E + 3), ref = -1;
      ids.data_as<int32_t>()[t * k + j] = id;
      ref_ids.data_as<int32_t>()[t * k + j] = ref;
    }
  }
  ActivationParams act;
  act.activation = c.act;
  const std::vector<double> want = test::reference_experts(x, ref_ids, tw, w, act, on_input);

  DeviceTensor x_d = DeviceTensor::from_host(c.io == DType::kBF16 ? test::to_bf16(x) : x, H + 8);
  const test::DeviceExperts dw(w);
  if (c.layout == cuda::W13Layout::kInterleaved128 && I % cuda::kW13Block == 0)
    cuda::interleave_w13(dw.w13.data_as<uint16_t>(), E, I, H, nullptr);
  DeviceTensor ids_d = DeviceTensor::from_host(ids), tw_d = DeviceTensor::from_host(tw);
  DeviceTensor out(c.io, {T, H}, H + 16);
  const size_t ws_bytes = cuda::fused_experts_workspace_bytes(T, H, I, E, k, on_input, c.layout);
  DeviceTensor ws(DType::kU8, {static_cast<int64_t>(ws_bytes)});
  out.poison();
  ws.poison();

  cuda::FusedExpertsArgs a =
      test::fused_experts_args(x_d, dw.w13, dw.w2, dw.b13, dw.b2, ids_d, tw_d, out, act, on_input);
  a.w13_layout = c.layout;
  cuda::fused_experts(a, ws.data(), ws_bytes, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  Tensor got = out.to_host();
  if (c.io == DType::kBF16) got = to_f32(got);
  EXPECT_EQ(test::count_non_finite(got), 0);
  std::vector<double> want_copy = want;
  const TensorView want_v(want_copy.data(), DType::kF64, {T, H});
  if (T > 0) EXPECT_LE(test::rel_l2(got, want_v), 1e-2);

  // the same call again, on a poisoned output: the same bits
  out.poison();
  cuda::fused_experts(a, ws.data(), ws_bytes, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  Tensor again = out.to_host();
  if (c.io == DType::kBF16) again = to_f32(again);
  EXPECT_EQ(std::memcmp(again.data(), got.data(), got.nbytes()), 0);
}

TEST(CudaFusedExperts, MatchesFloat64Reference) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<Case> cases = {
      {1, 8, 2, 64, 48, Activation::kSiluGlu, false, DType::kF32},
      {5, 8, 2, 64, 48, Activation::kSiluGlu, false, DType::kBF16},
      {64, 8, 2, 64, 48, Activation::kGeluGlu, false, DType::kF32},
      {33, 32, 4, 256, 72, Activation::kSwigluOai, true, DType::kF32},
      {300, 16, 8, 128, 40, Activation::kSiluGlu, true, DType::kBF16},
      {3, 128, 8, 2048, 768, Activation::kSiluGlu, false, DType::kBF16},
      {0, 8, 2, 64, 48, Activation::kSiluGlu, false, DType::kF32},
  };
  for (const Case& c : cases) run_case(c, rng);
  run_case({9, 4, 1, 32, 16, Activation::kSiluGlu, false, DType::kF32}, rng, /*on_input=*/true);
}

// The decode path (T * k <= 128: two weight-streaming kernels straight
// from topk_ids, src/kernels/cuda/decode_experts.cu) at every row count of its
// templates (1, 2, 4 rows per work group), with repeated ids (more slots of an
// expert than a group holds), -1 and out-of-range ids, H and I that are no
// multiple of the 8-row / 4-pair items or of 256, biases, f16 weights, the
// widest k (32), the T * k = 32 edge and I >= 4096 (4-row w2 items).
TEST(CudaFusedExperts, DecodePathMatchesFloat64Reference) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  using A = Activation;
  const DType bf = DType::kBF16, f32 = DType::kF32, f16 = DType::kF16;
  const std::vector<Case> cases = {
      {1, 128, 8, 2048, 768, A::kSiluGlu, false, bf},
      {1, 8, 2, 96, 80, A::kSiluGlu, false, f32},
      {1, 6, 4, 72, 40, A::kGeluGlu, true, f32, /*repeats=*/true},
      {1, 40, 32, 64, 24, A::kSiluGlu, false, bf},
      {1, 5, 32, 64, 24, A::kSiluGlu, false, bf, true},
      {2, 16, 4, 96, 80, A::kSwigluOai, true, f32},
      {2, 4, 16, 104, 56, A::kSiluGlu, false, bf, true},
      {3, 32, 4, 256, 72, A::kSiluGlu, false, bf},
      {3, 3, 8, 64, 48, A::kGeluTanhGlu, false, f32, true},
      {4, 64, 8, 520, 264, A::kSwigluOai, true, bf},
      {4, 2, 8, 64, 16, A::kSiluGlu, false, f32, true},
      {1, 8, 2, 96, 80, A::kSiluGlu, true, f32, false, f16},
      {4, 8, 4, 64, 48, A::kSiluGlu, false, f16, true, f16},
      // I >= 4096: decode_w2 in 4-row items
      {1, 4, 2, 64, 4096, A::kSiluGlu, true, bf},
      {3, 3, 2, 72, 4104, A::kSwigluOai, true, f32, true},
      // Past T = 4 where few slots reach each expert (pick_decode_experts:
      // T * k <= 2 E): Mixtral-like T = 8 and 16, k = 1 with 32 tokens.
      {8, 8, 2, 256, 200, A::kSiluGlu, false, bf},
      {16, 16, 2, 96, 80, A::kGeluGlu, true, f32},
      {32, 16, 1, 64, 48, A::kSiluGlu, false, bf, true},
      // 33 to 96 slots (picked up to 96): the groups come from a table in shared memory
      {8, 128, 8, 256, 200, A::kSiluGlu, false, bf},
      {12, 64, 8, 96, 80, A::kSwigluOai, true, f32, true},
      {11, 48, 6, 72, 1032, A::kGeluGlu, false, bf},
      // ... with I >= 4096 (4-row w2 items; picked up to T = 3 for such experts)
      {3, 48, 16, 72, 4104, A::kGeluGlu, false, bf},
  };
  for (const Case& c : cases) run_case(c, rng);
  run_case({1, 4, 1, 32, 16, Activation::kSiluGlu, false, DType::kF32}, rng, /*on_input=*/true);
  // bf16 output of 4 tokens: wide enough rows that bf16 rounding averages out (H 32 / I 16
  // gave 1.014e-2 for one seed, 3043849707374611687).
  run_case({4, 4, 1, 128, 64, Activation::kSiluGlu, false, DType::kBF16}, rng, /*on_input=*/true);
}

// w13 in W13Layout::kInterleaved128 (interleave_w13, as the layer keeps it where
// the sm90 path exists) on every path fused_experts takes: decode (1, 2 and 4
// slots a group, the shared-memory group table), the mma.sync grouped GEMM
// (FUSEDMOE_CUDA_EXPERTS=mma) and the sm90 path with the activation in the w13
// GEMM's epilogue (bf16 and f16, both bf16 tiles by rows per expert).
TEST(CudaFusedExperts, InterleavedW13OnEveryPath) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  using A = Activation;
  const DType bf = DType::kBF16, f32 = DType::kF32, f16 = DType::kF16;
  const auto il = cuda::W13Layout::kInterleaved128;
  const std::vector<Case> cases = {
      {1, 8, 2, 64, 256, A::kSiluGlu, false, bf, false, bf, il},
      {2, 16, 4, 96, 384, A::kSwigluOai, true, f32, false, bf, il},
      {4, 8, 4, 64, 128, A::kGeluGlu, true, f32, true, f16, il},
      {12, 64, 8, 96, 128, A::kGeluTanhGlu, true, f32, true, bf, il},
      {40, 8, 2, 136, 256, A::kSiluGlu, true, bf, false, bf, il},
      {300, 8, 2, 200, 384, A::kSwigluOai, true, bf, false, bf, il},
      {1000, 16, 4, 128, 256, A::kSiluGlu, false, f32, false, bf, il},
      {600, 8, 2, 136, 256, A::kGeluGlu, true, f32, false, f16, il},
  };
  for (const Case& c : cases) run_case(c, rng);
  setenv("FUSEDMOE_CUDA_EXPERTS", "mma", 1);
  for (const Case& c : cases) run_case(c, rng);
  unsetenv("FUSEDMOE_CUDA_EXPERTS");
  // I not a multiple of 128: refused, naming the field.
  Case bad{4, 8, 2, 64, 96, A::kSiluGlu, false, f32, false, bf, il};
  try {
    run_case(bad, rng);
    ADD_FAILURE() << "w13_layout kInterleaved128 with I = 96 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("w13_layout"), std::string::npos) << e.what();
  }
}

// Given the output (no shared expert), the decode path folds finalize into its
// second kernel (decode_w2_sum: the slots summed in shared memory); the sum
// must have the bits of decode_w2 (y by slot, as expert parallelism takes it)
// + finalize. T = 1..32, up to 128 slots, -1, out-of-range and repeated ids (groups of 1, 2 and
// 4 slots, one expert in several groups), biases, f32 / bf16 / f16 outputs
// with a row stride, k from 1 to 16 (1 to 8 row blocks a block), I >= 4096
// (4-row items), f16 weights.
TEST(CudaFusedExperts, DecodeSumHasTheBitsOfDecodePlusFinalize) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct SumCase {
    int64_t T, E, k, H, I;
    bool bias;
    DType out, weights;
  };
  const DType bf = DType::kBF16, f32 = DType::kF32, f16 = DType::kF16;
  const std::vector<SumCase> cases = {
      {1, 8, 2, 96, 80, false, f32, bf},
      {1, 128, 8, 2048, 768, false, bf, bf},
      {1, 6, 3, 88, 40, true, f32, bf},
      {2, 40, 16, 64, 24, false, bf, bf},
      {1, 4, 1, 104, 48, true, f16, f16},
      {3, 16, 6, 72, 56, true, bf, bf},
      {4, 3, 8, 64, 48, false, f32, bf},
      {4, 64, 8, 520, 264, true, f32, bf},
      {2, 4, 2, 64, 4096, true, f32, bf},
      {3, 9, 5, 72, 4104, false, f32, f16},
      {4, 2, 2, 64, 32, false, f16, bf},
      // T > 4 (T * k <= 32): more tokens than one pass of the block's threads sums
      {8, 16, 2, 96, 80, false, f32, bf},
      {32, 16, 1, 72, 48, true, bf, bf},
      {16, 4, 2, 64, 40, false, f16, bf},
      // 33 to 128 slots (the shared-memory group table)
      {16, 128, 8, 96, 80, false, bf, bf},
      {12, 40, 8, 72, 48, true, f32, bf},
      {5, 3, 8, 64, 4096, false, f32, f16},
  };
  for (const SumCase& c : cases) {
    SCOPED_TRACE("T" + std::to_string(c.T) + " E" + std::to_string(c.E) + " k" +
                 std::to_string(c.k) + " H" + std::to_string(c.H) + " I" + std::to_string(c.I) +
                 " out " + dtype_name(c.out) + " weights " + dtype_name(c.weights));
    const int64_t T = c.T, E = c.E, k = c.k, H = c.H, I = c.I;
    const ExpertWeights w = test::random_experts(rng, E, H, I, c.weights, c.bias);
    Tensor x = test::randn_f32(rng, {T, H});
    Tensor ids = Tensor::empty(DType::kI32, {T, k});
    Tensor tw = test::random_f32(rng, {T, k}, 0.1f, 1.0f);
    for (int64_t s = 0; s < T * k; ++s)  // repeats allowed
      ids.data_as<int32_t>()[s] = static_cast<int32_t>(rng() % static_cast<uint64_t>(E));
    if (k >= 2) ids.data_as<int32_t>()[0] = -1;
    if (k >= 3) ids.data_as<int32_t>()[T * k - 1] = static_cast<int32_t>(E + 3);
    DeviceTensor x_d =
        DeviceTensor::from_host(c.weights == bf ? test::to_bf16(x) : test::to_f16(x), H + 8);
    const test::DeviceExperts dw(w);
    DeviceTensor ids_d = DeviceTensor::from_host(ids), tw_d = DeviceTensor::from_host(tw);
    DeviceTensor inter(c.weights, {T * k, I}), y(f32, {T * k, H});
    cuda::RoutedExpertsArgs r;
    r.dtype = c.weights;
    r.x = x_d.data_as<const uint16_t>();
    r.ldx = x_d.ld();
    r.topk_ids = ids_d.data_as<const int32_t>();
    r.topk_weights = tw_d.data_as<const float>();
    r.num_tokens = T;
    r.top_k = k;
    r.num_experts = E;
    r.hidden = H;
    r.inter = I;
    r.w13 = dw.w13.data_as<const uint16_t>();
    r.w2 = dw.w2.data_as<const uint16_t>();
    r.w13_bias = dw.b13.data_as<const float>();
    r.w2_bias = dw.b2.data_as<const float>();
    r.act.activation = c.bias ? Activation::kSwigluOai : Activation::kSiluGlu;
    std::vector<Tensor> got;
    for (const bool sum : {false, true}) {
      DeviceTensor out(c.out, {T, H}, H + 16);
      out.poison();
      inter.poison();
      y.poison();
      cuda::RoutedExpertsArgs a = r;
      if (sum) {
        a.out = out.data();
        a.out_dtype = c.out;
        a.ldo = out.ld();
      }
      const bool written =
          cuda::decode_experts(a, inter.data_as<uint16_t>(), y.data_as<float>(), nullptr);
      EXPECT_EQ(written, sum);
      if (!written) {
        cuda::FinalizeArgs f;
        f.y = y.data();
        f.topk_ids = r.topk_ids;
        f.num_tokens = T;
        f.top_k = k;
        f.hidden = H;
        f.num_experts = E;
        f.out = out.data();
        f.out_dtype = c.out;
        f.ldo = out.ld();
        cuda::finalize(f, nullptr);
      }
      CUDA_OK(cudaDeviceSynchronize());
      got.push_back(to_f32(out.to_host()));
      EXPECT_EQ(test::count_non_finite(got.back()), 0);
    }
    EXPECT_EQ(std::memcmp(got[0].data(), got[1].data(), got[0].nbytes()), 0);
  }
}

// Argument checks run before anything touches the device: no GPU needed.
TEST(CudaFusedExperts, ArgumentErrorsNameTheField) {
  auto* fake = reinterpret_cast<void*>(uintptr_t{1} << 20);  // never dereferenced
  cuda::FusedExpertsArgs a;
  a.hidden_states = fake;
  a.hidden_dtype = DType::kF32;
  a.ldx = 64;
  a.num_tokens = 4;
  a.hidden_size = 64;
  a.intermediate_size = 32;
  a.num_experts = 8;
  a.top_k = 2;
  a.w13 = static_cast<const uint16_t*>(fake);
  a.w2 = static_cast<const uint16_t*>(fake);
  a.topk_ids = static_cast<const int32_t*>(fake);
  a.topk_weights = static_cast<const float*>(fake);
  a.output = reinterpret_cast<void*>(uintptr_t{1} << 30);
  a.ldo = 64;
  const size_t need = cuda::fused_experts_workspace_bytes(4, 64, 32, 8, 2, false);
  EXPECT_GT(need, size_t{4} * 64 * 2);
  EXPECT_GE(cuda::fused_experts_workspace_bytes(400, 64, 32, 8, 2, false), need);
  // w13 interleaved: no h13 rows where the sm90 path applies the activation in its epilogue.
  const auto il = cuda::W13Layout::kInterleaved128;
  const size_t standard = cuda::fused_experts_workspace_bytes(4096, 256, 128, 8, 2, false);
  const size_t interleaved = cuda::fused_experts_workspace_bytes(4096, 256, 128, 8, 2, false, il);
  if (cuda::sm90_experts_available())
    // h13: room for the rows of the contiguous GEMMs (each expert's rows padded to 64).
    EXPECT_EQ(standard - interleaved,
              static_cast<size_t>((cuda::max_padded_rows(4096 * 2, 8, 64) + 63) / 64 * 64) * 2 *
                  128 * 2)
        << "the h13 rows";
  else
    EXPECT_EQ(standard, interleaved);
  void* ws = reinterpret_cast<void*>(uintptr_t{1} << 24);
  auto call = [&](cuda::FusedExpertsArgs b, size_t bytes = 0, void* w = nullptr) {
    return [=] { cuda::fused_experts(b, w ? w : ws, bytes ? bytes : need, nullptr); };
  };
  using test::error_of;
  EXPECT_HAS(error_of(call(a, need - 1), ErrorCode::kInvalidArgument), "workspace");
  EXPECT_HAS(error_of(call(a, need, reinterpret_cast<void*>((uintptr_t{1} << 24) + 8)),
                      ErrorCode::kInvalidArgument),
             "256-byte");
  cuda::FusedExpertsArgs b = a;
  b.ldx = 32;
  EXPECT_HAS(error_of(call(b), ErrorCode::kInvalidArgument), "hidden_states: row stride");
  b = a;
  b.ldo = 8;
  EXPECT_HAS(error_of(call(b), ErrorCode::kInvalidArgument), "output: row stride");
  b = a;
  b.hidden_dtype = DType::kF64;
  EXPECT_HAS(error_of(call(b), ErrorCode::kInvalidArgument), "hidden_states: expected dtype");
  b = a;
  b.output_dtype = DType::kI32;
  EXPECT_HAS(error_of(call(b), ErrorCode::kInvalidArgument), "output: expected dtype");
  b = a;
  b.topk_ids = nullptr;
  EXPECT_HAS(error_of(call(b), ErrorCode::kInvalidArgument), "non-null");
  b = a;
  b.output = const_cast<void*>(a.hidden_states);
  EXPECT_HAS(error_of(call(b), ErrorCode::kInvalidArgument), "alias");
  b = a;
  b.top_k = 2;
  b.apply_router_weight_on_input = true;
  EXPECT_HAS(error_of(call(b), ErrorCode::kUnsupported), "apply_router_weight_on_input");
  b = a;
  b.intermediate_size = 36;
  EXPECT_HAS(error_of(call(b, cuda::fused_experts_workspace_bytes(4, 64, 36, 8, 2, false)),
                      ErrorCode::kUnsupported),
             "multiples of 8");
  b = a;
  b.top_k = 33;
  EXPECT_HAS(error_of(call(b, cuda::fused_experts_workspace_bytes(4, 64, 32, 8, 33, false)),
                      ErrorCode::kUnsupported),
             "top_k");
  EXPECT_HAS(error_of([] { cuda::fused_experts_workspace_bytes(-1, 64, 32, 8, 2, false); },
                      ErrorCode::kInvalidArgument),
             "num_tokens");
}

}  // namespace
}  // namespace fusedmoe
