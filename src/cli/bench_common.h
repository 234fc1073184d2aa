// fusedmoe benchmark helpers, shared by `fusedmoe bench` (src/cli/cmd_bench.cpp)
// and the Google Benchmark programs (bench/*.cpp):
//   - the machine's own ceilings: peak fp32 FMA rate (a register-only
//     microkernel, AVX-512 or AVX2+FMA as compiled) and read bandwidth (a large
//     streaming sum), both on all threads;
//   - synthetic MoE layers of the published model shapes (random weights,
//     routing from the routing simulator, MoEConfig::routing_method kSimulated);
//   - the baseline: a plain BLAS-per-expert loop (for each expert: gather its
//     rows, sgemm with f32 weights for w13, activation, sgemm for w2,
//     scatter-add), each GEMM split over the threads along N as a threaded
//     BLAS would;
//   - the roofline of one layer forward (see ../shared/perf-targets.md):
//     floor = max(bytes / read bandwidth, FLOPs / peak), bytes = distinct
//     experts touched x expert weight bytes + activations in and out,
//     FLOPs = 2 T k 3 H I.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fusedmoe/config/moe_config.h"
#include "fusedmoe/core/tensor.h"
#include "fusedmoe/core/thread_pool.h"
#include "fusedmoe/experts/expert_weights.h"
#include "fusedmoe/kernels/modular_kernel.h"

