// fp16 on the CUDA backend: MoERunner with compute_dtype f16 (f32 weights kept
// as f16) and the functional cuda::fused_experts with f16 weights, against the
// float64 reference on fresh random inputs — T / E / k / H / I with H and I
// not multiples of the tiles, both routed-expert paths (mma.sync / GEMV and
// the sm90 CUTLASS instances, forced with FUSEDMOE_CUDA_EXPERTS), f32 / f16 /
// bf16 activations, poisoned outputs, bit-identical reruns; that f16 is what
// runs (its error is well below bf16's on the same weights); an f16 output
// that overflows is +-inf exactly where the f32 result rounds past 65504;
// and the dtype checks, which need no device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "expect_error.h"
#include "reference_moe.h"

namespace fusedmoe {
namespace {

using test::DeviceTensor;

// f32 values rounded to f16 in place (what f16 storage keeps).
void round_f16(Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    t.data_as<float>()[i] = f16_to_f32(f32_to_f16(t.data_as<float>()[i]));
}
void round_experts_f16(ExpertWeights& w) {
  round_f16(w.w13);
  round_f16(w.w2);
}
// Host f32 copy of an f32 / bf16 / f16 device result.
Tensor host_f32(const DeviceTensor& d) {
  return to_f32(d.to_host());
}
Tensor as_dtype(const Tensor& f32, DType d) {
  return d == DType::kF16 ? test::to_f16(f32) : d == DType::kBF16 ? test::to_bf16(f32) : f32;
}
// The f32 values a tensor of dtype d keeps of f32 (rounded).
Tensor kept(const Tensor& f32, DType d) {
  return d == DType::kF32 ? f32 : to_f32(as_dtype(f32, d));
}

struct ForceExperts {
  explicit ForceExperts(const char* path) {
    if (path) setenv("FUSEDMOE_CUDA_EXPERTS", path, 1);
  }
  ~ForceExperts() { unsetenv("FUSEDMOE_CUDA_EXPERTS"); }
};

RunnerOptions cuda_options(int64_t max_tokens, DType compute) {
  RunnerOptions o;
  o.compute_dtype = compute;
  o.device = Device{DeviceType::kCUDA, 0};
  o.max_num_tokens = max_tokens;
  return o;
}

// One MoERunner forward on the device (own gate GEMM); returns the f32 output
// and the router's ids / weights on the host.
struct LayerRun {
  Tensor out, ids, weights;
};
LayerRun run_layer(MoERunner& gpu, const DeviceTensor& x_d, DType io, int64_t T, int64_t H,
                   int64_t k) {
  DeviceTensor out(io, {T, H}), ids(DType::kI32, {T, k}), w(DType::kF32, {T, k});
  out.poison();
  ForwardOutputs fo{TensorView(), ids, w};
  gpu.forward(x_d, out, nullptr, nullptr, &fo);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {host_f32(out), ids.to_host(), w.to_host()};
}

// f16 weights (f32 checkpoint values rounded to f16, compute_dtype f16) vs the
// float64 reference on the same weights; and bf16 compute on the same weights
// for comparison.
void check_f16_layer(const MoEConfig& c, int64_t T, DType io, std::mt19937_64& rng,
                     const char* path) {
  const int64_t H = c.hidden_size, k = c.top_k;
  SCOPED_TRACE("T " + std::to_string(T) + " E " + std::to_string(c.num_experts) + " k " +
               std::to_string(k) + " H " + std::to_string(H) + " I " +
               std::to_string(c.intermediate_size) + " io " + dtype_name(io) + " experts " +
               (path ? path : "auto"));
  const ForceExperts force(path);
  MoELayerWeights lw = test::random_layer(rng, c, DType::kF32);
  round_experts_f16(lw.experts);
  if (lw.shared_experts) round_experts_f16(*lw.shared_experts);
  MoERunner gpu(c, lw, cuda_options(std::max<int64_t>(T, 1), DType::kF16));
  const Tensor x = kept(test::randn_f32(rng, {T, H}), io);  // the values the kernels read
  const DeviceTensor x_d = DeviceTensor::from_host(as_dtype(x, io), H + 8);
  const LayerRun r = run_layer(gpu, x_d, io, T, H, k);
  if (T == 0) return;
  ASSERT_EQ(test::count_non_finite(r.out), 0) << "unwritten (NaN-poisoned) or non-finite output";
  std::vector<double> ref = test::reference_moe_layer(c, lw, x, r.ids, r.weights);
  const double err = test::rel_l2(r.out, TensorView(ref.data(), DType::kF64, {T, H}));
  EXPECT_LE(err, 1e-2) << "f16 vs float64 reference";

  // Again: the same bits.
  const LayerRun again = run_layer(gpu, x_d, io, T, H, k);
  EXPECT_EQ(std::memcmp(again.out.data(), r.out.data(), r.out.nbytes()), 0)
      << "rerun not bit-identical";

  // The same weights in bf16: a clearly larger error (f16 keeps 3 more
  // mantissa bits), so f16 is what ran. Only where the routing is the same.
  if (io == DType::kF32 && T >= 17) {
    MoERunner gb(c, lw, cuda_options(T, DType::kBF16));
    const LayerRun b = run_layer(gb, x_d, io, T, H, k);
    if (std::memcmp(b.ids.data(), r.ids.data(), r.ids.nbytes()) == 0) {
      const double err_b = test::rel_l2(b.out, TensorView(ref.data(), DType::kF64, {T, H}));
      EXPECT_LT(2 * err, err_b) << "f16 error " << err << " not well below bf16's " << err_b;
    }
  }
}

// The routed-expert paths to force: mma, and sm90 where available.
std::vector<const char*> expert_paths() {
  std::vector<const char*> v = {"mma"};
  if (cuda::sm90_experts_available()) v.push_back("sm90");
  return v;
}

TEST(CudaF16, RunnerMatchesFloat64Reference) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Shape {
    int64_t T, E, k, H, I;
  };
  for (const Shape& s :
       {Shape{1, 8, 2, 96, 80}, Shape{17, 60, 6, 96, 80}, Shape{300, 16, 4, 104, 1408},
        Shape{1000, 8, 2, 96, 80}, Shape{130, 128, 8, 264, 88}, Shape{0, 8, 2, 96, 80}}) {
    MoEConfig c = test::base_config(s.E, s.k, s.H, s.I);
    c.renormalize = true;
    for (const char* path : expert_paths()) {
      check_f16_layer(c, s.T, DType::kF32, rng, path);
      check_f16_layer(c, s.T, DType::kF16, rng, path);
      if (HasFailure()) return;
    }
  }
}

TEST(CudaF16, ArchitecturesBothPaths) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // shared expert + gate (qwen2_moe: the gate reads the f16 expert input),
  // grouped routing + shared (deepseek_v3), biases + clamped SwiGLU
  // (gpt_oss), weight on the input (llama4), zero experts.
  for (const std::string arch : {"qwen2_moe", "deepseek_v3", "gpt_oss", "llama4", "zero_experts"}) {
    const MoEConfig c = test::arch_config(arch, 16, arch == "llama4" ? 1 : 4, 72, 40);
    SCOPED_TRACE(arch);
    for (const char* path : expert_paths()) {
      check_f16_layer(c, 33, DType::kF16, rng, path);
      check_f16_layer(c, 300, DType::kF32, rng, path);
      if (HasFailure()) return;
    }
  }
}

