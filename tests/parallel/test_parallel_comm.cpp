// mpirun -np N: the MPI communicator's collectives against values every rank
// can compute locally (uneven and zero sizes, a message large enough for
// MPI's rendezvous protocol, sub-communicators).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "fusedmoe/parallel/communicator.h"
#include "parallel_test_util.h"
#include "test_util.h"

namespace fusedmoe {
namespace {

std::shared_ptr<Communicator> g_world;

// Byte b of the message from rank `from` to rank `to`.
uint8_t pattern(int from, int to, int64_t b, uint64_t salt) {
  return static_cast<uint8_t>((from * 131 + to * 17 + b * 7 + salt) & 0xff);
}

TEST(MpiCommunicator, RankAndSize) {
  EXPECT_EQ(g_world->backend(), "mpi");
  EXPECT_GE(g_world->size(), 2);
  EXPECT_GE(g_world->rank(), 0);
  EXPECT_LT(g_world->rank(), g_world->size());
}

TEST(MpiCommunicator, AllToAllVUnevenAndZeroSizes) {
  const int P = g_world->size(), me = g_world->rank();
  const uint64_t seed = test::shared_seed(*g_world);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // bytes[from][to], the same table on every rank; some zero, one large (rendezvous).
  std::vector<std::vector<int64_t>> bytes(P, std::vector<int64_t>(P));
  for (int f = 0; f < P; ++f)
    for (int t = 0; t < P; ++t) bytes[f][t] = rng() % 3 == 0 ? 0 : rng() % 5000;
  bytes[0][P - 1] = 3 << 20;
  for (int round = 0; round < 3; ++round) {
    std::vector<int64_t> sc(P), sd(P), rc(P), rd(P);
    int64_t so = 0, ro = 0;
    for (int p = 0; p < P; ++p) {
      sc[p] = bytes[me][p];
      sd[p] = so;
      so += sc[p] + 3;  // gaps between blocks
      rc[p] = bytes[p][me];
      rd[p] = ro;
      ro += rc[p] + 5;
    }
    std::vector<uint8_t> send(so), recv(ro, 0xee);
    for (int p = 0; p < P; ++p)
      for (int64_t b = 0; b < sc[p]; ++b) send[sd[p] + b] = pattern(me, p, b, round);
    g_world->all_to_all_v(send.data(), sc, sd, recv.data(), rc, rd);
    for (int p = 0; p < P; ++p) {
      int64_t bad = 0;
      for (int64_t b = 0; b < rc[p]; ++b) bad += recv[rd[p] + b] != pattern(p, me, b, round);
      EXPECT_EQ(bad, 0) << "from rank " << p;
      for (int64_t b = rd[p] + rc[p]; b < rd[p] + rc[p] + 5 && b < ro; ++b)
        EXPECT_EQ(recv[b], 0xee) << "written outside the block from rank " << p;
    }
  }
}

// Every rank gets the same error, naming the first entry that differs and the
// ranks of each value; the communicator is still usable afterwards.
TEST(MpiCommunicator, SameOnAllRanksNamesTheFirstDifference) {
  const int P = g_world->size(), me = g_world->rank();
  check_same_on_all_ranks(*g_world, {{"--tokens", "8"}, {"--seed", "7"}}, "run");
  auto expect_error = [&](const std::vector<std::pair<std::string, std::string>>& values,
                          const std::string& want) {
    try {
      check_same_on_all_ranks(*g_world, values, "run");
      ADD_FAILURE() << "no error, expected: " << want;
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), want);
    }
  };
  std::string others;  // "0,2,3" : every rank but 1
  for (int p = 0; p < P; ++p)
    if (p != 1) others += (others.empty() ? "" : ",") + std::to_string(p);
  const std::string on_others = (P > 2 ? " on ranks " : " on rank ") + others;
  expect_error(
      {{"--tokens", "8"}, {"--seed", me == 1 ? "9" : "7"}, {"--layer", std::to_string(me)}},
      "run: the ranks disagree on --seed: 7" + on_others +
          ", 9 on rank 1 (every rank must be given the same value)");
  // An entry only rank 1 has.
  std::vector<std::pair<std::string, std::string>> extra{{"--tokens", "8"}};
  if (me == 1) extra.emplace_back("--output", "");
  expect_error(extra, "run: the ranks disagree on --output: (not given)" + on_others +
                          ", \"\" on rank 1 (every rank must be given the same value)");
  const std::vector<int64_t> ranks = g_world->all_gather_int64(me);
  for (int p = 0; p < P; ++p) EXPECT_EQ(ranks[p], p);
}

// Strings of other lengths per rank (rank 1's empty), in rank order everywhere.
TEST(MpiCommunicator, AllGatherString) {
  const int me = g_world->rank(), P = g_world->size();
  const std::vector<std::string> all =
      g_world->all_gather_string(me == 1 ? std::string() : std::string(me + 2, 'a' + me));
  ASSERT_EQ(all.size(), static_cast<size_t>(P));
  for (int p = 0; p < P; ++p)
    EXPECT_EQ(all[p], p == 1 ? std::string() : std::string(p + 2, 'a' + p)) << "rank " << p;
}

// Broadcasts with other sizes per rank: an error on every rank, not a truncated
// or overrun buffer.
TEST(MpiCommunicator, BroadcastOfOtherSizesIsAnError) {
  const int me = g_world->rank();
  std::vector<char> buf(64, 'a');
  EXPECT_THROW(g_world->broadcast(buf.data(), me == 1 ? 64 : 32, 0), Error);
  int64_t x = me == 0 ? 42 : 0;
  g_world->broadcast(&x, sizeof x, 0);  // still usable
  EXPECT_EQ(x, 42);
}

