// MoERunner on the CUDA backend against the CPU backend and the float64
// reference: every architecture's shape, T / E / k grids with H and I that are
// not multiples of the tile, -1 ids, strided router_logits, poisoned outputs,
// bit-identical reruns, CUDA-graph capture and replay, 64-bit offsets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "expect_error.h"
#include "kernels/cuda/routed_experts.h"  // pick_w13_layout
#include "reference_moe.h"

namespace fusedmoe {
namespace {

using test::DeviceTensor;

TensorView f64_view(std::vector<double>& v, int64_t rows, int64_t cols) {
  return TensorView(v.data(), DType::kF64, {rows, cols});
}

RunnerOptions cuda_options(int64_t max_tokens, cudaStream_t stream = nullptr) {
  RunnerOptions o;
  o.compute_dtype = DType::kBF16;
  o.device = Device{DeviceType::kCUDA, 0};
  o.max_num_tokens = max_tokens;
  o.cuda_stream = stream;
  return o;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// One case: CPU runner (bf16) vs CUDA runner on the same hidden states.
void check_runner(const MoEConfig& c, int64_t T, std::mt19937_64& rng, DType io_dtype) {
  const int64_t H = c.hidden_size, k = c.top_k, L = c.num_router_logits();
  SCOPED_TRACE("T " + std::to_string(T) + " E " + std::to_string(c.num_experts) + " k " +
               std::to_string(k) + " H " + std::to_string(H) + " I " +
               std::to_string(c.intermediate_size) + " io " + dtype_name(io_dtype));
  MoELayerWeights lw = test::random_layer(rng, c, DType::kBF16);
  RunnerOptions cpu_opts;
  cpu_opts.compute_dtype = DType::kBF16;
  MoERunner cpu(c, lw, cpu_opts);
  MoERunner gpu(c, lw, cuda_options(std::max<int64_t>(T, 1)));

  Tensor x = test::randn_f32(rng, {T, H});
  if (io_dtype == DType::kBF16) x = to_f32(test::to_bf16(x));  // the same values on both sides
  Tensor logits_h = Tensor::empty(DType::kF32, {T, L});
  Tensor ids_h = Tensor::empty(DType::kI32, {T, k}), w_h = Tensor::empty(DType::kF32, {T, k});
  Tensor out_cpu = Tensor::empty(DType::kF32, {T, H});
  ForwardOutputs fo{logits_h, ids_h, w_h};
  cpu.forward(x, out_cpu, nullptr, nullptr, &fo);

  // 1) CPU's logits passed in (strided): ids must equal the CPU router's.
  DeviceTensor x_d = DeviceTensor::from_host(io_dtype == DType::kBF16 ? test::to_bf16(x) : x,
                                             H + 8);  // row stride > H
  DeviceTensor logits_d = DeviceTensor::from_host(logits_h, L + 3);
  DeviceTensor out_d(io_dtype, {T, H}), ids_d(DType::kI32, {T, k}), w_d(DType::kF32, {T, k});
  out_d.poison();
  ids_d.poison();
  w_d.poison();
  ForwardOutputs fo_d{TensorView(), ids_d, w_d};
  const TensorView lv = logits_d.view();
  gpu.forward(x_d, out_d, &lv, nullptr, &fo_d);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor ids_g = ids_d.to_host(), w_g = w_d.to_host();
  for (int64_t i = 0; i < T * k; ++i) {
    ASSERT_EQ(ids_g.data_as<int32_t>()[i], ids_h.data_as<int32_t>()[i]) << "slot " << i;
    const float a = w_g.data_as<float>()[i], b = w_h.data_as<float>()[i];
    ASSERT_LE(std::abs(a - b), 1e-6f * std::abs(b) + 1e-30f) << "slot " << i;
  }
  const Tensor out_g = to_f32(out_d.to_host());
  ASSERT_EQ(test::count_non_finite(out_g), 0) << "unwritten (NaN-poisoned) or non-finite output";
  std::vector<double> ref = test::reference_moe_layer(c, lw, x, ids_h, w_h);
  const double err = T ? test::rel_l2(out_g, f64_view(ref, T, H)) : 0.0;
  EXPECT_LE(err, 1e-2) << "CUDA vs float64 reference";
  if (T) EXPECT_LE(test::rel_l2(out_g, out_cpu), 1e-2) << "CUDA vs CPU bf16 backend";

  // 2) Same call again: bit-identical.
  out_d.poison();
  gpu.forward(x_d, out_d, &lv, nullptr, &fo_d);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(same_bits(to_f32(out_d.to_host()), out_g)) << "rerun not bit-identical";

  // 2b) The functional cuda::fused_experts on the same input, ids and weights:
  //     the same routed-expert code as the layer, so the same bits (layers
  //     without a shared expert; on whichever path the layer took).
  if (!c.has_shared_expert() && T > 0) {
    const ExpertWeights& ew = lw.experts;
    DeviceTensor w13 = DeviceTensor::from_host(ew.w13), w2 = DeviceTensor::from_host(ew.w2);
    // w13 as the layer keeps it.
    const bool interleaved =
        cuda::pick_w13_layout(c.intermediate_size) == cuda::W13Layout::kInterleaved128;
    if (interleaved)
      cuda::interleave_w13(w13.data_as<uint16_t>(), ew.w13.size(0), ew.w13.size(1) / 2,
                           ew.w13.size(2), nullptr);
    DeviceTensor b13, b2;  // empty: no bias
    if (ew.w13_bias) b13 = DeviceTensor::from_host(to_f32(*ew.w13_bias));
    if (ew.w2_bias) b2 = DeviceTensor::from_host(to_f32(*ew.w2_bias));
    const size_t ws_bytes = cuda::fused_experts_workspace_bytes(
        T, H, c.intermediate_size, c.num_experts, k, c.apply_router_weight_on_input);
    DeviceTensor ws(DType::kU8, {static_cast<int64_t>(ws_bytes)}), fout(io_dtype, {T, H});
    ws.poison();
    fout.poison();
    cuda::FusedExpertsArgs a =
        test::fused_experts_args(x_d, w13, w2, b13, b2, ids_d, w_d, fout,
                                 ActivationParams::from_config(c), c.apply_router_weight_on_input);
    if (interleaved) a.w13_layout = cuda::W13Layout::kInterleaved128;
    cuda::fused_experts(a, ws.data(), ws_bytes, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(same_bits(to_f32(fout.to_host()), out_g))
        << "cuda::fused_experts differs from the layer's routed experts";
  }

  // 3) The CUDA gate GEMM: logits within f32 rounding of the CPU's.
  if (c.routing_method != RoutingMethod::kHash && T > 0) {
    DeviceTensor lg(DType::kF32, {T, L});
    lg.poison();
    ForwardOutputs fo2{lg, ids_d, w_d};
    out_d.poison();
    gpu.forward(x_d, out_d, nullptr, nullptr, &fo2);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LE(test::rel_l2(lg.to_host(), logits_h), 1e-5) << "router logits";
    const Tensor o2 = to_f32(out_d.to_host());
    const Tensor ids2 = ids_d.to_host(), w2 = w_d.to_host();
    std::vector<double> ref2 = test::reference_moe_layer(c, lw, x, ids2, w2);
    EXPECT_LE(test::rel_l2(o2, f64_view(ref2, T, H)), 1e-2) << "own gate GEMM";
  }
}

std::vector<std::pair<std::string, MoEConfig>> arch_configs() {
  std::vector<std::pair<std::string, MoEConfig>> v;
  for (const auto& [arch, E, k, H, I] :
       std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, int64_t>>{
           {"mixtral", 8, 2, 96, 80},
           {"qwen2_moe", 12, 4, 72, 40},
           {"deepseek_v3", 16, 4, 64, 24},
           {"gpt_oss", 8, 2, 80, 32},
           {"llama4", 8, 1, 64, 40},
           {"zero_experts", 10, 3, 48, 32},
       })
    v.emplace_back(arch, test::arch_config(arch, E, k, H, I));
  {
    MoEConfig c = test::base_config(60, 6, 96, 80);  // GELU (erf), sigmoid scores
    c.activation = Activation::kGeluGlu;
    c.scoring_func = ScoringFunc::kSigmoid;
    c.renormalize = true;
    v.emplace_back("gelu_sigmoid", c);
  }
  return v;
}

class CudaRunnerArch : public ::testing::TestWithParam<int> {};

TEST_P(CudaRunnerArch, MatchesCpuBackendAndReference) {
  FUSEDMOE_REQUIRE_CUDA();
  const auto [name, c] = arch_configs()[GetParam()];
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + name);
  std::mt19937_64 rng(seed);
  for (int64_t T : {0, 1, 3, 17, 130}) {
    check_runner(c, T, rng, DType::kF32);
    if (HasFailure()) return;
  }
  check_runner(c, 33, rng, DType::kBF16);
}

INSTANTIATE_TEST_SUITE_P(Architectures, CudaRunnerArch, ::testing::Range(0, 7),
                         [](const auto& p) { return arch_configs()[p.param].first; });

// The sm_90a wgmma + TMA path (sm90_experts) forced for every architecture and
// small T too (most experts empty: M = 0 groups); large T takes it by default.
struct ForceExperts {
  explicit ForceExperts(const char* path) { setenv("FUSEDMOE_CUDA_EXPERTS", path, 1); }
  ~ForceExperts() { unsetenv("FUSEDMOE_CUDA_EXPERTS"); }
};

TEST_P(CudaRunnerArch, Sm90ExpertsPathMatches) {
  FUSEDMOE_REQUIRE_CUDA();
  if (!cuda::sm90_experts_available()) GTEST_SKIP() << "skipped: no sm_90 device or no CUTLASS";
  const ForceExperts force("sm90");
  const auto [name, c] = arch_configs()[GetParam()];
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " " + name + " sm90");
  std::mt19937_64 rng(seed);
  for (int64_t T : {1, 17, 300}) {
    check_runner(c, T, rng, DType::kF32);
    if (HasFailure()) return;
  }
  check_runner(c, 33, rng, DType::kBF16);
}

// The sm90 path's two forms of its GEMMs (pick_sm90_contig): contiguous (one TMA
// descriptor per operand over rows padded to 64 an expert; forced on, at T where
// the scratch holds those rows: T * k >= 32 E) and CUTLASS's ptr-array grouped GEMMs.
TEST_P(CudaRunnerArch, Sm90ContiguousAndGroupedGemmsMatch) {
  FUSEDMOE_REQUIRE_CUDA();
  if (!cuda::sm90_experts_available()) GTEST_SKIP() << "skipped: no sm_90 device or no CUTLASS";
  const ForceExperts force("sm90");
  const auto [name, c] = arch_configs()[GetParam()];
  const uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  const int64_t T = std::max<int64_t>(300, 33 * c.num_experts / c.top_k + 1);
  for (const char* mode : {"on", "off"}) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " " + name + " T " + std::to_string(T) +
                 " FUSEDMOE_CUDA_SM90_CONTIG=" + mode);
    setenv("FUSEDMOE_CUDA_SM90_CONTIG", mode, 1);
    check_runner(c, T, rng, DType::kBF16);
    unsetenv("FUSEDMOE_CUDA_SM90_CONTIG");
    if (HasFailure()) return;
  }
}

