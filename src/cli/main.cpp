// fusedmoe: command-line entry point. Subcommands: inspect, run, bench.
#include <fcntl.h>
#include <signal.h>  // sigaction (POSIX)
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cli/bench_common.h"
#include "cli/cli.h"
#include "fusedmoe/core/env.h"
#include "fusedmoe/core/error.h"
#include "fusedmoe/io/safetensors.h"
#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/parallel/ep_prepare_finalize.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_amx.h"

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

int local_size(int world_size) {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    const char* v = std::getenv(name);
    if (v && *v) {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (end && *end == '\0' && n >= 1 && n <= world_size) return static_cast<int>(n);
    }
  }
  return world_size;
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

// What fits the given sizes: their number of ranks, or sizes for `world` ranks
// that change as few of the given ones as possible (the EP / DP size before
// --tp-size), e.g. --ep-size 1 --tp-size 2 for --ep-size 2 --tp-size 2 on 2 ranks.
std::string launch_size_hint(int ep_size, int tp_size, int dp_size, int world) {
  const auto valid = [](int e, int d) { return d == 1 || e == 1 || e == d; };
  std::string out;
  const int need = ranks_needed(ep_size, tp_size, dp_size);
  if (valid(ep_size, dp_size))
    out = need == 1 ? "run one rank (no mpirun, or mpirun -np 1), or "
                    : "start " + std::to_string(need) + " ranks (mpirun -np " +
                          std::to_string(need) + "), or ";
  int best[3] = {world, 1, 1}, best_cost = -1;
  for (int t = 1; t <= world; ++t) {
    if (world % t != 0) continue;
    const int g = world / t;  // token groups: the EP size, or the DP size
    for (const auto& [e, d] : {std::pair{g, 1}, {1, g}, {g, g}}) {
      if (!valid(e, d)) continue;
      const int cost =
          2 * ((e != ep_size) + (t != tp_size) + (d != dp_size)) + (t != tp_size ? 1 : 0);
      if (best_cost < 0 || cost < best_cost)
        best[0] = e, best[1] = t, best[2] = d, best_cost = cost;
    }
  }
  std::string sizes;
  const int given[3] = {ep_size, tp_size, dp_size};
  const char* names[3] = {"--ep-size ", "--tp-size ", "--dp-size "};
  for (int i = 0; i < 3; ++i)
    if (best[i] != given[i] || best[i] > 1)
      sizes += (sizes.empty() ? "" : " ") + std::string(names[i]) + std::to_string(best[i]);
  return out + "give sizes for " + std::to_string(world) +
         " ranks ((--dp-size > 1 ? --dp-size : --ep-size) x --tp-size = " + std::to_string(world) +
         "), e.g. " + sizes;
}

// The MPI world of a launch with more than one rank (main() starts it before
// the command runs), and how far the command got with it: a rank that stops
// with an error before the command's first collective tells the others, which
// wait for it there (join_launch); one that stops during the command's
// collectives ends the job (MPI_Abort).
enum class Phase {
  kNone,               // no launch world (one rank)
  kBeforeCollectives,  // run / bench: rank-local checks, before make_parallel_world
                       // or between rank_local_begin() and rank_local_done()
  kChecking,           // make_parallel_world: the ranks compare their options
  kRunning,            // the command's collectives
  kDone,               // no collective left (inspect, --help; run after its gather)
};
struct Launch {
  std::shared_ptr<Communicator> world;
  Phase phase = Phase::kNone;
};
Launch& launch() {
  static Launch l;
  return l;
}

// Collective over the launch world, at the command's first collective: every
// rank says whether it stopped with an error before it (its exit code, 0:
// none). A rank with none throws CollectiveError when another had one (its
// exit code; the message from the lowest rank without one only).
void join_launch(int code) {
  Communicator& world = *launch().world;
  const std::vector<int64_t> codes = world.all_gather_int64(code);
  std::string failed;
  int first_code = 0, first_ok = -1;
  for (int p = 0; p < world.size(); ++p) {
    if (codes[p] == 0) {
      if (first_ok < 0) first_ok = p;
      continue;
    }
    if (first_code == 0) first_code = static_cast<int>(codes[p]);
    failed += (failed.empty() ? "" : ",") + std::to_string(p);
  }
  if (failed.empty() || code != 0) return;
  throw CollectiveError(world.rank() != first_ok
                            ? std::string()
                            : std::string("not run: rank") +
                                  (failed.find(',') == std::string::npos ? " " : "s ") + failed +
                                  " stopped with an error (see its message)",
                        first_code);
}
}  // namespace

std::shared_ptr<Communicator> launch_world() {
  return launch().world;
}

void check_comm_timeout() {
  try {
    comm_timeout_seconds();
  } catch (const fusedmoe::Error& e) {
    throw UsageError(e.what());
  }
}

void check_ep_transport() {
  try {
    ep_transport_from_env();
  } catch (const fusedmoe::Error& e) {
    throw UsageError(e.what());
  }
}

void check_gemm_switches() {
  try {
    cpu::gemm_isa();        // FUSEDMOE_CPU_ISA
    cpu::amx_in_use();      // FUSEDMOE_CPU_AMX
    check_cuda_switches();  // FUSEDMOE_CUDA_*, on every backend
  } catch (const fusedmoe::Error& e) {
    throw UsageError(e.what());
  }
}

std::string stdout_error() {
  errno = 0;
  const bool cout_ok = static_cast<bool>(std::cout.flush());
  if (cout_ok && std::fflush(stdout) == 0 && !std::ferror(stdout)) return "";
  return std::string("the standard output is incomplete: ") +
         (errno != 0 ? std::strerror(errno) : "a write to it failed");
}

void check_stdout() {
  if (std::string e = stdout_error(); !e.empty()) throw fusedmoe::Error(ErrorCode::kIo, e);
}

