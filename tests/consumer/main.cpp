// A user's program built against the installed package, as the README's C++
// example (tests/consumer/consumer.sh builds that one too, from README.md):
// the bundled model's first MoE layer on 8 tokens; exits 1 unless every output
// element is finite.
#include <cmath>
#include <cstdio>

#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/loader.h"
#include "fusedmoe/io/safetensors.h"
#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/runner/moe_runner.h"

using namespace fusedmoe;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer MODEL_DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  const ModelInfo info = load_model_info(dir);
  const Checkpoint checkpoint = Checkpoint::open(dir);
  const int64_t layer = info.moe_layers.front();

  RunnerOptions options;
  options.compute_dtype = DType::kF32;
  MoERunner runner(info.layer_config(layer), load_moe_layer(checkpoint, info, layer), options);

  const int64_t T = 8, H = runner.config().hidden_size;
  Tensor hidden_states = Tensor::empty(DType::kF32, {T, H});
  for (int64_t i = 0; i < T * H; ++i) hidden_states.data_as<float>()[i] = std::sin(0.1f * i);
  Tensor output = Tensor::empty(DType::kF32, {T, H});
  runner.forward(hidden_states, output);
  for (int64_t i = 0; i < T * H; ++i)
    if (!std::isfinite(output.data_as<float>()[i])) return 1;
  std::printf("consumer: layer %lld, %lld tokens, output finite\n", static_cast<long long>(layer),
              static_cast<long long>(T));
  return 0;
}
