// fusedmoe: the MPI communicator (parallel/communicator.h).
//
// Every operation is non-blocking (point-to-point Isend, Improbe + Imrecv,
// MPI_Ibcast, MPI_Ibarrier, MPI_Comm_idup) and completed by a polling loop
// with a deadline, so that a lost peer becomes an Error(kIo) instead of a hang.
// A receive is posted only once the probed message has the expected size, and
// every pair of ranks exchanges at least one (maybe empty) message per
// operation: ranks that disagree on a size (different options per rank) get an
// Error naming both sizes, never a truncated receive (which Open MPI's
// single-copy transport writes past the end of the buffer). The error
// handler is MPI_ERRORS_RETURN. all_to_all_v, all_gather_v and
// reduce_scatter_sum are direct point-to-point exchanges (one message per peer,
// split into chunks of at most 1 GiB, so byte counts are 64-bit);
// reduce_scatter_sum sums the P blocks in rank order 0..P-1 and all_reduce_sum
// is reduce_scatter_sum + all_gather_v, so results are deterministic, do not
// depend on the MPI library's choice of algorithm and are bit-identical on all
// ranks.
#ifdef FUSEDMOE_WITH_MPI

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "fusedmoe/core/error.h"
#include "fusedmoe/parallel/communicator.h"