void start_launch(const std::string& ran, bool parse_failed, bool collectives) {
  if (!mpi_built() || !launched_by_mpi() || launcher_world_size() == 1) return;
  // The deadline of every wait below. A bad FUSEDMOE_COMM_TIMEOUT_S is this
  // rank's usage error, but the rank still starts MPI (with the default
  // deadline) and joins the comparison below to tell the others, which would
  // else wait for it (in MPI_Init, with no deadline) when only its
  // environment has the bad value.
  double timeout_s = kDefaultCommTimeoutSeconds;
  std::string timeout_error;
  try {
    timeout_s = comm_timeout_seconds();
  } catch (const fusedmoe::Error& e) {
    timeout_error = e.what();
  }
  std::shared_ptr<Communicator> world = make_mpi_communicator(timeout_s);
  if (world->size() <= 1) {
    if (!timeout_error.empty()) throw UsageError(timeout_error);
    return;
  }
  Launch& l = launch();
  l.world = world;
  l.phase = Phase::kDone;  // the comparison below is the same on every rank
  // "!": the command line does not parse; "?": FUSEDMOE_COMM_TIMEOUT_S is bad.
  const std::string mark = parse_failed ? "!" : !timeout_error.empty() ? "?" : "";
  const std::vector<std::string> all = world->all_gather_string(mark + ran);
  const int P = world->size();
  std::string unparsed, bad_timeout;
  int first_ok = -1;
  for (int p = 0; p < P; ++p) {
    if (!all[p].empty() && all[p][0] == '!')
      unparsed += (unparsed.empty() ? "" : ",") + std::to_string(p);
    else if (!all[p].empty() && all[p][0] == '?')
      bad_timeout += (bad_timeout.empty() ? "" : ",") + std::to_string(p);
    else if (first_ok < 0)
      first_ok = p;
  }
  if (parse_failed) return;                                     // main() prints this rank's error
  if (!timeout_error.empty()) throw UsageError(timeout_error);  // this rank's own
  const auto ranks = [](const std::string& list) {
    return std::string(list.find(',') == std::string::npos ? "rank " : "ranks ") + list;
  };
  if (!unparsed.empty())
    throw CollectiveError(
        world->rank() != first_ok
            ? std::string()
            : "not run: the command line of " + ranks(unparsed) + " does not parse (see its error)",
        2);
  if (!bad_timeout.empty())
    throw CollectiveError(world->rank() != first_ok
                              ? std::string()
                              : "not run: " + ranks(bad_timeout) +
                                    " has a bad FUSEDMOE_COMM_TIMEOUT_S (see its error)",
                          2);
  // What each rank ran, in order of first appearance, with its ranks.
  std::vector<std::pair<std::string, std::string>> seen;
  for (int p = 0; p < P; ++p) {
    auto it =
        std::find_if(seen.begin(), seen.end(), [&](const auto& e) { return e.first == all[p]; });
    if (it == seen.end())
      seen.push_back({all[p], "rank " + std::to_string(p)});
    else
      it->second += "," + std::to_string(p);
  }
  if (seen.size() > 1) {
    std::string list;
    for (auto& [command, ranks] : seen) {
      if (ranks.find(',') != std::string::npos) ranks.insert(4, "s");
      list += (list.empty() ? "" : ", ") + command + " on " + ranks;
    }
    throw CollectiveError("the ranks ran different commands: " + list +
                              " (every rank must run the same command, with the same options)",
                          2);
  }
  l.phase = collectives ? Phase::kBeforeCollectives : Phase::kDone;
}

void after_error(int code) {
  Launch& l = launch();
  switch (l.phase) {
    case Phase::kBeforeCollectives:
      l.phase = Phase::kDone;
      try {
        join_launch(code);  // the other ranks wait for this one at their first collective
      } catch (const fusedmoe::Error&) {
        AtomicFile::remove_pending_temporaries();
        l.world->abort(code);
      }
      return;
    case Phase::kChecking:
    case Phase::kRunning:
      AtomicFile::remove_pending_temporaries();  // MPI_Abort runs no destructor
      l.world->abort(code);  // others may wait for this rank inside a collective
    default:
      return;
  }
}

void rank_local_begin() {
  Launch& l = launch();
  if (l.world && l.phase == Phase::kRunning) l.phase = Phase::kBeforeCollectives;
}

void rank_local_done() {
  Launch& l = launch();
  if (!l.world || l.phase != Phase::kBeforeCollectives) return;
  join_launch(0);  // the ranks that stopped in rank-local work (after_error)
  l.phase = Phase::kRunning;
}

void parallel_world_done() {
  if (launch().world) launch().phase = Phase::kDone;
}

void check_launch_size(int ep_size, int tp_size, int dp_size) {
  const int world = launch().world ? launch().world->size() : launcher_world_size();
  if (world <= 1 || world == ranks_needed(ep_size, tp_size, dp_size)) return;
  // Before MPI starts, the size is the launcher's environment variable: one set
  // by hand (no mpirun) is named as the source, with the way out first (a trial
  // finding: the advice to change the sizes led to the next error).
  if (!launch().world)
    throw UsageError(expected_ranks(ep_size, tp_size, dp_size) +
                     ", but the environment says an MPI launcher started " + std::to_string(world) +
                     " (OMPI_COMM_WORLD_SIZE, PMI_SIZE or SLURM_STEP_NUM_TASKS): without an MPI "
                     "launcher, run without those variables; under mpirun -np " +
                     std::to_string(world) + ", " +
                     launch_size_hint(ep_size, tp_size, dp_size, world));
  throw UsageError(expected_ranks(ep_size, tp_size, dp_size) + ", but the MPI launcher started " +
                   std::to_string(world) + " (mpirun -np " + std::to_string(world) + "); " +
                   launch_size_hint(ep_size, tp_size, dp_size, world));
}

CLI::Option* add_expert_placement_option(CLI::App& cmd, std::string& value) {
  return cmd
      .add_option("--expert-placement", value,
                  "contiguous or round-robin: which experts each EP rank holds (--ep-size > 1)")
      ->check(one_of({"contiguous", "round-robin"}))
      ->capture_default_str();
}

void add_ep_payload_options(CLI::App& cmd, std::string& dispatch_dtype,
                            std::string& combine_dtype) {
  cmd.add_option("--dispatch-dtype", dispatch_dtype,
                 "EP dispatch payload: auto, f32, bf16 or fp8 (e4m3, 1x128 group scales)")
      ->check(one_of({"auto", "f32", "bf16", "fp8"}))
      ->capture_default_str();
  cmd.add_option("--combine-dtype", combine_dtype,
                 "GPU EP (peer transport) combine payload: f32, or bf16 (half the bytes)")
      ->check(one_of({"f32", "bf16"}))
      ->capture_default_str();
}

