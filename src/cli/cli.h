// fusedmoe command-line tool: internal declarations shared by the command files.
//
// Each command registers its CLI11 subcommand (options bound to an options
// struct) and has a run function called by main() after parsing. Run
// functions report failures by throwing fusedmoe::Error; main() turns any
// error into one line "fusedmoe: error: <message>" on stderr ("rank R: "
// first under a launcher with more than one rank) and exit code 1 (2 for
// argument errors: CLI11's parse errors, and UsageError, which run functions
// throw through usage_check() for what the command line alone decides;
// CollectiveError carries its own).
#pragma once

#include <CLI/CLI.hpp>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/parse_number.h"
#include "fusedmoe/core/error.h"
#include "fusedmoe/core/thread_pool.h"

namespace fusedmoe {
class Communicator;
}  // namespace fusedmoe

namespace fusedmoe::cli {

// Numbers on the command line: plain decimal only (core/parse_number.h), the
// same rule as FUSEDMOE_* variables. Each validator checks the form and the
// range while parsing, so a bad value is a usage error (exit code 2) naming
// the option, the expected form and the text given. Add them with
// ->transform(), not ->check(): they hand CLI11 the parsed value's canonical
// text, since its own conversion would read "0x10" as 16 and "010" as 8.
// `want`: "a decimal integer in [0, 1024]"; `in_range`: the bounds; `type`: the help text.
template <typename T, typename InRange>
CLI::Validator decimal_validator(const std::string& want, InRange in_range,
                                 const std::string& type) {
  return CLI::Validator(
      [want, in_range](std::string& input) -> std::string {
        T v{};
        ParseNumber r = parse_decimal(input, v);
        bool underflow = false;
        if constexpr (std::is_floating_point_v<T>) {
          // A number too small for a double (1e-400) is 0, as a double takes
          // it, when the option's range has 0; only one too large is beyond it.
          if (r == ParseNumber::kOutOfRange && std::fabs(std::strtod(input.c_str(), nullptr)) < 1)
            r = ParseNumber::kOk, v = 0, underflow = true;
          if (v == 0) v = 0;  // -0 is 0 (not echoed as "-0")
        }
        if (r != ParseNumber::kOk || !in_range(v)) {
          const char* why = underflow ? " (it underflows to 0)"
                            : r != ParseNumber::kOutOfRange || input[0] == '-' ? ""
                            : std::is_floating_point_v<T> ? " (beyond the range of a double)"
                                                          : " (beyond 64 bits)";
          return "expected " + want + ", got \"" + input + "\"" + why;
        }
        if constexpr (std::is_floating_point_v<T>) {
          char buf[64];  // hexadecimal: converted back exactly
          std::snprintf(buf, sizeof buf, "%a", v);
          input = buf;
        } else {
          input = std::to_string(v);
        }
        return {};
      },
      type);
}

// An integer lo <= v <= hi; `note` follows the range, e.g. " (0: all cores)".
inline CLI::Validator integer_in(int64_t lo, int64_t hi, const std::string& note = "") {
  const std::string range = "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  return decimal_validator<int64_t>(
      "a decimal integer " + range + note, [lo, hi](int64_t v) { return v >= lo && v <= hi; },
      "INTEGER " + range);
}
// An integer >= lo (an int64_t option).
inline CLI::Validator integer_at_least(int64_t lo) {
  const std::string want = ">= " + std::to_string(lo);
  return decimal_validator<int64_t>(
      "a decimal integer " + want, [lo](int64_t v) { return v >= lo; }, "INTEGER " + want);
}
// A (finite) number lo <= v <= hi.
inline CLI::Validator number_in(double lo, double hi) {
  const std::string range =
      "in [" + CLI::detail::to_string(lo) + ", " + CLI::detail::to_string(hi) + "]";
  return decimal_validator<double>(
      "a decimal number " + range, [lo, hi](double v) { return v >= lo && v <= hi; },
      "NUMBER " + range);
}
// A (finite) number >= lo.
inline CLI::Validator number_at_least(double lo) {
  const std::string want = ">= " + CLI::detail::to_string(lo);
  return decimal_validator<double>(
      "a decimal number " + want, [lo](double v) { return v >= lo; }, "NUMBER " + want);
}
// Each rank-count option (--ep-size, ...), --repeat: 1 up to int's maximum.
inline const CLI::Validator kPositiveInt = integer_in(1, 2147483647);
// --threads of run and bench: what the thread pool takes (ThreadPool::kMaxThreads).
inline const CLI::Validator kThreads = integer_in(0, ThreadPool::kMaxThreads, " (0: all cores)");
// A seed: an integer in [0, 2^64) (run prints its random seeds in that range).
inline const CLI::Validator kSeed = decimal_validator<uint64_t>(
    "a decimal integer in [0, 2^64)", [](uint64_t) { return true; }, "INTEGER in [0, 2^64)");