namespace fusedmoe {

namespace {

constexpr int64_t kChunkBytes = int64_t{1} << 30;
constexpr int kTagAllToAll = 0x4d01;
constexpr int kTagAllGather = 0x4d02;
constexpr int kTagReduceScatter = 0x4d03;
// On MPI_COMM_WORLD: "this rank arrived" (make_mpi_communicator).
constexpr int kTagHello = 0x4d7e;

// Initializes MPI on first use; finalizes it at exit when this library
// initialized it and no communicator broke (a broken one has requests that
// will never complete, and MPI_Finalize would wait for them).
struct MpiRuntime {
  bool we_initialized = false;
  bool broken = false;
  static MpiRuntime& get() {
    static MpiRuntime r;
    return r;
  }
  void ensure() {
    int init = 0;
    MPI_Initialized(&init);
    if (init) return;
    int provided = 0;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) FUSEDMOE_THROW(kIo, "MPI_Init_thread failed (error ", rc, ")");
    we_initialized = true;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  ~MpiRuntime() {
    if (!we_initialized || broken) return;
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) MPI_Finalize();
  }
};

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "error " + std::to_string(rc);
  return std::string(buf, len);
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, double timeout_s) : comm_(comm), timeout_s_(timeout_s) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin && !broken_ && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  void all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                    std::span<const int64_t> send_displs, void* recv,
                    std::span<const int64_t> recv_counts,
                    std::span<const int64_t> recv_displs) override {
    const char* op = "all_to_all_v";
    start(op);
    check_span(op, send_counts.size(), "send_counts");
    check_span(op, send_displs.size(), "send_displs");
    check_span(op, recv_counts.size(), "recv_counts");
    check_span(op, recv_displs.size(), "recv_displs");
    Exchange x;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      post_recv(x, static_cast<char*>(recv) + recv_displs[p], recv_counts[p], p, kTagAllToAll, op);
    }
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      post_send(x, static_cast<const char*>(send) + send_displs[p], send_counts[p], p, kTagAllToAll,
                op);
    }
    FUSEDMOE_CHECK(send_counts[rank_] == recv_counts[rank_], op, ": recv_counts[", rank_,
                   "] = ", recv_counts[rank_], " but this rank sends itself ", send_counts[rank_],
                   " bytes");
    if (send_counts[rank_] > 0)
      std::memcpy(static_cast<char*>(recv) + recv_displs[rank_],
                  static_cast<const char*>(send) + send_displs[rank_], send_counts[rank_]);
    wait(x, op);
  }

  void all_gather_v(const void* send, int64_t send_bytes, void* recv,
                    std::span<const int64_t> recv_counts,
                    std::span<const int64_t> recv_displs) override {
    const char* op = "all_gather_v";
    start(op);
    check_span(op, recv_counts.size(), "recv_counts");
    check_span(op, recv_displs.size(), "recv_displs");
    FUSEDMOE_CHECK(recv_counts[rank_] == send_bytes, op, ": recv_counts[", rank_,
                   "] = ", recv_counts[rank_], " but this rank sends ", send_bytes, " bytes");
    Exchange x;
    for (int p = 0; p < size_; ++p)
      if (p != rank_)
        post_recv(x, static_cast<char*>(recv) + recv_displs[p], recv_counts[p], p, kTagAllGather,
                  op);
    for (int p = 0; p < size_; ++p)
      if (p != rank_) post_send(x, send, send_bytes, p, kTagAllGather, op);
    char* own = static_cast<char*>(recv) + recv_displs[rank_];
    if (send_bytes > 0 && own != send) std::memmove(own, send, send_bytes);
    wait(x, op);
  }

  void reduce_scatter_sum(const float* send, float* recv,
                          std::span<const int64_t> recv_counts) override {
    const char* op = "reduce_scatter_sum";
    start(op);
    check_span(op, recv_counts.size(), "recv_counts");
    std::vector<int64_t> offset(size_ + 1, 0);
    for (int p = 0; p < size_; ++p) offset[p + 1] = offset[p] + recv_counts[p];
    const int64_t n = recv_counts[rank_];
    // Blocks from every other rank, then the sum in rank order.
    scratch_.resize(static_cast<size_t>(std::max<int64_t>(n * (size_ - 1), 1)));
    Exchange x;
    for (int p = 0, slot = 0; p < size_; ++p)
      if (p != rank_) post_recv(x, scratch_.data() + n * slot++, n * 4, p, kTagReduceScatter, op);
    for (int p = 0; p < size_; ++p)
      if (p != rank_) post_send(x, send + offset[p], recv_counts[p] * 4, p, kTagReduceScatter, op);
    wait(x, op);
    const float* own = send + offset[rank_];
    for (int64_t i = 0; i < n; ++i) {
      float s = 0.0f;
      for (int p = 0, slot = 0; p < size_; ++p) s += p == rank_ ? own[i] : scratch_[n * slot++ + i];
      recv[i] = s;
    }
  }

  void all_reduce_sum(float* data, int64_t count) override {
    start("all_reduce_sum");
    if (size_ == 1) return;
    std::vector<int64_t> counts(size_), displs(size_);
    for (int p = 0; p < size_; ++p) {
      counts[p] = count / size_ + (p < count % size_ ? 1 : 0);
      displs[p] = p == 0 ? 0 : displs[p - 1] + counts[p - 1];
    }
    reduced_.resize(static_cast<size_t>(std::max<int64_t>(counts[rank_], 1)));
    reduce_scatter_sum(data, reduced_.data(), counts);
    std::vector<int64_t> bytes(size_), byte_displs(size_);
    for (int p = 0; p < size_; ++p) {
      bytes[p] = counts[p] * 4;
      byte_displs[p] = displs[p] * 4;
    }
    all_gather_v(reduced_.data(), bytes[rank_], data, bytes, byte_displs);
  }

  void broadcast(void* data, int64_t bytes, int root) override {
    const char* op = "broadcast";
    start(op);
    FUSEDMOE_CHECK(root >= 0 && root < size_, op, ": root must be in [0, ", size_, "), got ", root);
    // MPI_Ibcast with other sizes or roots per rank truncates (or overruns):
    // every rank checks every rank's (bytes, root) first, point to point.
    {
      const int64_t mine[2] = {bytes, root};
      std::vector<int64_t> all(2 * static_cast<size_t>(size_)), counts(size_, 16), displs(size_);
      for (int p = 0; p < size_; ++p) displs[p] = 16 * p;
      all_gather_v(mine, 16, all.data(), counts, displs);
      for (int p = 1; p < size_; ++p)
        FUSEDMOE_CHECK(all[2 * p] == all[0] && all[2 * p + 1] == all[1], op,
                       ": the ranks disagree: rank 0 broadcasts ", all[0], " bytes from rank ",
                       all[1], ", rank ", p, " ", all[2 * p], " bytes from rank ", all[2 * p + 1]);
    }
    for (int64_t off = 0; off < bytes; off += kChunkBytes) {
      Exchange x;
      x.reqs.emplace_back();
      x.peer.push_back(-1);
      check(MPI_Ibcast(static_cast<char*>(data) + off,
                       static_cast<int>(std::min(kChunkBytes, bytes - off)), MPI_BYTE, root, comm_,
                       &x.reqs.back()),
            op);
      wait(x, op);
    }
  }

  void barrier() override {
    const char* op = "barrier";
    start(op);
    Exchange x;
    x.reqs.emplace_back();
    x.peer.push_back(-1);
    check(MPI_Ibarrier(comm_, &x.reqs.back()), op);
    wait(x, op);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    // MPI_Comm_split blocks; a barrier with a deadline first makes a lost peer
    // an error rather than a hang.
    barrier();
    MPI_Comm out = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color, key, &out), "split");
    return std::make_unique<MpiCommunicator>(out, timeout_s_);
  }

  [[noreturn]] void abort(int code) override {
    MpiRuntime::get().broken = true;
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  // Requests of one operation; peer[i] = the rank request i talks to, with
  // recv requests first (for the timeout message), -1 for a collective.
  // Receives not posted yet: matched with MPI_Improbe (in order per peer)
  // and posted with MPI_Imrecv once their size is checked.
  struct PendingRecv {
    char* buf;
    int64_t bytes;
    int peer, tag;
    bool posted = false;
  };
  struct Exchange {
    std::vector<MPI_Request> reqs;
    std::vector<int> peer;
    std::vector<bool> is_recv;
    std::vector<PendingRecv> pending;
    size_t unposted = 0;
  };

  void start(const char* op) {
    if (broken_)
      FUSEDMOE_THROW(kIo, "MPI ", op, " (rank ", rank_, " of ", size_,
                     "): the communicator is broken by an earlier error");
  }
  void check_span(const char* op, size_t n, const char* name) const {
    FUSEDMOE_CHECK(n == static_cast<size_t>(size_), op, ": ", name, ": expected ", size_,
                   " entries (one per rank), got ", n);
  }
  void check(int rc, const char* op) {
    if (rc == MPI_SUCCESS) return;
    fail();
    FUSEDMOE_THROW(kIo, "MPI ", op, " (rank ", rank_, " of ", size_,
                   ") failed: ", mpi_error_string(rc));
  }
  void fail() {
    broken_ = true;
    MpiRuntime::get().broken = true;
  }

  // Messages of `bytes` bytes: chunks of at most kChunkBytes, at least one
  // (empty when bytes == 0, so that a peer expecting data hears of it).
  void post_recv(Exchange& x, void* buf, int64_t bytes, int peer, int tag, const char* op) {
    FUSEDMOE_CHECK(bytes >= 0, op, ": negative byte count ", bytes, " for rank ", peer);
    for (int64_t off = 0; off == 0 || off < bytes; off += kChunkBytes) {
      x.pending.push_back(
          {static_cast<char*>(buf) + off, std::min(kChunkBytes, bytes - off), peer, tag});
      ++x.unposted;
    }
  }
  void post_send(Exchange& x, const void* buf, int64_t bytes, int peer, int tag, const char* op) {
    FUSEDMOE_CHECK(bytes >= 0, op, ": negative byte count ", bytes, " for rank ", peer);
    for (int64_t off = 0; off == 0 || off < bytes; off += kChunkBytes) {
      x.reqs.emplace_back();
      x.peer.push_back(peer);
      x.is_recv.push_back(false);
      check(MPI_Isend(static_cast<const char*>(buf) + off,
                      static_cast<int>(std::min(kChunkBytes, bytes - off)), MPI_BYTE, peer, tag,
                      comm_, &x.reqs.back()),
            op);
    }
  }

  // Posts the pending receives whose message has arrived, in order per peer;
  // a message of another size than expected is an error (nothing is received).
  void post_arrived(Exchange& x, const char* op) {
    if (x.unposted == 0) return;
    blocked_.assign(static_cast<size_t>(size_), false);
    for (PendingRecv& r : x.pending) {
      if (r.posted || blocked_[r.peer]) continue;
      int flag = 0;
      MPI_Message msg = MPI_MESSAGE_NULL;
      MPI_Status status;
      check(MPI_Improbe(r.peer, r.tag, comm_, &flag, &msg, &status), op);
      if (!flag) {
        blocked_[r.peer] = true;  // its later chunks come after this one
        continue;
      }
      MPI_Count got = 0;
      check(MPI_Get_elements_x(&status, MPI_BYTE, &got), op);
      if (got != r.bytes) {
        fail();
        FUSEDMOE_THROW(kIo, "MPI ", op, " (rank ", rank_, " of ", size_, "): rank ", r.peer,
                       " sent a message of ", static_cast<long long>(got),
                       " bytes, this rank expected ", r.bytes,
                       ": the ranks disagree on the sizes (were they given different options "
                       "or inputs?); nothing was received");
      }
      x.reqs.emplace_back();
      x.peer.push_back(r.peer);
      x.is_recv.push_back(true);
      check(MPI_Imrecv(r.buf, static_cast<int>(r.bytes), MPI_BYTE, &msg, &x.reqs.back()), op);
      r.posted = true;
      --x.unposted;
    }
  }

  void wait(Exchange& x, const char* op) {
    if (x.reqs.empty() && x.unposted == 0) return;
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                             std::chrono::duration<double>(timeout_s_));
    int spins = 0;
    for (;;) {
      post_arrived(x, op);
      int done = 0;
      const int rc =
          MPI_Testall(static_cast<int>(x.reqs.size()), x.reqs.data(), &done, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) check(rc, op);
      if (done && x.unposted == 0) return;
      if (clock::now() > deadline) timeout(x, op);
      // Spin briefly (latency), then yield the core (ranks may share cores).
      if (++spins > 200)
        std::this_thread::sleep_for(std::chrono::microseconds(spins > 20000 ? 500 : 20));
    }
  }

  [[noreturn]] void timeout(Exchange& x, const char* op) {
    fail();
    std::string missing, unsent;
    for (const PendingRecv& r : x.pending) {
      const std::string name = std::to_string(r.peer);
      if (!r.posted && missing.find(" " + name + ",") == std::string::npos)
        missing += " " + name + ",";
    }
    // Receives not complete name the peers that sent nothing; sends not complete
    // (a message too large to leave before its receiver takes it) the peers that
    // took nothing, e.g. a rank stopped after sending its own data.
    for (size_t i = 0; i < x.reqs.size(); ++i) {
      if (x.peer[i] < 0) continue;
      int flag = 0;
      MPI_Request_get_status(x.reqs[i], &flag, MPI_STATUS_IGNORE);
      std::string& list = x.is_recv[i] ? missing : unsent;
      const std::string name = std::to_string(x.peer[i]);
      if (!flag && list.find(" " + name + ",") == std::string::npos) list += " " + name + ",";
    }
    if (!missing.empty()) missing.pop_back();
    if (!unsent.empty()) unsent.pop_back();
    FUSEDMOE_THROW(kIo, "MPI ", op, " (rank ", rank_, " of ", size_, "): timed out after ",
                   timeout_s_, " s (FUSEDMOE_COMM_TIMEOUT_S)",
                   missing.empty() ? std::string() : ", no data from rank(s)" + missing,
                   unsent.empty() ? std::string() : ", data to rank(s)" + unsent + " not taken",
                   ": a peer exited, crashed or stopped calling the collective");
  }

  MPI_Comm comm_;
  double timeout_s_;
  int rank_ = 0, size_ = 1;
  bool broken_ = false;
  std::vector<float> scratch_, reduced_;
  std::vector<bool> blocked_;
};

}  // namespace