TEST(MpiCommunicator, AllReduceSumIsExactAndIdenticalOnAllRanks) {
  const int P = g_world->size(), me = g_world->rank();
  const uint64_t seed = test::shared_seed(*g_world);
  std::mt19937_64 rng(seed + me);
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{P - 1}, int64_t{1000}, int64_t{300001}}) {
    // Small integers: exact sums, whatever the order.
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>((i * 3 + me * 11) % 97 - 40);
    g_world->all_reduce_sum(v.data(), n);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      float want = 0;
      for (int p = 0; p < P; ++p) want += static_cast<float>((i * 3 + p * 11) % 97 - 40);
      bad += v[i] != want;
    }
    EXPECT_EQ(bad, 0) << "n = " << n;
    // Random values: every rank ends with the same bits.
    std::vector<float> r(n);
    std::normal_distribution<float> d;
    for (auto& x : r) x = d(rng);
    g_world->all_reduce_sum(r.data(), n);
    std::vector<float> r0(r);
    g_world->broadcast(r0.data(), n * 4, 0);
    EXPECT_EQ(std::memcmp(r.data(), r0.data(), n * 4), 0) << "n = " << n;
  }
}

TEST(MpiCommunicator, AllGatherV) {
  const int P = g_world->size(), me = g_world->rank();
  std::vector<int64_t> counts(P), displs(P);
  int64_t total = 0;
  for (int p = 0; p < P; ++p) {
    counts[p] = p == 1 ? 0 : 100 * p + 7;
    displs[p] = total;
    total += counts[p];
  }
  std::vector<uint8_t> send(counts[me]), recv(total, 0);
  for (int64_t b = 0; b < counts[me]; ++b) send[b] = pattern(me, 0, b, 1);
  g_world->all_gather_v(send.data(), counts[me], recv.data(), counts, displs);
  for (int p = 0; p < P; ++p)
    for (int64_t b = 0; b < counts[p]; ++b)
      ASSERT_EQ(recv[displs[p] + b], pattern(p, 0, b, 1)) << "rank " << p << " byte " << b;
  const std::vector<int64_t> ranks = g_world->all_gather_int64(me * 10 + 3);
  for (int p = 0; p < P; ++p) EXPECT_EQ(ranks[p], p * 10 + 3);
}

TEST(MpiCommunicator, ReduceScatterSum) {
  const int P = g_world->size(), me = g_world->rank();
  std::vector<int64_t> counts(P);
  int64_t total = 0;
  for (int p = 0; p < P; ++p) total += counts[p] = p == 0 ? 0 : 5 * p + 1;
  std::vector<float> send(total);
  for (int64_t i = 0; i < total; ++i) send[i] = static_cast<float>(me * 1000 + i);
  std::vector<float> recv(std::max<int64_t>(counts[me], 1), -1.0f);
  g_world->reduce_scatter_sum(send.data(), recv.data(), counts);
  int64_t start = 0;
  for (int p = 0; p < me; ++p) start += counts[p];
  for (int64_t i = 0; i < counts[me]; ++i) {
    float want = 0;
    for (int p = 0; p < P; ++p) want += static_cast<float>(p * 1000 + start + i);
    EXPECT_EQ(recv[i], want) << "element " << i;
  }
}

TEST(MpiCommunicator, BroadcastFromEveryRootAndBarrier) {
  const int P = g_world->size(), me = g_world->rank();
  for (int root = 0; root < P; ++root) {
    std::vector<int32_t> v(777, me == root ? root + 100 : -1);
    g_world->broadcast(v.data(), v.size() * 4, root);
    EXPECT_EQ(std::count(v.begin(), v.end(), root + 100), 777) << "root " << root;
    g_world->barrier();
  }
}

TEST(MpiCommunicator, SplitAndParallelGroups) {
  const int P = g_world->size(), me = g_world->rank();
  auto sub = g_world->split(me % 2, me);
  EXPECT_EQ(sub->size(), (P + 1 - me % 2) / 2);
  EXPECT_EQ(sub->rank(), me / 2);
  std::vector<float> v{static_cast<float>(me)};
  sub->all_reduce_sum(v.data(), 1);
  float want = 0;
  for (int p = me % 2; p < P; p += 2) want += p;
  EXPECT_EQ(v[0], want);

  if (P % 2 == 0) {
    const ParallelGroups g = ParallelGroups::create(g_world, P / 2, 2, 1);
    EXPECT_EQ(g.config.tp_rank, me % 2);
    EXPECT_EQ(g.config.ep_rank, me / 2);
    EXPECT_EQ(g.tp->size(), 2);
    EXPECT_EQ(g.ep->size(), P / 2);
    EXPECT_EQ(g.ep->rank(), me / 2);
  }
  const ParallelGroups d = ParallelGroups::create(g_world, P, 1, P);
  EXPECT_EQ(d.config.dp_rank, me);
  EXPECT_EQ(d.config.ep_rank, me);
  EXPECT_THROW(ParallelGroups::create(g_world, P + 1, 1, 1), Error);
}

}  // namespace
}  // namespace fusedmoe

int main(int argc, char** argv) {
  return fusedmoe::test::run_mpi_tests(argc, argv, fusedmoe::g_world);
}