TEST(CudaRunner, RejectsUnknownSm90ContigValue) {
  FUSEDMOE_REQUIRE_CUDA();
  setenv("FUSEDMOE_CUDA_SM90_CONTIG", "yes", 1);
  EXPECT_THROW(cuda::pick_sm90_contig(DType::kBF16, 64, 8192, 128, 2048, 768), Error);
  unsetenv("FUSEDMOE_CUDA_SM90_CONTIG");
}

TEST(CudaRunner, ForcedMmaPathAtLargeT) {
  FUSEDMOE_REQUIRE_CUDA();
  const ForceExperts force("mma");
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  MoEConfig c = test::base_config(8, 2, 96, 80);
  c.renormalize = true;
  check_runner(c, 1000, rng, DType::kF32);
}

// The shared expert at many rows: sm90_dense_expert (by default from T = 16 on,
// and forced) and the mma.sync kernels (forced), with the routed experts on the
// same path; a shared intermediate size (264) and H (264) off the tiles.
TEST(CudaRunner, SharedExpertBothPathsAtLargeT) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const char* arch : {"deepseek_v3", "qwen2_moe"}) {
    MoEConfig c = test::arch_config(arch, 16, 4, 264, 40);
    c.shared_intermediate_size = 264;
    for (const char* path : {"", "mma", "sm90"}) {
      if (std::string(path) == "sm90" && !cuda::sm90_experts_available()) continue;
      SCOPED_TRACE(std::string(arch) + " path '" + path + "'");
      const ForceExperts force(path);
      check_runner(c, 600, rng, DType::kBF16);
      if (HasFailure()) return;
    }
  }
}

