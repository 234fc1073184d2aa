// fusedmoe: the single-rank communicator, communicator helpers and the
// parallel layout (parallel/communicator.h).
#include "fusedmoe/parallel/communicator.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/parse_number.h"
#include "fusedmoe/core/error.h"

namespace fusedmoe {

std::vector<int64_t> Communicator::all_gather_int64(int64_t value) {
  const int n = size();
  std::vector<int64_t> out(n), counts(n, 8), displs(n);
  for (int p = 0; p < n; ++p) displs[p] = 8 * p;
  all_gather_v(&value, 8, out.data(), counts, displs);
  return out;
}

std::vector<std::string> Communicator::all_gather_string(const std::string& value) {
  const int P = size();
  const std::vector<int64_t> sizes = all_gather_int64(static_cast<int64_t>(value.size()));
  std::vector<int64_t> displs(P, 0);
  for (int p = 1; p < P; ++p) displs[p] = displs[p - 1] + sizes[p - 1];
  std::string all(static_cast<size_t>(displs[P - 1] + sizes[P - 1]), '\0');
  all_gather_v(value.data(), static_cast<int64_t>(value.size()), all.data(), sizes, displs);
  std::vector<std::string> out(P);
  for (int p = 0; p < P; ++p) out[p] = all.substr(displs[p], sizes[p]);
  return out;
}

namespace {

class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "single"; }

  void all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                    std::span<const int64_t> send_displs, void* recv,
                    std::span<const int64_t> recv_counts,
                    std::span<const int64_t> recv_displs) override {
    check_spans(send_counts.size(), "send_counts");
    check_spans(send_displs.size(), "send_displs");
    check_spans(recv_counts.size(), "recv_counts");
    check_spans(recv_displs.size(), "recv_displs");
    FUSEDMOE_CHECK(send_counts[0] == recv_counts[0],
                   "all_to_all_v: recv_counts[0] = ", recv_counts[0], " but rank 0 sends ",
                   send_counts[0], " bytes");
    if (send_counts[0] > 0)
      std::memcpy(static_cast<char*>(recv) + recv_displs[0],
                  static_cast<const char*>(send) + send_displs[0], send_counts[0]);
  }
  void all_reduce_sum(float*, int64_t) override {}
  void all_gather_v(const void* send, int64_t send_bytes, void* recv,
                    std::span<const int64_t> recv_counts,
                    std::span<const int64_t> recv_displs) override {
    check_spans(recv_counts.size(), "recv_counts");
    check_spans(recv_displs.size(), "recv_displs");
    FUSEDMOE_CHECK(recv_counts[0] == send_bytes, "all_gather_v: recv_counts[0] = ", recv_counts[0],
                   " but rank 0 sends ", send_bytes, " bytes");
    if (send_bytes > 0 && static_cast<char*>(recv) + recv_displs[0] != send)
      std::memmove(static_cast<char*>(recv) + recv_displs[0], send, send_bytes);
  }
  void reduce_scatter_sum(const float* send, float* recv,
                          std::span<const int64_t> recv_counts) override {
    check_spans(recv_counts.size(), "recv_counts");
    if (recv_counts[0] > 0) std::memcpy(recv, send, recv_counts[0] * sizeof(float));
  }
  void broadcast(void*, int64_t, int root) override {
    FUSEDMOE_CHECK(root == 0, "broadcast: root must be 0 on a single rank, got ", root);
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int) override {
    return std::make_unique<SingleRankCommunicator>();
  }
  [[noreturn]] void abort(int code) override { std::exit(code); }

 private:
  static void check_spans(size_t n, const char* name) {
    FUSEDMOE_CHECK(n == 1, name, ": expected 1 entry (one rank), got ", n);
  }
};

}  // namespace

std::unique_ptr<Communicator> make_single_rank_communicator() {
  return std::make_unique<SingleRankCommunicator>();
}

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
}