// A value from a fixed list (in place of CLI::IsMember, whose "f64 not in
// {f32,bf16}" is not this command line's style): "expected f32 or bf16, got
// \"f64\"", a usage error naming the option (CLI11 puts it first).
inline CLI::Validator one_of(std::vector<std::string> values) {
  std::string list, braces;
  for (size_t i = 0; i < values.size(); ++i) {
    list += (i == 0 ? "" : i + 1 == values.size() ? " or " : ", ") + values[i];
    braces += (i == 0 ? "" : ",") + values[i];
  }
  return CLI::Validator(
      [values, list](std::string& input) -> std::string {
        for (const auto& v : values)
          if (input == v) return {};
        return "expected " + list + ", got \"" + input + "\"";
      },
      "{" + braces + "}");
}

// What is wrong with a path option's value, or "": an empty string (not the
// same as leaving the option out), or an option's name or "--" ("run --model
// --tokens 1": the value left out, the parser took --tokens as the path, then
// failed on the "1"). A file of such a name is given as ./--tokens.
inline std::string path_error(const std::string& input) {
  if (input.empty()) return "expected a path, got an empty string";
  if (input == "--")
    return "expected a path, got \"--\", the end of the options (./-- names a file of that "
           "name)";
  if (input.size() < 3 || input.compare(0, 2, "--") != 0 ||
      !std::isalpha(static_cast<unsigned char>(input[2])))
    return {};
  return "expected a path, got \"" + input + "\", which is an option (was the value left out? ./" +
         input + " names a file of that name)";
}

// A name option given as "": an error naming the option, not the same as
// leaving the option out.
inline CLI::Validator non_empty(const std::string& what, const std::string& metavar) {
  return CLI::Validator(
      [what](std::string& input) -> std::string {
        return input.empty() ? "expected " + what + ", got an empty string" : std::string();
      },
      metavar);
}
// An input path option (path_error).
inline const CLI::Validator kNonEmpty =
    CLI::Validator([](std::string& input) { return path_error(input); }, "PATH");
inline const CLI::Validator kNonEmptyKey = non_empty("a tensor name", "KEY");

// A flag (run --quiet, bench --no-baseline, ...): given alone, or as
// --flag=true / --flag=false. Any other value is a usage error naming the flag
// and the text given (CLI11 alone would read "--quiet=3" or "--quiet=yes" as
// true and "--quiet=0" as false). Given twice, it is a usage error as any
// other option given twice ("run --quiet: expected once, given 2 times").
inline CLI::Option* add_bool_flag(CLI::App& cmd, const std::string& name, bool& value,
                                  const std::string& help) {
  return cmd.add_flag(name, value, help)
      ->multi_option_policy(CLI::MultiOptionPolicy::Throw)
      ->check(CLI::Validator(
          [](std::string& input) -> std::string {
            if (input == "true" || input == "false") return {};
            return "a flag, expected no value (or true / false), got \"" + input + "\"";
          },
          ""));
}

// An output file option (run --output, bench --csv): a non-empty path, and not
// "-": the standard output carries the command's report, so "-" cannot mean
// it, and is not taken as a file named "-" either (./- names one).
inline CLI::Validator output_path(const std::string& what) {
  return CLI::Validator(
      [what](std::string& input) -> std::string {
        if (std::string e = path_error(input); !e.empty()) return e;
        if (input == "-")
          return "expected a file path, got \"-\" (not the standard output: it carries the "
                 "report, and " +
                 what + "; ./- names a file called -)";
        return {};
      },
      "PATH");
}

// The defaults of --dispatch-dtype, --combine-dtype and --expert-placement (of
// run and bench; --help shows them).
inline constexpr const char* kDefaultDispatchDtype = "auto";
inline constexpr const char* kDefaultCombineDtype = "f32";
inline constexpr const char* kDefaultExpertPlacement = "contiguous";