namespace fusedmoe::bench {

// ---- the baseline's BLAS ----------------------------------------------------------
// OpenBLAS picks its kernels from cpuid when the library loads; a release that
// does not know the CPU model falls back to an old one (0.3.21 picks
// "Prescott", SSE3, on Emerald Rapids), which would make the baseline
// several times slower than it should be. When that happened and
// OPENBLAS_CORETYPE is not set, this re-executes the program (/proc/self/exe,
// same argv) with OPENBLAS_CORETYPE naming the kernel for the CPU's ISA
// (SkylakeX for AVX-512, Haswell for AVX2+FMA). Returns normally otherwise.
void use_best_openblas_kernel(char** argv);
// "SkylakeX", plus " (chosen by fusedmoe; OpenBLAS detected Prescott)" when
// use_best_openblas_kernel changed it.
std::string openblas_kernel_description();

// ---- machine ceilings ----------------------------------------------------------
struct Ceilings {
  int threads = 1;
  // The threads the ceilings were measured on: `threads`, at most usable_cpus()
  // (more threads share those cores and cannot go faster).
  int measured_threads = 1;
  std::string isa;         // "avx512f", "avx2+fma" or "scalar"
  double peak_gflops = 0;  // fp32 FMA rate, all threads
  double read_gbps = 0;    // streaming read bandwidth, all threads (1 GB = 1e9 bytes)
  // bf16 tile products on Intel AMX, all threads, where the CPU experts use
  // AMX (cpu::amx_in_use(): bf16 weights with bf16 compute); else 0.
  double amx_gflops = 0;
  // The compute ceiling of a layer with these weights and compute: amx_gflops
  // for bf16 where it is measured, else peak_gflops.
  double peak_for(DType dtype) const {
    return dtype == DType::kBF16 && amx_gflops > 0 ? amx_gflops : peak_gflops;
  }
};
// Best of a few trials of each. Takes about a second, whatever `threads`: each
// measures on min(threads, usable_cpus()) threads (a fixed amount of work a
// thread, so a thread count far above the cores took time in proportion).
Ceilings measure_ceilings(int threads);
double measure_peak_fma_gflops(int threads);
// 0 where the CPU experts do not use AMX.
double measure_peak_amx_gflops(int threads);
double measure_read_gbps(int threads, size_t bytes = size_t{1} << 30);
const char* simd_isa();
// The largest CPU cache's size in bytes (Linux sysfs, cpu0), 0 if unknown.
size_t last_level_cache_bytes();

// ---- shapes ----------------------------------------------------------------------
struct LayerShape {
  std::string name;   // "mixtral", "qwen3", "deepseek", "qwen3-cpu"
  std::string model;  // "Mixtral-8x7B", ...
  int64_t E = 0, k = 0, H = 0, I = 0;
  std::string note;  // set when the shape was scaled down to fit memory
};
std::vector<LayerShape> standard_shapes();
// Throws Error(kInvalidArgument) listing the known names.
LayerShape find_shape(const std::string& name);
// `requested` with at most max_experts experts (0: no cap), noting the cap; a
// max_experts below the shape's k throws Error(kInvalidArgument) naming --max-experts.
LayerShape cap_experts(const LayerShape& requested, int64_t max_experts);
// Bytes of one expert's weights (w13 + w2).
inline size_t expert_bytes(const LayerShape& s, DType dtype) {
  return static_cast<size_t>(3 * s.H * s.I) * dtype_size(dtype);
}
// Bytes a synthetic layer of `s` needs: weights in `dtype`, plus the
// baseline's f32 copy when dtype is not f32 and `with_baseline`.
size_t layer_bytes(const LayerShape& s, DType dtype, bool with_baseline);
// Bytes `fusedmoe bench` holds for each token of a shape's largest T while it
// measures it: the kBatchRotation routed batches (hidden states f32 [T, H],
// topk ids and weights [T, k]), the output f32 [T, H], the CPU kernel's
// workspace for the T k routed rows (permuted input and expert output f32
// [T k, H], activation f32 [T k, I], row maps and work items), and with the
// baseline its reference output f32 [T, H], its per-expert buffers (at most T
// rows: the experts are distinct per token) and its slot list.
size_t token_bytes(const LayerShape& s, bool with_baseline);
// The batches' and the output's share of token_bytes: kBatchRotation routed
// batches (hidden states f32 [H], topk ids and weights [k]) and the output [H].
size_t batch_token_bytes(const LayerShape& s);
// Bytes the CPU modular kernel's workspace holds for each routed row (one
// token's slot at one expert, kernels/cpu): permuted input and expert output
// f32 [H], activation f32 [I], source row and slot maps (i32), and its work
// items. token_bytes counts k of them a token.
size_t routed_row_bytes(int64_t H, int64_t I);
// Bytes the routed experts of one rank hold at worst for each token of a token
// group (parallel/distributed_experts.cpp), the rank holding E_local experts
// with I_local columns each. With expert parallelism over `groups` token groups
// (> 1) a rank may receive every group's tokens (all-to-one routing), each with
// min(k, E_local) routed rows: per token of a group, `groups` received records
// (f32 payload, the largest), hidden states, ids and weights, those routed rows
// and their combine rows, plus the rank's own dispatch records (one per
// destination rank, at most min(k, groups)), maps and combine rows. With one
// group (no expert parallelism): the token's k routed rows and local ids.
size_t rank_token_bytes(int64_t H, int64_t I_local, int64_t k, int64_t E_local, int groups);
// The most tokens of `per_token` bytes that fit in `budget` bytes beside
// `fixed` bytes (0 when `fixed` alone is over it); compared by division, so
// that no count overflows.
int64_t most_tokens_within(size_t budget, size_t fixed, size_t per_token);
// Fits a shape and its buffers for up to `max_tokens` tokens into
// `budget_bytes`: reduces E (keeping k, H, I; E a multiple of 8 where it can,
// >= k) until layer_bytes + max_tokens x token_bytes fits; records what it did
// in `note`. Throws Error(kInvalidArgument) before anything is allocated:
// naming --memory-fraction, the bytes needed and the budget when the weights
// alone do not fit even at E = k; naming --tokens, the most that fit and
// `max_tokens` when the weights at E = k do, but not with the tokens' buffers.
LayerShape fit_to_memory(LayerShape s, DType dtype, bool with_baseline, size_t budget_bytes,
                         int64_t max_tokens = 0);
// The machine's memory (sysconf), or the process's cgroup memory limit where
// one is set below it (a container or a job slot: the budget --memory-fraction
// is a share of).
size_t physical_memory_bytes();
// The memory a new allocation can take without swapping: MemAvailable of
// /proc/meminfo (free memory plus reclaimable caches; what other processes
// hold is not), and under a cgroup limit at most the limit less the cgroup's
// usage; at most physical_memory_bytes(); that when it is unknown.
size_t available_memory_bytes();
// The cgroup memory limit and usage under `root` (a cgroup v2 directory with
// memory.max / memory.current, or v1's memory/memory.limit_in_bytes /
// memory.usage_in_bytes below it): limit 0 when none is set ("max", or v1's
// "unlimited" value of 2^63 rounded down to a page), usage 0 when unknown.
struct CgroupMemory {
  size_t limit = 0, usage = 0;
};
CgroupMemory cgroup_memory(const std::string& root = "/sys/fs/cgroup");

// ---- synthetic layer and batches --------------------------------------------------
struct SyntheticLayer {
  LayerShape shape;
  DType dtype = DType::kF32;
  ExpertWeights weights;   // w13 [E, 2I, H], w2 [E, H, I] in `dtype`, uniform(+-1/sqrt(fan_in))
  Tensor w13_f32, w2_f32;  // the baseline's f32 weights (the same storage when dtype is f32)
};
SyntheticLayer make_synthetic_layer(const LayerShape& shape, DType dtype, uint64_t seed,
                                    bool baseline_weights = true);

struct RoutedBatch {
  Tensor hidden_states;  // f32 [T, H], N(0, 1)-like
  Tensor topk_ids;       // i32 [T, k] from the routing simulator
  Tensor topk_weights;   // f32 [T, k]
  int64_t distinct_experts = 0;
};
RoutedBatch make_routed_batch(const LayerShape& shape, int64_t T, SimulatedRouting routing,
                              uint64_t seed);

// `count` batches of T tokens with different routing. Timed runs cycle through
// them, so that consecutive runs touch different experts and the weights come
// from memory, not from a cache that still holds them (as in a real model,
// where the other layers run in between).
inline constexpr int kBatchRotation = 8;
std::vector<RoutedBatch> make_routed_batches(const LayerShape& shape, int64_t T,
                                             SimulatedRouting routing, uint64_t seed,
                                             int count = kBatchRotation);
double mean_distinct_experts(const std::vector<RoutedBatch>& batches);

// ---- the two implementations ---------------------------------------------------------
// fusedmoe's CPU modular kernel (routed experts only, as perf-targets.md times them).
class FusedMoECpu {
 public:
  FusedMoECpu(const SyntheticLayer& layer, DType compute_dtype, ThreadPool* pool = nullptr);
  ~FusedMoECpu();
  void forward(const RoutedBatch& batch, const TensorView& output);