bool mpi_built() {
  return true;
}

std::unique_ptr<Communicator> make_mpi_communicator() {
  return make_mpi_communicator(comm_timeout_seconds());
}

std::unique_ptr<Communicator> make_mpi_communicator(double timeout) {
  FUSEDMOE_CHECK(timeout > 0 && timeout <= kMaxCommTimeoutSeconds,
                 "make_mpi_communicator: timeout_s: expected seconds in (0, ",
                 kMaxCommTimeoutSeconds, "], got ", timeout);
  MpiRuntime::get().ensure();
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // Each rank tells every other one that it arrived (an empty message on the
  // world, sent just before the collective below): on a timeout, the ranks
  // whose message did not come are the ones that never started the creation.
  // Every message is received before this returns (one from each rank, per
  // creation), so none is left on the caller's MPI_COMM_WORLD (a receive of the
  // caller's own with MPI_ANY_TAG pending on it meanwhile could take one).
  std::vector<MPI_Request> hello_recv(static_cast<size_t>(size), MPI_REQUEST_NULL),
      hello_send(static_cast<size_t>(size), MPI_REQUEST_NULL);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    int rc = MPI_Irecv(nullptr, 0, MPI_BYTE, p, kTagHello, MPI_COMM_WORLD, &hello_recv[p]);
    if (rc == MPI_SUCCESS)
      rc = MPI_Isend(nullptr, 0, MPI_BYTE, p, kTagHello, MPI_COMM_WORLD, &hello_send[p]);
    if (rc != MPI_SUCCESS) {
      MpiRuntime::get().broken = true;
      FUSEDMOE_THROW(kIo, "MPI communicator creation (rank ", rank, " of ", size,
                     "): telling rank ", p, " of this one failed: ", mpi_error_string(rc));
    }
  }
  // A private copy of the world, so that our messages never meet the caller's.
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Comm_idup(MPI_COMM_WORLD, &comm, &req);
  if (rc != MPI_SUCCESS) FUSEDMOE_THROW(kIo, "MPI_Comm_idup failed: ", mpi_error_string(rc));
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(timeout));
  // Done when the copy exists and every rank's message has come (sent before
  // its part of the copy, it is on its way once the copy exists).
  for (bool done = false;;) {
    int flag = 0;
    if (req != MPI_REQUEST_NULL) {
      rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) FUSEDMOE_THROW(kIo, "MPI_Comm_idup failed: ", mpi_error_string(rc));
    }
    if (req == MPI_REQUEST_NULL) {
      rc = MPI_Testall(size, hello_recv.data(), &flag, MPI_STATUSES_IGNORE);
      if (rc == MPI_SUCCESS && flag)
        rc = MPI_Testall(size, hello_send.data(), &flag, MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS)
        FUSEDMOE_THROW(kIo, "MPI communicator creation (rank ", rank, " of ", size,
                       "): failed: ", mpi_error_string(rc));
      done = flag != 0;
    }
    if (done) break;
    if (clock::now() > deadline) {
      MpiRuntime::get().broken = true;
      // The ranks not heard from (a completed request is MPI_REQUEST_NULL).
      std::string missing;
      int count = 0;
      for (int p = 0; p < size; ++p) {
        if (hello_recv[p] == MPI_REQUEST_NULL) continue;
        int arrived = 0;
        MPI_Request_get_status(hello_recv[p], &arrived, MPI_STATUS_IGNORE);
        if (arrived) continue;
        missing += (missing.empty() ? "" : ", ") + std::to_string(p);
        ++count;
      }
      FUSEDMOE_THROW(kIo, "MPI communicator creation (rank ", rank, " of ", size,
                     "): timed out after ", timeout, " s (FUSEDMOE_COMM_TIMEOUT_S) ",
                     missing.empty()
                         ? std::string("waiting for the other ranks")
                         : std::string("waiting for rank") + (count > 1 ? "s " : " ") + missing +
                               ", which did not reach it (exited, crashed, "
                               "stopped, or still busy before it)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return std::make_unique<MpiCommunicator>(comm, timeout);
}

}  // namespace fusedmoe

#endif  // FUSEDMOE_WITH_MPI
