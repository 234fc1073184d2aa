// fusedmoe: the NCCL communicator (parallel/communicator.h, "NCCL").
//
// Non-blocking NCCL (ncclConfig_t.blocking = 0, NCCL >= 2.14): every NCCL call
// may return ncclInProgress, and completion is observed by polling
// ncclCommGetAsyncError and cudaStreamQuery against a deadline, so a peer that
// never calls turns into Error(kIo) after FUSEDMOE_COMM_TIMEOUT_S seconds
// instead of a hang (NCCL user guide, "Fault tolerance" / "Non-blocking
// communicators"). Each collective is enqueued on the communicator's own stream
// and waited for before returning (host-synchronous).
#ifdef FUSEDMOE_WITH_NCCL

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "fusedmoe/core/error.h"
#include "fusedmoe/parallel/communicator.h"

namespace fusedmoe {

namespace {

using Clock = std::chrono::steady_clock;

std::string nccl_message(ncclComm_t comm, ncclResult_t r) {
  std::string m = ncclGetErrorString(r);
  const char* last = comm ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
  if (last && *last) m += std::string(" (") + last + ")";
  return m;
}

void cuda_or_throw(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    FUSEDMOE_THROW(kIo, "NCCL communicator: ", what, ": ", cudaGetErrorName(e), " (",
                   cudaGetErrorString(e), ")");
}

// Makes `device` current for a scope; restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_or_throw(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) cuda_or_throw(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

ncclConfig_t nonblocking_config() {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  c.blocking = 0;
  return c;
}

// Polls a communicator until its pending NCCL call (init, split, group) is
// done. Returns ncclSuccess, an error, or ncclInProgress on timeout.
ncclResult_t poll_ready(ncclComm_t comm, Clock::time_point deadline) {
  for (int spin = 0;; ++spin) {
    ncclResult_t st = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &st);
    if (r != ncclSuccess) return r;
    if (st != ncclInProgress) return st;
    if (Clock::now() > deadline) return ncclInProgress;
    if (spin > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

Clock::time_point deadline_in(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

class NcclCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (already initialised, on `device`).
  NcclCommunicator(ncclComm_t comm, int device, double timeout_s,
                   std::shared_ptr<Communicator> bootstrap)
      : comm_(comm), device_(device), timeout_s_(timeout_s), bootstrap_(std::move(bootstrap)) {
    DeviceGuard g(device_);
    ncclResult_t r = ncclCommUserRank(comm_, &rank_);
    if (r == ncclSuccess) r = ncclCommCount(comm_, &size_);
    if (r != ncclSuccess) {
      ncclCommAbort(comm_);
      FUSEDMOE_THROW(kIo, "NCCL communicator: rank / size query failed: ", nccl_message(comm_, r));
    }
    const cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    if (e == cudaSuccess) {
      const cudaError_t e2 = cudaMalloc(&scratch_, sizeof(float));
      if (e2 != cudaSuccess) {
        cudaStreamDestroy(stream_);
        ncclCommAbort(comm_);
        cuda_or_throw(e2, "cudaMalloc (barrier scratch)");
      }
    } else {
      ncclCommAbort(comm_);
      cuda_or_throw(e, "cudaStreamCreate");
    }
  }
  ~NcclCommunicator() override {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    if (!broken_) {
      // Orderly: finalize (non-blocking, polled with the deadline), then destroy.
      ncclResult_t r = ncclCommFinalize(comm_);
      if (r == ncclSuccess || r == ncclInProgress) r = poll_ready(comm_, deadline_in(timeout_s_));
      if (r == ncclSuccess)
        ncclCommDestroy(comm_);
      else
        ncclCommAbort(comm_);
    }
    if (scratch_) cudaFree(scratch_);
    if (stream_) cudaStreamDestroy(stream_);
    cudaSetDevice(prev);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  bool device_buffers() const override { return true; }

  void all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                    std::span<const int64_t> send_displs, void* recv,
                    std::span<const int64_t> recv_counts,
                    std::span<const int64_t> recv_displs) override {
    const char* op = "all_to_all_v";
    DeviceGuard g(device_);
    start(op);
    check_span(op, send_counts.size(), "send_counts");
    check_span(op, send_displs.size(), "send_displs");
    check_span(op, recv_counts.size(), "recv_counts");
    check_span(op, recv_displs.size(), "recv_displs");
    int64_t send_total = 0, recv_total = 0;
    for (int p = 0; p < size_; ++p) {
      check_count(op, "send_counts", p, send_counts[p]);
      check_count(op, "recv_counts", p, recv_counts[p]);
      send_total += send_counts[p];
      recv_total += recv_counts[p];
    }
    if (send_total > 0) check_device_pointer(op, "send", send);
    if (recv_total > 0) check_device_pointer(op, "recv", recv);
    FUSEDMOE_CHECK(send_counts[rank_] == recv_counts[rank_], op, ": recv_counts[", rank_,
                   "] = ", recv_counts[rank_], " but this rank sends itself ", send_counts[rank_],
                   " bytes");
    exchange(op, static_cast<const char*>(send), send_counts, send_displs, static_cast<char*>(recv),
             recv_counts, recv_displs);
  }

  void all_reduce_sum(float* data, int64_t count) override {
    const char* op = "all_reduce_sum";
    DeviceGuard g(device_);
    start(op);
    FUSEDMOE_CHECK(count >= 0, op, ": count: expected >= 0, got ", count);
    if (count == 0) return;
    check_device_pointer(op, "data", data);
    group(op, [&] {
      return ncclAllReduce(data, data, static_cast<size_t>(count), ncclFloat32, ncclSum, comm_,
                           stream_);
    });
    wait(op);
  }

  void all_gather_v(const void* send, int64_t send_bytes, void* recv,
                    std::span<const int64_t> recv_counts,
                    std::span<const int64_t> recv_displs) override {
    const char* op = "all_gather_v";
    DeviceGuard g(device_);
    start(op);
    check_span(op, recv_counts.size(), "recv_counts");
    check_span(op, recv_displs.size(), "recv_displs");
    check_count(op, "send_bytes", rank_, send_bytes);
    int64_t recv_total = 0;
    for (int p = 0; p < size_; ++p) {
      check_count(op, "recv_counts", p, recv_counts[p]);
      recv_total += recv_counts[p];
    }
    FUSEDMOE_CHECK(recv_counts[rank_] == send_bytes, op, ": recv_counts[", rank_,
                   "] = ", recv_counts[rank_], " but this rank sends ", send_bytes, " bytes");
    if (send_bytes > 0) check_device_pointer(op, "send", send);
    if (recv_total > 0) check_device_pointer(op, "recv", recv);
    // Every peer gets the same bytes: an all-to-all whose sends all start at 0.
    const std::vector<int64_t> send_counts(static_cast<size_t>(size_), send_bytes);
    const std::vector<int64_t> send_displs(static_cast<size_t>(size_), 0);
    exchange(op, static_cast<const char*>(send), send_counts, send_displs, static_cast<char*>(recv),
             recv_counts, recv_displs);
  }

  void reduce_scatter_sum(const float* send, float* recv,
                          std::span<const int64_t> recv_counts) override {
    const char* op = "reduce_scatter_sum";
    DeviceGuard g(device_);
    start(op);
    check_span(op, recv_counts.size(), "recv_counts");
    int64_t total = 0;
    for (int p = 0; p < size_; ++p) {
      check_count(op, "recv_counts", p, recv_counts[p]);
      total += recv_counts[p];
    }
    if (total > 0) check_device_pointer(op, "send", send);
    if (recv_counts[rank_] > 0) check_device_pointer(op, "recv", recv);
    // Block p (recv_counts[p] floats at its prefix offset) is reduced to rank p.
    group(op, [&] {
      int64_t off = 0;
      for (int p = 0; p < size_; ++p) {
        if (recv_counts[p] > 0)
          // recvbuff is written on the root only; elsewhere a valid pointer of the size.
          if (ncclResult_t r = ncclReduce(
                  send + off, p == rank_ ? recv : const_cast<float*>(send + off),
                  static_cast<size_t>(recv_counts[p]), ncclFloat32, ncclSum, p, comm_, stream_);
              r != ncclSuccess && r != ncclInProgress)
            return r;
        off += recv_counts[p];
      }
      return ncclSuccess;
    });
    wait(op);
  }

  void broadcast(void* data, int64_t bytes, int root) override {
    const char* op = "broadcast";
    DeviceGuard g(device_);
    start(op);
    FUSEDMOE_CHECK(root >= 0 && root < size_, op, ": root: expected in [0, ", size_, "), got ",
                   root);
    check_count(op, "bytes", rank_, bytes);
    if (bytes == 0) return;
    check_device_pointer(op, "data", data);
    group(op, [&] {
      return ncclBroadcast(data, data, static_cast<size_t>(bytes), ncclInt8, root, comm_, stream_);
    });
    wait(op);
  }

  void barrier() override {
    const char* op = "barrier";
    DeviceGuard g(device_);
    start(op);
    group(op, [&] {
      return ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_);
    });
    wait(op);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    const char* op = "split";
    DeviceGuard g(device_);
    start(op);
    FUSEDMOE_CHECK(color >= 0, op, ": color: expected >= 0, got ", color);
    ncclConfig_t cfg = nonblocking_config();
    ncclComm_t child = nullptr;
    ncclResult_t r = ncclCommSplit(comm_, color, key, &child, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) fail(op, r);
    r = poll_ready(comm_, deadline_in(timeout_s_));
    if (r == ncclInProgress) timeout(op);
    if (r != ncclSuccess) fail(op, r);
    if (child) {
      r = poll_ready(child, deadline_in(timeout_s_));
      if (r != ncclSuccess) {
        ncclCommAbort(child);
        if (r == ncclInProgress) timeout(op);
        fail(op, r);
      }
    }
    FUSEDMOE_CHECK(child != nullptr, op, ": ncclCommSplit returned no communicator for color ",
                   color);
    return std::make_unique<NcclCommunicator>(child, device_, timeout_s_, bootstrap_);
  }

  [[noreturn]] void abort(int code) override {
    if (!broken_) {
      broken_ = true;
      ncclCommAbort(comm_);
    }
    if (bootstrap_ && bootstrap_->size() > 1) bootstrap_->abort(code);
    std::exit(code);
  }

 private:
  void start(const char* op) const {
    if (broken_)
      FUSEDMOE_THROW(kIo, op, ": the NCCL communicator is broken by an earlier error (rank ", rank_,
                     " of ", size_, ")");
  }
  void check_span(const char* op, size_t n, const char* name) const {
    FUSEDMOE_CHECK(static_cast<int>(n) == size_, op, ": ", name, ": expected ", size_,
                   " entries (one per rank), got ", n);
  }
  static void check_count(const char* op, const char* name, int p, int64_t v) {
    FUSEDMOE_CHECK(v >= 0, op, ": ", name, "[", p, "]: expected >= 0 bytes, got ", v);
  }
  void check_device_pointer(const char* op, const char* name, const void* ptr) const {
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, ptr);
    if (e != cudaSuccess) cudaGetLastError();
    const bool device_memory =
        e == cudaSuccess && (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged);
    FUSEDMOE_CHECK(ptr != nullptr && device_memory, op, ": ", name,
                   ": expected device memory (the NCCL communicator on CUDA device ", device_,
                   "), got ", ptr == nullptr ? "a null pointer" : "host memory");
    FUSEDMOE_CHECK(a.type == cudaMemoryTypeManaged || a.device == device_, op, ": ", name,
                   ": expected memory of CUDA device ", device_, ", got device ", a.device);
  }
  void enqueue_cuda(const char* op, cudaError_t e) {
    if (e == cudaSuccess) return;
    broken_ = true;
    ncclCommAbort(comm_);
    FUSEDMOE_THROW(kIo, op, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e),
                   ") on NCCL rank ", rank_, " of ", size_, "; the communicator was aborted");
  }
  // The byte exchange of all_to_all_v and all_gather_v (arguments checked by
  // them): this rank's own part by a device copy (none when in place), every
  // peer's by one grouped ncclSend / ncclRecv pair; waits for completion.
  void exchange(const char* op, const char* s, std::span<const int64_t> send_counts,
                std::span<const int64_t> send_displs, char* d, std::span<const int64_t> recv_counts,
                std::span<const int64_t> recv_displs) {
    if (send_counts[rank_] > 0 && d + recv_displs[rank_] != s + send_displs[rank_])
      enqueue_cuda(op, cudaMemcpyAsync(d + recv_displs[rank_], s + send_displs[rank_],
                                       send_counts[rank_], cudaMemcpyDeviceToDevice, stream_));
    group(op, [&] {
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        if (send_counts[p] > 0)
          if (ncclResult_t r = ncclSend(s + send_displs[p], static_cast<size_t>(send_counts[p]),
                                        ncclInt8, p, comm_, stream_);
              r != ncclSuccess && r != ncclInProgress)
            return r;
        if (recv_counts[p] > 0)
          if (ncclResult_t r = ncclRecv(d + recv_displs[p], static_cast<size_t>(recv_counts[p]),
                                        ncclInt8, p, comm_, stream_);
              r != ncclSuccess && r != ncclInProgress)
            return r;
      }
      return ncclSuccess;
    });
    wait(op);
  }
  // ncclGroupStart; body (the NCCL calls); ncclGroupEnd; poll until launched.
  template <typename Body>
  void group(const char* op, Body&& body) {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) fail(op, r);
    const ncclResult_t rb = body();
    r = ncclGroupEnd();
    if (rb != ncclSuccess) fail(op, rb);
    if (r != ncclSuccess && r != ncclInProgress) fail(op, r);
    r = poll_ready(comm_, deadline_in(timeout_s_));
    if (r == ncclInProgress) timeout(op);
    if (r != ncclSuccess) fail(op, r);
  }
  // Polls the stream (and NCCL's asynchronous error) until the work is done.
  void wait(const char* op) {
    const Clock::time_point deadline = deadline_in(timeout_s_);
    for (int spin = 0;; ++spin) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) enqueue_cuda(op, e);
      ncclResult_t st = ncclSuccess;
      ncclCommGetAsyncError(comm_, &st);
      if (st != ncclSuccess && st != ncclInProgress) fail(op, st);
      if (Clock::now() > deadline) timeout(op);
      if (spin > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  [[noreturn]] void fail(const char* op, ncclResult_t r) {
    const std::string msg = nccl_message(comm_, r);
    broken_ = true;
    ncclCommAbort(comm_);
    FUSEDMOE_THROW(kIo, op, ": NCCL error on rank ", rank_, " of ", size_, ": ", msg,
                   "; the communicator was aborted");
  }
  [[noreturn]] void timeout(const char* op) {
    broken_ = true;
    ncclCommAbort(comm_);
    FUSEDMOE_THROW(kIo, op, ": timed out after ", timeout_s_,
                   " s (FUSEDMOE_COMM_TIMEOUT_S) on NCCL rank ", rank_, " of ", size_,
                   ": a peer did not take part (exited, crashed or called another operation); "
                   "the communicator was aborted");
  }

  ncclComm_t comm_ = nullptr;
  int device_ = 0;
  double timeout_s_ = 60;
  std::shared_ptr<Communicator> bootstrap_;
  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  float* scratch_ = nullptr;
  bool broken_ = false;
};

