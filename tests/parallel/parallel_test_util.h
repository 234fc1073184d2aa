// Helpers of the parallel tests (single-rank unit tests and mpirun tests):
// random expert layers, random routings, the single-rank routed result.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "fusedmoe/core/thread_pool.h"
#include "fusedmoe/kernels/modular_kernel.h"
#include "fusedmoe/parallel/communicator.h"
#include "fusedmoe/parallel/distributed_experts.h"
#include "random_layer.h"
#include "test_util.h"

namespace fusedmoe::test {

// main() of the mpirun gtest programs: `world` over MPI_COMM_WORLD, the ranks
// share the machine's cores, the tests run, and the communicator is released
// before MPI finalizes.
inline int run_mpi_tests(int argc, char** argv, std::shared_ptr<Communicator>& world) {
  ::testing::InitGoogleTest(&argc, argv);
  world = make_mpi_communicator();
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  ThreadPool::set_global_num_threads(std::max(1, cores / world->size()));
  const int rc = RUN_ALL_TESTS();
  world.reset();
  return rc;
}

// topk_ids i32 [T, k]: k distinct experts per token, each slot -1 with
// probability p_none; topk_weights f32 [T, k] in [0.05, 1).
inline void random_routing(std::mt19937_64& rng, int64_t T, int64_t k, int64_t E, double p_none,
                           Tensor& ids, Tensor& weights) {
  ids = Tensor::empty(DType::kI32, {T, k});
  weights = random_f32(rng, {T, k}, 0.05f, 1.0f);
  std::vector<int32_t> perm(E);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) perm[e] = static_cast<int32_t>(e);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < k; ++j)
      ids.data_as<int32_t>()[t * k + j] = u(rng) < p_none ? -1 : perm[j];
  }
}

// The single-rank routed output with all experts: f32 [T, H].
inline Tensor single_rank_routed(const TensorView& hidden, const TensorView& ids,
                                 const TensorView& weights, const ExpertWeights& experts,
                                 const ExpertsParams& params, bool on_input) {
  const int64_t T = hidden.size(0), H = hidden.size(1);
  Tensor out = Tensor::empty(DType::kF32, {T, H});
  auto kernel = make_cpu_modular_kernel();
  Workspace ws;
  kernel->forward(hidden, ids, weights, experts, params, on_input, out.view(), ws);
  return out;
}

// The same seed on every rank of `world` (rank 0's fresh seed).
inline uint64_t shared_seed(Communicator& world) {
  uint64_t seed = world.rank() == 0 ? fresh_seed() : 0;
  world.broadcast(&seed, sizeof(seed), 0);
  return seed;
}

// Rows [row0, row0 + rows) of a contiguous 2-d tensor, as a view.
inline TensorView rows_of(const Tensor& t, int64_t row0, int64_t rows) {
  return t.view().narrow(0, row0, rows);
}

// True when a and b (f32, same shape, rows contiguous) have identical bits.
inline bool bit_identical(const TensorView& a, const TensorView& b) {
  if (a.size(0) != b.size(0) || a.size(1) != b.size(1)) return false;
  for (int64_t r = 0; r < a.size(0); ++r)
    if (std::memcmp(a.data_as<const float>() + r * a.stride(0),
                    b.data_as<const float>() + r * b.stride(0), a.size(1) * sizeof(float)) != 0)
      return false;
  return true;
}

}  // namespace fusedmoe::test
