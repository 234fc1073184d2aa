// fusedmoe: communicators — the collectives that spread one MoE layer over ranks.
//
// A Communicator is a group of `size()` ranks that call the same collectives
// in the same order (MPI's model). Implementations:
//   - single rank (always available): every collective is a local copy;
//   - MPI (builds that found MPI: FUSEDMOE_WITH_MPI): CPU ranks started by
//     `mpirun`; created over MPI_COMM_WORLD by make_mpi_communicator();
//   - NCCL (builds that found NCCL: FUSEDMOE_WITH_NCCL): GPU ranks, one
//     device each; buffers are device memory (see "NCCL" below).
//
// Failures never hang: every MPI operation is non-blocking and polled with a
// deadline of FUSEDMOE_COMM_TIMEOUT_S seconds (default 60, read when the
// communicator is created). A peer that exits, crashes or stops calling the
// collective makes the others throw Error(kIo) within that time, naming the
// operation (and, for all_to_all_v, the ranks still missing); MPI errors are
// returned (MPI_ERRORS_RETURN), not fatal, and become Error(kIo) with MPI's
// message. After such an error the communicator is broken: every later call
// throws, and the process should end (abort() stops the other ranks too).
//
// Buffers are host memory for the CPU implementations and device memory of
// the communicator's GPU for NCCL (device_buffers()). Byte counts and
// displacements are int64; all collectives are in place-safe only where said.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fusedmoe/config/moe_config.h"

namespace fusedmoe {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "single", "mpi" or "nccl".
  virtual std::string backend() const = 0;
  // True when the buffers of every collective are device memory (NCCL), false
  // for host memory (single rank, MPI).
  virtual bool device_buffers() const { return false; }

  // All-to-all with per-peer sizes, in bytes: rank p sends
  // send[send_displs[p], + send_counts[p]) to each peer p, and receives into
  // recv[recv_displs[p], + recv_counts[p]) what peer p sent it. All spans have
  // size() entries (Error(kInvalidArgument) otherwise); recv_counts[p] must
  // equal what p sends: Error(kIo) for a peer's mismatch found on the wire,
  // Error(kInvalidArgument) for this rank's own count (and on one rank).
  // Zero counts are fine. send and recv must not overlap.
  virtual void all_to_all_v(const void* send, std::span<const int64_t> send_counts,
                            std::span<const int64_t> send_displs, void* recv,
                            std::span<const int64_t> recv_counts,
                            std::span<const int64_t> recv_displs) = 0;

  // In place: data[0, count) = sum over ranks of each rank's data (f32).
  virtual void all_reduce_sum(float* data, int64_t count) = 0;

  // Every rank contributes `send_bytes` bytes (may differ per rank); recv gets
  // rank p's contribution at recv_displs[p] with recv_counts[p] == p's send_bytes.
  virtual void all_gather_v(const void* send, int64_t send_bytes, void* recv,
                            std::span<const int64_t> recv_counts,
                            std::span<const int64_t> recv_displs) = 0;

  // send: f32 [sum(recv_counts)] = rank 0's block, rank 1's block, ...; rank p
  // receives recv[0, recv_counts[p]) = sum over ranks of their block p.
  // send and recv must not overlap.
  virtual void reduce_scatter_sum(const float* send, float* recv,
                                  std::span<const int64_t> recv_counts) = 0;

  // data[0, bytes) of rank `root` is copied to every rank.
  virtual void broadcast(void* data, int64_t bytes, int root) = 0;

  virtual void barrier() = 0;

  // New communicator over the ranks that pass the same `color`, ordered by
  // (key, rank). Collective over this communicator.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // Ends the whole job (all ranks of the world) with `code`: MPI_Abort for
  // MPI; std::exit for a single rank. Used after an Error in a multi-rank run,
  // so that the other ranks do not wait for their timeout.
  [[noreturn]] virtual void abort(int code) = 0;

  // Convenience: all_gather_v of one int64 per rank (e.g. token counts).
  std::vector<int64_t> all_gather_int64(int64_t value);
  // Convenience: every rank's string, in rank order (two all_gather_v).
  std::vector<std::string> all_gather_string(const std::string& value);
};

