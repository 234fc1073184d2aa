// `fusedmoe bench`: fusedmoe's CPU MoE kernel against a BLAS-per-expert loop on
// synthetic layers of published model shapes, with this machine's roofline
// measured in the same run (see src/cli/bench_common.h, ../shared/perf-targets.md).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cli/bench_common.h"
#include "cli/cli.h"
#include "fusedmoe/core/thread_pool.h"
#include "fusedmoe/io/safetensors.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_amx.h"
#ifdef FUSEDMOE_WITH_CUDA
#include "bench/cuda/cuda_bench.h"
#include "fusedmoe/kernels/cuda.h"
#endif

namespace fusedmoe::cli {
namespace {

std::string cpu_model_name() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  return "unknown CPU";
}

// The shapes of the single-GPU CUDA bench (bench/cuda/cuda_bench.cu's kShapes).
bool is_cuda_bench_shape(const std::string& name) {
  return name == "mixtral" || name == "qwen3" || name == "deepseek";
}

}  // namespace

CLI::App* add_bench_command(CLI::App& app, BenchOptions& o) {
  CLI::App* cmd = app.add_subcommand(
      "bench", "Benchmark the CPU MoE kernel against a BLAS-per-expert loop on synthetic layers");
  // Checked while parsing, as run's --tokens: a bad list is a command line that
  // does not parse (exit code 2).
  cmd->add_option("--tokens", o.tokens, "Comma-separated token counts T")
      ->check(CLI::Validator(
          [](std::string& input) -> std::string {
            std::vector<int64_t> counts;
            try {
              counts = parse_int_list(input, "--tokens");
            } catch (const Error& e) {
              std::string why = e.what();
              const std::string prefix = "--tokens: ";
              return why.rfind(prefix, 0) == 0 ? why.substr(prefix.size()) : why;
            }
            // A count listed twice would be measured twice (as a flag given twice, an error).
            for (size_t i = 1; i < counts.size(); ++i)
              if (std::find(counts.begin(), counts.begin() + i, counts[i]) != counts.begin() + i)
                return "expected distinct token counts, got " + std::to_string(counts[i]) +
                       " twice in \"" + input + "\" (each count is measured once; list it once)";
            return {};
          },
          "T1,T2,..."))
      ->capture_default_str();
  cmd->add_option("--shapes", o.shapes,
                  "Comma-separated shapes: mixtral (E=8,k=2,H=4096,I=14336), qwen3 "
                  "(E=128,k=8,H=2048,I=768), deepseek (E=256,k=8,H=7168,I=2048), qwen3-cpu "
                  "(E=64,k=8,H=2048,I=768)")
      ->check(CLI::Validator(
          [](std::string& input) -> std::string {
            const std::string prefix = "--shapes: ";
            try {
              const std::vector<std::string> names = split_list(input);
              if (names.empty()) return "expected at least one shape, got \"" + input + "\"";
              // split_list drops empty items: "qwen3,,mixtral" is refused, as --tokens does.
              if (names.size() !=
                  static_cast<size_t>(std::count(input.begin(), input.end(), ',') + 1))
                return "expected a comma-separated list of shape names, got \"" + input +
                       "\" (an empty item)";
              for (const auto& name : names) bench::find_shape(name);
              // A shape listed twice would be measured twice (as a flag given twice, an error).
              for (size_t i = 1; i < names.size(); ++i)
                if (std::find(names.begin(), names.begin() + i, names[i]) != names.begin() + i)
                  return "expected distinct shape names, got \"" + names[i] + "\" twice in \"" +
                         input + "\" (each shape is measured once; list it once)";
            } catch (const Error& e) {
              const std::string why = e.what();
              return why.rfind(prefix, 0) == 0 ? why.substr(prefix.size()) : why;
            }
            return {};
          },
          "NAME1,NAME2,..."))
      ->capture_default_str();
  cmd->add_option("--dtype", o.dtype,
                  "Weight and compute dtype: f32 or bf16 (default f32; --backend cuda: bf16)")
      ->check(one_of({"f32", "bf16"}));
  cmd->add_option("--threads", o.threads, "Threads (default: all cores)")->transform(kThreads);
  cmd->add_option("--min-time", o.min_time,
                  "Minimum seconds of timed runs per measurement, at most 3600 (also at least 3 "
                  "and at most 1000 runs)")
      ->transform(number_in(0, 3600))
      ->capture_default_str();
  cmd->add_option("--routing", o.routing, "Simulated routing: uniform, zipf or all-to-one")
      ->check(one_of({"uniform", "zipf", "all-to-one"}))
      ->capture_default_str();
  cmd->add_option("--csv", o.csv,
                  "Also write the results to this CSV file (written in full at the end; none on "
                  "an error; a file path: not - for the standard output, which carries the tables; "
                  "not in the bundled model's folder, nor named *.safetensors / .json / .npy / "
                  ".npz)")
      ->check(output_path("the tables there are Markdown"));
  cmd->add_option("--memory-fraction", o.memory_fraction,
                  "Share of physical memory (or of a lower cgroup limit) a layer may use; larger "
                  "shapes get fewer experts")
      ->transform(number_in(0.01, 0.95))
      ->capture_default_str();
  cmd->add_option("--seed", o.seed, "Seed of weights, inputs and routing")
      ->transform(kSeed)
      ->capture_default_str();
  cmd->add_option("--max-experts", o.max_experts,
                  "Use at most this many experts per shape (quick runs; k, H, I are kept)")
      ->transform(integer_at_least(1));
  add_bool_flag(*cmd, "--no-baseline", o.no_baseline, "Skip the BLAS-per-expert baseline");
  cmd->add_option("--ep-size", o.ep_size,
                  "Expert parallelism under mpirun (-np = ep or dp size x tp size): layer time, "
                  "dispatch and combine bandwidth; --tokens are per rank")
      ->transform(kPositiveInt);
  add_bool_flag(*cmd, "--nccl", o.nccl,
                "--backend cuda: run the expert-parallel path also at --ep-size 1 (one rank, "
                "an NCCL communicator; dispatch / combine by the transport "
                "FUSEDMOE_EP_TRANSPORT picks: peer, or nccl)");
  cmd->add_option("--tp-size", o.tp_size, "Tensor parallelism inside experts")
      ->transform(kPositiveInt);
  cmd->add_option("--dp-size", o.dp_size, "Data-parallel token groups (naive DP + EP)")
      ->transform(kPositiveInt);
  add_expert_placement_option(*cmd, o.expert_placement);
  add_ep_payload_options(*cmd, o.dispatch_dtype, o.combine_dtype);
  cmd->add_option("--backend", o.backend,
                  "cpu, or cuda: routed experts on the GPU (bf16, CUDA graphs and events, "
                  "--routing as on the CPU; shapes mixtral, qwen3, deepseek)")
      ->check(one_of({"cpu", "cuda"}))
      ->capture_default_str();
  add_bool_flag(*cmd, "--sweep", o.sweep, "cuda: also time every GEMM tile configuration");
  cmd->add_option("--dump-dir", o.dump_dir,
                  "cuda: write routings, outputs and manifest.json for "
                  "bench/cuda/torch_baseline.py (PyTorch on the same inputs)")
      ->check(kNonEmpty);
  return cmd;
}