// ---- inspect ------------------------------------------------------------------
struct InspectOptions {
  std::string path;  // model directory, config.json, or a .safetensors file
  bool json = false;
};
CLI::App* add_inspect_command(CLI::App& app, InspectOptions& opts);
int run_inspect(const InspectOptions& opts);

// ---- run ----------------------------------------------------------------------
struct RunOptions {
  std::string model;   // empty: the bundled model
  int64_t layer = -1;  // -1: the first MoE layer
  std::string input, input_key;
  int64_t tokens = -1;
  uint64_t seed = 0;
  bool seed_given = false;
  std::string output;
  std::string compute_dtype = "f32";
  int threads = 0;
  std::string reference, reference_key;
  double tolerance = -1.0;  // < 0: default for the compute dtype
  int repeat = 1;
  int warmup = 1;  // untimed forward calls before the timed ones
  bool quiet = false;
  std::string backend = "cpu";  // cpu or cuda (bf16 compute on the GPU)
  bool compute_dtype_given = false;
  // Parallel layout (under mpirun; world = (dp > 1 ? dp : ep) * tp ranks).
  int ep_size = 1, tp_size = 1, dp_size = 1;
  std::string expert_placement = kDefaultExpertPlacement;
  std::string dispatch_dtype = kDefaultDispatchDtype;
  std::string combine_dtype = kDefaultCombineDtype;  // GPU expert parallelism: f32 or bf16
};
CLI::App* add_run_command(CLI::App& app, RunOptions& opts);
int run_run(const RunOptions& opts);

// ---- bench --------------------------------------------------------------------
struct BenchOptions {
  std::string tokens = "1,16,64,256";
  std::string shapes = "mixtral,qwen3,deepseek,qwen3-cpu";
  std::string dtype;  // f32 or bf16; empty: f32 (the CPU), bf16 (--backend cuda)
  int threads = 0;
  double min_time = 0.3;
  std::string routing = "uniform";
  std::string csv;
  double memory_fraction = 0.25;
  uint64_t seed = 1234;
  bool no_baseline = false;
  std::string backend = "cpu";  // cpu or cuda (bench/cuda/cuda_bench.cu: CUDA events, graphs)
  bool sweep = false;           // cuda: also time every GEMM tile configuration
  std::string dump_dir;         // cuda: inputs and outputs for bench/cuda/torch_baseline.py
  int64_t max_experts = 0;      // > 0: cap E of every shape (quick runs, tests)
  int ep_size = 1, tp_size = 1, dp_size = 1;  // > 1: run_bench_parallel (under mpirun)
  bool nccl = false;  // cuda: the EP path over NCCL also at --ep-size 1 (one rank)
  std::string expert_placement = kDefaultExpertPlacement;
  std::string dispatch_dtype = kDefaultDispatchDtype;
  std::string combine_dtype = kDefaultCombineDtype;  // GPU expert parallelism: f32 or bf16
};
CLI::App* add_bench_command(CLI::App& app, BenchOptions& opts);
int run_bench(const BenchOptions& opts);
// The routed experts spread over ranks: layer time, dispatch / combine bandwidth.
int run_bench_parallel(const BenchOptions& opts);
// --backend cuda: the layer with its experts spread over GPUs (NCCL, one GPU per
// rank): layer time, dispatch and combine bandwidth (cmd_bench_parallel_cuda.cpp).
// The caller (run_bench) has checked the options: --ep-size only.
int run_bench_parallel_cuda(const BenchOptions& opts);
// Per-rank statistics of both parallel benchmarks (cmd_bench_parallel.cpp):
// every rank's `value` (a collective over a host-buffer communicator), their
// maximum and sum.
std::vector<double> gather_doubles(Communicator& comm, double value);
// The MPI world of both parallel benchmarks (make_parallel_world with the
// options every rank must share; --threads is the rank's own).
std::shared_ptr<Communicator> make_bench_world(const BenchOptions& opts);
double max_of(const std::vector<double>& v);
double sum_of(const std::vector<double>& v);