void check_ep_options(int ep_size, int dp_size, const std::string& dispatch_dtype,
                      const std::string& combine_dtype, const std::string& expert_placement,
                      bool on_cuda, bool ep_one_rank) {
  const bool ep = ep_size > 1 || ep_one_rank;
  // ParallelGroups' rule, here before any rank builds its groups (it used to
  // pass the rank-count check and fail on each rank with ExpertMap's texts).
  usage_check(dp_size == 1 || ep_size == 1 || ep_size == dp_size, "--ep-size ", ep_size,
              " with --dp-size ", dp_size, ": expected --ep-size 1 (each data-parallel rank holds ",
              "every expert) or ", dp_size, " (the experts spread over the data-parallel ranks)");
  // Each of these options at its default (what --help shows) changes nothing
  // and is taken in any layout, given or not; a value other than the default
  // where the option has no effect is a usage error naming both.
  //
  // The payload is that of the EP all-to-all (DistributedExperts with ep_size
  // > 1 and dp_size 1); the data-parallel layout gathers the hidden states in
  // f32, so there the option would change nothing but the reference tolerance.
  const bool dispatch_set = dispatch_dtype != kDefaultDispatchDtype;
  usage_check(!dispatch_set || dp_size == 1, "--dispatch-dtype ", dispatch_dtype,
              " with --dp-size ", dp_size,
              ": the expert-parallel dispatch payload, taken with --ep-size > 1 and --dp-size 1 "
              "only (the data-parallel layout gathers the hidden states in f32); expected the "
              "default, ",
              kDefaultDispatchDtype, ", with --dp-size > 1");
  usage_check(!dispatch_set || ep, "--dispatch-dtype ", dispatch_dtype,
              ": the expert-parallel dispatch payload, needs --ep-size > 1, got --ep-size ",
              ep_size, " (without expert parallelism only the default, ", kDefaultDispatchDtype,
              ", is taken)");
  // The GPUs' experts take bf16 (or f16): f32 records would be rounded anyway.
  usage_check(!on_cuda || dispatch_dtype != "f32",
              "--dispatch-dtype f32: with --backend cuda the experts take bf16 (or f16) "
              "inputs; expected auto (the experts' type), bf16 (with bf16 compute) or fp8");
  usage_check(combine_dtype == kDefaultCombineDtype || (on_cuda && ep), "--combine-dtype ",
              combine_dtype,
              ": the combine payload of GPU expert parallelism, needs --backend cuda and "
              "--ep-size > 1 (the peer transport), got --backend ",
              on_cuda ? "cuda" : "cpu", " --ep-size ", ep_size, " (elsewhere only the default, ",
              kDefaultCombineDtype, ", is taken)");
  usage_check(expert_placement == kDefaultExpertPlacement || ep_size > 1, "--expert-placement ",
              expert_placement,
              ": which experts each expert-parallel rank holds, needs --ep-size > 1, got "
              "--ep-size ",
              ep_size, " (one rank holds them all; only the default, ", kDefaultExpertPlacement,
              ", is taken)");
}

std::shared_ptr<Communicator> make_parallel_world(
    int ep_size, int tp_size, int dp_size,
    const std::vector<std::pair<std::string, std::string>>& options, const char* command) {
  // main() checked FUSEDMOE_COMM_TIMEOUT_S before run / bench (a usage error
  // before any rank waits on another), and check_launch_size() ran before (the
  // callers need it for one-rank runs too); the size check below catches
  // launchers it cannot see.
  Launch& l = launch();
  std::shared_ptr<Communicator> world = l.world ? l.world : make_world_communicator();
  if (l.world) join_launch(0);  // the ranks that stopped before this point
  if (l.world) l.phase = Phase::kChecking;
  // Every rank throws the same error (the same gathered lists, then the same sizes).
  try {
    check_same_on_all_ranks(*world, options, command);
  } catch (const fusedmoe::Error& e) {
    if (e.code() != fusedmoe::ErrorCode::kInvalidArgument) throw;  // a lost rank
    throw CollectiveError(e.what(), 2);
  }
  const int need = ranks_needed(ep_size, tp_size, dp_size);
  // A launcher's size variable that MPI does not bear out (OMPI_COMM_WORLD_SIZE
  // set by hand, no mpirun): named as such, not as a rank count the
  // variable contradicts (check_launch_size() believed it).
  const int declared = launcher_world_size();
  if (declared > 0 && declared != world->size())
    throw CollectiveError("the environment says an MPI launcher started " +
                              std::to_string(declared) + " ranks (OMPI_COMM_WORLD_SIZE, PMI_SIZE " +
                              "or SLURM_STEP_NUM_TASKS), but MPI started " +
                              std::to_string(world->size()) + ": start the ranks with mpirun -np " +
                              std::to_string(need) + ", or run without those variables",
                          2);
  if (world->size() != need)
    throw CollectiveError(expected_ranks(ep_size, tp_size, dp_size) + " (mpirun -np " +
                              std::to_string(need) + "), got " + std::to_string(world->size()),
                          2);
  if (l.world) l.phase = Phase::kRunning;
  return world;
}

std::string exact_number(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest round trip
  return std::string(buf, r.ptr);
}

// The installed model beside an installed executable (<bin>/../share/fusedmoe/
// models/..., wherever the prefix was put), else the source tree's (a build's
// executable), else the configured install prefix's.
std::string bundled_model_dir() {
  const auto is_dir = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
  };
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const std::string installed =
        (exe.parent_path() / FUSEDMOE_BUNDLED_MODEL_FROM_BIN).lexically_normal().string();
    if (is_dir(installed)) return installed;
  }
  if (is_dir(FUSEDMOE_BUNDLED_MODEL_DIR)) return FUSEDMOE_BUNDLED_MODEL_DIR;
  return FUSEDMOE_BUNDLED_MODEL_INSTALL_DIR;
}