// cuda::fused_experts with `wd` weights and `io` hidden states / output.
struct FusedRun {
  Tensor out;
  std::vector<double> want;
};
// Random experts (f32 tensors) holding values of the half type wd.
ExpertWeights half_experts(std::mt19937_64& rng, int64_t E, int64_t H, int64_t I, DType wd,
                           bool bias) {
  ExpertWeights w = test::random_experts(rng, E, H, I, DType::kF32, bias);
  w.w13 = kept(w.w13, wd);
  w.w2 = kept(w.w2, wd);
  return w;
}
FusedRun run_fused(std::mt19937_64& rng, const ExpertWeights& w, int64_t T, int64_t k, DType wd,
                   DType io, DType out_dtype, const Tensor* x_in = nullptr) {
  const int64_t E = w.num_experts(), H = w.hidden_size(), I = w.intermediate_size();
  const bool bias = w.w13_bias.has_value();
  const Tensor x = x_in ? *x_in : kept(test::randn_f32(rng, {T, H}), io);
  Tensor ids = Tensor::empty(DType::kI32, {T, k});
  const Tensor tw = test::random_f32(rng, {T, k}, 0.1f, 1.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)
      ids.data_as<int32_t>()[t * k + j] =
          t % 7 == 3 && j == 0 ? -1 : static_cast<int32_t>((t * 5 + j * 3) % E);
  for (int64_t t = 0; t < T; ++t)  // distinct ids per token
    for (int64_t j = 1; j < k; ++j)
      if (ids.data_as<int32_t>()[t * k + j] == ids.data_as<int32_t>()[t * k + j - 1])
        ids.data_as<int32_t>()[t * k + j] = -1;
  ActivationParams act;
  FusedRun r;
  r.want = test::reference_experts(x, ids, tw, w, act, false);
  DeviceTensor x_d = DeviceTensor::from_host(as_dtype(x, io), H + 8);
  DeviceTensor w13 = DeviceTensor::from_host(as_dtype(w.w13, wd));
  DeviceTensor w2 = DeviceTensor::from_host(as_dtype(w.w2, wd));
  DeviceTensor b13, b2;
  if (bias) {
    b13 = DeviceTensor::from_host(to_f32(*w.w13_bias));
    b2 = DeviceTensor::from_host(to_f32(*w.w2_bias));
  }
  DeviceTensor ids_d = DeviceTensor::from_host(ids), tw_d = DeviceTensor::from_host(tw);
  DeviceTensor out(out_dtype, {T, H}, H + 16);
  const size_t ws_bytes = cuda::fused_experts_workspace_bytes(T, H, I, E, k, false);
  DeviceTensor ws(DType::kU8, {static_cast<int64_t>(ws_bytes)});
  out.poison();
  ws.poison();
  const cuda::FusedExpertsArgs a =
      test::fused_experts_args(x_d, w13, w2, b13, b2, ids_d, tw_d, out, act, false);
  cuda::fused_experts(a, ws.data(), ws_bytes, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  r.out = host_f32(out);
  return r;
}

TEST(CudaF16, FusedExpertsMatchesFloat64Reference) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  struct Case {
    int64_t T, E, k, H, I;
    DType wd, io;
    bool bias;
  };
  // f16 weights with f32 / f16 / bf16 (converted to f16) activations; bf16
  // weights with f16 activations (converted to bf16). T = 300, E = 16, k = 8:
  // 150 rows per expert, the sm90 path where available.
  for (const Case& c : {Case{1, 8, 2, 64, 48, DType::kF16, DType::kF16, false},
                        Case{5, 8, 2, 64, 48, DType::kF16, DType::kF32, true},
                        Case{64, 8, 2, 104, 88, DType::kF16, DType::kBF16, false},
                        Case{300, 16, 8, 128, 40, DType::kF16, DType::kF16, true},
                        Case{33, 32, 4, 256, 72, DType::kBF16, DType::kF16, false}}) {
    SCOPED_TRACE("T " + std::to_string(c.T) + " weights " + dtype_name(c.wd) + " io " +
                 dtype_name(c.io));
    const ExpertWeights w = half_experts(rng, c.E, c.H, c.I, c.wd, c.bias);
    const FusedRun r = run_fused(rng, w, c.T, c.k, c.wd, c.io, c.io);
    EXPECT_EQ(test::count_non_finite(r.out), 0);
    std::vector<double> want = r.want;
    EXPECT_LE(test::rel_l2(r.out, TensorView(want.data(), DType::kF64, {c.T, c.H})), 1e-2);
  }
}