// ---- helpers (main.cpp) -------------------------------------------------------
// The bundled tiny model: the source-tree copy when it exists, else the
// installed one.
std::string bundled_model_dir();
// An output file (run --output, bench --csv) is never written among a model's
// files: throws a UsageError (exit 2) naming `flag` when `output`, resolved
// (links followed, a file not there yet by its folder), lies inside the folder
// of the model's config.json `config` (resolved), owned by `owner` ("the
// bundled model DIR", "--model DIR"). Nothing is checked where either cannot
// be resolved (no config.json there: the model does not load).
void refuse_output_in_model_folder(const char* flag, const std::string& output,
                                   const std::filesystem::path& config, const std::string& owner);
// The extension of `path` in lower case (".npy" for "OUT.NPY"; "" for none).
inline std::string lower_extension(const std::string& path) {
  std::string ext = std::filesystem::path(path).extension().string();
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext;
}
// "1.23 MiB"
std::string format_bytes(double bytes);
// "1 thread", "2 threads": `n` and the noun, plural unless n is 1.
inline std::string count_of(long long n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}
// printable(text): fusedmoe::printable (core/error.h), control characters and
// bytes that are not UTF-8 written as \xNN.
using fusedmoe::printable;
// Comma-separated integers >= 0, each plain decimal: "1,16,64" -> {1, 16, 64}.
// Throws Error naming `what`.
std::vector<int64_t> parse_int_list(const std::string& text, const char* what);
std::vector<std::string> split_list(const std::string& text);
// This process's rank on its node (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID,
// SLURM_LOCALID), else `world_rank`: picks the GPU of a rank.
int local_rank(int world_rank);
// The number of this launch's ranks on this node (OMPI_COMM_WORLD_LOCAL_SIZE,
// MPI_LOCALNRANKS), else `world_size` (all on this machine): the ranks that
// share its memory.
int local_size(int world_size);

// An error in how the command was invoked, found after parsing (the rank count
// does not match the parallel sizes): main() prints it and exits with 2, as
// for CLI11's parse errors.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// FUSEDMOE_CHECK for what the command line alone decides (options that do not
// go together, a value a command does not take): a UsageError, exit code 2.
template <typename... Args>
void usage_check(bool ok, const Args&... message) {
  if (!ok) throw UsageError(fusedmoe::detail::concat(message...));
}
// An error that every rank of a launch raises at the same step of the same
// collective check (the ranks run different commands or disagree on an option,
// another rank stopped with an error before the run): main() prints it (unless
// empty: one rank speaks for all) and exits with `code`, no MPI_Abort.
struct CollectiveError : std::runtime_error {
  CollectiveError(const std::string& message, int exit_code)
      : std::runtime_error(message), code(exit_code) {}
  int code;
};
// Ranks of a layout: (dp_size > 1 ? dp_size : ep_size) * tp_size.
int ranks_needed(int ep_size, int tp_size, int dp_size);
// Started by mpirun / srun with more than one rank for sizes that need another
// number: UsageError naming the options, the world size and what would fit
// (the sizes' rank count, or sizes for the world that keep most given ones).
// Callers run it before their other collectives (and for one-rank runs too:
// -np 2 without sizes is not two separate runs writing the same file).
void check_launch_size(int ep_size, int tp_size, int dp_size);
// --expert-placement of run and bench.
CLI::Option* add_expert_placement_option(CLI::App& cmd, std::string& value);
// --dispatch-dtype and --combine-dtype of run and bench.
void add_ep_payload_options(CLI::App& cmd, std::string& dispatch_dtype, std::string& combine_dtype);
// --dispatch-dtype, --combine-dtype and --expert-placement (of run and bench)
// where a value other than their default means nothing: UsageError naming the
// option, its value and what it needs. Each one's default (auto, f32,
// contiguous), given or not, is taken in any layout: it changes nothing. The
// dispatch payload other than auto needs --ep-size > 1 with --dp-size 1 (the
// EP all-to-all; the data-parallel layout gathers in f32); on the GPUs f32 is
// refused (the experts take bf16). The combine payload other than f32 needs
// --backend cuda and --ep-size > 1; the placement other than contiguous needs
// --ep-size > 1. ep_one_rank: bench --backend cuda --ep-size 1 --nccl, the GPU
// EP path on one rank (the payloads are taken there too).
void check_ep_options(int ep_size, int dp_size, const std::string& dispatch_dtype,
                      const std::string& combine_dtype, const std::string& expert_placement,
                      bool on_cuda, bool ep_one_rank = false);