// I a multiple of 128: where the sm90 path exists the layer keeps w13
// interleaved (W13Layout::kInterleaved128) and every path reads it: decode
// (T = 1, 4), the mma.sync GEMMs (T = 40, and forced at 600) and the sm90 path
// with the activation in the w13 epilogue (T = 600); gpt-oss's biases and
// clamped SwiGLU, DeepSeek-V3's shared expert (standard order: its own path).
// FUSEDMOE_CUDA_W13_LAYOUT=standard keeps HF's order (the separate pass).
TEST(CudaRunner, InterleavedW13OnEveryPath) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const char* layout : {"", "standard"}) {
    SCOPED_TRACE(std::string("FUSEDMOE_CUDA_W13_LAYOUT=") + layout);
    setenv("FUSEDMOE_CUDA_W13_LAYOUT", layout, 1);
    for (const char* arch : {"mixtral", "gpt_oss", "deepseek_v3"}) {
      MoEConfig c = test::arch_config(arch, 16, 4, 136, 256);
      SCOPED_TRACE(arch);
      for (const int64_t T : {1, 4, 40, 600}) check_runner(c, T, rng, DType::kBF16);
      const ForceExperts force("mma");
      check_runner(c, 600, rng, DType::kBF16);
      if (HasFailure()) break;
    }
  }
  unsetenv("FUSEDMOE_CUDA_W13_LAYOUT");
}