namespace {

// The folder of a model: the one holding its config.json `config` (as
// model_files() names it), resolved (links followed, absolute). Empty when
// that config.json is no regular file (the model does not load, so nothing is
// written) or the folder cannot be resolved.
std::filesystem::path model_folder(const std::filesystem::path& config) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_regular_file(fs::status(config, ec))) return {};
  fs::path resolved =
      fs::canonical(config.has_parent_path() ? config.parent_path() : fs::path("."), ec);
  return ec ? fs::path() : resolved;
}

// Where the output `path` lands: absolute, links followed (the file's own, when
// it is one, dangling or not, and its folders'), a file not there yet named by
// its resolved folder. Empty when it cannot be resolved (creating the file
// reports why).
std::filesystem::path resolved_output(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path at = fs::absolute(path, ec);
  if (ec) return {};
  // weakly_canonical() stops at a link to a missing file; follow such links by
  // hand (at most 40, as the kernel's ELOOP), each target relative to its
  // link's folder.
  for (int hops = 0; hops < 40 && fs::is_symlink(fs::symlink_status(at, ec)) && !fs::exists(at, ec);
       ++hops) {
    const fs::path target = fs::read_symlink(at, ec);
    if (ec) return {};
    at = target.is_absolute() ? target : at.parent_path() / target;
  }
  fs::path resolved = fs::weakly_canonical(at, ec);
  return ec ? fs::path() : resolved;
}

// True when `path` is `folder` or lies below it (both resolved).
bool is_inside(const std::filesystem::path& path, const std::filesystem::path& folder) {
  const std::filesystem::path rel = path.lexically_relative(folder);
  return !rel.empty() && *rel.begin() != "..";
}

}  // namespace

void refuse_output_in_model_folder(const char* flag, const std::string& output,
                                   const std::filesystem::path& config, const std::string& owner) {
  const std::filesystem::path folder = model_folder(config), out = resolved_output(output);
  usage_check(folder.empty() || out.empty() || !is_inside(out, folder), flag, " ", output,
              out.string() == output ? "" : " (" + out.string() + ")", ": is inside ",
              folder.string(), ", the folder of ", owner,
              "; the output is never written among the model's files, give a path outside "
              "that folder");
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

// The command line's arguments (run_command_line sets them): an error message
// that quotes one (a path given to --model, --output, ...) shows it as
// printable() does, its newlines too.
std::vector<std::string> g_arguments;

// Whether an argument quoted raw in a message must be written as printable()
// writes it: control characters, and backslashes (a typed "m\x0ai.npy" read
// like "m<newline>i.npy"; session 29's trial). A lone backslash is left alone:
// it would match every escape of the message.
bool needs_escape(const std::string& s) {
  return std::any_of(s.begin(), s.end(),
                     [](char c) {
                       const auto u = static_cast<unsigned char>(c);
                       return u < 0x20 || u == 0x7f;
                     }) ||
         (s.size() > 1 && s.find('\\') != std::string::npos);
}

// A part of an error message on one line: newlines as "; ", other control
// characters as printable() writes them; backslashes kept (the values the
// message quotes are printable() already: escaping them again would show
// "\\x0a" for a newline).
std::string plain_line(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '\n')
      out += "; ";
    else if (c != '\r')
      out += c;
  }
  return fusedmoe::printable(out, /*escape_backslash=*/false);
}

// Error messages go on one line: the arguments they quote (those with control
// characters) as printable() writes them, a newline in a path as \x0a, the
// message's own newlines as "; ".
std::string one_line(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  std::string out;
  size_t pos = 0;
  for (;;) {
    size_t best = std::string::npos;
    const std::string* which = nullptr;
    for (const std::string& arg : g_arguments) {
      if (!needs_escape(arg)) continue;
      const size_t at = s.find(arg, pos);
      if (at != std::string::npos && (at < best || (at == best && arg.size() > which->size()))) {
        best = at;
        which = &arg;
      }
    }
    if (which == nullptr) break;
    out += plain_line(std::string_view(s).substr(pos, best - pos));
    out += fusedmoe::cli::printable(*which);
    pos = best + which->size();
  }
  return out + plain_line(std::string_view(s).substr(pos));
}

// This process's rank when started by mpirun/srun with more than one rank
// (-1 otherwise): every error it prints carries the rank that hit it.
int launch_rank() {
  using namespace fusedmoe::cli;
  if (const auto world = launch_world()) return world->rank();
  if (fusedmoe::launcher_world_size() <= 1) return -1;
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char* v = std::getenv(var)) return std::atoi(v);
  return -1;
}

int fail(const std::string& message, int code) {
  std::fflush(stdout);
  const int rank = launch_rank();
  const std::string who = rank >= 0 ? "rank " + std::to_string(rank) + ": " : std::string();
  std::fprintf(stderr, "fusedmoe: error: %s%s\n", who.c_str(), one_line(message).c_str());
  std::fflush(stderr);
  return code;
}

}  // namespace

