// `fusedmoe bench --backend cuda --ep-size N` under mpirun (or `--ep-size 1
// --nccl`, one rank): MoERunner on the CUDA backend with its experts spread
// over GPUs through NCCL (one GPU per rank: local rank % device count). Every
// rank brings --tokens T tokens of its own, routed by a random gate (the same
// on every rank), through a runner sized for T. Reports the transport (nccl or
// peer: FUSEDMOE_EP_TRANSPORT), the layer time (forward + device
// synchronisation; with the peer transport also as the replay of a CUDA graph
// through RunnerOptions::cuda_graph_sizes) and the dispatch / combine time and bandwidth from the
// EP path's statistics (nccl: host wall clock of each phase, including its stream synchronisation;
// peer: CUDA events from the pack kernel to the end of the receive kernel, and from the combine
// kernel to the end of its wait): logical GB/s = bytes that left their rank, summed over ranks /
// the slowest rank's time; payload GB/s = all payload bytes including a rank's copy to itself /
// that time (the only traffic at one rank).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cli/bench_common.h"
#include "cli/cli.h"
#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/runner/moe_runner.h"
#ifdef FUSEDMOE_WITH_CUDA
#include <cuda_runtime_api.h>

#include "fusedmoe/kernels/cuda.h"
#include "kernels/cuda/ep_dispatch.h"  // ep_record_bytes
#endif