void check_device(int device) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    n = 0;
  }
  FUSEDMOE_CHECK(device >= 0 && device < n, "device: expected a CUDA device in [0, ", n, "), got ",
                 device);
}

// Waits for a non-blocking init; aborts and throws on error or timeout.
void finish_init(ncclComm_t comm, const char* op, int rank, int nranks, double timeout_s,
                 Clock::time_point deadline) {
  const ncclResult_t r = poll_ready(comm, deadline);
  if (r == ncclSuccess) return;
  const std::string msg = nccl_message(comm, r);
  ncclCommAbort(comm);
  if (r == ncclInProgress)
    FUSEDMOE_THROW(kIo, op, ": timed out after ", timeout_s,
                   " s (FUSEDMOE_COMM_TIMEOUT_S) creating NCCL rank ", rank, " of ", nranks,
                   ": not every rank joined; the communicator was aborted");
  FUSEDMOE_THROW(kIo, op, ": NCCL error creating rank ", rank, " of ", nranks, ": ", msg);
}

}  // namespace

bool nccl_built() {
  return true;
}

namespace {

ncclUniqueId new_unique_id() {
  ncclUniqueId id{};
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) FUSEDMOE_THROW(kIo, "ncclGetUniqueId: ", nccl_message(nullptr, r));
  return id;
}