namespace {

// fusedmoe's commands, for the checks made before (or without) CLI11's parse.
bool is_command(const std::string& word) {
  return word == "inspect" || word == "run" || word == "bench";
}

// Edit distance of two option names (for "did you mean"), capped at 3:
// insertions, deletions, substitutions and swaps of two neighbours ("rnu" is
// one from "run"), each 1 (the optimal string alignment distance).
int edit_distance(const std::string& a, const std::string& b) {
  // Rows i - 2, i - 1 and i of the (|a| + 1) x (|b| + 1) table.
  std::vector<int> prev2(b.size() + 1), prev(b.size() + 1), row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = static_cast<int>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    row[0] = static_cast<int>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      row[j] = std::min({prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        row[j] = std::min(row[j], prev2[j - 2] + 1);  // two neighbours swapped
    }
    std::swap(prev2, prev);
    std::swap(prev, row);
  }
  return std::min(prev[b.size()], 3);
}

// The candidate nearest to `given` (for "did you mean"), where one lies below
// distance `below` (edit_distance); "" where none does.
std::string nearest_name(const std::string& given, const std::vector<std::string>& candidates,
                         int below) {
  std::string nearest;
  for (const std::string& c : candidates)
    if (const int d = edit_distance(given, c); d < below) below = d, nearest = c;
  return nearest;
}

// An option typed with a dash that is no hyphen (a word processor's en or em
// dash, or a minus sign: "—tokens"): "; '—tokens' starts with an em dash (U+2014),
// not two hyphens: did you mean --tokens?" where is_option("--tokens"), else "".
template <class IsOption>
std::string dash_hint(const std::string& arg, const IsOption& is_option) {
  for (const auto& [bytes, what] :
       {std::pair<std::string_view, const char*>{"\xE2\x80\x94", "an em dash (U+2014)"},
        {"\xE2\x80\x93", "an en dash (U+2013)"},
        {"\xE2\x88\x92", "a minus sign (U+2212)"}}) {
    if (arg.rfind(bytes, 0) != 0) continue;
    std::string rest = arg.substr(bytes.size());
    while (!rest.empty() && rest[0] == '-') rest.erase(0, 1);
    const std::string option = "--" + rest.substr(0, rest.find('='));
    if (!is_option(option)) return {};
    return "; '" + arg + "' starts with " + what + ", not two hyphens: did you mean " + option +
           "?";
  }
  return {};
}

// The text after "TYPE:" in an option's CLI11 type name ("INT:INTEGER >= 0" ->
// "INTEGER >= 0", "TEXT:{f32,bf16}" -> "one of f32, bf16"), "" for a bare type.
std::string value_form(const CLI::Option& opt) {
  const std::string type = opt.get_type_name();
  const size_t colon = type.find(':');
  if (colon == std::string::npos) return "";
  std::string form = type.substr(colon + 1);
  if (form.size() > 2 && form.front() == '{' && form.back() == '}') {
    form = "one of " + form.substr(1, form.size() - 2);
    for (size_t at = 0; (at = form.find(',', at)) != std::string::npos; at += 2)
      form.replace(at, 1, ", ");
  }
  return form;
}

// CLI11's parse errors of a command in this command line's style, as its
// other usage errors: the command, the option or argument, what was expected
// and what was given ("run --tokens: expected a value (INTEGER >= 0), got
// none" for CLI11's "--tokens: 1 required INT:INTEGER >= 0 missing").
std::string describe_parse_error(const CLI::ParseError& e, CLI::App& cmd, int argc, char** argv) {
  const std::string name = cmd.get_name(), what = e.what();
  const std::string help = " (see fusedmoe " + name + " --help)";
  // The option a message starts with ("--tokens: ...", "--tokens was ...").
  const auto option_named = [&](const std::string& text) -> CLI::Option* {
    if (text.empty() || text[0] != '-') return nullptr;
    return cmd.get_option_no_throw(text.substr(0, text.find_first_of(": ")));
  };
  if (dynamic_cast<const CLI::ExtrasError*>(&e)) {
    std::vector<std::string> options, args;
    for (const std::string& x : cmd.remaining())
      (x.size() > 1 && x[0] == '-' ? options : args).push_back(x);
    // Arguments after "--" are not in remaining(): CLI11 takes "--" as the
    // end of the command's options and leaves them to the top level. They are
    // arguments, whatever they look like ("run -- foo" named none).
    if (options.empty() && args.empty()) {
      bool after = false;
      for (int i = 1; i < argc; ++i) {
        if (after) args.emplace_back(argv[i]);
        after = after || std::string_view(argv[i]) == "--";
      }
    }
    const auto list = [](const std::vector<std::string>& v, const char* quote) {
      std::string out;
      for (const auto& x : v) out += (out.empty() ? "" : ", ") + (quote + x + quote);
      return out;
    };
    if (!options.empty()) {
      // "--tokn": the nearest option of the command, where one is close.
      std::vector<std::string> names;
      for (const CLI::Option* opt : cmd.get_options())
        for (const std::string& l : opt->get_lnames()) names.push_back("--" + l);
      const std::string nearest =
          nearest_name(options[0].substr(0, options[0].find('=')), names, 3);
      return name + ": unknown option" + (options.size() > 1 ? "s " : " ") + list(options, "") +
             (nearest.empty() ? "" : "; did you mean " + nearest + "?") + help;
    }
    const bool takes_path = cmd.get_option_no_throw("PATH") != nullptr;
    // "—model" anywhere on the line (also where it took a PATH's place, and the
    // PATH became the extra argument): named, with the option it would be.
    std::string hint;
    for (int i = 1; i < argc && hint.empty(); ++i)
      hint = dash_hint(argv[i],
                       [&](const std::string& o) { return cmd.get_option_no_throw(o) != nullptr; });
    return name + ": unexpected argument" + (args.size() > 1 ? "s " : " ") + list(args, "'") +
           (takes_path ? ": expected one PATH" : ": expected options only, each with its value") +
           hint + help;
  }
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e)) {
    if (CLI::Option* opt = option_named(what)) {
      const std::string opt_name = what.substr(0, what.find_first_of(": "));
      if (what.find(" missing") != std::string::npos) {
        const std::string form = value_form(*opt);
        return name + " " + opt_name + ": expected a value" +
               (form.empty() ? "" : " (" + form + ")") + ", got none" + help;
      }
      if (what.find("At Most") != std::string::npos) {
        int times = 0;
        for (int i = 1; i < argc; ++i) {
          const std::string a = argv[i];
          if (a == opt_name || a.rfind(opt_name + "=", 0) == 0) ++times;
        }
        if (times > 1)
          return name + " " + opt_name + ": expected once, given " + std::to_string(times) +
                 " times" + help;
      }
    }
  }
  if (dynamic_cast<const CLI::ValidationError*>(&e)) {
    // "--quiet: a flag, expected no value ...": a flag given a value (add_bool_flag).
    if (const CLI::Option* opt = option_named(what); opt && opt->get_expected_min() == 0)
      return name + " " + what + help;
  }
  if (dynamic_cast<const CLI::RequiredError*>(&e)) {
    // "PATH is required": a positional argument left out.
    const std::string tail = " is required";
    if (what.size() > tail.size() &&
        what.compare(what.size() - tail.size(), tail.size(), tail) == 0) {
      const std::string arg = what.substr(0, what.size() - tail.size());
      if (const CLI::Option* opt = cmd.get_option_no_throw(arg))
        return name + ": expected " + arg + ", got none (" + arg + ": " + opt->get_description() +
               "; see fusedmoe " + name + " --help)";
    }
  }
  // Messages of this command's validators ("--tokens: expected ..."), and any
  // other: the command first.
  return name + (what.size() > 1 && what[0] == '-' ? " " : ": ") + what;
}