// With the activation in the w13 epilogue the layer's sm90 scratch holds no w13
// output rows (h13: padded rows x 2I half-type elements); the separate activation
// pass switched on after set-up is refused, naming the switch, instead of
// writing past the workspace.
TEST(CudaRunner, EpilogueScratchHasNoW13Rows) {
  FUSEDMOE_REQUIRE_CUDA();
  if (!cuda::sm90_experts_available()) GTEST_SKIP() << "no sm90 path on this device";
  {
    const int64_t T = 4096, k = 2, E = 8, H = 4096, I = 14336;  // Mixtral-8x7B
    const size_t with_h13 = cuda::routed_scratch_bytes(T, k, E, H, I, true, false);
    const size_t without = cuda::routed_scratch_bytes(T, k, E, H, I, true, true);
    // h13: room for the rows of the contiguous GEMMs (each expert's rows padded to 64).
    const int64_t rows = (cuda::max_padded_rows(T * k, E, 64) + 63) / 64 * 64;
    EXPECT_EQ(with_h13 - without, static_cast<size_t>(rows * 2 * I * 2));
  }
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  MoEConfig c = test::arch_config("mixtral", 16, 4, 136, 256);
  MoELayerWeights lw = test::random_layer(rng, c, DType::kBF16);
  const int64_t T = 600, H = c.hidden_size;
  MoERunner gpu(c, lw, cuda_options(T));
  DeviceTensor x = DeviceTensor::from_host(test::randn_f32(rng, {T, H}));
  DeviceTensor out(DType::kF32, {T, H});
  gpu.forward(x, out);  // the epilogue: fits
  CUDA_OK(cudaDeviceSynchronize());
  setenv("FUSEDMOE_CUDA_SM90_GLU", "pass", 1);
  try {
    gpu.forward(x, out);
    ADD_FAILURE() << "the separate pass ran in a scratch sized for the epilogue";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("FUSEDMOE_CUDA_SM90_GLU"), std::string::npos) << e.what();
  }
  unsetenv("FUSEDMOE_CUDA_SM90_GLU");
  CUDA_OK(cudaDeviceSynchronize());
}

// kSimulated (benchmark routing) on the device: the ids and weights of the CPU
// simulator for the same seed (no logits, no gate GEMM), and the layer's
// output within bf16 tolerance of the float64 reference on those ids.
TEST(CudaRunner, SimulatedRoutingMatchesCpuSimulator) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const SimulatedRouting kind :
       {SimulatedRouting::kUniform, SimulatedRouting::kZipf, SimulatedRouting::kAllToOne}) {
    SCOPED_TRACE(to_string(kind));
    MoEConfig c = test::base_config(24, 4, 64, 40);
    c.routing_method = RoutingMethod::kSimulated;
    c.simulated = kind;
    c.zipf_s = 1.3;
    c.simulation_seed = seed;
    c.num_zero_experts = kind == SimulatedRouting::kUniform ? 2 : 0;
    const int64_t T = 300, H = c.hidden_size, k = c.top_k;
    MoELayerWeights lw = test::random_layer(rng, c, DType::kBF16);
    RunnerOptions cpu_opts;
    cpu_opts.compute_dtype = DType::kBF16;
    MoERunner cpu(c, lw, cpu_opts);
    MoERunner gpu(c, lw, cuda_options(T));
    const Tensor x = test::randn_f32(rng, {T, H});
    Tensor ids_h = Tensor::empty(DType::kI32, {T, k}), w_h = Tensor::empty(DType::kF32, {T, k});
    Tensor out_cpu = Tensor::empty(DType::kF32, {T, H});
    ForwardOutputs fo{TensorView(), ids_h, w_h};
    cpu.forward(x, out_cpu, nullptr, nullptr, &fo);
    DeviceTensor x_d = DeviceTensor::from_host(x), out_d(DType::kF32, {T, H});
    DeviceTensor ids_d(DType::kI32, {T, k}), w_d(DType::kF32, {T, k});
    out_d.poison();
    ids_d.poison();
    w_d.poison();
    ForwardOutputs fo_d{TensorView(), ids_d, w_d};
    gpu.forward(x_d, out_d, nullptr, nullptr, &fo_d);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Tensor ids_g = ids_d.to_host(), w_g = w_d.to_host();
    ASSERT_EQ(std::memcmp(ids_g.data(), ids_h.data(), ids_h.nbytes()), 0) << "topk_ids";
    ASSERT_EQ(std::memcmp(w_g.data(), w_h.data(), w_h.nbytes()), 0) << "topk_weights";
    const Tensor out_g = out_d.to_host();
    ASSERT_EQ(test::count_non_finite(out_g), 0);
    std::vector<double> ref = test::reference_moe_layer(c, lw, x, ids_h, w_h);
    EXPECT_LE(test::rel_l2(out_g, f64_view(ref, T, H)), 1e-2);
  }
}

TEST(CudaRunner, RejectsUnknownExpertsPath) {
  FUSEDMOE_REQUIRE_CUDA();
  const ForceExperts force("wgmma");
  EXPECT_THROW(cuda::pick_sm90_experts(4096, 4096, 96, 80), Error);
}