int launcher_world_size() {
  // srun with PMIx sets PMIX_RANK but no size of its own: the step's task count.
  const bool pmix = std::getenv("PMIX_RANK") != nullptr;
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"}) {
    if (!pmix && std::strcmp(name, "SLURM_STEP_NUM_TASKS") == 0) continue;
    const char* v = std::getenv(name);
    if (!v || !*v) continue;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end && *end == '\0' && n >= 1 && n <= INT_MAX) return static_cast<int>(n);
  }
  return -1;
}

std::unique_ptr<Communicator> make_world_communicator() {
  if (launched_by_mpi()) return make_mpi_communicator();
  return make_single_rank_communicator();
}

double comm_timeout_seconds() {
  const char* s = std::getenv("FUSEDMOE_COMM_TIMEOUT_S");
  if (!s || !*s) return kDefaultCommTimeoutSeconds;
  double v = 0;
  // Beyond kMaxCommTimeoutSeconds the deadline (int64 nanoseconds) would overflow.
  FUSEDMOE_CHECK(parse_decimal(s, v) == ParseNumber::kOk && v > 0 && v <= kMaxCommTimeoutSeconds,
                 "FUSEDMOE_COMM_TIMEOUT_S: expected a decimal number of seconds in (0, ",
                 kMaxCommTimeoutSeconds, "], got \"", printable(s), "\"");
  return v;
}

void check_same_on_all_ranks(Communicator& comm,
                             const std::vector<std::pair<std::string, std::string>>& values,
                             const std::string& context) {
  // name \x1f value \x1e ..., every rank's blob gathered on every rank.
  std::string mine;
  for (const auto& [name, value] : values) mine += name + '\x1f' + value + '\x1e';
  const int P = comm.size();
  const std::vector<std::string> blobs = comm.all_gather_string(mine);
  // Rank p's list as (name, value) pairs.
  std::vector<std::vector<std::pair<std::string, std::string>>> lists(P);
  for (int p = 0; p < P; ++p) {
    const std::string& blob = blobs[p];
    for (size_t at = 0; at < blob.size();) {
      const size_t sep = blob.find('\x1f', at), end = blob.find('\x1e', at);
      if (sep == std::string::npos || end == std::string::npos || sep > end) break;
      lists[p].emplace_back(blob.substr(at, sep - at), blob.substr(sep + 1, end - sep - 1));
      at = end + 1;
    }
  }
  // The first entry (in rank 0's order) whose value is not the same everywhere;
  // every rank walks the same gathered lists, so every rank throws the same error.
  const size_t n = lists[0].size();
  for (size_t i = 0;; ++i) {
    bool same = true;
    for (int p = 1; p < P; ++p)
      same = same &&
             (i < n ? i < lists[p].size() && lists[p][i] == lists[0][i] : lists[p].size() <= n);
    if (same) {
      if (i >= n) return;
      continue;
    }
    std::string name;  // rank 0's entry i, else the first rank's that has one
    for (int p = 0; p < P && name.empty(); ++p)
      if (i < lists[p].size()) name = lists[p][i].first;
    // Distinct values in order of first appearance, each with its ranks.
    std::vector<std::pair<std::string, std::vector<int>>> seen;
    for (int p = 0; p < P; ++p) {
      std::string v = "(not given)";
      for (const auto& [key, val] : lists[p])
        if (key == name) v = val.empty() ? "\"\"" : val;
      auto it = std::find_if(seen.begin(), seen.end(), [&](const auto& e) { return e.first == v; });
      if (it == seen.end())
        seen.push_back({v, {p}});
      else
        it->second.push_back(p);
    }
    std::string list;
    for (const auto& [v, ranks] : seen) {
      if (!list.empty()) list += ", ";
      list += v;
      list += ranks.size() == 1 ? " on rank " : " on ranks ";
      for (size_t j = 0; j < ranks.size(); ++j) {
        if (j) list += ',';
        list += std::to_string(ranks[j]);
      }
    }
    FUSEDMOE_THROW(kInvalidArgument, context, ": the ranks disagree on ", name, ": ", list,
                   " (every rank must be given the same value)");
  }
}