// --help (and --version) end CLI11's checks where they stand: an unknown
// option beside them ("run --help --bogus") or a value given to them
// ("--help=3") went unchecked and the help exited 0. Such a command line is a
// usage error as it is without --help: the flag is refused a value, and the
// command line without these flags is parsed again, any error but a missing
// argument or input (what help is asked for before giving) reported as the
// parse reports it. --version beside a command ("--version run ...") is one
// too: the command would not run. Returns the message, or "" when the command
// line is fine. Parses `app` again.
std::string help_misuse(CLI::App& app, int argc, char** argv) {
  std::vector<char*> kept{argv[0]};
  std::string cmd;  // the command the flag came after ("" for the top level)
  bool options_end = false, saw_version = false;
  std::string top_help;              // --help or -h given before any command
  std::map<std::string, int> times;  // of each flag alone, before and after the command
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (!options_end && a == "--") options_end = true;
    if (!options_end && cmd.empty() && is_command(a)) cmd = a;
    std::string flag;  // the flag `a` gives, where it is one of these
    for (const char* f : {"--help", "-h", "--version"})
      if (!options_end && a.rfind(f, 0) == 0 &&
          (a.size() == std::strlen(f) || a[std::strlen(f)] == '=' || f[1] == 'h'))
        flag = f;
    if (flag.empty()) {
      kept.push_back(argv[i]);
      continue;
    }
    if (a.size() == flag.size()) {  // the flag alone
      saw_version = saw_version || flag == "--version";
      if (cmd.empty() && flag != "--version" && top_help.empty()) top_help = flag;
      const std::string key = cmd + (flag == "-h" ? "--help" : flag);
      if (++times[key] > 1) {
        const std::string where = cmd.empty() ? "" : cmd + " ";
        return where + flag + ": expected once, given " + std::to_string(times[key]) +
               " times (see fusedmoe " + where + "--help)";
      }
      continue;
    }
    // "--help=3", "-h=3", "-h3": no value.
    const std::string value = a.substr(a[flag.size()] == '=' ? flag.size() + 1 : flag.size());
    const std::string where = cmd.empty() ? "" : cmd + " ";
    return where + flag + ": a flag, expected no value, got \"" + value + "\" (see fusedmoe " +
           where + "--help)";
  }
  // --version prints the version and nothing else: a command beside it
  // ("fusedmoe --version run ...") would not run, so it is a usage error.
  const auto version_with_command = [&]() -> std::string {
    // Nor beside --help: one of the two would be left unsaid.
    if (saw_version && app.get_subcommands().empty() && !top_help.empty())
      return "--version: prints the version only, got --version with " + top_help +
             " (fusedmoe --version for the version; fusedmoe --help for the help)";
    if (!saw_version || app.get_subcommands().empty()) return "";
    const std::string name = app.get_subcommands()[0]->get_name();
    return "--version: prints the version only and takes no command, got --version with " + name +
           " (fusedmoe --version alone; fusedmoe " + name +
           " ... without --version to run the command)";
  };
  try {
    app.clear();
    app.parse(static_cast<int>(kept.size()), kept.data());
  } catch (const CLI::RequiredError&) {
    // Missing what help is asked for (inspect's PATH, run's input): fine, but
    // for anything unknown beside it.
    if (app.remaining_size(true) == 0) return version_with_command();
    if (!app.get_subcommands().empty())
      return describe_parse_error(CLI::ExtrasError(app.get_subcommands()[0]->remaining()),
                                  *app.get_subcommands()[0], static_cast<int>(kept.size()),
                                  kept.data());
    std::string list;
    for (const std::string& x : app.remaining(true)) list += (list.empty() ? "" : ", ") + x;
    return "unknown argument" + std::string(app.remaining_size(true) > 1 ? "s " : " ") + list +
           ": expected a command, inspect, run or bench, and its options (see fusedmoe --help)";
  } catch (const CLI::ParseError& e) {
    if (!app.get_subcommands().empty())
      return describe_parse_error(e, *app.get_subcommands()[0], static_cast<int>(kept.size()),
                                  kept.data());
    return std::string(e.what()) + " (see fusedmoe --help)";
  }
  return version_with_command();
}

// Interrupted (Ctrl-C, kill, a closed pipe): remove the temporaries of unfinished output files
// (bench --csv, run --output) so that no partial file is left, then die of the
// signal as before.
extern "C" void on_fatal_signal(int sig) {
  fusedmoe::AtomicFile::remove_pending_temporaries();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
}  // namespace

namespace {
int run_command_line(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {  // "--output=PATH" quotes PATH
    const std::string arg = argv[i];
    g_arguments.push_back(arg);
    const size_t eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos)
      g_arguments.push_back(arg.substr(eq + 1));
  }
  // SIGPIPE too: a report written into a closed pipe (run ... | head -c 1) ends
  // the run before its output file is committed, and leaves no temporary. A
  // SIGINT, SIGTERM or SIGHUP the process was started ignoring (a background job
  // of a script, nohup) stays ignored (the glibc manual's "Basic Signal
  // Handling" idiom).
  for (const int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) {
    struct sigaction was {};
    if (sig != SIGPIPE && ::sigaction(sig, nullptr, &was) == 0 && was.sa_handler == SIG_IGN)
      continue;
    std::signal(sig, on_fatal_signal);
  }
  // A write past the file size limit (ulimit -f) fails with EFBIG instead of
  // killing the process: the write error names the file and no temporary stays.
  std::signal(SIGXFSZ, SIG_IGN);
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

