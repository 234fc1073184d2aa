// fusedmoe CUDA benchmark entry point, shared by bench_cuda_moe and
// `fusedmoe bench --backend cuda`. See cuda_bench.cu for what is timed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fusedmoe/config/moe_config.h"

namespace fusedmoe::bench {

struct CudaBenchOptions {
  std::string shapes = "mixtral,qwen3,deepseek";  // layer shapes (names in cuda_bench.cu)
  std::vector<int64_t> tokens = {1, 16, 64, 128, 256, 1024, 4096};
  int routings = 8;  // different routings cycled through (weights from HBM)
  // kUniform: k distinct experts per token drawn by the bench itself; kZipf /
  // kAllToOne: the routing simulator (routing/router.h, RoutingMethod::kSimulated).
  SimulatedRouting routing = SimulatedRouting::kUniform;
  int iters = 40;           // timed graph replays per case (median reported)
  bool sweep = false;       // also time every GEMM tile configuration
  bool sweep_sm90 = false;  // also time the mma.sync path's tile and the sm90 path
  std::string dump_dir;     // write routings, our output and manifest.json (torch_baseline.py)
};

// Prints a markdown table (time, TFLOP/s, GB/s, floor, % of floor) to stdout.
// Returns 0 (also when there is no CUDA device: then it says so), 2 on bad options.
int run_cuda_bench(const CudaBenchOptions& options);

}  // namespace fusedmoe::bench