// ---- layout -------------------------------------------------------------------

ParallelConfig parallel_config_for_rank(int rank, int ep_size, int tp_size, int dp_size) {
  ParallelConfig c;
  c.ep_size = ep_size;
  c.tp_size = tp_size;
  c.dp_size = dp_size;
  c.tp_rank = rank % tp_size;
  const int group = rank / tp_size;  // ep_rank (dp_size == 1) or dp_rank
  if (dp_size > 1) {
    c.dp_rank = group;
    c.ep_rank = ep_size > 1 ? group : 0;
  } else {
    c.ep_rank = group;
  }
  return c;
}

ParallelGroups ParallelGroups::create(std::shared_ptr<Communicator> world, int ep_size, int tp_size,
                                      int dp_size) {
  FUSEDMOE_CHECK(world != nullptr, "ParallelGroups::create: world communicator is null");
  FUSEDMOE_CHECK(ep_size >= 1, "ep_size: expected >= 1, got ", ep_size);
  FUSEDMOE_CHECK(tp_size >= 1, "tp_size: expected >= 1, got ", tp_size);
  FUSEDMOE_CHECK(dp_size >= 1, "dp_size: expected >= 1, got ", dp_size);
  FUSEDMOE_CHECK(dp_size == 1 || ep_size == 1 || ep_size == dp_size,
                 "ep_size: with dp_size = ", dp_size,
                 " expected 1 or dp_size (experts spread over the DP group), got ", ep_size);
  const int64_t groups = dp_size > 1 ? dp_size : ep_size;
  const int64_t expected = groups * tp_size;
  FUSEDMOE_CHECK(world->size() == expected, "world size: expected ", expected, " ranks (",
                 dp_size > 1 ? "dp_size" : "ep_size", " ", groups, " x tp_size ", tp_size,
                 "), got ", world->size());
  ParallelGroups g;
  g.config = parallel_config_for_rank(world->rank(), ep_size, tp_size, dp_size);
  g.world = world;
  const int group = world->rank() / tp_size;
  // Same tp_rank: the EP / DP group. Same group index: the TP group.
  g.ep = groups > 1 ? std::shared_ptr<Communicator>(world->split(g.config.tp_rank, group))
                    : std::shared_ptr<Communicator>(make_single_rank_communicator());
  g.tp = tp_size > 1 ? std::shared_ptr<Communicator>(world->split(group, g.config.tp_rank))
                     : std::shared_ptr<Communicator>(make_single_rank_communicator());
  return g;
}

ParallelGroups ParallelGroups::single() {
  ParallelGroups g;
  g.world = make_single_rank_communicator();
  g.ep = make_single_rank_communicator();
  g.tp = make_single_rank_communicator();
  return g;
}

#ifndef FUSEDMOE_WITH_NCCL
namespace {
[[noreturn]] void no_nccl() {
  FUSEDMOE_THROW(kUnsupported,
                 "NCCL communicator: this build of fusedmoe has no NCCL (a CUDA build finds "
                 "nccl.h and libnccl in the CUDA toolkit or NCCL_HOME)");
}
}  // namespace
bool nccl_built() {
  return false;
}
std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator>, int) {
  no_nccl();
}
std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(std::span<const int>) {
  no_nccl();
}
std::vector<uint8_t> nccl_unique_id() {
  no_nccl();
}
std::unique_ptr<Communicator> make_nccl_communicator(std::span<const uint8_t>, int, int, int) {
  no_nccl();
}
#endif

#ifndef FUSEDMOE_WITH_MPI
bool mpi_built() {
  return false;
}
std::unique_ptr<Communicator> make_mpi_communicator(double /*timeout_s*/) {
  FUSEDMOE_THROW(kUnsupported,
                 "MPI communicator: this build of fusedmoe has no MPI (install libopenmpi-dev "
                 "and reconfigure)");
}
std::unique_ptr<Communicator> make_mpi_communicator() {
  return make_mpi_communicator(kDefaultCommTimeoutSeconds);
}
#endif

}  // namespace fusedmoe
