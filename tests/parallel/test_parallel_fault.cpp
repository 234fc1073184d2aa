// mpirun -np N test_parallel_fault MODE: the last rank leaves after one good
// collective; the others must fail with a clear error within
// FUSEDMOE_COMM_TIMEOUT_S, never hang. Run by fault.sh, which checks the exit
// status, the message and the time.
//   MODE exit:  the last rank exits without MPI_Finalize;
//   MODE stuck: the last rank stops calling collectives (sleeps).
//   MODE mismatch: every rank is there, but they disagree on the sizes of an
//     all_gather_v (rank r sends 8192 (r + 1) bytes and expects as much from
//     every rank): every rank must fail with an error naming both sizes, and
//     nothing may be written past the receive buffer (Open MPI's single-copy
//     transport writes a truncated message past the end).
//   MODE late: the last rank stops (sleeps) before a second communicator's
//     creation; the others must time out there with an error naming it
//     ("waiting for rank P-1, which did not arrive").
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "fusedmoe/core/error.h"
#include "fusedmoe/parallel/communicator.h"

int main(int argc, char** argv) {
  using namespace fusedmoe;
  const bool stuck = argc > 1 && std::strcmp(argv[1], "stuck") == 0;
  const bool mismatch = argc > 1 && std::strcmp(argv[1], "mismatch") == 0;
  const bool late = argc > 1 && std::strcmp(argv[1], "late") == 0;
  auto world = make_mpi_communicator();
  const int P = world->size(), me = world->rank();
  std::vector<float> v(1024, 1.0f);
  world->all_reduce_sum(v.data(), v.size());  // everybody is there
  if (v[0] != static_cast<float>(P)) {
    std::fprintf(stderr, "rank %d: first all_reduce_sum gave %g, expected %d\n", me, v[0], P);
    return 2;
  }
  if (late) {
    if (me == P - 1) {
      std::fprintf(stderr, "rank %d: not creating the second communicator (late)\n", me);
      std::fflush(stderr);
      std::this_thread::sleep_for(std::chrono::seconds(600));
      _exit(0);
    }
    try {
      auto second = make_mpi_communicator();
      std::fprintf(stderr, "rank %d: the second communicator was created without rank %d\n", me,
                   P - 1);
      return 1;
    } catch (const Error& e) {
      std::fprintf(stderr, "rank %d: fusedmoe::Error: %s\n", me, e.what());
      std::fflush(stderr);
      _exit(3);
    }
  }
  if (mismatch) {
    const int64_t n = 8192 * (me + 1), guard = 8192 * (P + 1);
    std::vector<int64_t> counts(P, n), displs(P);
    for (int p = 0; p < P; ++p) displs[p] = n * p;
    std::vector<char> send(n, 'x'), recv(n * P + guard, 'g');
    try {
      world->all_gather_v(send.data(), n, recv.data(), counts, displs);
      std::fprintf(stderr, "rank %d: all_gather_v with mismatched sizes succeeded\n", me);
      return 1;
    } catch (const Error& e) {
      std::fprintf(stderr, "rank %d: fusedmoe::Error: %s\n", me, e.what());
    }
    for (int64_t b = n * P; b < n * P + guard; ++b)
      if (recv[b] != 'g') {
        std::fprintf(stderr, "rank %d: written past the receive buffer at byte %lld\n", me,
                     static_cast<long long>(b - n * P));
        _exit(4);
      }
    std::fflush(stderr);
    // Time for every rank to report before mpirun ends the job on this exit.
    std::this_thread::sleep_for(std::chrono::seconds(1));
    _exit(3);
  }
  if (me == P - 1) {
    std::fprintf(stderr, "rank %d: leaving early (%s)\n", me, stuck ? "stuck" : "exit");
    std::fflush(stderr);
    if (stuck) std::this_thread::sleep_for(std::chrono::seconds(600));
    _exit(0);
  }
  try {
    std::vector<int64_t> counts(P, 64), displs(P);
    for (int p = 0; p < P; ++p) displs[p] = 64 * p;
    std::vector<char> send(64 * P, 'x'), recv(64 * P);
    for (int round = 0; round < 3; ++round) {
      world->all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs);
      world->all_reduce_sum(v.data(), v.size());
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "rank %d: fusedmoe::Error: %s\n", me, e.what());
    std::fflush(stderr);
    _exit(3);
  }
  std::fprintf(stderr, "rank %d: collectives succeeded without the last rank\n", me);
  return 1;
}