// T, E, k, H, I grid (H, I not multiples of the tiles).
struct Shape {
  int64_t T, E, k, H, I;
};
// How gtest (and ctest's list) shows a Shape: "T=17 E=60 k=6 H=96 I=80", not its bytes.
void PrintTo(const Shape& s, std::ostream* os) {
  *os << "T=" << s.T << " E=" << s.E << " k=" << s.k << " H=" << s.H << " I=" << s.I;
}
class CudaRunnerShapes : public ::testing::TestWithParam<Shape> {};

TEST_P(CudaRunnerShapes, MatchesCpuBackendAndReference) {
  FUSEDMOE_REQUIRE_CUDA();
  const Shape s = GetParam();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  MoEConfig c = test::base_config(s.E, s.k, s.H, s.I);
  c.renormalize = true;
  check_runner(c, s.T, rng, DType::kF32);
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaRunnerShapes,
                         ::testing::Values(Shape{0, 8, 2, 96, 80}, Shape{1, 8, 2, 96, 80},
                                           Shape{1, 256, 8, 96, 80}, Shape{3, 10, 1, 96, 80},
                                           Shape{17, 60, 6, 96, 80}, Shape{130, 128, 8, 96, 80},
                                           Shape{1000, 256, 8, 96, 80}, Shape{4096, 128, 8, 96, 80},
                                           Shape{4096, 8, 2, 104, 80}, Shape{1000, 8, 2, 96, 1408},
                                           Shape{130, 60, 6, 264, 1408},
                                           Shape{17, 10, 2, 1032, 1408},
                                           Shape{1000, 10, 2, 1032, 88}),
                         [](const auto& p) {
                           const Shape& s = p.param;
                           return "T" + std::to_string(s.T) + "_E" + std::to_string(s.E) + "_k" +
                                  std::to_string(s.k) + "_H" + std::to_string(s.H) + "_I" +
                                  std::to_string(s.I);
                         });

TEST(CudaRunner, GraphCaptureReplaysWithNewInputs) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  MoEConfig c = arch_configs()[2].second;  // DeepSeek-V3 shape: grouped routing, shared expert
  MoELayerWeights lw = test::random_layer(rng, c, DType::kBF16);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t T = 48, H = c.hidden_size;
  MoERunner gpu(c, lw, cuda_options(64, stream));
  DeviceTensor x(DType::kF32, {T, H}), out(DType::kF32, {T, H});
  const Tensor x0 = test::randn_f32(rng, {T, H});
  CUDA_OK(cudaMemcpy(x.data(), x0.data(), x0.nbytes(), cudaMemcpyHostToDevice));
  gpu.forward(x, out);  // warm-up: attributes set, nothing lazily allocated during capture
  CUDA_OK(cudaStreamSynchronize(stream));

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  gpu.forward(x, out);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  for (int rep = 0; rep < 3; ++rep) {
    const Tensor xi = test::randn_f32(rng, {T, H});
    CUDA_OK(cudaMemcpy(x.data(), xi.data(), xi.nbytes(), cudaMemcpyHostToDevice));
    out.poison();
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const Tensor replayed = out.to_host();
    out.poison();
    gpu.forward(x, out);  // eager
    CUDA_OK(cudaStreamSynchronize(stream));
    const Tensor eager = out.to_host();
    ASSERT_EQ(test::count_non_finite(replayed), 0);
    EXPECT_TRUE(same_bits(replayed, eager)) << "replay " << rep << " differs from eager";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// RunnerOptions::cuda_graph_sizes: each T replays the graph of the smallest
// capture size >= T with rows T.. as padding; results equal the eager runner's
// (same ids and weights; output within bf16 rounding, the tile may differ).
// Larger T run eagerly.
TEST(CudaRunner, GraphReplayPadsToCaptureSize) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int arch : {2, 1}) {  // DeepSeek-V3 (grouped, shared expert), Qwen2-MoE (shared gate)
    MoEConfig c = arch_configs()[arch].second;
    SCOPED_TRACE(arch_configs()[arch].first);
    MoELayerWeights lw = test::random_layer(rng, c, DType::kBF16);
    const int64_t H = c.hidden_size, k = c.top_k, L = c.num_router_logits();
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    RunnerOptions go = cuda_options(64, stream);
    go.cuda_graph_sizes = {16, 1, 4};
    MoERunner graphed(c, lw, go);
    MoERunner eager(c, lw, cuda_options(64, stream));
    for (int64_t T : {1, 3, 4, 9, 16, 1, 30}) {
      SCOPED_TRACE("T " + std::to_string(T));
      const Tensor xh = test::randn_f32(rng, {T, H});
      DeviceTensor x = DeviceTensor::from_host(xh);
      DeviceTensor out_g(DType::kF32, {T, H}), out_e(DType::kF32, {T, H});
      DeviceTensor ids_g(DType::kI32, {T, k}), ids_e(DType::kI32, {T, k});
      DeviceTensor w_g(DType::kF32, {T, k}), w_e(DType::kF32, {T, k});
      DeviceTensor lg_g(DType::kF32, {T, L});
      out_g.poison();
      ids_g.poison();
      w_g.poison();
      lg_g.poison();
      ForwardOutputs fg{lg_g, ids_g, w_g}, fe{TensorView(), ids_e, w_e};
      graphed.forward(x, out_g, nullptr, nullptr, &fg);
      eager.forward(x, out_e, nullptr, nullptr, &fe);
      CUDA_OK(cudaStreamSynchronize(stream));
      EXPECT_TRUE(same_bits(ids_g.to_host(), ids_e.to_host())) << "topk_ids";
      EXPECT_TRUE(same_bits(w_g.to_host(), w_e.to_host())) << "topk_weights";
      const Tensor og = out_g.to_host(), oe = out_e.to_host();
      ASSERT_EQ(test::count_non_finite(og), 0) << "unwritten rows";
      ASSERT_EQ(test::count_non_finite(lg_g.to_host()), 0) << "unwritten router logits";
      EXPECT_LE(test::rel_l2(og, oe), 1e-2);
      std::vector<double> ref =
          test::reference_moe_layer(c, lw, xh, ids_e.to_host(), w_e.to_host());
      EXPECT_LE(test::rel_l2(og, f64_view(ref, T, H)), 1e-2) << "vs float64 reference";
    }
    EXPECT_EQ(graphed.num_cuda_graphs(), 3u) << "sizes 1, 4 and 16 (T = 30 runs eagerly)";
    EXPECT_EQ(eager.num_cuda_graphs(), 0u);
    CUDA_OK(cudaStreamDestroy(stream));
  }
}

