// Conformance with HF transformers through the CUDA backend: every HF fixture
// (tests/data/hf/*), every MoE layer and token count, bf16 weights with f32
// accumulation (f32 activations), and f16 weights (compute_dtype f16) with f16
// activations and output: output within 1e-2 relative L2 of output_f64, topk
// ids equal to the CPU router's (given the same logits).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "fixtures.h"
#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/loader.h"

namespace fusedmoe {
namespace {

using test::DeviceTensor;

// f32 host tensor -> `io` (f32 or f16) host tensor.
Tensor as_io(const Tensor& f32, DType io) {
  return io == DType::kF32 ? f32 : test::to_f16(f32);
}

// Every layer and token count of `arch` on the CUDA backend with `compute`
// (the experts' half type) and `io` hidden states / output; with own_gate also
// through the device's gate GEMM (f32 inputs: f16-rounded ones move the logits
// by ~1e-4 and may flip near-tied experts away from HF's choice).
void check_arch(const std::string& arch, DType compute, DType io, bool own_gate) {
  const std::string dir = test::hf_fixture_dir(arch);
  const ModelInfo info = load_model_info(dir);
  const Checkpoint ckpt = Checkpoint::open(dir);
  const auto ref = test::open_reference(arch);
  ASSERT_FALSE(info.moe_layers.empty());
  for (int64_t layer : info.moe_layers) {
    const MoEConfig& cfg = info.layer_config(layer);
    MoELayerWeights w = load_moe_layer(ckpt, info, layer, LoadOptions{false});
    RunnerOptions copt;
    copt.compute_dtype = DType::kBF16;
    MoERunner cpu(cfg, w, copt);
    RunnerOptions gopt = copt;
    gopt.compute_dtype = compute;
    gopt.device = Device{DeviceType::kCUDA, 0};
    gopt.max_num_tokens = 128;
    MoERunner gpu(cfg, w, gopt);
    const int64_t H = cfg.hidden_size, k = cfg.top_k, L = cfg.num_router_logits();
    for (int64_t T : test::reference_token_counts(*ref, layer)) {
      SCOPED_TRACE(arch + " layer " + std::to_string(layer) + " T " + std::to_string(T));
      const Tensor x = test::load_tensor_f32(*ref, test::reference_name(layer, T, "input"));
      const Tensor want = test::load_tensor_f64(*ref, test::reference_name(layer, T, "output_f64"));
      const Tensor hf_logits =
          test::load_tensor_f32(*ref, test::reference_name(layer, T, "router_logits"));
      // CPU router on HF's logits: the ids the CUDA router must reproduce.
      Tensor ids_c = Tensor::empty(DType::kI32, {T, k}), w_c = Tensor::empty(DType::kF32, {T, k});
      cpu.router().select_experts(hf_logits, ids_c, w_c);

      DeviceTensor x_d = DeviceTensor::from_host(as_io(x, io));
      DeviceTensor lg = DeviceTensor::from_host(hf_logits);
      DeviceTensor out(io, {T, H}), ids(DType::kI32, {T, k}), wt(DType::kF32, {T, k});
      out.poison();
      ForwardOutputs fo{TensorView(), ids, wt};
      const TensorView lv = lg.view();
      gpu.forward(x_d, out, &lv, nullptr, &fo);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const Tensor o = to_f32(out.to_host()), ids_g = ids.to_host(), w_g = wt.to_host();
      EXPECT_EQ(test::count_non_finite(o), 0);
      EXPECT_LE(test::rel_l2(o, want), 1e-2) << "output (HF logits) vs output_f64";
      for (int64_t i = 0; i < T * k; ++i) {
        ASSERT_EQ(ids_g.data_as<int32_t>()[i], ids_c.data_as<int32_t>()[i]) << "slot " << i;
        const float a = w_g.data_as<float>()[i], b = w_c.data_as<float>()[i];
        ASSERT_LE(std::abs(a - b), 1e-6f * std::abs(b) + 1e-30f) << "slot " << i;
      }

      if (!own_gate) continue;
      // Our own gate GEMM on the device.
      DeviceTensor lg2(DType::kF32, {T, L});
      out.poison();
      ForwardOutputs fo2{lg2, ids, wt};
      gpu.forward(x_d, out, nullptr, nullptr, &fo2);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_LE(test::rel_l2(lg2.to_host(), hf_logits), 1e-5) << "router logits";
      EXPECT_LE(test::rel_l2(to_f32(out.to_host()), want), 1e-2)
          << "output (own gate) vs output_f64";
    }
  }
}

class CudaHfConformance : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaHfConformance, EveryMoELayerMatchesTransformers) {
  FUSEDMOE_REQUIRE_CUDA();
  check_arch(GetParam(), DType::kBF16, DType::kF32, true);
}

TEST_P(CudaHfConformance, EveryMoELayerMatchesTransformersF16) {
  FUSEDMOE_REQUIRE_CUDA();
  check_arch(GetParam(), DType::kF16, DType::kF32, true);
  check_arch(GetParam(), DType::kF16, DType::kF16, false);
}

INSTANTIATE_TEST_SUITE_P(AllArchitectures, CudaHfConformance,
                         ::testing::ValuesIn(test::hf_fixture_archs()),
                         [](const auto& p) { return p.param; });

}  // namespace
}  // namespace fusedmoe
