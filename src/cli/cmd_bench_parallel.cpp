// `fusedmoe bench --ep-size N [--tp-size M] [--dp-size D]` under mpirun: the
// routed experts of synthetic layers spread over the ranks (DistributedExperts),
// timing the layer and, on the EP all-to-all path, dispatch and combine.
// Every rank brings --tokens T tokens of its own (TP ranks of a group share
// them); bandwidth = logical bytes that left their rank (summed over ranks) /
// the slowest rank's dispatch (or combine) time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/bench_common.h"
#include "cli/cli.h"
#include "fusedmoe/core/thread_pool.h"
#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/parallel/distributed_experts.h"

namespace fusedmoe::cli {

std::vector<double> gather_doubles(Communicator& c, double v) {
  const int P = c.size();
  std::vector<double> out(P);
  std::vector<int64_t> n(P, 8), d(P);
  for (int p = 0; p < P; ++p) d[p] = 8 * p;
  c.all_gather_v(&v, 8, out.data(), n, d);
  return out;
}

double max_of(const std::vector<double>& v) {
  return *std::max_element(v.begin(), v.end());
}
double sum_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

std::shared_ptr<Communicator> make_bench_world(const BenchOptions& o) {
  return make_parallel_world(o.ep_size, o.tp_size, o.dp_size,
                             {{"--tokens", o.tokens},
                              {"--shapes", o.shapes},
                              {"--dtype", or_not_given(o.dtype)},
                              {"--min-time", exact_number(o.min_time)},
                              {"--routing", o.routing},
                              {"--memory-fraction", exact_number(o.memory_fraction)},
                              {"--seed", std::to_string(o.seed)},
                              {"--no-baseline", o.no_baseline ? "true" : "false"},
                              {"--backend", o.backend},
                              {"--sweep", o.sweep ? "true" : "false"},
                              {"--dump-dir", or_not_given(o.dump_dir)},
                              {"--max-experts", std::to_string(o.max_experts)},
                              {"--ep-size", std::to_string(o.ep_size)},
                              {"--tp-size", std::to_string(o.tp_size)},
                              {"--dp-size", std::to_string(o.dp_size)},
                              {"--nccl", o.nccl ? "true" : "false"},
                              {"--expert-placement", o.expert_placement},
                              {"--dispatch-dtype", o.dispatch_dtype}},
                             "fusedmoe bench");
}

int run_bench_parallel(const BenchOptions& o) {
  using namespace fusedmoe::bench;
  std::shared_ptr<Communicator> world = make_bench_world(o);
  // This rank's checks (the shapes, the memory budget) come before any other
  // collective: an error there, such as more tokens than the memory fits, is
  // told to the other ranks at rank_local_done(), not MPI_Abort.
  rank_local_begin();
  const ParallelConfig pc =
      parallel_config_for_rank(world->rank(), o.ep_size, o.tp_size, o.dp_size);
  const bool root = world->rank() == 0;
  const std::vector<int64_t> token_counts = parse_int_list(o.tokens, "--tokens");
  std::vector<LayerShape> shapes;
  for (const auto& name : split_list(o.shapes)) shapes.push_back(find_shape(name));
  FUSEDMOE_CHECK(!shapes.empty(), "--shapes: expected at least one shape, got \"", o.shapes, "\"");
  const DType dtype = parse_dtype(o.dtype.empty() ? "f32" : o.dtype);
  const SimulatedRouting routing = parse_simulated_routing(o.routing);
  const ExpertPlacement placement = parse_expert_placement(o.expert_placement);
  const DispatchDType dispatch = parse_dispatch_dtype(o.dispatch_dtype);
  if (o.threads > 0) ThreadPool::set_global_num_threads(o.threads);
  const int threads = ThreadPool::global().num_threads();
  const bool a2a = pc.ep_size > 1 && pc.dp_size == 1;

  const size_t budget =
      static_cast<size_t>(o.memory_fraction * static_cast<double>(physical_memory_bytes()));
  const int64_t max_tokens = *std::max_element(token_counts.begin(), token_counts.end());
  // Each shape and this rank's share of it, checked against the memory budget
  // before anything is printed or allocated.
  std::vector<std::pair<LayerShape, LayerShape>> layouts;  // (shape, this rank's share)
  for (const LayerShape& requested : shapes) {
    LayerShape shape = cap_experts(requested, o.max_experts);
    shape.E = std::max<int64_t>(shape.E, pc.ep_size);
    // This rank's share must fit the memory budget (all ranks share the machine here).
    const ExpertMap map(shape.E, pc.ep_size, placement);
    LayerShape local = shape;
    local.E = map.num_local_experts(pc.ep_rank);
    local.I = tp_slice(shape.I, pc.tp_size, pc.tp_rank).second;
    const size_t shares = layer_bytes(local, dtype, false) * world->size();
    FUSEDMOE_CHECK(
        shares <= budget, shape.name, ": the ranks' expert shares need ",
        format_bytes(static_cast<double>(shares)), ", over the budget of ",
        format_bytes(static_cast<double>(budget)), " (--memory-fraction ",
        exact_number(o.memory_fraction), " of ",
        format_bytes(static_cast<double>(physical_memory_bytes())),
        " physical memory); give a larger --memory-fraction or fewer experts (--max-experts)");
    // ... with the buffers of the largest T beside it: each rank's batches and
    // output, and what its experts may receive at worst, whatever the routing
    // (rank_token_bytes: under expert parallelism every token group's tokens,
    // as all-to-one routing sends them, not an even share).
    const int groups = pc.ep_size > 1 ? (pc.dp_size > 1 ? pc.dp_size : pc.ep_size) : 1;
    const size_t per_token =
        (batch_token_bytes(local) + rank_token_bytes(local.H, local.I, local.k, local.E, groups)) *
        world->size();
    const int64_t most_tokens = most_tokens_within(budget, shares, per_token);
    FUSEDMOE_CHECK(max_tokens <= most_tokens, "--tokens: expected at most ", most_tokens,
                   " per rank for this machine's memory, got ", max_tokens, " (shape '", shape.name,
                   "': ", format_bytes(static_cast<double>(per_token)),
                   " a token for the activations, intermediates and outputs of the ", world->size(),
                   " ranks, each budgeted for the most it can receive (",
                   groups > 1 ? "every rank's tokens" : "its own tokens' routed rows",
                   "), beside their expert shares of ", format_bytes(static_cast<double>(shares)),
                   ", within the budget of ", format_bytes(static_cast<double>(budget)),
                   ": --memory-fraction ", exact_number(o.memory_fraction), " of ",
                   format_bytes(static_cast<double>(physical_memory_bytes())),
                   " physical memory); give fewer --tokens or a larger --memory-fraction");
    layouts.emplace_back(shape, local);
  }
  rank_local_done();
  const ParallelGroups groups = ParallelGroups::create(world, o.ep_size, o.tp_size, o.dp_size);

  if (root) {
    std::printf("# fusedmoe bench (parallel)\n\n");
    std::printf("- %d ranks (%s): ep %d, tp %d, dp %d; %s per rank; experts %s\n", world->size(),
                world->backend().c_str(), pc.ep_size, pc.tp_size, pc.dp_size,
                count_of(threads, "thread").c_str(), to_string(placement));
    // Only the EP all-to-all (ep > 1, dp 1) has a dispatch payload; the
    // data-parallel layout gathers f32 rows, tensor parallelism alone none.
    const std::string exchange =
        pc.ep_size > 1 && pc.dp_size == 1
            ? std::string("dispatch payload ") +
                  (dispatch != DispatchDType::kAuto ? to_string(dispatch)
                   : dtype == DType::kBF16          ? "auto (bf16)"
                                                    : "auto (f32)") +
                  ", combine f32"
        : pc.ep_size > 1 ? std::string("all-gather / reduce-scatter of f32 rows (no dispatch)")
                         : std::string("no dispatch");
    std::printf("- weights and compute %s; routing simulated %s; %s\n", dtype_name(dtype),
                o.routing.c_str(), exchange.c_str());
    std::printf(
        "- T = tokens per token group (EP or DP rank; TP ranks share them); times: median over "
        "ranks' medians of repeated runs; dispatch / combine GB/s = bytes that left their rank, "
        "summed over ranks / slowest rank's time (median run); routed experts only\n\n");
    std::fflush(stdout);
  }

  uint64_t seed = o.seed;
  for (const auto& layout : layouts) {
    const LayerShape &shape = layout.first, &local = layout.second;
    SyntheticLayer layer = make_synthetic_layer(local, dtype, ++seed + world->rank(), false);
    MoEConfig config;
    config.num_experts = shape.E;
    config.top_k = shape.k;
    config.hidden_size = shape.H;
    config.intermediate_size = shape.I;
    DistributedOptions dopts;
    dopts.placement = placement;
    dopts.dispatch_dtype = dispatch;
    DistributedExperts de(config, groups, layer.weights, dopts);
    ExpertsParams params;
    params.compute_dtype = dtype;
    Workspace ws;

    if (root) {
      std::printf("## %s: %s, E=%lld, k=%lld, H=%lld, I=%lld, %s weights, %s per rank\n\n",
                  shape.name.c_str(), shape.model.c_str(), static_cast<long long>(shape.E),
                  static_cast<long long>(shape.k), static_cast<long long>(shape.H),
                  static_cast<long long>(shape.I), dtype_name(dtype),
                  format_bytes(static_cast<double>(layer.weights.nbytes())).c_str());
      if (!shape.note.empty()) std::printf("(%s)\n\n", shape.note.c_str());
      std::printf(
          "| T | layer ms | dispatch ms | dispatch GB/s | combine ms | combine GB/s | "
          "dispatched rows (max rank) |\n|---:|---:|---:|---:|---:|---:|---:|\n");
      std::fflush(stdout);
    }
    const int group = world->rank() / pc.tp_size;
    for (int64_t T : token_counts) {
      const std::vector<RoutedBatch> batches =
          make_routed_batches(shape, T, routing, ++seed * 7919 + group);
      Tensor out = Tensor::empty(DType::kF32, {T, shape.H});
      size_t next = 0;
      EpStats last;
      std::vector<double> layer_s, dispatch_s, combine_s;
      auto run = [&] {
        const RoutedBatch& b = batches[next++ % batches.size()];
        const auto t0 = std::chrono::steady_clock::now();
        de.forward(b.hidden_states.view(), b.topk_ids.view(), b.topk_weights.view(), params, false,
                   out.view(), ws);
        de.reduce_tp(out.view());
        layer_s.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        if (de.ep_stats()) {
          last = *de.ep_stats();
          dispatch_s.push_back(last.dispatch_seconds);
          combine_s.push_back(last.combine_seconds);
        }
      };
      // Warm-up, then the same number of runs on every rank (rank 0 decides).
      run();
      int reps = static_cast<int>(std::clamp(o.min_time / std::max(layer_s[0], 1e-6), 3.0, 1000.0));
      world->broadcast(&reps, sizeof reps, 0);
      layer_s.clear();
      dispatch_s.clear();
      combine_s.clear();
      for (int r = 0; r < reps; ++r) run();
      const double t_layer = median(gather_doubles(*world, median(layer_s)));
      if (a2a) {
        const double td = max_of(gather_doubles(*world, median(dispatch_s)));
        const double tc = max_of(gather_doubles(*world, median(combine_s)));
        const double bd =
            sum_of(gather_doubles(*world, static_cast<double>(last.dispatch_bytes_sent)));
        const double bc =
            sum_of(gather_doubles(*world, static_cast<double>(last.combine_bytes_sent)));
        const double rows =
            max_of(gather_doubles(*world, static_cast<double>(last.dispatch_rows_received)));
        if (root)
          std::printf("| %lld | %.3f | %.3f | %.2f | %.3f | %.2f | %.0f |\n",
                      static_cast<long long>(T), t_layer * 1e3, td * 1e3,
                      td > 0 ? bd / td * 1e-9 : 0.0, tc * 1e3, tc > 0 ? bc / tc * 1e-9 : 0.0, rows);
      } else if (root) {
        std::printf("| %lld | %.3f | - | - | - | - | - |\n", static_cast<long long>(T),
                    t_layer * 1e3);
      }
      if (root) std::fflush(stdout);
    }
    if (root) std::printf("\n");
  }
  return 0;
}

}  // namespace fusedmoe::cli