// Hash routing on CUDA: token_ids must be i32 [T] on the device (refused
// before anything runs); an id outside [0, hash_vocab_size) reads no table row
// (it read out of bounds): the token goes to no expert (its output row is
// zero), the others route as on the CPU, and check_errors() names the token
// once.
TEST(CudaRunner, HashTokenIdsOutsideTheTableAreReported) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  MoEConfig c = test::base_config(8, 2, 64, 48);
  c.routing_method = RoutingMethod::kHash;
  c.hash_vocab_size = 50;
  MoELayerWeights lw = test::random_layer(rng, c, DType::kBF16);
  MoERunner gpu(c, lw, cuda_options(16));
  MoERunner cpu(c, lw);
  const int64_t T = 5, H = 64;
  const Tensor x = test::randn_f32(rng, {T, H});
  Tensor tok = Tensor::empty(DType::kI32, {T});
  const int32_t ids[T] = {3, 49, 50, 0, -7};  // 50 and -7: outside the table
  std::memcpy(tok.data(), ids, sizeof ids);
  DeviceTensor xd = DeviceTensor::from_host(x), td = DeviceTensor::from_host(tok),
               out(DType::kF32, {T, H});
  out.poison();
  const TensorView tv = td.view();
  gpu.forward(xd, out, nullptr, &tv);
  const std::string msg = test::error_of([&] { gpu.check_errors(); }, ErrorCode::kInvalidArgument);
  EXPECT_HAS(msg, "hash_vocab_size = 50");
  EXPECT_HAS(msg, "at token 2");
  EXPECT_NO_THROW(gpu.check_errors());  // cleared
  const Tensor got = to_f32(out.to_host());
  EXPECT_EQ(test::count_non_finite(got), 0);
  // Tokens 2 and 4: no expert, a zero row. Tokens 0, 1, 3: the CPU's output
  // for the same token ids (the CPU refuses the bad ones, so those rows alone).
  for (const int64_t t : {int64_t{2}, int64_t{4}})
    for (int64_t n = 0; n < H; ++n) EXPECT_EQ(got.data_as<float>()[t * H + n], 0.0f) << t;
  const int64_t good[3] = {0, 1, 3};
  for (const int64_t t : good) {
    Tensor xt = Tensor::empty(DType::kF32, {1, H}), tt = Tensor::empty(DType::kI32, {1});
    std::memcpy(xt.data(), x.data_as<float>() + t * H, H * sizeof(float));
    tt.data_as<int32_t>()[0] = ids[t];
    Tensor ot = Tensor::empty(DType::kF32, {1, H});
    const TensorView ttv = tt.view();
    cpu.forward(xt, ot, nullptr, &ttv);
    const TensorView got_t(const_cast<float*>(got.data_as<float>()) + t * H, DType::kF32, {1, H});
    EXPECT_LE(test::rel_l2(got_t, ot), 1e-2) << "token " << t;
  }
  // token_ids of another dtype or length: refused naming the argument (by
  // MoERunner's checks, before the layer's own).
  DeviceTensor t64 = DeviceTensor::from_host(Tensor::zeros(DType::kI64, {T}));
  DeviceTensor short_ids = DeviceTensor::from_host(Tensor::zeros(DType::kI32, {T - 1}));
  for (const DeviceTensor* bad : {&t64, &short_ids}) {
    const TensorView bv = bad->view();
    const std::string m =
        test::error_of([&] { gpu.forward(xd, out, nullptr, &bv); }, ErrorCode::kInvalidArgument);
    EXPECT_EQ(m.rfind("token_ids: expected i32 [5], got ", 0), 0u) << m;
  }
}

