// Google Benchmark: fusedmoe's CPU MoE kernel (routed experts) against the
// BLAS-per-expert baseline on the perf-target CPU layer (Qwen3-30B-A3B-like,
// E = 64, k = 8, H = 2048, I = 768), f32 and bf16 weights, T = 1, 16, 256,
// uniform simulated routing. Counters: FLOP/s (2 T k 3 H I), bytes/s (distinct
// experts touched x expert bytes + activations), experts touched, and
// `roofline` = floor / time with this machine's ceilings measured at start-up
// (shown in the context), each at least what the run achieved (so at most 1).
// The baseline always reads f32 weights.
//
//   ./build/bench/bench_cpu_moe [--benchmark_filter=bf16] [--benchmark_min_time=1]
#include <benchmark/benchmark.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cli/bench_common.h"

namespace {

using namespace fusedmoe;
using namespace fusedmoe::bench;

const LayerShape& cpu_shape() {
  static const LayerShape s = find_shape("qwen3-cpu");
  return s;
}

Ceilings& ceilings() {
  static Ceilings c;
  return c;
}

// One synthetic layer per weight dtype, made on first use and kept.
const SyntheticLayer& layer(DType dtype) {
  static std::map<DType, std::unique_ptr<SyntheticLayer>> layers;
  auto& l = layers[dtype];
  if (!l)
    l = std::make_unique<SyntheticLayer>(
        make_synthetic_layer(cpu_shape(), dtype, dtype == DType::kF32 ? 11 : 12));
  return *l;
}

enum class Impl { kFusedMoE, kBlasPerExpert };

void bm_moe(benchmark::State& state, DType dtype, Impl impl) {
  const int64_t T = state.range(0);
  const SyntheticLayer& l = layer(dtype);
  // Runs cycle through kBatchRotation routings so the weights come from memory.
  const std::vector<RoutedBatch> batches =
      make_routed_batches(cpu_shape(), T, SimulatedRouting::kUniform, 100 + T);
  size_t next = 0;
  Tensor out = Tensor::empty(DType::kF32, {T, cpu_shape().H});
  std::unique_ptr<FusedMoECpu> ours;
  std::unique_ptr<BlasPerExpertBaseline> base;
  if (impl == Impl::kFusedMoE)
    ours = std::make_unique<FusedMoECpu>(l, dtype);
  else
    base = std::make_unique<BlasPerExpertBaseline>(l);
  auto run = [&] {
    if (ours)
      ours->forward(batches[next++ % batches.size()], out);
    else
      base->forward(batches[next++ % batches.size()], out);
  };
  run();  // warm-up: workspace, page cache
  double total = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const Roofline r = layer_roofline(cpu_shape(), T, mean_distinct_experts(batches),
                                    impl == Impl::kFusedMoE ? dtype : DType::kF32, ceilings());
  state.counters["FLOP/s"] =
      benchmark::Counter(r.flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bytes/s"] =
      benchmark::Counter(r.bytes, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["experts"] = mean_distinct_experts(batches);
  // floor / time, each ceiling at least what the run achieved (at most 1).
  state.counters["roofline"] =
      state.iterations() > 0
          ? roofline_share(r, total / static_cast<double>(state.iterations()), ceilings()).frac
          : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  use_best_openblas_kernel(argv);  // may re-execute with OPENBLAS_CORETYPE set
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  Ceilings& c = ceilings();
  c = measure_ceilings(ThreadPool::global().num_threads());
  benchmark::AddCustomContext("fusedmoe_threads", std::to_string(c.threads));
  benchmark::AddCustomContext("fusedmoe_simd", c.isa);
  benchmark::AddCustomContext("openblas_kernel", openblas_kernel_description());
  benchmark::AddCustomContext("peak_fp32_fma_gflops", std::to_string(c.peak_gflops));
  benchmark::AddCustomContext("read_bandwidth_gbps", std::to_string(c.read_gbps));
  const LayerShape& s = cpu_shape();
  benchmark::AddCustomContext("layer", "E=" + std::to_string(s.E) + " k=" + std::to_string(s.k) +
                                           " H=" + std::to_string(s.H) +
                                           " I=" + std::to_string(s.I));
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (Impl impl : {Impl::kFusedMoE, Impl::kBlasPerExpert}) {
      const std::string name =
          std::string(impl == Impl::kFusedMoE ? "fusedmoe" : "blas_per_expert") + "/" +
          dtype_name(dtype);
      benchmark::RegisterBenchmark(name.c_str(), bm_moe, dtype, impl)
          ->ArgName("T")
          ->Arg(1)
          ->Arg(16)
          ->Arg(256)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