// Rank `rank` of `size` on `device` joined by `id` (bootstrap: kept for
// abort(), may be null).
std::unique_ptr<Communicator> init_rank(const ncclUniqueId& id, int rank, int size, int device,
                                        std::shared_ptr<Communicator> bootstrap) {
  const char* op = "ncclCommInitRankConfig";
  const double timeout_s = comm_timeout_seconds();
  DeviceGuard g(device);
  ncclConfig_t cfg = nonblocking_config();
  ncclComm_t comm = nullptr;
  const Clock::time_point deadline = deadline_in(timeout_s);
  const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm) ncclCommAbort(comm);
    FUSEDMOE_THROW(kIo, op, ": NCCL error creating rank ", rank, " of ", size, ": ",
                   nccl_message(nullptr, r));
  }
  finish_init(comm, op, rank, size, timeout_s, deadline);
  return std::make_unique<NcclCommunicator>(comm, device, timeout_s, std::move(bootstrap));
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap,
                                                     int device) {
  FUSEDMOE_CHECK(bootstrap != nullptr, "make_nccl_communicator: bootstrap communicator is null");
  FUSEDMOE_CHECK(!bootstrap->device_buffers(),
                 "make_nccl_communicator: the bootstrap must be a host communicator (single or "
                 "MPI), got ",
                 bootstrap->backend());
  check_device(device);
  comm_timeout_seconds();  // a bad FUSEDMOE_COMM_TIMEOUT_S throws before the broadcast
  ncclUniqueId id{};
  if (bootstrap->rank() == 0) id = new_unique_id();
  bootstrap->broadcast(&id, sizeof(id), 0);
  const int rank = bootstrap->rank(), size = bootstrap->size();
  return init_rank(id, rank, size, device, std::move(bootstrap));
}