// The one-rank communicator (rank 0 of 1).
std::unique_ptr<Communicator> make_single_rank_communicator();

// True when this build has the MPI communicator (FUSEDMOE_WITH_MPI).
bool mpi_built();
// True when the process looks started by mpirun/srun (OMPI_COMM_WORLD_SIZE,
// PMI_SIZE or PMIX_RANK in the environment). Does not initialize MPI.
bool launched_by_mpi();
// The number of ranks the launcher started, from its environment
// (OMPI_COMM_WORLD_SIZE for Open MPI, PMI_SIZE for MPICH / Intel MPI,
// SLURM_STEP_NUM_TASKS for srun with PMIx), or -1 when not launched by MPI or
// the launcher does not say. Does not initialize MPI.
int launcher_world_size();
// A communicator over MPI_COMM_WORLD; initializes MPI on first use
// (MPI_THREAD_SERIALIZED; finalized at exit unless a communicator broke).
// Its deadline is comm_timeout_seconds() (which throws for a bad
// FUSEDMOE_COMM_TIMEOUT_S, before MPI starts), or `timeout_s` given: seconds
// in (0, kMaxCommTimeoutSeconds], else Error(kInvalidArgument) (so that a rank
// whose variable is bad can still join the others' first collective and tell
// them, with the default deadline). A creation that a rank does not join
// within the deadline throws Error(kIo) naming the ranks that did not reach it
// (each rank sends every other an empty message on MPI_COMM_WORLD first).
// Throws Error(kUnsupported) when the build has no MPI.
std::unique_ptr<Communicator> make_mpi_communicator();
std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s);
// make_mpi_communicator() when launched_by_mpi(), else a single rank.
std::unique_ptr<Communicator> make_world_communicator();

// ---- NCCL (GPU ranks) ----------------------------------------------------------
//
// One rank per GPU. All buffers are device memory of the communicator's
// device (checked: a host pointer is Error(kInvalidArgument)); counts and
// displacements are host spans as above. all_to_all_v, all_gather_v are
// grouped ncclSend/ncclRecv (the copy to itself is a device memcpy);
// all_reduce_sum is ncclAllReduce; reduce_scatter_sum with per-rank sizes is
// one grouped ncclReduce per rank; broadcast is ncclBroadcast; barrier an
// all-reduce of one float; split is ncclCommSplit; abort is ncclCommAbort
// followed by the bootstrap's abort (MPI_Abort ends the job) or std::exit.
//
// Stream semantics: each collective is enqueued on the communicator's own
// stream (created on its device) and the call returns when it has completed
// — synchronous with respect to the host, like the MPI communicator. It does
// not wait for other streams: the caller makes sure the input is written
// (synchronises the stream that produced it) before calling, and may use the
// output as soon as the call returns. Why: the Communicator interface is
// host-synchronous for every backend, so the EP code above it is one code
// path; and a deadline can only be enforced by a host that waits. The price
// is one host round trip per collective (the GPU EP path needs the counts on
// the host anyway, so it is not graph-capturable).
//
// Failures never hang: communicators are created non-blocking
// (ncclConfig_t.blocking = 0); every wait (initialisation, split, group
// launch, stream completion) polls ncclCommGetAsyncError and the stream with
// the deadline comm_timeout_seconds(). On timeout or NCCL error the
// communicator is aborted (ncclCommAbort) and Error(kIo) names the
// operation, the rank and NCCL's message; every later call throws.
// A communicator is used by one host thread at a time; each call makes its
// device current and restores the caller's.

// True when this build has the NCCL communicator (FUSEDMOE_WITH_NCCL).
bool nccl_built();
// Rank bootstrap->rank() of bootstrap->size() on CUDA device `device`:
// rank 0 creates the ncclUniqueId and bootstrap->broadcast()s it (host memory;
// collective over bootstrap, e.g. the MPI world or a single rank). The
// bootstrap is kept for abort(). Throws Error(kUnsupported) without NCCL,
// Error(kInvalidArgument) for a device out of range, Error(kIo) on NCCL
// errors or when the other ranks do not join within the deadline.
std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap,
                                                     int device);