 private:
  const SyntheticLayer& layer_;
  ExpertsParams params_;
  std::unique_ptr<ModularKernel> kernel_;
  Workspace ws_;
};

// The baseline: BLAS-per-expert loop on f32 weights.
class BlasPerExpertBaseline {
 public:
  explicit BlasPerExpertBaseline(const SyntheticLayer& layer, ThreadPool* pool = nullptr);
  // hidden_states f32 [T, H], topk_ids i32 [T, k], topk_weights f32 [T, k];
  // output f32 [T, H] overwritten.
  void forward(const RoutedBatch& batch, const TensorView& output);

 private:
  void gemm_nt(int64_t M, int64_t N, int64_t K, const float* A, const float* B, float* C);
  const SyntheticLayer& layer_;
  ThreadPool* pool_;
  ActivationParams act_;
  std::vector<float> xe_, h13_, a_, y_;
  std::vector<int64_t> count_, offset_, slot_;
};

// ---- measurement -------------------------------------------------------------------------
struct Roofline {
  double flops = 0;        // 2 T k 3 H I
  double bytes = 0;        // distinct experts x expert bytes + T H 4 x 2
  double floor_s = 0;      // max(bytes / bandwidth, flops / peak)
  double peak_gflops = 0;  // the compute ceiling used: Ceilings::peak_for(weight dtype)
  bool memory_bound = false;
};
Roofline layer_roofline(const LayerShape& s, int64_t T, double distinct_experts, DType weight_dtype,
                        const Ceilings& c);
// The share of the roofline a run of `seconds` reached (floor / seconds), each
// ceiling taken as at least what the run achieved (bytes / seconds, FLOPs /
// seconds): a run faster than a ceiling measured once at start-up (its weights
// in the caches, a machine busier or a clock lower during the measurement) is
// at 1, never above; `raised` says it was.
struct RooflineShare {
  double frac = 0;
  bool raised = false;
};
RooflineShare roofline_share(const Roofline& r, double seconds, const Ceilings& c);

// Runs fn once (warm-up), then repeatedly until `min_time` seconds passed and at
// least `min_reps` runs were made (only 2 when each takes over a second; at most
// `max_reps`); returns each run's seconds.
template <typename F>
std::vector<double> time_repeats(F&& fn, double min_time, int min_reps = 3, int max_reps = 1000) {
  using clock = std::chrono::steady_clock;
  fn();
  std::vector<double> times;
  double total = 0;
  for (;;) {
    const int n = static_cast<int>(times.size());
    const bool enough_reps = n >= min_reps || (n >= 2 && total / n > 1.0);
    if ((total >= min_time && enough_reps) || n >= max_reps) break;
    const auto t0 = clock::now();
    fn();
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    times.push_back(dt);
    total += dt;
  }
  return times;
}
double median(std::vector<double> v);
// ||a - b|| / ||b|| over n values, in f64 with both norms scaled (finite for
// any finite inputs whose ratio is, however large or small b is): 0 when a and
// b are all zeros, inf when only b is, NaN / inf when a - b is.
double rel_l2(const float* a, const float* b, size_t n);
double rel_l2(const float* a, const double* b, size_t n);

// Peak resident set size of this process in bytes (VmHWM, else getrusage).
size_t peak_rss_bytes();
// Resets the peak (Linux: writes 5 to /proc/self/clear_refs); false if it cannot.
bool reset_peak_rss();

}  // namespace fusedmoe::bench
