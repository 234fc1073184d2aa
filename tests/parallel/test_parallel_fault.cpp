// mpirun -np N test_parallel_fault MODE: the last rank leaves after one good
// collective; the others must fail with a clear error within
// FUSEDMOE_COMM_TIMEOUT_S, never hang. Run by fault.sh, which checks the exit
// status, the message and the time.
//   MODE exit:  the last rank exits without MPI_Finalize;
//   MODE stuck: the last rank stops calling collectives (sleeps).
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
  auto world = make_mpi_communicator();
  const int P = world->size(), me = world->rank();
  std::vector<float> v(1024, 1.0f);
  world->all_reduce_sum(v.data(), v.size());  // everybody is there
  if (v[0] != static_cast<float>(P)) {
    std::fprintf(stderr, "rank %d: first all_reduce_sum gave %g, expected %d\n", me, v[0], P);
    return 2;
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