std::vector<uint8_t> nccl_unique_id() {
  static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes);
  const ncclUniqueId id = new_unique_id();
  const auto* p = reinterpret_cast<const uint8_t*>(&id);
  return std::vector<uint8_t>(p, p + sizeof(id));
}

std::unique_ptr<Communicator> make_nccl_communicator(std::span<const uint8_t> unique_id, int rank,
                                                     int size, int device) {
  FUSEDMOE_CHECK(static_cast<int64_t>(unique_id.size()) == kNcclUniqueIdBytes,
                 "unique_id: expected the ", kNcclUniqueIdBytes, " bytes of nccl_unique_id(), got ",
                 unique_id.size());
  FUSEDMOE_CHECK(size >= 1, "size: expected >= 1 ranks, got ", size);
  FUSEDMOE_CHECK(rank >= 0 && rank < size, "rank: expected 0..", size - 1, " (size ", size,
                 "), got ", rank);
  check_device(device);
  ncclUniqueId id{};
  std::memcpy(&id, unique_id.data(), sizeof(id));
  return init_rank(id, rank, size, device, nullptr);
}

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(std::span<const int> devices) {
  const char* op = "ncclCommInitRankConfig (one process)";
  const int n = static_cast<int>(devices.size());
  FUSEDMOE_CHECK(n >= 1, "devices: expected at least one device, got none");
  for (int i = 0; i < n; ++i) {
    check_device(devices[i]);
    for (int j = 0; j < i; ++j)
      FUSEDMOE_CHECK(devices[i] != devices[j], "devices: expected distinct devices (NCCL allows ",
                     "one rank per GPU), got device ", devices[i], " twice");
  }
  const double timeout_s = comm_timeout_seconds();
  ncclUniqueId id{};
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
    FUSEDMOE_THROW(kIo, "ncclGetUniqueId: ", nccl_message(nullptr, r));
  std::vector<ncclComm_t> comms(n, nullptr);
  const Clock::time_point deadline = deadline_in(timeout_s);
  {
    int prev = 0;
    cuda_or_throw(cudaGetDevice(&prev), "cudaGetDevice");
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < n && (r == ncclSuccess || r == ncclInProgress); ++i) {
      cuda_or_throw(cudaSetDevice(devices[i]), "cudaSetDevice");
      ncclConfig_t cfg = nonblocking_config();
      r = ncclCommInitRankConfig(&comms[i], n, id, i, &cfg);
    }
    const ncclResult_t re = ncclGroupEnd();
    cudaSetDevice(prev);
    if ((r != ncclSuccess && r != ncclInProgress) || (re != ncclSuccess && re != ncclInProgress)) {
      for (ncclComm_t c : comms)
        if (c) ncclCommAbort(c);
      FUSEDMOE_THROW(kIo, op, ": NCCL error: ",
                     nccl_message(nullptr, r != ncclSuccess && r != ncclInProgress ? r : re));
    }
  }
  for (int i = 0; i < n; ++i) {
    try {
      DeviceGuard g(devices[i]);
      finish_init(comms[i], op, i, n, timeout_s, deadline);
    } catch (...) {
      for (int j = i + 1; j < n; ++j) ncclCommAbort(comms[j]);
      for (int j = 0; j < i; ++j) ncclCommAbort(comms[j]);
      throw;
    }
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (int i = 0; i < n; ++i)
    out.push_back(std::make_unique<NcclCommunicator>(comms[i], devices[i], timeout_s, nullptr));
  return out;
}

}  // namespace fusedmoe

#endif  // FUSEDMOE_WITH_NCCL