// NaN router logits: forward() cannot report them (no host sync); check_errors()
// names the first such token once, then is clear. In graph replay, a stale NaN
// in a padding row is not a token and is not reported.
TEST(CudaRunner, CheckErrorsNamesNanLogitToken) {
  FUSEDMOE_REQUIRE_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  MoEConfig c = test::base_config(8, 2, 64, 48);
  MoELayerWeights lw = test::random_layer(rng, c, DType::kBF16);
  RunnerOptions go = cuda_options(16);
  go.cuda_graph_sizes = {4};
  for (bool graph : {false, true}) {
    SCOPED_TRACE(graph ? "graph replay" : "eager");
    MoERunner gpu(c, lw, graph ? go : cuda_options(16));
    const int64_t T = 4, H = 64, L = 8;
    Tensor lh = test::randn_f32(rng, {T, L});
    lh.data_as<float>()[3 * L + 5] = std::nanf("");
    lh.data_as<float>()[2 * L + 1] = std::nanf("");
    DeviceTensor x = DeviceTensor::from_host(test::randn_f32(rng, {T, H}));
    DeviceTensor logits = DeviceTensor::from_host(lh), out(DType::kF32, {T, H});
    const TensorView lv = logits.view();
    gpu.forward(x, out, &lv);
    try {
      gpu.check_errors();
      ADD_FAILURE() << "no error for NaN logits";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("NaN at token 2"), std::string::npos) << e.what();
    }
    EXPECT_NO_THROW(gpu.check_errors());  // cleared
    // T = 3: the graph's static row 3 still holds the NaN logits of the call above.
    DeviceTensor x3 = DeviceTensor::from_host(test::randn_f32(rng, {3, H}));
    DeviceTensor l3 = DeviceTensor::from_host(test::randn_f32(rng, {3, L}));
    DeviceTensor out3(DType::kF32, {3, H});
    out3.poison();
    const TensorView lv3 = l3.view();
    gpu.forward(x3, out3, &lv3);
    EXPECT_NO_THROW(gpu.check_errors());
    EXPECT_EQ(test::count_non_finite(out3.to_host()), 0);
  }
}

TEST(CudaRunner, RejectsBadArguments) {
  FUSEDMOE_REQUIRE_CUDA();
  std::mt19937_64 rng(1);
  MoEConfig c = test::base_config(8, 2, 64, 48);
  MoELayerWeights lw = test::random_layer(rng, c, DType::kBF16);
  RunnerOptions f32 = cuda_options(16);
  f32.compute_dtype = DType::kF32;
  EXPECT_THROW(MoERunner(c, lw, f32), Error);
  MoERunner gpu(c, lw, cuda_options(16));
  DeviceTensor x(DType::kF32, {17, 64}), out(DType::kF32, {17, 64});
  EXPECT_THROW(gpu.forward(x, out), Error);  // more than max_num_tokens
  Tensor xh = Tensor::empty(DType::kF32, {4, 64}), oh = Tensor::empty(DType::kF32, {4, 64});
  EXPECT_THROW(gpu.forward(xh, oh), Error);         // host tensors on the CUDA backend
  MoEConfig odd = test::base_config(8, 2, 60, 48);  // H % 8 != 0
  MoELayerWeights lw2 = test::random_layer(rng, odd, DType::kBF16);
  EXPECT_THROW(MoERunner(odd, lw2, cuda_options(16)), Error);
}

