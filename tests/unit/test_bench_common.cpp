// Tests of the benchmark helpers (src/cli/bench_common.h): the roofline share
// `fusedmoe bench` prints, the BLAS baseline's determinism under threads.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cli/bench_common.h"

namespace fusedmoe::bench {
namespace {

// A run faster than a ceiling measured at start-up (weights in the caches, a
// machine busier during the measurement) printed more than 100 % of the roofline;
// each ceiling is taken as at least what the run achieved now.
TEST(BenchRoofline, ShareIsAtMostOneAndSaysWhenACeilingWasRaised) {
  Ceilings c;
  c.read_gbps = 10;     // 10 GB/s
  c.peak_gflops = 100;  // 100 GFLOP/s
  Roofline r;
  r.bytes = 1e9;                  // 0.1 s at the bandwidth
  r.flops = 1e9;                  // 0.01 s at the peak
  r.peak_gflops = c.peak_gflops;  // as layer_roofline sets it (Ceilings::peak_for)
  // Slower than both ceilings: floor / time, nothing raised.
  RooflineShare s = roofline_share(r, 0.2, c);
  EXPECT_DOUBLE_EQ(s.frac, 0.5);
  EXPECT_FALSE(s.raised);
  // 20 GB/s, twice the measured bandwidth: 100 %, not 200 %, and marked.
  s = roofline_share(r, 0.05, c);
  EXPECT_DOUBLE_EQ(s.frac, 1.0);
  EXPECT_TRUE(s.raised);
  // Compute bound, above the measured peak: likewise.
  r.bytes = 1e6;
  r.flops = 2e10;  // 0.2 s at the peak
  s = roofline_share(r, 0.1, c);
  EXPECT_DOUBLE_EQ(s.frac, 1.0);
  EXPECT_TRUE(s.raised);
  s = roofline_share(r, 0.4, c);
  EXPECT_DOUBLE_EQ(s.frac, 0.5);
  EXPECT_FALSE(s.raised);
  // No time, no share.
  EXPECT_EQ(roofline_share(r, 0.0, c).frac, 0.0);
}

// bf16 layers whose experts run on AMX are held against the AMX peak, the
// rest against the FMA peak.
TEST(BenchRoofline, Bf16OnAmxUsesTheAmxPeak) {
  Ceilings c;
  c.read_gbps = 10;
  c.peak_gflops = 100;
  const LayerShape s = find_shape("qwen3-cpu");
  EXPECT_EQ(layer_roofline(s, 256, 64, DType::kBF16, c).peak_gflops, 100);
  c.amx_gflops = 1000;
  const Roofline bf16 = layer_roofline(s, 256, 64, DType::kBF16, c);
  const Roofline f32 = layer_roofline(s, 256, 64, DType::kF32, c);
  EXPECT_EQ(bf16.peak_gflops, 1000);
  EXPECT_EQ(f32.peak_gflops, 100);
  EXPECT_DOUBLE_EQ(bf16.floor_s, std::max(bf16.bytes / 10e9, bf16.flops / 1000e9));
  EXPECT_DOUBLE_EQ(f32.floor_s, std::max(f32.bytes / 10e9, f32.flops / 100e9));
}

// The FMA ceiling ran a fixed amount of work on each of `threads` threads:
// `fusedmoe bench --threads 1024` on 2 cores spent ~7 minutes measuring it
// (~0.3 s a thread). More threads than CPUs now measure on the CPUs alone, in
// the time of one thread a CPU, and give a peak all the same.
TEST(BenchCeilings, ThreadsBeyondTheCpusTakeNoLonger) {
  const int cpus = usable_cpus();
  ASSERT_GE(cpus, 1);
  const auto t0 = std::chrono::steady_clock::now();
  const double gflops = measure_peak_fma_gflops(64 * cpus);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GT(gflops, 0.0);
  EXPECT_LT(seconds, 10.0) << "64 threads a CPU: the measurement grew with the threads";
}

// The memory budget of `fusedmoe bench` is a share of the machine's memory, or of
// the cgroup limit where a container or job slot sets one below it.
// The baseline's threads call sgemm at once: with the serial OpenBLAS (no
// buffer locks) about 1 run in 3 of `fusedmoe bench --threads 8` had a
// baseline 0.2-0.4 off (and "BLAS : Bad memory unallocation!"). Every repeat
// must give the same bits.
TEST(BlasBaseline, ThreadedCallsGiveTheSameBitsEveryTime) {
  const LayerShape shape{"t", "t", 4, 2, 7168, 512, ""};
  const SyntheticLayer layer = make_synthetic_layer(shape, DType::kF32, 7);
  const RoutedBatch batch = make_routed_batch(shape, 16, SimulatedRouting::kUniform, 11);
  ThreadPool pool(8);
  BlasPerExpertBaseline baseline(layer, &pool);
  Tensor first = Tensor::empty(DType::kF32, {16, 7168}),
         again = Tensor::empty(DType::kF32, {16, 7168});
  baseline.forward(batch, first);
  for (int rep = 0; rep < 100; ++rep) {
    baseline.forward(batch, again);
    ASSERT_EQ(std::memcmp(first.data(), again.data(), first.nbytes()), 0) << "repeat " << rep;
  }
}

TEST(BenchMemory, CgroupLimitAndUsageFromV2AndV1Files) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("fusedmoe-cgroup-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "memory");
  auto write = [](const fs::path& p, const std::string& text) { std::ofstream(p) << text; };
  // No files: no limit.
  CgroupMemory m = cgroup_memory(dir.string());
  EXPECT_EQ(m.limit, 0u);
  EXPECT_EQ(m.usage, 0u);
  // v1, unlimited (2^63 rounded down to a page): no limit.
  write(dir / "memory" / "memory.limit_in_bytes", "9223372036854771712\n");
  write(dir / "memory" / "memory.usage_in_bytes", "1000\n");
  EXPECT_EQ(cgroup_memory(dir.string()).limit, 0u);
  // v1 with a limit.
  write(dir / "memory" / "memory.limit_in_bytes", "2147483648\n");
  m = cgroup_memory(dir.string());
  EXPECT_EQ(m.limit, size_t{2} << 30);
  EXPECT_EQ(m.usage, 1000u);
  // v2 "max": no v2 limit, so v1's is read.
  write(dir / "memory.max", "max\n");
  EXPECT_EQ(cgroup_memory(dir.string()).limit, size_t{2} << 30);
  // v2 with a limit wins.
  write(dir / "memory.max", "1073741824\n");
  write(dir / "memory.current", "4096\n");
  m = cgroup_memory(dir.string());
  EXPECT_EQ(m.limit, size_t{1} << 30);
  EXPECT_EQ(m.usage, 4096u);
  fs::remove_all(dir);
  // This machine: never above its physical memory, never 0.
  EXPECT_GT(physical_memory_bytes(), 0u);
  EXPECT_LE(available_memory_bytes(), physical_memory_bytes());
}

}  // namespace
}  // namespace fusedmoe::bench