  // An option before the command ("fusedmoe --bogus run", "fusedmoe --tokens 3
  // run", "fusedmoe -- run"): only --help and --version belong to fusedmoe
  // itself; CLI11 would blame the command with an empty argument name.
  std::string before_command;
  for (int i = 1; i < argc; ++i) {
    const std::string w = argv[i];
    if (w.empty() || w[0] != '-') break;  // the command (an unknown one is named later)
    const std::string name = w.substr(0, w.find('='));
    if (name == "-h" || name == "--help" || name == "--version") continue;
    std::vector<std::string> takers;
    for (CLI::App* cmd : {inspect, run, bench})
      if (w != "--" && cmd->get_option_no_throw(name) != nullptr) takers.push_back(cmd->get_name());
    // The command given later ("--tokens 3 run") comes first in the suggestion.
    std::string command = takers.empty() ? "" : takers.front(), rest;
    int command_at = 0;
    for (int j = i + 1; j < argc && command_at == 0; ++j)
      for (const std::string& t : takers)
        if (t == argv[j]) command = t, command_at = j;
    for (int j = 1; j < argc; ++j)
      if (j != command_at) rest += std::string(" ") + argv[j];
    if (!takers.empty()) {
      std::string list;
      for (size_t j = 0; j < takers.size(); ++j)
        list += (j == 0 ? "" : j + 1 == takers.size() ? " and " : ", ") + takers[j];
      before_command = name + ": an option of " + list +
                       ", given before the command; the command comes first, e.g. fusedmoe " +
                       command + rest + " (see fusedmoe --help)";
    } else {
      before_command = (w == "--" ? std::string("'--'") : "unknown option " + name) +
                       " before the command: fusedmoe itself takes only --help and --version; "
                       "a command's options come after it (fusedmoe inspect|run|bench "
                       "[options], see fusedmoe --help)";
    }
    break;
  }
  // Parsed here, reported after the ranks of a launch compared what they run.
  std::exception_ptr parse_error;
  if (!before_command.empty()) {
    parse_error = std::make_exception_ptr(CLI::ExtrasError(std::vector<std::string>{}));
  } else {
    // "--name=" with nothing after '=' for an option that takes a value: CLI11
    // reads it as "--name" and takes the next argument as the value ("--output=
    // --quiet" wrote a file named --quiet; trial). Passed as "--name" "" instead,
    // so the option's own check names the empty value.
    std::vector<std::string> words(argv, argv + argc);
    const CLI::App* cmd = nullptr;
    for (size_t i = 1; i < words.size() && words[i] != "--"; ++i) {
      const std::string& w = words[i];
      if (cmd == nullptr) {
        for (const CLI::App* c : {inspect, run, bench})
          if (w == c->get_name()) cmd = c;
        continue;
      }
      if (w.size() < 4 || w.rfind("--", 0) != 0 || w.find('=') != w.size() - 1) continue;
      const CLI::Option* opt = cmd->get_option_no_throw(w.substr(0, w.size() - 1));
      if (opt == nullptr || opt->get_expected_min() == 0) continue;
      words[i].pop_back();
      words.insert(words.begin() + static_cast<std::ptrdiff_t>(i) + 1, std::string());
      ++i;
    }
    std::vector<char*> word_ptrs;
    for (std::string& w : words) word_ptrs.push_back(w.data());
    try {
      app.parse(static_cast<int>(word_ptrs.size()), word_ptrs.data());
    } catch (const CLI::ParseError&) {
      parse_error = std::current_exception();
    }
  }
  // A flag given an empty value ("--quiet="): CLI11 reads it as the flag alone
  // (true) before add_bool_flag's check sees it; a usage error as any value
  // other than true or false.
  if (!parse_error && !app.get_subcommands().empty()) {
    const CLI::App& cmd = *app.get_subcommands()[0];
    for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i) {
      const std::string_view arg = argv[i];
      if (arg.size() < 4 || arg.substr(0, 2) != "--" || arg.find('=') != arg.size() - 1) continue;
      const CLI::Option* opt = cmd.get_option_no_throw(std::string(arg.substr(0, arg.size() - 1)));
      if (opt != nullptr && opt->get_expected_min() == 0 && opt != cmd.get_help_ptr()) {
        parse_error = std::make_exception_ptr(
            CLI::ValidationError(std::string(arg.substr(0, arg.size() - 1)) +
                                 ": a flag, expected no value (or true / false), got \"\""));
        break;
      }
    }
  }
  std::string ran = app.get_subcommands().empty() ? "" : app.get_subcommands()[0]->get_name();
  bool parse_failed = false;
  std::string help_error;  // what --help left unchecked (help_misuse)
  // "--version=false", "--help=0": CLI11 takes them as the flag not given and
  // runs the command (or asks for one); a value is a usage error as "--help=3" is.
  for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i) {
    const std::string_view a = argv[i];
    if (a.rfind("--help=", 0) == 0 || a.rfind("--version=", 0) == 0 || a.rfind("-h=", 0) == 0) {
      help_error = help_misuse(app, argc, argv);
      parse_failed = !help_error.empty();
      break;
    }
  }
  if (parse_error) {
    try {
      std::rethrow_exception(parse_error);
    } catch (const CLI::Success& e) {  // --help, --version
      help_error = help_misuse(app, argc, argv);
      if (!help_error.empty())
        parse_failed = true;
      else if (dynamic_cast<const CLI::CallForVersion*>(&e))
        ran = "--version";
      else
        ran += ran.empty() ? "--help" : " --help";
    } catch (const CLI::ParseError&) {
      parse_failed = true;
    }
  }
  const bool collectives = !parse_error && !parse_failed && (run->parsed() || bench->parsed());
  // It may exec this program again: before MPI starts.
  if (!parse_error && !parse_failed && bench->parsed())
    fusedmoe::bench::use_best_openblas_kernel(argv);
  try {
    start_launch(ran, parse_failed, collectives);
  } catch (const CollectiveError& e) {
    return *e.what() ? fail(e.what(), e.code) : e.code;
  } catch (const UsageError& e) {
    return fail(e.what(), 2);
  } catch (const fusedmoe::Error& e) {
    return fail(e.what(), 1);
  }

  // Under a launch, rank 0 alone prints what the commands print (--help,
  // --version, inspect), as run does; the other ranks stay silent. Parse
  // errors are every rank's own.
  const bool silent_rank = launch_world() && launch_world()->rank() != 0;
  if (!help_error.empty()) return fail(help_error, 2);
  if (parse_error) {
    try {
      std::rethrow_exception(parse_error);
    } catch (const CLI::Success& e) {  // --help, --version
      if (silent_rank) return 0;
      // Written here, not by CLI11's std::endl: a failed write's errno is
      // then known (--version > /dev/full said "a write to it failed" where
      // every other command says "No space left on device").
      std::ostringstream out;
      const int rc = app.exit(e, out, std::cerr);
      if (std::fflush(stdout) != 0) return fail(stdout_error(), 1);
      const std::string text = out.str();
      for (size_t done = 0; done < text.size();) {
        const ssize_t n = ::write(STDOUT_FILENO, text.data() + done, text.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0)
          return fail(std::string("the standard output is incomplete: ") +
                          (n < 0 ? std::strerror(errno) : "a write to it failed"),
                      1);
        done += static_cast<size_t>(n);
      }
      return rc;
    } catch (const CLI::ParseError& e) {
      if (!before_command.empty()) return fail(before_command, 2);
      if (app.get_subcommands().empty()) {
        // The first word that is no option names the command: say so when it is none.
        for (int i = 1; i < argc; ++i)
          if (const std::string w = argv[i]; w[0] != '-' && !is_command(w)) {
            // "RUN", "rn": the command it is nearest to, where one is close.
            std::string lower = w;
            for (char& c : lower)
              c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
            const std::string nearest =
                nearest_name(lower, {"inspect", "run", "bench"}, lower.size() > 3 ? 3 : 2);
            const std::string hint = dash_hint(
                w, [](const std::string& o) { return o == "--help" || o == "--version"; });
            return fail(std::string("unknown command '") + argv[i] +
                            "': expected inspect, run or bench" +
                            (nearest.empty() ? hint : "; did you mean " + nearest + "?") +
                            " (see fusedmoe --help)",
                        2);
          }
        // CLI11's "A subcommand is required", in lower case as the other errors.
        if (dynamic_cast<const CLI::RequiredError*>(&e))
          return fail("a command is required: expected inspect, run or bench (see fusedmoe --help)",
                      2);
        std::string what = e.what();
        if (!what.empty())
          what[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(what[0])));
        return fail(what + ": inspect, run or bench (see fusedmoe --help)", 2);
      }
      return fail(describe_parse_error(e, *app.get_subcommands()[0], argc, argv), 2);
    }
  }

  // A failing rank prints its error; then the other ranks of a launch hear of
  // it (before the command's collectives) or are ended with it (MPI_Abort).
  const auto end = [](const std::string& message, int code) {
    fail(message, code);
    after_error(code);
    return code;
  };
  try {
    // run and bench take FUSEDMOE_COMM_TIMEOUT_S on one rank too (a usage error
    // whatever the launch, as under mpirun), and FUSEDMOE_EP_TRANSPORT on every
    // backend (only the GPUs' expert parallelism reads it, but a bad value is
    // never silently ignored).
    if (collectives) {
      check_comm_timeout();
      check_ep_transport();
      check_gemm_switches();  // the GEMMs' switches, before anything runs (any backend)
    }
    if (inspect->parsed()) {
      // "inspect —help": no such path, and an option with a dash that is no
      // hyphen: a usage error with the option it would be (session 31's trial).
      struct stat st {};
      if (stat(inspect_opts.path.c_str(), &st) != 0)
        if (const std::string hint = dash_hint(inspect_opts.path,
                                               [&](const std::string& o) {
                                                 return o == "--help" ||
                                                        inspect->get_option_no_throw(o) != nullptr;
                                               });
            !hint.empty())
          throw UsageError("inspect: " + printable(inspect_opts.path) +
                           ": no such model directory or file" + hint);
      return silent_rank ? 0 : run_inspect(inspect_opts);
    }
    if (run->parsed()) return run_run(run_opts);
    if (bench->parsed()) return run_bench(bench_opts);
    return end("no command given (try --help)", 2);
  } catch (const CollectiveError& e) {  // the same on every rank, at the same step
    return *e.what() ? fail(e.what(), e.code) : e.code;
  } catch (const UsageError& e) {
    return end(e.what(), 2);
  } catch (const fusedmoe::Error& e) {
    return end(e.what(), 1);
  } catch (const std::bad_alloc&) {
    return end("out of memory", 1);
  } catch (const std::exception& e) {
    return end(e.what(), 1);
  }
}
}  // namespace

