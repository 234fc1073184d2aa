// CUDA align / permute: invariants of the expert-contiguous padded layout
// (offsets multiples of block_m and just large enough, every routed slot
// exactly once in its expert's rows, padding -1, ids outside [0, E) skipped,
// slot_row the inverse of sorted_slot; the chunks kernels: slot order within
// each expert).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cuda_test_util.h"

namespace fusedmoe {
namespace {

using test::DeviceTensor;

// stable: each expert's rows must hold its slots in ascending order (the
// chunks kernels).
void check_align(int64_t T, int64_t E, int64_t k, int block_m, std::mt19937_64& rng,
                 bool stable = false) {
  SCOPED_TRACE("T " + std::to_string(T) + " E " + std::to_string(E) + " k " + std::to_string(k) +
               " block_m " + std::to_string(block_m));
  const int64_t n = T * k;
  Tensor ids_h = Tensor::empty(DType::kI32, {T, k});
  int32_t* idh = ids_h.data_as<int32_t>();
  for (int64_t i = 0; i < n; ++i) {  // ~10% "no expert" (-1), ~1% out of range
    const uint64_t r = rng() % 100;
    idh[i] = r < 10    ? -1
             : r == 10 ? static_cast<int32_t>(E + rng() % 3)
                       : static_cast<int32_t>(rng() % E);
  }
  const int64_t max_rows = cuda::max_padded_rows(n, E, block_m);
  DeviceTensor ids = DeviceTensor::from_host(ids_h);
  DeviceTensor offsets(DType::kI64, {E + 1}), sorted(DType::kI32, {std::max<int64_t>(max_rows, 1)});
  DeviceTensor counts(DType::kI32, {E}), cursor(DType::kI32, {E}),
      chunk_counts(DType::kI32, {cuda::align_chunk_counts_size(n, E)}),
      slot_row(DType::kI32, {std::max<int64_t>(n, 1)}),
      zero_words(DType::kI32, {cuda::kAlignMaxZeroWords + 1});
  zero_words.poison();
  offsets.poison();
  sorted.poison();
  counts.poison();
  chunk_counts.poison();
  slot_row.poison();
  const int32_t poison = slot_row.to_host().data_as<int32_t>()[0];
  cuda::AlignArgs a;
  a.topk_ids = ids.data_as<int32_t>();
  a.num_slots = n;
  a.num_experts = E;
  a.block_m = block_m;
  a.expert_offsets = offsets.data_as<int64_t>();
  a.sorted_slot = sorted.data_as<int32_t>();
  a.slot_row = slot_row.data_as<int32_t>();
  a.expert_counts = counts.data_as<int32_t>();
  a.expert_cursor = cursor.data_as<int32_t>();
  a.chunk_counts = chunk_counts.data_as<int32_t>();
  // The words align zeroes (the GEMMs' work counters); the one after them kept.
  a.zero_words = zero_words.data_as<int32_t>();
  a.num_zero_words = cuda::kAlignMaxZeroWords;
  cuda::align(a, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor zero_h = zero_words.to_host();
  for (int i = 0; i < cuda::kAlignMaxZeroWords; ++i)
    ASSERT_EQ(zero_h.data_as<int32_t>()[i], 0) << "zero_words[" << i << "]";
  ASSERT_EQ(zero_h.data_as<int32_t>()[cuda::kAlignMaxZeroWords], -1) << "past zero_words";
  const Tensor off_h = offsets.to_host(), sorted_h = sorted.to_host(), row_h = slot_row.to_host();
  const int64_t* off = off_h.data_as<int64_t>();
  const int32_t* s = sorted_h.data_as<int32_t>();
  const int32_t* row = row_h.data_as<int32_t>();
  auto routed = [&](int64_t i) { return idh[i] >= 0 && idh[i] < E; };
  std::vector<int64_t> cnt(E, 0);
  for (int64_t i = 0; i < n; ++i)
    if (routed(i)) ++cnt[idh[i]];
  ASSERT_EQ(off[0], 0);
  std::vector<int> seen(static_cast<size_t>(n), 0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    ASSERT_EQ(rows, (cnt[e] + block_m - 1) / block_m * block_m) << "expert " << e;
    ASSERT_LE(off[e + 1], max_rows);
    int64_t valid = 0;
    int32_t last = -1;
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      const int32_t slot = s[r];
      if (slot < 0) {
        ASSERT_EQ(slot, -1) << "row " << r;
        continue;
      }
      ASSERT_LT(slot, n);
      ASSERT_EQ(idh[slot], e) << "row " << r << " slot " << slot;
      ASSERT_EQ(row[slot], r) << "slot_row of slot " << slot;
      if (stable) ASSERT_GT(slot, last) << "row " << r << " of expert " << e << ": not slot order";
      last = slot;
      ++seen[slot];
      ++valid;
    }
    ASSERT_EQ(valid, cnt[e]) << "expert " << e;
  }
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(seen[i], routed(i) ? 1 : 0) << "slot " << i;
    if (!routed(i)) ASSERT_EQ(row[i], poison) << "slot_row written for unrouted slot " << i;
  }
}

TEST(CudaAlign, PaddedExpertContiguousLayout) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // The picked kernels (one block up to 4096 slots, beyond it the chunks),
  // then each forced (FUSEDMOE_CUDA_ALIGN).
  for (const char* mode : {"", "fused", "chunks", "grid"}) {
    SCOPED_TRACE(std::string("FUSEDMOE_CUDA_ALIGN=") + mode);
    setenv("FUSEDMOE_CUDA_ALIGN", mode, 1);
    const bool chunks = std::string(mode) == "chunks";
    for (int64_t T : {0, 1, 3, 17, 130, 1000, 1500, 4096})
      for (int64_t E : {8, 10, 60, 128, 256})
        for (int64_t k : {1, 2, 8})
          for (int bm : {1, 16, 64, 128}) {
            check_align(T, E, k, bm, rng, chunks);
            if (HasFailure()) {
              unsetenv("FUSEDMOE_CUDA_ALIGN");
              return;
            }
          }
    // Chunks of more than the least slots (up to 32 chunks), E at the chunks'
    // limit, and beyond it (the grid kernels; histogram beyond shared memory).
    check_align(20000, 256, 8, 1, rng, chunks);
    check_align(9000, 1024, 6, 16, rng, chunks);
    check_align(3000, 5000, 4, 16, rng);
  }
  unsetenv("FUSEDMOE_CUDA_ALIGN");
}

TEST(CudaAlign, UnknownKernelChoiceIsAnError) {
  FUSEDMOE_REQUIRE_CUDA();
  DeviceTensor ids(DType::kI32, {4}), offsets(DType::kI64, {9}), sorted(DType::kI32, {64}),
      counts(DType::kI32, {8}), cursor(DType::kI32, {8});
  cuda::AlignArgs a;
  a.topk_ids = ids.data_as<int32_t>();
  a.num_slots = 4;
  a.num_experts = 8;
  a.expert_offsets = offsets.data_as<int64_t>();
  a.sorted_slot = sorted.data_as<int32_t>();
  a.expert_counts = counts.data_as<int32_t>();
  a.expert_cursor = cursor.data_as<int32_t>();
  setenv("FUSEDMOE_CUDA_ALIGN", "blocks", 1);
  try {
    cuda::align(a, nullptr);
    ADD_FAILURE() << "FUSEDMOE_CUDA_ALIGN=blocks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "FUSEDMOE_CUDA_ALIGN: expected fused, chunks or grid, got 'blocks'"),
              std::string::npos)
        << e.what();
  }
  unsetenv("FUSEDMOE_CUDA_ALIGN");
}

}  // namespace
}  // namespace fusedmoe