// An f16 output beyond the f16 range: +-inf exactly where the f32 result
// rounds past 65504, the other elements the f32 result rounded to f16 (the
// same f32 sums, one rounding at the store) — on both expert paths.
TEST(CudaF16, OverflowingOutputIsInfAsDocumented) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const char* path : expert_paths()) {
    SCOPED_TRACE(path);
    const ForceExperts force(path);
    std::mt19937_64 rng(seed);
    const int64_t T = 64, E = 8, k = 2, H = 64, I = 48;
    // Scale w2 by a power of two so that the largest outputs reach ~4 x 65504
    // (w2 itself stays inside the f16 range: |w2| <= 2 / sqrt(I) * scale).
    const ExpertWeights w = half_experts(rng, E, H, I, DType::kF16, false);
    const Tensor x = test::randn_f32(rng, {T, H});
    const FusedRun base = run_fused(rng, w, T, k, DType::kF16, DType::kF32, DType::kF32, &x);
    double m = 0;
    for (int64_t i = 0; i < base.out.numel(); ++i)
      m = std::max(m, std::abs(static_cast<double>(base.out.data_as<float>()[i])));
    ASSERT_GT(m, 0.0);
    const float scale = std::exp2(std::ceil(std::log2(2.6e5 / m)));
    ASSERT_LT(2.0 / std::sqrt(double(I)) * scale, 65504.0) << "w2 would overflow f16 itself";
    ExpertWeights ws = w;
    ws.w2 = Tensor::copy_of(w.w2);
    for (int64_t i = 0; i < ws.w2.numel(); ++i) ws.w2.data_as<float>()[i] *= scale;
    std::mt19937_64 r32(seed + 2), r16(seed + 2);  // the same ids / weights in both runs
    const FusedRun f32 = run_fused(r32, ws, T, k, DType::kF16, DType::kF32, DType::kF32, &x);
    const FusedRun f16 = run_fused(r16, ws, T, k, DType::kF16, DType::kF32, DType::kF16, &x);
    int64_t infs = 0, finite = 0;
    for (int64_t i = 0; i < f32.out.numel(); ++i) {
      const float v = f32.out.data_as<float>()[i];
      ASSERT_TRUE(std::isfinite(v)) << "f32 output " << i;
      const float want = f16_to_f32(f32_to_f16(v));
      const float got = f16.out.data_as<float>()[i];
      ASSERT_EQ(std::memcmp(&want, &got, 4), 0) << "element " << i << ": f32 " << v;
      (std::isinf(got) ? infs : finite) += 1;
    }
    EXPECT_GT(infs, 0) << "no element overflowed: the test scale is off";
    EXPECT_GT(finite, 0);
  }
}