// For ranks that exchange the NCCL id themselves (e.g. Python processes over
// torch.distributed): one rank calls nccl_unique_id() (the bytes of a fresh
// ncclUniqueId, kNcclUniqueIdBytes of them), hands them to every rank, and
// each calls make_nccl_communicator(id, rank, size, device) — collective, as
// above. abort() aborts NCCL and std::exit()s this process only (the others
// see the broken communicator and fail within the deadline). Throws
// Error(kInvalidArgument) for an id of another size, size < 1 or rank outside
// [0, size); otherwise as above.
inline constexpr int64_t kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
std::vector<uint8_t> nccl_unique_id();
std::unique_ptr<Communicator> make_nccl_communicator(std::span<const uint8_t> unique_id, int rank,
                                                     int size, int device);
// One process, several GPUs: rank i on devices[i] (distinct), created together
// (ncclGroupStart / ncclCommInitRankConfig per device / ncclGroupEnd, which is
// ncclCommInitAll with a non-blocking config). Collectives must then be called
// from one host thread per rank, concurrently. Throws as above.
std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(std::span<const int> devices);

// Seconds from FUSEDMOE_COMM_TIMEOUT_S (default 60). Throws
// Error(kInvalidArgument) for a value that is not a number in
// (0, kMaxCommTimeoutSeconds].
inline constexpr double kMaxCommTimeoutSeconds = 1e9;     // ~31 years: fits the clocks' int64 ns
inline constexpr double kDefaultCommTimeoutSeconds = 60;  // FUSEDMOE_COMM_TIMEOUT_S unset
double comm_timeout_seconds();

// Checks that every rank of `comm` passed the same (name, value) list:
// collective (two all_gather_v). Throws Error(kInvalidArgument) on every rank,
// with the same message, naming the first name whose values differ and each
// value with its ranks: "<context>: the ranks disagree on <name>: 8 on rank 0,
// 16 on rank 1 (...)". Call it before any collective whose sizes depend on
// these values: a size mismatch there is an error at best.
void check_same_on_all_ranks(Communicator& comm,
                             const std::vector<std::pair<std::string, std::string>>& values,
                             const std::string& context);

// ---- the groups of one parallel layout --------------------------------------
//
// World ranks of one MoE layer, tp_size consecutive ranks per TP group:
//   dp_size == 1: world = ep_size * tp_size, rank = ep_rank * tp_size + tp_rank
//   dp_size  > 1: world = dp_size * tp_size, rank = dp_rank * tp_size + tp_rank,
//                 ep_size is 1 (experts replicated) or dp_size (experts spread
//                 over the DP group: vLLM's naive DP+EP path).
// The EP group (all-to-all dispatch/combine) and the DP group (all-gather /
// reduce-scatter) are the ranks with the same tp_rank; the TP group (one
// all-reduce) the ranks with the same ep_rank / dp_rank.
struct ParallelGroups {
  ParallelConfig config;                // sizes and this rank's ranks
  std::shared_ptr<Communicator> world;  // all ranks of the layout
  std::shared_ptr<Communicator> ep;     // size ep_size (dp_size == 1) or dp_size
  std::shared_ptr<Communicator> tp;     // size tp_size

  // Splits `world` (collective). Throws Error(kInvalidArgument) when the sizes
  // are not positive, dp_size > 1 with ep_size not in {1, dp_size}, or
  // world->size() does not match the layout above.
  static ParallelGroups create(std::shared_ptr<Communicator> world, int ep_size, int tp_size,
                               int dp_size);
  // One rank, all sizes 1.
  static ParallelGroups single();
};

// The ranks of world rank `rank` in the layout above (sizes copied in).
ParallelConfig parallel_config_for_rank(int rank, int ep_size, int tp_size, int dp_size);

}  // namespace fusedmoe
