// fusedmoe: command-line entry point. Subcommands: inspect, run, bench.
#include <sys/stat.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <sstream>
#include <string>
#include <string_view>

#include "cli/bench_common.h"
#include "cli/cli.h"
#include "fusedmoe/core/error.h"
#include "fusedmoe/io/safetensors.h"
#include "fusedmoe/parallel/communicator.h"

namespace fusedmoe::cli {

int local_rank(int world_rank) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    const char* v = std::getenv(name);
    if (v && *v) {
      char* end = nullptr;
      const long r = std::strtol(v, &end, 10);
      if (end && *end == '\0' && r >= 0) return static_cast<int>(r);
    }
  }
  return world_rank;
}

int ranks_needed(int ep_size, int tp_size, int dp_size) {
  return (dp_size > 1 ? dp_size : ep_size) * tp_size;
}

namespace {
// "--ep-size E --tp-size T --dp-size D: expected N ranks" (both rank-count errors).
std::string expected_ranks(int ep_size, int tp_size, int dp_size) {
  const int need = ranks_needed(ep_size, tp_size, dp_size);
  return "--ep-size " + std::to_string(ep_size) + " --tp-size " + std::to_string(tp_size) +
         " --dp-size " + std::to_string(dp_size) + ": expected " + std::to_string(need) +
         (need == 1 ? " rank" : " ranks");
}
}  // namespace

void check_launch_size(int ep_size, int tp_size, int dp_size) {
  const int world = launcher_world_size();
  if (world <= 1 || world == ranks_needed(ep_size, tp_size, dp_size)) return;
  throw UsageError(expected_ranks(ep_size, tp_size, dp_size) + ", but the MPI launcher started " +
                   std::to_string(world) + " (mpirun -np " + std::to_string(world) +
                   "); give every rank sizes whose product ((--dp-size > 1 ? --dp-size : "
                   "--ep-size) x --tp-size) is " +
                   std::to_string(world) + ", e.g. --ep-size " + std::to_string(world) +
                   ", or run one rank");
}

CLI::Option* add_expert_placement_option(CLI::App& cmd, std::string& value) {
  return cmd
      .add_option("--expert-placement", value,
                  "contiguous or round-robin: which experts each EP rank holds (--ep-size > 1)")
      ->check(CLI::IsMember({"contiguous", "round-robin"}))
      ->capture_default_str();
}

void check_ep_options(int ep_size, int dp_size, const std::string& dispatch_dtype,
                      const std::string& expert_placement, bool placement_given, bool on_cuda) {
  usage_check(dispatch_dtype == "auto" || ep_size > 1 || dp_size > 1, "--dispatch-dtype ",
              dispatch_dtype,
              ": the expert-parallel dispatch payload, needs --ep-size > 1 (or --dp-size > 1)");
  // The GPUs' expert parallelism (CudaEpMoELayer) has a payload of its own.
  usage_check(!on_cuda || dispatch_dtype == "auto", "--dispatch-dtype ", dispatch_dtype,
              ": an option of the CPU backend; with --backend cuda the dispatch sends the "
              "hidden states as the experts take them (leave it auto)");
  usage_check(!placement_given || ep_size > 1, "--expert-placement ", expert_placement,
              ": which experts each expert-parallel rank holds, needs --ep-size > 1 (with "
              "--ep-size 1 one rank holds them all)");
}

std::shared_ptr<Communicator> make_parallel_world(
    int ep_size, int tp_size, int dp_size,
    const std::vector<std::pair<std::string, std::string>>& options, const char* command) {
  // A FUSEDMOE_COMM_TIMEOUT_S that is no number of seconds: a usage error
  // before any rank waits on another.
  try {
    comm_timeout_seconds();
  } catch (const fusedmoe::Error& e) {
    throw UsageError(e.what());
  }
  // check_launch_size() ran before (the callers need it for one-rank runs too);
  // this catches launchers it cannot see.
  std::shared_ptr<Communicator> world = make_world_communicator();
  const int need = ranks_needed(ep_size, tp_size, dp_size);
  if (world->size() != need)
    throw UsageError(expected_ranks(ep_size, tp_size, dp_size) + " (mpirun -np " +
                     std::to_string(need) + "), got " + std::to_string(world->size()));
  try {
    check_same_on_all_ranks(*world, options, command);
  } catch (const fusedmoe::Error& e) {
    if (e.code() != fusedmoe::ErrorCode::kInvalidArgument) throw;  // a lost rank
    throw UsageError(e.what());
  }
  return world;
}