int run_bench(const BenchOptions& o) {
  // Under mpirun the sizes must account for every rank.
  check_launch_size(o.ep_size, o.tp_size, o.dp_size);
  if (!o.csv.empty()) {
    // Not over the bundled model (a trial's --csv models/tiny-deepseek-v3/model.safetensors
    // replaced its checkpoint), nor under a name of the formats the tool reads.
    refuse_output_in_model_folder("--csv", o.csv,
                                  std::filesystem::path(bundled_model_dir()) / "config.json",
                                  "the bundled model " + bundled_model_dir());
    const std::string ext = lower_extension(o.csv);
    usage_check(ext != ".safetensors" && ext != ".json" && ext != ".npy" && ext != ".npz", "--csv ",
                o.csv, ": the results are CSV text, not ", ext,
                " (a file of that name would be taken for one); name it *.csv");
  }
  // Options of the CUDA bench: an error on the CPU (parallel or not), not ignored.
  if (o.backend != "cuda") {
    std::string given;
    for (const auto& [flag, set] :
         {std::pair{"--dump-dir", !o.dump_dir.empty()}, {"--sweep", o.sweep}, {"--nccl", o.nccl}})
      if (set) given += (given.empty() ? "" : ", ") + std::string(flag);
    usage_check(given.empty(), given,
                ": options of --backend cuda, given without it (the CPU bench has its own "
                "BLAS baseline, tile-free kernels and host communicator)");
  }
  check_ep_options(o.ep_size, o.dp_size, o.dispatch_dtype, o.combine_dtype, o.expert_placement,
                   o.backend == "cuda", o.backend == "cuda" && o.nccl);
  // --max-experts below a shape's top_k: an error naming both, before anything runs.
  for (const auto& name : split_list(o.shapes)) {
    try {
      bench::cap_experts(bench::find_shape(name), o.max_experts);
    } catch (const Error& e) {
      throw UsageError(e.what());
    }
  }
  if (o.backend == "cuda") {
    // Options of the CPU bench that the CUDA benches do not take: an error, not
    // a result that silently ignores them.
    const BenchOptions d;
    const bool parallel = o.ep_size > 1 || o.nccl;
    usage_check(o.dtype.empty() || o.dtype == "bf16",
                "--dtype: --backend cuda benchmarks bf16 weights and activations, got ", o.dtype);
    usage_check(!parallel || o.routing == d.routing,
                "--routing: the CUDA expert-parallel bench routes with a random gate, got ",
                o.routing);
    usage_check(o.tp_size == 1 && o.dp_size == 1,
                "--backend cuda: --ep-size only (GPU expert parallelism); got --tp-size ",
                o.tp_size, " --dp-size ", o.dp_size);
    usage_check(
        o.csv.empty(),
        "--csv: not written with --backend cuda (it prints a markdown "
        "table; --dump-dir writes its routings and outputs for bench/cuda/torch_baseline.py), got ",
        o.csv);
    usage_check(o.threads == d.threads, "--threads: a CPU option, got ", o.threads,
                " with --backend cuda");
    usage_check(!o.no_baseline,
                "--no-baseline: a CPU option (the CUDA bench's baseline is "
                "bench/cuda/torch_baseline.py on --dump-dir), got it with --backend cuda");
    usage_check(o.memory_fraction == d.memory_fraction, "--memory-fraction: a CPU option, got ",
                o.memory_fraction, " with --backend cuda");
    if (!o.dump_dir.empty()) {
      // Checked before the benchmark runs, with the OS reason.
      struct stat st {};
      if (::stat(o.dump_dir.c_str(), &st) != 0)
        FUSEDMOE_THROW(kIo, "--dump-dir ", o.dump_dir, ": ", std::strerror(errno));
      FUSEDMOE_CHECK(S_ISDIR(st.st_mode), "--dump-dir ", o.dump_dir,
                     ": expected a directory (the bench writes several files into it)");
      if (::access(o.dump_dir.c_str(), W_OK) != 0)
        FUSEDMOE_THROW(kIo, "--dump-dir ", o.dump_dir, ": cannot write: ", std::strerror(errno));
    }
    if (!parallel) {
      std::string given;
      const auto add = [&](const char* flag, bool set, const std::string& value) {
        if (set) given += (given.empty() ? "" : ", ") + std::string(flag) + " " + value;
      };
      add("--min-time", o.min_time != d.min_time, exact_number(o.min_time));
      add("--seed", o.seed != d.seed, std::to_string(o.seed));
      add("--max-experts", o.max_experts != 0, std::to_string(o.max_experts));
      usage_check(given.empty(), given,
                  ": not taken by the single-GPU CUDA bench (fixed counter-based inputs, median "
                  "of a fixed number of graph replays); drop them");
      // Its shapes are its own (bench/cuda/cuda_bench.cu): the default list
      // runs those of them it has; a list given names only those.
      if (o.shapes != d.shapes)
        for (const std::string& name : split_list(o.shapes))
          usage_check(is_cuda_bench_shape(name), "--shapes ", o.shapes,
                      ": the single-GPU CUDA bench (--backend cuda without --ep-size or --nccl) "
                      "times mixtral, qwen3 or deepseek, got \"",
                      name, "\" (a shape of the CPU bench and of the expert-parallel benches)");
    } else {
      usage_check(!o.sweep && o.dump_dir.empty(), o.sweep ? "--sweep" : "--dump-dir",
                  ": an option of the single-GPU CUDA bench; the expert-parallel one "
                  "(--ep-size / --nccl) times the layer as it runs");
    }
    if (parallel) return run_bench_parallel_cuda(o);
  }
  if (o.ep_size > 1 || o.tp_size > 1 || o.dp_size > 1) {
    usage_check(o.csv.empty(),
                "--csv: not written by the parallel bench (--ep-size, --tp-size, --dp-size); "
                "it prints its table only, got ",
                o.csv);
    return run_bench_parallel(o);
  }
  using namespace fusedmoe::bench;
  if (o.backend == "cuda") {
#ifdef FUSEDMOE_WITH_CUDA
    // As `run --backend cuda`: no device is an error, not a skipped benchmark.
    FUSEDMOE_CHECK(cuda::device_count() > 0, "--backend cuda: no CUDA device found");
    CudaBenchOptions c;
    // The default list: the shapes the single-GPU bench has (run_bench checked a given one).
    if (o.shapes != BenchOptions().shapes) c.shapes = o.shapes;
    c.tokens = parse_int_list(o.tokens, "--tokens");
    c.sweep = o.sweep;
    c.dump_dir = o.dump_dir;
    c.routing = parse_simulated_routing(o.routing);
    return run_cuda_bench(c);
#else
    FUSEDMOE_THROW(kUnsupported, "--backend cuda: this build of fusedmoe has no CUDA backend");
#endif
  }
  const std::vector<int64_t> token_counts = parse_int_list(o.tokens, "--tokens");
  std::vector<LayerShape> shapes;
  for (const auto& name : split_list(o.shapes)) shapes.push_back(find_shape(name));
  FUSEDMOE_CHECK(!shapes.empty(), "--shapes: expected at least one shape, got \"", o.shapes, "\"");
  const DType dtype = parse_dtype(o.dtype.empty() ? "f32" : o.dtype);
  const SimulatedRouting routing = parse_simulated_routing(o.routing);
  if (o.threads > 0) ThreadPool::set_global_num_threads(o.threads);
  const int threads = ThreadPool::global().num_threads();
  const bool baseline = !o.no_baseline;
  // Each shape as run: capped by --max-experts, then fitted with its buffers
  // for the largest T to the memory budget (an error naming --memory-fraction
  // or --tokens before anything is allocated when one cannot fit).
  const int64_t max_tokens = *std::max_element(token_counts.begin(), token_counts.end());
  const size_t budget =
      static_cast<size_t>(o.memory_fraction * static_cast<double>(physical_memory_bytes()));
  std::vector<LayerShape> fitted;
  for (const LayerShape& requested : shapes) {
    try {
      fitted.push_back(fit_to_memory(cap_experts(requested, o.max_experts), dtype, baseline, budget,
                                     max_tokens));
    } catch (const Error& e) {
      // "--memory-fraction: ..." with the value given and the memory it is a share of.
      std::string what = e.what();
      const std::string flag = "--memory-fraction: ";
      if (what.rfind(flag, 0) == 0)
        what = "--memory-fraction " + exact_number(o.memory_fraction) + " (of " +
               format_bytes(static_cast<double>(physical_memory_bytes())) +
               " memory, physical or cgroup limit): " + what.substr(flag.size());
      throw Error(e.code(), what);
    }
  }

  // The CSV goes to a temporary file beside it (created now, so a path that
  // cannot be written fails before the benchmark runs), renamed into place
  // once every row is there: an error on the way leaves no file.
  // A write that fails (a full disk) drops the CSV, not the report: the
  // benchmark runs on and prints it, then the error names --csv.
  std::unique_ptr<AtomicFile> csv;
  std::string csv_error;
  const auto csv_write = [&](const std::string& text) {
    if (!csv) return;
    try {
      naming_option("--csv", [&] { csv->write(text); });
    } catch (const Error& e) {
      csv_error = e.what();
      csv.reset();  // its temporary removed
    }
  };
  if (!o.csv.empty()) {
    csv = naming_option("--csv", [&] { return std::make_unique<AtomicFile>(o.csv); });
    csv_write(
        "shape,E,k,H,I,dtype,routing,T,experts_touched,ours_s,ours_gflops,ours_gbps,"
        "roofline_frac,bound,baseline_s,baseline_gflops,speedup,rel_diff,ceiling_raised\n");
  }

  std::printf("# fusedmoe bench\n\n");
  std::printf("- CPU: %s, %s, GEMM %s%s (FUSEDMOE_CPU_ISA%s)\n", cpu_model_name().c_str(),
              count_of(threads, "thread").c_str(), cpu::cpu_isa_name(cpu::gemm_isa()),
              dtype == DType::kBF16 && cpu::amx_ready() ? ", bf16 experts on AMX" : "",
              dtype == DType::kBF16 ? ", FUSEDMOE_CPU_AMX" : "");
  std::printf(
      "- weights and compute: %s; routing: simulated %s; timing: median after 1 warm-up, "
      ">= 3 runs (2 if over 1 s each) and >= %.2f s, at most 1000 runs\n",
      dtype_name(dtype), o.routing.c_str(), o.min_time);
  std::fflush(stdout);
  const Ceilings ceil = measure_ceilings(threads);
  std::printf(
      "- ceilings (measured now, the best of 3 and 4 runs): peak fp32 FMA %.1f GFLOP/s "
      "(register-only %s microkernel, %s); read bandwidth %.1f GB/s (streaming sum over "
      "1 GiB)\n",
      ceil.peak_gflops, ceil.isa.c_str(),
      (count_of(ceil.measured_threads, "thread") +
       (ceil.measured_threads < threads ? ", the CPUs this process may use: --threads " +
                                              std::to_string(threads) + " share them"
                                        : ""))
          .c_str(),
      ceil.read_gbps);
  // The AMX ceiling is reported (and compared at the end) where it bounds the rows.
  const bool amx_ceiling = dtype == DType::kBF16 && ceil.amx_gflops > 0;
  if (amx_ceiling)
    std::printf(
        "- bf16 experts run on Intel AMX tiles (FUSEDMOE_CPU_AMX=0: AVX-512 instead): their "
        "compute ceiling is the peak bf16 AMX rate, %.1f GFLOP/s (TDPBF16PS on tiles in "
        "registers, the same threads)\n",
        ceil.amx_gflops);
  std::printf(
      "- roofline floor = max(bytes / bandwidth, FLOPs / peak); FLOPs = 2*T*k*3*H*I; bytes = "
      "distinct experts touched x expert bytes + activations in/out; %% roofline = floor / "
      "time, each ceiling at least what the row achieved, so at most 100%% (a row marked * "
      "beat a ceiling measured at the start: weights in the caches, or a machine busier then)\n");
  std::printf(
      "- each measurement cycles through %d batches with different routing, so weights come "
      "from memory unless those batches' experts fit the last-level cache (%s here; such "
      "rows are usually marked *); `experts` is the mean number touched per batch\n",
      kBatchRotation, format_bytes(static_cast<double>(last_level_cache_bytes())).c_str());
  if (baseline)
    std::printf(
        "- baseline: BLAS-per-expert loop (gather rows, OpenBLAS sgemm on f32 weights for "
        "w13, SiLU-GLU, sgemm for w2, scatter-add), each GEMM split over %s "
        "along N; OpenBLAS kernel %s\n",
        count_of(threads, "thread").c_str(), openblas_kernel_description().c_str());
  std::printf("\n");
  std::fflush(stdout);

  uint64_t seed = o.seed;
  size_t max_peak = 0;
  for (const LayerShape& shape : fitted) {
    reset_peak_rss();
    const auto t0 = std::chrono::steady_clock::now();
    SyntheticLayer layer = make_synthetic_layer(shape, dtype, ++seed, baseline);
    const double setup_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double weight_bytes =
        static_cast<double>(layer.weights.w13.nbytes() + layer.weights.w2.nbytes());
    std::printf("## %s: %s, E=%lld, k=%lld, H=%lld, I=%lld, %s weights %s\n\n", shape.name.c_str(),
                shape.model.c_str(), static_cast<long long>(shape.E),
                static_cast<long long>(shape.k), static_cast<long long>(shape.H),
                static_cast<long long>(shape.I), dtype_name(dtype),
                format_bytes(weight_bytes).c_str());
    if (!shape.note.empty()) std::printf("(%s)\n\n", shape.note.c_str());
    std::printf("| T | experts | fusedmoe ms | GFLOP/s | GB/s | %% roofline | bound |%s\n",
                baseline ? " BLAS loop ms | GFLOP/s | speedup | rel diff |" : "");
    std::printf("|---:|---:|---:|---:|---:|---:|---|%s\n", baseline ? "---:|---:|---:|---:|" : "");
    std::fflush(stdout);

    bool any_raised = false;  // a row beat a measured ceiling (marked *)
    FusedMoECpu ours(layer, dtype);
    std::unique_ptr<BlasPerExpertBaseline> base;
    if (baseline) base = std::make_unique<BlasPerExpertBaseline>(layer);
    for (int64_t T : token_counts) {
      const std::vector<RoutedBatch> batches = make_routed_batches(shape, T, routing, ++seed);
      const double experts = mean_distinct_experts(batches);
      Tensor out = Tensor::empty(DType::kF32, {T, shape.H});
      size_t next = 0;
      const double t_ours = median(
          time_repeats([&] { ours.forward(batches[next++ % batches.size()], out); }, o.min_time));
      const Roofline roof = layer_roofline(shape, T, experts, dtype, ceil);
      const RooflineShare share = roofline_share(roof, t_ours, ceil);
      const double frac = share.frac;
      any_raised |= share.raised;
      // T = 0 moves nothing: no share of a roofline, no bound ("-"; empty in the CSV).
      char roof_col[32] = "-";
      if (T > 0)
        std::snprintf(roof_col, sizeof roof_col, "%.0f%%%s", 100 * frac, share.raised ? "*" : "");
      const char* bound = T == 0 ? "-" : roof.memory_bound ? "memory" : "compute";
      std::printf("| %lld | %.1f | %.3f | %.1f | %.1f | %s | %s |", static_cast<long long>(T),
                  experts, t_ours * 1e3, roof.flops / t_ours * 1e-9, roof.bytes / t_ours * 1e-9,
                  roof_col, bound);
      double t_base = 0, diff = 0;
      if (baseline) {
        Tensor ref = Tensor::empty(DType::kF32, {T, shape.H});
        next = 0;
        t_base = median(time_repeats([&] { base->forward(batches[next++ % batches.size()], ref); },
                                     o.min_time));
        // Both on the same batch, then compare.
        ours.forward(batches[0], out);
        base->forward(batches[0], ref);
        diff = rel_l2(out.data_as<float>(), ref.data_as<float>(), static_cast<size_t>(T * shape.H));
        // T = 0: both times are the call's overhead alone; no speedup to speak of.
        char speedup[32] = "-";
        if (T > 0) std::snprintf(speedup, sizeof speedup, "%.2fx", t_base / t_ours);
        std::printf(" %.3f | %.1f | %s | %.1e |", t_base * 1e3, roof.flops / t_base * 1e-9, speedup,
                    diff);
      }
      std::printf("\n");
      std::fflush(stdout);
      if (csv) {
        // The baseline's columns: empty with --no-baseline (no time, no difference
        // measured: 0 would read as one), the speedup also at T = 0, as in the table.
        char base_cols[128] = ",,,";
        if (baseline) {
          char speedup[32] = "";
          if (T > 0) std::snprintf(speedup, sizeof speedup, "%.4f", t_base / t_ours);
          std::snprintf(base_cols, sizeof base_cols, "%.6e,%.3f,%s,%.3e", t_base,
                        roof.flops / t_base * 1e-9, speedup, diff);
        }
        char frac_col[32] = "";
        if (T > 0) std::snprintf(frac_col, sizeof frac_col, "%.4f", frac);
        char row[512];
        std::snprintf(
            row, sizeof row, "%s,%lld,%lld,%lld,%lld,%s,%s,%lld,%.2f,%.6e,%.3f,%.3f,%s,%s,%s,%d\n",
            shape.name.c_str(), static_cast<long long>(shape.E), static_cast<long long>(shape.k),
            static_cast<long long>(shape.H), static_cast<long long>(shape.I), dtype_name(dtype),
            o.routing.c_str(), static_cast<long long>(T), experts, t_ours,
            roof.flops / t_ours * 1e-9, roof.bytes / t_ours * 1e-9, frac_col, T == 0 ? "" : bound,
            base_cols, share.raised ? 1 : 0);
        csv_write(row);
      }
    }
    if (any_raised)
      std::printf(
          "\n\\* faster than the ceiling measured at the start (read bandwidth %.1f GB/s, peak "
          "%.1f GFLOP/s): its weights stayed in the caches, or the machine was busier during "
          "the measurement; %% roofline is against what the row achieved\n",
          ceil.read_gbps, ceil.peak_for(dtype));
    const size_t peak = peak_rss_bytes();
    max_peak = std::max(max_peak, peak);
    std::printf("\npeak resident memory for this shape: %s (weights %s%s); set-up %.1f s\n\n",
                format_bytes(static_cast<double>(peak)).c_str(), format_bytes(weight_bytes).c_str(),
                baseline && dtype != DType::kF32 ? ", plus the baseline's f32 copy" : "", setup_s);
    std::fflush(stdout);
  }
  std::printf("largest peak resident memory of one shape: %s\n",
              format_bytes(static_cast<double>(max_peak)).c_str());
  // The ceilings again: a machine shared with other processes (or VMs) measures
  // them far apart from one second to the next, and every % roofline above
  // used the first measurement.
  {
    const Ceilings end = measure_ceilings(threads);
    // Signed whole percentages, rounded first (no "-0 %").
    const auto change = [](double now, double then) {
      const long p = then > 0 ? std::lround(100 * (now / then - 1)) : 0;
      return (p >= 0 ? "+" : "") + std::to_string(p) + " %";
    };
    char amx[128] = "";
    if (amx_ceiling)
      std::snprintf(amx, sizeof amx, ", peak bf16 AMX %.1f GFLOP/s (%s)", end.amx_gflops,
                    change(end.amx_gflops, ceil.amx_gflops).c_str());
    std::printf(
        "ceilings measured again at the end: peak fp32 FMA %.1f GFLOP/s (%s)%s, read "
        "bandwidth %.1f GB/s (%s), against the start\n",
        end.peak_gflops, change(end.peak_gflops, ceil.peak_gflops).c_str(), amx, end.read_gbps,
        change(end.read_gbps, ceil.read_gbps).c_str());
    const auto moved = [](double now, double then) {
      return then > 0 && std::fabs(now / then - 1) > 0.15;
    };
    if (moved(end.peak_for(dtype), ceil.peak_for(dtype)) || moved(end.read_gbps, ceil.read_gbps))
      std::printf(
          "warning: the machine's ceilings changed by more than 15 %% during the run (other "
          "load on its cores or memory): the %% roofline figures above are not reliable; run "
          "again on a quiet machine\n");
  }
  // The report reached the standard output before the CSV is renamed into place.
  check_stdout();
  if (!csv_error.empty())
    throw Error(ErrorCode::kIo, csv_error + " (the report above is complete)");
  if (csv) naming_option("--csv", [&] { csv->commit(); });
  return 0;
}

}  // namespace fusedmoe::cli