namespace fusedmoe::cli {

#ifndef FUSEDMOE_WITH_CUDA
int run_bench_parallel_cuda(const BenchOptions&) {
  FUSEDMOE_THROW(kUnsupported, "--backend cuda: this build of fusedmoe has no CUDA backend");
}
#else

namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    FUSEDMOE_THROW(kInternal, what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

}  // namespace

int run_bench_parallel_cuda(const BenchOptions& o) {
  using namespace fusedmoe::bench;
  FUSEDMOE_CHECK(nccl_built(), "--backend cuda --ep-size: this build of fusedmoe has no NCCL");
  const int devices = cuda::device_count();
  FUSEDMOE_CHECK(devices > 0, "--backend cuda: no CUDA device found");
  std::shared_ptr<Communicator> world = make_bench_world(o);
  const int rank = world->rank(), P = world->size();
  const bool root = rank == 0;
  const int device = local_rank(rank) % devices;
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  std::shared_ptr<Communicator> nccl = make_nccl_communicator(world, device);
  const std::vector<int64_t> token_counts = parse_int_list(o.tokens, "--tokens");
  std::vector<LayerShape> shapes;
  for (const auto& name : split_list(o.shapes)) shapes.push_back(find_shape(name));
  FUSEDMOE_CHECK(!shapes.empty(), "--shapes: expected at least one shape, got \"", o.shapes, "\"");
  const ExpertPlacement placement = parse_expert_placement(o.expert_placement);
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");

  if (root) {
    std::printf("# fusedmoe bench (cuda, expert parallel)\n\n");
    std::printf(
        "- %d ranks, one GPU each (%s); experts %s; bf16 weights, f32 accumulation; dispatch "
        "payload %s, combine payload %s\n",
        P, prop.name, to_string(placement),
        o.dispatch_dtype == "fp8" ? "fp8 e4m3 + 1x128 scales" : "bf16", o.combine_dtype.c_str());
    std::printf(
        "- T = tokens per rank (bf16 hidden states and output), routed by a random bf16 gate "
        "(softmax top-k, renormalized); times: "
        "median over runs, slowest rank; layer = forward + device sync; graph = the same "
        "through the runner's CUDA-graph replay (cuda_graph_sizes {T}; peer transport only); "
        "transport nccl: "
        "dispatch = layout, pack, counts and records all-to-all; combine = pack, all-to-all, "
        "unpack (host wall clock, stream syncs included); transport peer (stores into the other "
        "GPUs' memory): dispatch = the pack kernel, combine = the combine kernel (CUDA events: "
        "this rank's stores into every rank's memory), wait = its receive and combine-wait "
        "kernels (the other ranks' skew included); "
        "logical GB/s = bytes to other ranks summed over ranks / time; "
        "payload GB/s = all payload bytes incl. a rank's copy to itself / time\n\n");
    std::fflush(stdout);
  }

  uint64_t seed = o.seed;
  for (const LayerShape& requested : shapes) {
    LayerShape shape = cap_experts(requested, o.max_experts);
    shape.E = std::max<int64_t>(shape.E, P);
    const ExpertMap map(shape.E, P, placement);
    LayerShape local = shape;
    local.E = map.num_local_experts(rank);
    MoEConfig config;
    config.num_experts = shape.E;
    config.top_k = shape.k;
    config.hidden_size = shape.H;
    config.intermediate_size = shape.I;
    config.renormalize = true;
    config.parallel = parallel_config_for_rank(rank, P, 1, 1);
    config.parallel.expert_placement = placement;
    MoELayerWeights w;
    {
      std::mt19937_64 rng(++seed);  // the same gate on every rank
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      w.gate_weight = Tensor::empty(DType::kF32, {shape.E, shape.H});
      float* g = w.gate_weight.data_as<float>();
      // bf16 values, as the models' checkpoints store their gates (and
      // bench_cuda_layer's): the router GEMM takes its bf16 path, not f32's.
      for (int64_t i = 0; i < shape.E * shape.H; ++i) g[i] = round_to_bf16(u(rng));
    }
    w.experts = make_synthetic_layer(local, DType::kBF16, seed * 31 + rank, false).weights;
    const size_t expert_bytes_rank = w.experts.nbytes();
    RunnerOptions ro;
    ro.compute_dtype = DType::kBF16;
    ro.device = Device{DeviceType::kCUDA, device};
    ro.communicator = nccl;
    ro.dispatch_dtype = parse_dispatch_dtype(o.dispatch_dtype);
    ro.combine_dtype = o.combine_dtype == "bf16" ? DType::kBF16 : DType::kF32;

    if (root) {
      std::printf("## %s: %s, E=%lld, k=%lld, H=%lld, I=%lld, bf16, %s of experts per rank\n\n",
                  shape.name.c_str(), shape.model.c_str(), static_cast<long long>(shape.E),
                  static_cast<long long>(shape.k), static_cast<long long>(shape.H),
                  static_cast<long long>(shape.I),
                  format_bytes(static_cast<double>(expert_bytes_rank)).c_str());
      if (!shape.note.empty()) std::printf("(%s)\n\n", shape.note.c_str());
      std::printf(
          "| T | transport | layer ms | graph ms | dispatch ms | dispatch GB/s logical | dispatch "
          "GB/s payload | combine ms | combine GB/s logical | combine GB/s payload | wait ms | "
          "rows received (max rank) |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
          "|\n");
      std::fflush(stdout);
    }
    const int64_t H = shape.H, k = shape.k;
    // Dispatch record bytes (the nccl transport's are the bf16 ones), combine row bytes.
    const int64_t rec = cuda::ep_record_bytes(H, k, o.dispatch_dtype == "fp8");
    const int64_t back = H * (o.combine_dtype == "bf16" ? 2 : 4);
    for (int64_t T : token_counts) {
      // A runner sized for this T: the peer transport's experts run on
      // ep_size * max_num_tokens rows (the weights are shared, not copied).
      ro.max_num_tokens = std::max<int64_t>(T, 1);
      MoERunner runner(config, w, ro);
      const Device dev{DeviceType::kCUDA, device};
      const int64_t T1 = std::max<int64_t>(T, 1);
      // bf16 hidden states and output, as an inference engine passes them (f32
      // ones would also time their conversion and the router GEMM's f32 path).
      cuda::DeviceBuffer x(T1 * H * 2), out(T1 * H * 2);
      {
        std::mt19937_64 rng(seed * 7919 + T * 131 + rank);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<uint16_t> h(T * H);
        for (auto& v : h) v = f32_to_bf16(nd(rng));
        if (T > 0) x.upload(h.data(), h.size() * 2);
      }
      const TensorView xv(x.data(), DType::kBF16, {T, H}, dev);
      const TensorView ov(out.data(), DType::kBF16, {T, H}, dev);
      std::vector<double> layer_s, dispatch_s, combine_s, wait_s;
      EpStats last;
      auto run = [&] {
        const auto t0 = std::chrono::steady_clock::now();
        runner.forward(xv, ov);
        cuda::synchronize();
        layer_s.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        last = *runner.cuda_ep_stats();
        dispatch_s.push_back(last.dispatch_seconds);
        combine_s.push_back(last.combine_seconds);
        wait_s.push_back(last.wait_seconds);
      };
      run();  // warm-up
      int reps = static_cast<int>(std::clamp(o.min_time / std::max(layer_s[0], 1e-6), 5.0, 1000.0));
      world->broadcast(&reps, sizeof reps, 0);
      layer_s.clear();
      dispatch_s.clear();
      combine_s.clear();
      wait_s.clear();
      for (int r = 0; r < reps; ++r) run();
      const double tl = max_of(gather_doubles(*world, median(layer_s)));
      const double td = max_of(gather_doubles(*world, median(dispatch_s)));
      const double tc = max_of(gather_doubles(*world, median(combine_s)));
      const double tw = max_of(gather_doubles(*world, median(wait_s)));
      const double bd =
          sum_of(gather_doubles(*world, static_cast<double>(last.dispatch_bytes_sent)));
      const double bc =
          sum_of(gather_doubles(*world, static_cast<double>(last.combine_bytes_sent)));
      const double pd =
          sum_of(gather_doubles(*world, static_cast<double>(last.dispatch_rows_sent) * rec));
      // Every slot is valid (no zero experts): nccl sends T * k f32 rows of H
      // back, peer one f32 / bf16 row per dispatched row (a rank's slots of a token summed).
      const double back_rows = last.transport == "peer"
                                   ? static_cast<double>(last.dispatch_rows_sent)
                                   : static_cast<double>(T * k);
      const double pc = sum_of(gather_doubles(*world, back_rows * back));
      const double rows =
          max_of(gather_doubles(*world, static_cast<double>(last.dispatch_rows_received)));
      // The same layer replayed as a CUDA graph (a runner of its own; every
      // rank decides alike: the transport is agreed at set-up).
      double tg = 0;
      if (last.transport == "peer" && T > 0) {
        RunnerOptions go = ro;
        go.cuda_graph_sizes = {T};
        MoERunner graphed(config, w, go);
        std::vector<double> graph_s;
        for (int r = 0; r <= reps; ++r) {  // the first captures the graph
          const auto t0 = std::chrono::steady_clock::now();
          graphed.forward(xv, ov);
          cuda::synchronize();
          if (r > 0)
            graph_s.push_back(
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        tg = max_of(gather_doubles(*world, median(graph_s)));
      }
      char graph_ms[32] = "-";
      if (tg > 0) std::snprintf(graph_ms, sizeof graph_ms, "%.3f", tg * 1e3);
      if (root)
        std::printf(
            "| %lld | %s | %.3f | %s | %.3f | %.2f | %.2f | %.3f | %.2f | %.2f | %.3f | %.0f |\n",
            static_cast<long long>(T), last.transport.c_str(), tl * 1e3, graph_ms, td * 1e3,
            td > 0 ? bd / td * 1e-9 : 0.0, td > 0 ? pd / td * 1e-9 : 0.0, tc * 1e3,
            tc > 0 ? bc / tc * 1e-9 : 0.0, tc > 0 ? pc / tc * 1e-9 : 0.0, tw * 1e3, rows);
      if (root) std::fflush(stdout);
    }
    if (root) std::printf("\n");
  }
  return 0;
}

#endif  // FUSEDMOE_WITH_CUDA

}  // namespace fusedmoe::cli