std::string exact_number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string bundled_model_dir() {
  struct stat st {};
  if (::stat(FUSEDMOE_BUNDLED_MODEL_DIR, &st) == 0 && S_ISDIR(st.st_mode))
    return FUSEDMOE_BUNDLED_MODEL_DIR;
  return FUSEDMOE_BUNDLED_MODEL_INSTALL_DIR;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::string item;
  std::istringstream is(text);
  while (std::getline(is, item, ',')) {
    const auto b = item.find_first_not_of(" \t");
    const auto e = item.find_last_not_of(" \t");
    if (b != std::string::npos) out.push_back(item.substr(b, e - b + 1));
  }
  return out;
}

std::vector<int64_t> parse_int_list(const std::string& text, const char* what) {
  // Each item plain decimal, as every number of the command line: no spaces
  // around it, no empty item.
  std::vector<int64_t> out;
  size_t at = 0;
  for (;;) {
    const size_t comma = std::min(text.find(',', at), text.size());
    int64_t v = -1;
    const ParseNumber r = parse_decimal(std::string_view(text).substr(at, comma - at), v);
    FUSEDMOE_CHECK(r == ParseNumber::kOk && v >= 0, what,
                   ": expected a comma-separated list of decimal integers >= 0, got \"", text, "\"",
                   comma == at                     ? " (an empty item)"
                   : r == ParseNumber::kOutOfRange ? " (an item beyond 64 bits)"
                                                   : "");
    out.push_back(v);
    if (comma == text.size()) return out;
    at = comma + 1;
  }
}

}  // namespace fusedmoe::cli

namespace {

// Error messages go on one line: newlines inside a message become "; ".
std::string one_line(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  std::string out;
  for (char c : s) {
    if (c == '\n')
      out += "; ";
    else if (c != '\r')
      out += c;
  }
  return out;
}

// This process's rank when started by mpirun/srun (-1 otherwise): every rank
// parses the same arguments, so an argument error is printed by rank 0 only,
// and other errors carry the rank that hit them.
int launch_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char* v = std::getenv(var)) return std::atoi(v);
  return -1;
}

int fail(const std::string& message, int code, bool same_on_every_rank = false) {
  std::fflush(stdout);
  const int rank = launch_rank();
  if (rank > 0 && same_on_every_rank) return code;
  const std::string who = rank >= 0 ? "rank " + std::to_string(rank) + ": " : std::string();
  std::fprintf(stderr, "fusedmoe: error: %s%s\n", who.c_str(), one_line(message).c_str());
  return code;
}

}  // namespace

namespace {
// Interrupted (Ctrl-C, kill): remove the temporaries of unfinished output files
// (bench --csv, run --output) so that no partial file is left, then die of the
// signal as before.
extern "C" void on_fatal_signal(int sig) {
  fusedmoe::AtomicFile::remove_pending_temporaries();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
}  // namespace

int main(int argc, char** argv) {
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, on_fatal_signal);
  using namespace fusedmoe::cli;
  CLI::App app{
      "fusedmoe: run and benchmark the Mixture-of-Experts layer of HF models on the CPU or a\n"
      "CUDA GPU (--backend cuda), on one rank or several (mpirun).\n"
      "Bundled model: " +
          bundled_model_dir(),
      "fusedmoe"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "fusedmoe 0.1.0");
  InspectOptions inspect_opts;
  RunOptions run_opts;
  BenchOptions bench_opts;
  CLI::App* inspect = add_inspect_command(app, inspect_opts);
  CLI::App* run = add_run_command(app, run_opts);
  CLI::App* bench = add_bench_command(app, bench_opts);

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (app.get_subcommands().empty()) {
      // The first word that is no option names the command: say so when it is none.
      for (int i = 1; i < argc; ++i)
        if (const std::string w = argv[i];
            w[0] != '-' && w != "inspect" && w != "run" && w != "bench")
          return fail(std::string("unknown command '") + argv[i] +
                          "': expected inspect, run or bench (see fusedmoe --help)",
                      2, true);
      return fail(std::string(e.what()) + ": inspect, run or bench (see fusedmoe --help)", 2, true);
    }
    return fail(e.what(), 2, true);
  }

  try {
    if (inspect->parsed()) return run_inspect(inspect_opts);
    if (run->parsed()) return run_run(run_opts);
    if (bench->parsed()) {
      fusedmoe::bench::use_best_openblas_kernel(argv);
      return run_bench(bench_opts);
    }
    return fail("no command given (try --help)", 2);
  } catch (const UsageError& e) {
    return fail(e.what(), 2);
  } catch (const fusedmoe::Error& e) {
    return fail(e.what(), 1);
  } catch (const std::bad_alloc&) {
    return fail("out of memory", 1);
  } catch (const std::exception& e) {
    return fail(e.what(), 1);
  }
}