// Experts run in f16 on request, also from bf16 weights (exact within the
// f16 range); a weight beyond it is an error naming the tensor.
TEST(CudaF16, Bf16WeightsConvertedAndOutOfRangeWeightRejected) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const MoEConfig c = test::base_config(8, 2, 64, 48);
  MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
  {
    MoERunner gpu(c, w, cuda_options(16, DType::kF16));
    const Tensor x = test::randn_f32(rng, {16, 64});
    const LayerRun r = run_layer(gpu, DeviceTensor::from_host(x), DType::kF32, 16, 64, 2);
    std::vector<double> ref = test::reference_moe_layer(c, w, x, r.ids, r.weights);
    EXPECT_LE(test::rel_l2(r.out, TensorView(ref.data(), DType::kF64, {16, 64})), 1e-2);
  }
  w.experts.w2 = Tensor::copy_of(w.experts.w2);
  w.experts.w2.data_as<uint16_t>()[5] = f32_to_bf16(1.0e5f);
  EXPECT_HAS(test::error_of([&] { MoERunner gpu(c, w, cuda_options(16, DType::kF16)); },
                            ErrorCode::kInvalidArgument),
             "experts.w2");
  MoERunner ok(c, w, cuda_options(16, DType::kBF16));  // bf16 holds it
}

// Without a device: the dtype checks.
TEST(CudaF16, DtypeErrorsNameTheArgument) {
  cuda::FusedExpertsArgs a;
  a.num_tokens = 1;
  a.hidden_size = 64;
  a.intermediate_size = 48;
  a.num_experts = 8;
  a.top_k = 2;
  a.ldx = a.ldo = 64;
  a.weight_dtype = DType::kF32;
  const size_t big = size_t{1} << 30;
  EXPECT_HAS(test::error_of([&] { cuda::fused_experts(a, nullptr, big, nullptr); },
                            ErrorCode::kInvalidArgument),
             "weight_dtype");
  a.weight_dtype = DType::kF16;
  a.output_dtype = DType::kI32;
  EXPECT_HAS(test::error_of([&] { cuda::fused_experts(a, nullptr, big, nullptr); },
                            ErrorCode::kInvalidArgument),
             "output");
  // f16 compute is the CUDA backend's: the CPU runner says so.
  std::mt19937_64 rng(1);
  const MoEConfig c = test::base_config(8, 2, 64, 48);
  const MoELayerWeights w = test::random_layer(rng, c, DType::kF32);
  RunnerOptions o;
  o.compute_dtype = DType::kF16;
  EXPECT_HAS(test::error_of([&] { MoERunner r(c, w, o); }, ErrorCode::kInvalidArgument),
             "compute_dtype");
}

}  // namespace
}  // namespace fusedmoe