// FUSEDMOE_COMM_TIMEOUT_S that is set but no number of seconds in (0, 1e9]:
// UsageError naming it (run and bench check it on every launch, one rank too).
void check_comm_timeout();
// FUSEDMOE_EP_TRANSPORT that is set but not auto, nccl or peer: UsageError
// with ep_transport_from_env()'s message (run and bench, every backend and
// rank, right after check_comm_timeout()).
void check_ep_transport();
// Flushes the standard output (C++ and C streams): "" when everything written
// to it arrived, else "the standard output is incomplete: <reason>" (a full
// disk, a closed pipe with SIGPIPE ignored). main() reports it (exit 1) after
// a command that succeeded.
std::string stdout_error();
// stdout_error() as Error(kIo): run and bench call it after their report and
// before they commit an output file (--output, --csv), so that a run whose
// report did not arrive leaves no file, as any other failed run.
void check_stdout();
// f()'s result; an Error it throws comes back with `option` in front of its
// message ("--csv: PATH: write failed: ..."): the errors of a file an option names.
template <class F>
auto naming_option(const char* option, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const fusedmoe::Error& e) {
    throw fusedmoe::Error(e.code(), std::string(option) + ": " + e.what());
  }
}
// Under a launcher with more than one rank (and a build with MPI), main()
// starts MPI for every command, so that no rank waits in MPI_Init for one that
// never calls it (--help on one rank, run on another), and the ranks compare
// what they `ran` ("run", "bench --help", "--version", ...) first: a rank whose
// command line does not parse (parse_failed) returns to print its error, the
// others throw CollectiveError (exit 2; "not run: the command line of rank 1
// does not parse"); different commands are a CollectiveError naming each
// rank's. `collectives`: the command calls make_parallel_world (run, bench).
// A rank with a bad FUSEDMOE_COMM_TIMEOUT_S still starts MPI (the default
// deadline) and joins that comparison, then throws UsageError naming it; the
// others throw CollectiveError ("not run: rank 1 has a bad
// FUSEDMOE_COMM_TIMEOUT_S"), so that none waits for it. Throws Error when MPI
// cannot start.
void start_launch(const std::string& ran, bool parse_failed, bool collectives);
// The world start_launch() started (nullptr when it started none).
std::shared_ptr<Communicator> launch_world();
// main(), after it printed this rank's error: under a launch, the other ranks
// must not wait for this one. Before the command's first collective they hear
// of it there (make_parallel_world: CollectiveError "not run: rank R stopped
// with an error", the same exit code); during the collectives the job ends
// (MPI_Abort with `code`). Returns where nothing is left to do.
void after_error(int code);
// run: no collective is left (rank 0 only reports and writes); an error after
// this ends this rank alone, without MPI_Abort.
void parallel_world_done();
// The MPI world of a parallel run (callers run check_launch_size() first;
// start_launch()'s world under a launch): first collects the errors of the
// ranks that stopped before it (after_error), then every rank must have been
// given the same `options` (name, value), checked before any other collective
// (CollectiveError, exit 2, naming the option and each rank's value; `command`
// starts the message), and the world's size must be ranks_needed(). Errors
// after it end the job (after_error).
std::shared_ptr<Communicator> make_parallel_world(
    int ep_size, int tp_size, int dp_size,
    const std::vector<std::pair<std::string, std::string>>& options, const char* command);
// After make_parallel_world, work of this rank alone before the command's next
// collective (run: reading the model, the input, the reference and its share
// of the weights, and checking that the tokens fit the memory): an error in it
// is told to the other ranks at rank_local_done() as one before
// make_parallel_world is (each rank prints its own error, the others say why
// they stop, the job ends with its exit code), not MPI_Abort.
void rank_local_begin();
// The end of that work, a collective (every rank of the launch calls it): a
// rank that stopped in it is named (CollectiveError, as make_parallel_world
// throws). No-op without a launch world.
void rank_local_done();
// A number as the options check compares it: the shortest text that reads
// back as the same double ("0.1"; different doubles, different texts).
std::string exact_number(double v);
// An option's value for the options check: "(not given)" when empty.
inline std::string or_not_given(const std::string& v) {
  return v.empty() ? "(not given)" : v;
}

}  // namespace fusedmoe::cli