// RunnerOptions::cuda_workspace: layers of different shapes sharing one
// workspace, run one after another on one stream in a mixed order (each leaves
// its scratch full of its own data for the next), give the bits of the same
// layers with workspaces of their own: decode, mma.sync and sm90 paths, a
// shared expert, CUDA-graph replay. Memory: one block of the largest layer's
// size when it is built first (or reserved); a larger layer built later gets a
// new block.
TEST(CudaRunner, SharedWorkspaceMatchesOwnWorkspaces) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  MoEConfig big = test::arch_config("deepseek_v3", 16, 4, 264, 40);
  big.shared_intermediate_size = 264;
  const std::vector<MoEConfig> cfgs = {test::arch_config("mixtral", 8, 2, 96, 80), big,
                                       test::arch_config("qwen2_moe", 12, 4, 72, 40)};
  std::vector<MoELayerWeights> lws;
  for (const MoEConfig& c : cfgs) lws.push_back(test::random_layer(rng, c, DType::kBF16));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t max_tokens = 600;
  auto ws = std::make_shared<cuda::SharedWorkspace>();
  EXPECT_EQ(ws->bytes(), 0u);
  std::vector<std::unique_ptr<MoERunner>> shared, own;
  for (size_t i = 0; i < cfgs.size(); ++i) {
    RunnerOptions o = cuda_options(max_tokens, stream);
    if (i == 2) o.cuda_graph_sizes = {4, 16};
    own.push_back(std::make_unique<MoERunner>(cfgs[i], lws[i], o));
    o.cuda_workspace = ws;
    shared.push_back(std::make_unique<MoERunner>(cfgs[i], lws[i], o));
    EXPECT_EQ(shared[i]->cuda_workspace_bytes(), own[i]->cuda_workspace_bytes());
  }
  // Built small (mixtral), large (deepseek_v3), small: the block grew once, to the largest.
  size_t largest = 0;
  for (const auto& r : own) largest = std::max(largest, r->cuda_workspace_bytes());
  EXPECT_EQ(ws->bytes(), (largest + 255) / 256 * 256);
  EXPECT_GT(own[1]->cuda_workspace_bytes(), own[0]->cuda_workspace_bytes());

  const std::vector<std::pair<size_t, int64_t>> calls = {
      {1, 600}, {0, 3}, {2, 9}, {1, 1}, {0, 500}, {2, 600}, {1, 40}, {2, 3}, {0, 64}, {1, 600}};
  for (const auto& [i, T] : calls) {
    SCOPED_TRACE("layer " + std::to_string(i) + " T " + std::to_string(T));
    const int64_t H = cfgs[i].hidden_size;
    DeviceTensor x = DeviceTensor::from_host(test::randn_f32(rng, {T, H}));
    DeviceTensor out_s(DType::kF32, {T, H}), out_o(DType::kF32, {T, H});
    out_s.poison();
    out_o.poison();
    shared[i]->forward(x, out_s);
    own[i]->forward(x, out_o);
    CUDA_OK(cudaStreamSynchronize(stream));
    const Tensor a = out_s.to_host(), b = out_o.to_host();
    ASSERT_EQ(test::count_non_finite(a), 0);
    EXPECT_TRUE(same_bits(a, b)) << "shared workspace vs own: rel L2 " << test::rel_l2(a, b);
  }
  // Reserved up front: every layer takes the one block.
  auto ws2 = std::make_shared<cuda::SharedWorkspace>();
  ws2->reserve(largest);
  const size_t reserved = ws2->bytes();
  for (size_t i = 0; i < cfgs.size(); ++i) {
    RunnerOptions o = cuda_options(max_tokens, stream);
    o.cuda_workspace = ws2;
    MoERunner r(cfgs[i], lws[i], o);
  }
  EXPECT_EQ(ws2->bytes(), reserved);
  EXPECT_EQ(ws2->device(), 0);
  shared.clear();
  own.clear();
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST(CudaRunner, SharedWorkspaceOnCpuIsRefused) {
  std::mt19937_64 rng(2);
  MoEConfig c = test::base_config(8, 2, 64, 48);
  RunnerOptions o;
  o.cuda_workspace = std::make_shared<cuda::SharedWorkspace>();  // no device touched
  try {
    MoERunner r(c, test::random_layer(rng, c, DType::kBF16), o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda_workspace"), std::string::npos) << e.what();
  }
}

// T * k * H > 2^31 elements in the routed buffers: 64-bit offsets. Checked on
// a sample of tokens against the float64 reference.
TEST(CudaRunner, SixtyFourBitOffsets) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t T = 16384, E = 8, k = 8, H = 16392, I = 64;
  ASSERT_GT(T * k * H, int64_t{1} << 31);
  MoEConfig c = test::base_config(E, k, H, I);
  c.renormalize = true;
  MoELayerWeights lw = test::random_layer(rng, c, DType::kBF16);
  MoERunner gpu(c, lw, cuda_options(T));
  const Tensor x = test::random_f32(rng, {T, H}, -1.0f, 1.0f);
  DeviceTensor x_d = DeviceTensor::from_host(x);
  DeviceTensor out(DType::kBF16, {T, H}), ids(DType::kI32, {T, k}), w(DType::kF32, {T, k});
  out.poison();
  ForwardOutputs fo{TensorView(), ids, w};
  gpu.forward(x_d, out, nullptr, nullptr, &fo);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor out_h = to_f32(out.to_host());
  ASSERT_EQ(test::count_non_finite(out_h), 0);
  const Tensor ids_h = ids.to_host(), w_h = w.to_host();
  for (int64_t t : {int64_t{0}, int64_t{1}, T / 2, T - 2, T - 1}) {
    const TensorView xs = x.view().narrow(0, t, 1);
    const TensorView is = ids_h.view().narrow(0, t, 1), ws = w_h.view().narrow(0, t, 1);
    std::vector<double> ref = test::reference_moe_layer(c, lw, xs, is, ws);
    EXPECT_LE(test::rel_l2(out_h.view().narrow(0, t, 1), f64_view(ref, 1, H)), 1e-2)
        << "token " << t;
  }
}

}  // namespace
}  // namespace fusedmoe