// What a command printed must reach the standard output: a full disk (fusedmoe
// inspect --json > x.json) is an error, not exit code 0 with a cut or empty
// file. After an error (already reported, with its code) nothing more is said.
// A standard descriptor the caller closed (`>&-`) would be the next file
// opened — an output's temporary file would then receive the report. Each
// closed one gets /dev/null opened read-only in its place: writes to it fail
// (EBADF), so a closed standard output is still reported as one.
void reserve_standard_descriptors() {
  for (int fd = 0; fd <= 2; ++fd)
    if (fcntl(fd, F_GETFD) == -1 && errno == EBADF) {
      const int got = open("/dev/null", O_RDONLY);
      if (got != fd && got >= 0) {  // a lower one was open after all: put it in place
        dup2(got, fd);
        close(got);
      }
    }
}

int main(int argc, char** argv) {
  reserve_standard_descriptors();
  // "fusedmoe help [COMMAND]" (git's, cargo's form) is "fusedmoe [COMMAND] --help",
  // "help help" the top-level help; "help X" for X no command is "fusedmoe X" (the
  // unknown command's error); further arguments are left to the parse to refuse.
  std::vector<char*> args(argv, argv + argc);
  static char help_flag[] = "--help";
  if ((argc == 2 || argc == 3) && std::string(argv[1]) == "help") {
    const std::string cmd = argc == 3 ? argv[2] : "help";
    args.erase(args.begin() + 1);
    if (cmd == "help") args.resize(1);
    if (cmd == "help" || is_command(cmd)) args.push_back(help_flag);
  }
  args.push_back(nullptr);
  const int code = run_command_line(static_cast<int>(args.size()) - 1, args.data());
  if (code != 0) return code;
  const std::string error = fusedmoe::cli::stdout_error();
  return error.empty() ? 0 : fail(error, 1);
}
