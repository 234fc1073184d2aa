// The NCCL communicator and expert parallelism on GPUs (MoERunner, CUDA backend,
// a device-buffer communicator):
//   - every collective against expected values on a one-rank NCCL communicator,
//     and on every visible GPU (one process, one thread per rank) when >= 2;
//   - a timeout: rank 0 of a two-rank communicator whose rank 1 never joins
//     fails with Error(kIo) within the deadline;
//   - the EP layer through NCCL at ep_size 1, and through an in-process
//     device-buffer communicator at ep_size 2..4 on one GPU (threads as ranks:
//     it exercises the same dispatch / combine kernels), and through NCCL at
//     ep_size = device_count when >= 2: outputs bit-identical to one GPU on
//     all ranks' tokens given the same router logits (<= 1e-6 relative with
//     each rank's own gate GEMM) (random layers with E not a multiple of ep_size,
//     uneven T, T = 0 on some ranks, k up to 8; HF fixtures).
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_test_util.h"
#include "expect_error.h"
#include "fixtures.h"
#include "fusedmoe/io/hf_config.h"
#include "fusedmoe/io/loader.h"
#include "fusedmoe/parallel/communicator.h"

namespace fusedmoe {
namespace {

using test::DeviceTensor;

// Expects Error(code) from expr with `needle` in its message.
#define FUSEDMOE_EXPECT_ERROR(expr, code, needle) \
  EXPECT_HAS(test::error_of([&] { (void)(expr); }, ErrorCode::code), needle)

#define FUSEDMOE_REQUIRE_NCCL()                                                        \
  do {                                                                                 \
    FUSEDMOE_REQUIRE_CUDA();                                                           \
    if (!nccl_built()) GTEST_SKIP() << "skipped: this build has no NCCL communicator"; \
  } while (0)

// Runs fn(rank) on one thread per rank; rethrows the first exception.
void run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  // Every rank's error: the first rank's is often only the timeout that a
  // peer's failure caused.
  std::string all;
  for (int r = 0; r < n; ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      all += (all.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " + e.what();
    } catch (...) {
      all += (all.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": unknown";
    }
  }
  if (!all.empty()) throw std::runtime_error(all);
}

std::shared_ptr<Communicator> one_rank_nccl() {
  return std::shared_ptr<Communicator>(
      make_nccl_communicator(std::shared_ptr<Communicator>(make_single_rank_communicator()), 0));
}

// GPUs 0 .. n - 1.
std::vector<int> first_gpus(int n) {
  std::vector<int> devices(n);
  for (int i = 0; i < n; ++i) devices[i] = i;
  return devices;
}

// One process's ranks, a thread each, one NCCL rank a GPU of `devices` (one
// device: one NCCL rank on GPU 0). Made together and destroyed together: each
// rank's finalize may wait for its peers'.
struct GpuRanks {
  std::vector<int> devices;
  std::vector<std::shared_ptr<Communicator>> comms;

  explicit GpuRanks(std::vector<int> devs) : devices(std::move(devs)) {
    if (devices.size() == 1) {
      comms.push_back(one_rank_nccl());
    } else {
      for (auto& c : make_nccl_communicators(devices)) comms.push_back(std::move(c));
    }
  }
  GpuRanks(const GpuRanks&) = delete;
  GpuRanks& operator=(const GpuRanks&) = delete;
  ~GpuRanks() {
    run_ranks(static_cast<int>(comms.size()), [&](int r) { comms[r].reset(); });
  }
};

// One rank a GPU over the first min(4, visible) GPUs, or one NCCL rank on GPU 0.
GpuRanks up_to_four_gpus() {
  return GpuRanks(first_gpus(std::max(1, std::min(cuda::device_count(), 4))));
}

// Rank r of P's layer config: `c` with rank r's parallel config (contiguous experts).
MoEConfig rank_config(const MoEConfig& c, int r, int P) {
  MoEConfig cr = c;
  cr.parallel = parallel_config_for_rank(r, P, 1, 1);
  return cr;
}

template <typename T>
DeviceTensor upload_vec(const std::vector<T>& v, DType dtype) {
  DeviceTensor d(dtype, {static_cast<int64_t>(v.size())});
  test::cuda_ok(cudaMemcpy(d.data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
                "upload");
  return d;
}
template <typename T>
std::vector<T> download_vec(const DeviceTensor& d, size_t n) {
  std::vector<T> v(n);
  test::cuda_ok(cudaMemcpy(v.data(), d.data(), n * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return v;
}

// ---- every collective, checked on rank r of P --------------------------------
// Values are small integers in f32, so sums are exact in any order.
void check_collectives(Communicator& c) {
  const int P = c.size(), r = c.rank();
  SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(P));
  EXPECT_EQ(c.backend(), "nccl");
  EXPECT_TRUE(c.device_buffers());
  // all_to_all_v: rank r sends (r + p + 1) int32 values r*1000 + p*10 + i to p.
  {
    std::vector<int64_t> sc(P), sd(P), rc(P), rd(P);
    std::vector<int32_t> send;
    int64_t off = 0, roff = 0;
    for (int p = 0; p < P; ++p) {
      sd[p] = off * 4;
      sc[p] = (r + p + 1) * 4;
      for (int i = 0; i < r + p + 1; ++i) send.push_back(r * 1000 + p * 10 + i);
      off += r + p + 1;
      rd[p] = roff * 4;
      rc[p] = (p + r + 1) * 4;
      roff += p + r + 1;
    }
    DeviceTensor s = upload_vec(send, DType::kI32), d(DType::kI32, {roff});
    d.poison();
    c.all_to_all_v(s.data(), sc, sd, d.data(), rc, rd);
    const std::vector<int32_t> got = download_vec<int32_t>(d, roff);
    for (int p = 0, k = 0; p < P; ++p)
      for (int i = 0; i < p + r + 1; ++i, ++k)
        ASSERT_EQ(got[k], p * 1000 + r * 10 + i) << "all_to_all_v from " << p << " item " << i;
  }
  // all_reduce_sum: element i = sum_p (p + 1) * (i + 1).
  {
    const int64_t n = 1000;
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>((r + 1) * (i + 1));
    DeviceTensor d = upload_vec(v, DType::kF32);
    c.all_reduce_sum(d.data_as<float>(), n);
    const std::vector<float> got = download_vec<float>(d, n);
    const float ranks = static_cast<float>(P * (P + 1) / 2);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], ranks * (i + 1)) << "all_reduce_sum " << i;
  }
  // all_gather_v: rank p contributes 3p + 1 bytes of value p + 7 (rank 0: 1 byte).
  {
    std::vector<int64_t> rc(P), rd(P);
    int64_t tot = 0;
    for (int p = 0; p < P; ++p) {
      rd[p] = tot;
      rc[p] = 3 * p + 1;
      tot += rc[p];
    }
    std::vector<uint8_t> mine(3 * r + 1, static_cast<uint8_t>(r + 7));
    DeviceTensor s = upload_vec(mine, DType::kU8), d(DType::kU8, {tot});
    d.poison();
    c.all_gather_v(s.data(), 3 * r + 1, d.data(), rc, rd);
    const std::vector<uint8_t> got = download_vec<uint8_t>(d, tot);
    for (int p = 0; p < P; ++p)
      for (int64_t i = 0; i < rc[p]; ++i)
        ASSERT_EQ(got[rd[p] + i], p + 7) << "all_gather_v from " << p;
  }
  // reduce_scatter_sum: block p has p + 2 floats; rank q's block p value (q + 1) * (i + p).
  {
    std::vector<int64_t> rc(P);
    std::vector<float> send;
    for (int p = 0; p < P; ++p) {
      rc[p] = p + 2;
      for (int i = 0; i < p + 2; ++i) send.push_back(static_cast<float>((r + 1) * (i + p)));
    }
    DeviceTensor s = upload_vec(send, DType::kF32), d(DType::kF32, {r + 2});
    d.poison();
    c.reduce_scatter_sum(s.data_as<float>(), d.data_as<float>(), rc);
    const std::vector<float> got = download_vec<float>(d, r + 2);
    const float ranks = static_cast<float>(P * (P + 1) / 2);
    for (int i = 0; i < r + 2; ++i)
      ASSERT_EQ(got[i], ranks * (i + r)) << "reduce_scatter_sum " << i;
  }
  // broadcast from the last rank.
  {
    const int root = P - 1;
    std::vector<int32_t> v(77);
    for (int i = 0; i < 77; ++i) v[i] = r == root ? 5 * i + 3 : -i;
    DeviceTensor d = upload_vec(v, DType::kI32);
    c.broadcast(d.data(), 77 * 4, root);
    const std::vector<int32_t> got = download_vec<int32_t>(d, 77);
    for (int i = 0; i < 77; ++i) ASSERT_EQ(got[i], 5 * i + 3) << "broadcast " << i;
  }
  c.barrier();
  // split: even / odd ranks, reversed order by key.
  {
    std::unique_ptr<Communicator> sub = c.split(r % 2, P - r);
    const int n = (P - r % 2 + 1) / 2;
    EXPECT_EQ(sub->size(), n);
    // Ranks of one color ordered by key = P - r: the highest world rank is rank 0.
    int expect = 0;
    for (int q = r + 2; q < P; q += 2) ++expect;
    EXPECT_EQ(sub->rank(), expect);
    std::vector<float> one{static_cast<float>(r)};
    DeviceTensor d = upload_vec(one, DType::kF32);
    sub->all_reduce_sum(d.data_as<float>(), 1);
    float want = 0;
    for (int q = r % 2; q < P; q += 2) want += static_cast<float>(q);
    EXPECT_EQ(download_vec<float>(d, 1)[0], want) << "all_reduce_sum over the split";
  }
  // Host memory is a clear error, not a crash.
  {
    std::vector<float> host(4, 1.0f);
    FUSEDMOE_EXPECT_ERROR(c.all_reduce_sum(host.data(), 4), kInvalidArgument, "device memory");
  }
}

// The nccl transport runs its local experts on the mma.sync kernels at every T
// (its combine sends rows by slot), so the one-GPU reference is pinned to the
// same kernels: outputs stay bit-identical. The peer transport's sm90 path
// (expert-sorted rows into its combine) has tests of its own (Sm90Experts).
class MmaExpertsEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { setenv("FUSEDMOE_CUDA_EXPERTS", "mma", 1); }
};
[[maybe_unused]] ::testing::Environment* const kMmaExperts =
    ::testing::AddGlobalTestEnvironment(new MmaExpertsEnvironment);

TEST(NcclCommunicator, OneRankCollectives) {
  FUSEDMOE_REQUIRE_NCCL();
  std::unique_ptr<Communicator> c =
      make_nccl_communicator(std::shared_ptr<Communicator>(make_single_rank_communicator()), 0);
  ASSERT_EQ(c->size(), 1);
  ASSERT_EQ(c->rank(), 0);
  check_collectives(*c);
  // Bad sizes name the argument.
  std::vector<int64_t> two{0, 0};
  FUSEDMOE_EXPECT_ERROR(c->all_to_all_v(nullptr, two, two, nullptr, two, two), kInvalidArgument,
                        "send_counts");
  FUSEDMOE_EXPECT_ERROR(
      make_nccl_communicator(std::shared_ptr<Communicator>(make_single_rank_communicator()), 9999),
      kInvalidArgument, "device");
}

TEST(NcclCommunicator, EveryVisibleGpuOneProcess) {
  FUSEDMOE_REQUIRE_NCCL();
  const int n = cuda::device_count();
  if (n < 2) GTEST_SKIP() << "skipped: needs >= 2 CUDA devices, found " << n;
  const GpuRanks ranks(first_gpus(n));
  ASSERT_EQ(static_cast<int>(ranks.comms.size()), n);
  run_ranks(n, [&](int r) {
    test::cuda_ok(cudaSetDevice(r), "cudaSetDevice");
    check_collectives(*ranks.comms[r]);
  });
}

// Ranks joined by one nccl_unique_id() handed to each (as Python processes do
// over torch.distributed): one thread a rank over the first min(4, visible)
// GPUs; the id's size and the rank are checked first.
TEST(NcclCommunicator, RanksJoinedByAUniqueId) {
  FUSEDMOE_REQUIRE_NCCL();
  const std::vector<uint8_t> id = nccl_unique_id();
  ASSERT_EQ(static_cast<int64_t>(id.size()), kNcclUniqueIdBytes);
  FUSEDMOE_EXPECT_ERROR(make_nccl_communicator(std::span<const uint8_t>(id).first(100), 0, 1, 0),
                        kInvalidArgument, "unique_id: expected the 128 bytes");
  FUSEDMOE_EXPECT_ERROR(make_nccl_communicator(id, 2, 2, 0), kInvalidArgument,
                        "rank: expected 0..1 (size 2), got 2");
  const int n = std::max(1, std::min(cuda::device_count(), 4));
  std::vector<std::unique_ptr<Communicator>> comms(n);
  run_ranks(n, [&](int r) {
    comms[r] = make_nccl_communicator(id, r, n, r);
    EXPECT_EQ(comms[r]->rank(), r);
    EXPECT_EQ(comms[r]->size(), n);
    test::cuda_ok(cudaSetDevice(r), "cudaSetDevice");
    check_collectives(*comms[r]);
  });
  run_ranks(n, [&](int r) { comms[r].reset(); });
}

// A bootstrap that claims to be rank 0 of 2 but has no peer: rank 1 never joins.
class LonelyBootstrap final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string backend() const override { return "lonely"; }
  void all_to_all_v(const void*, std::span<const int64_t>, std::span<const int64_t>, void*,
                    std::span<const int64_t>, std::span<const int64_t>) override {
    FUSEDMOE_THROW(kUnsupported, "lonely bootstrap: broadcast only");
  }
  void all_reduce_sum(float*, int64_t) override {
    FUSEDMOE_THROW(kUnsupported, "lonely bootstrap: broadcast only");
  }
  void all_gather_v(const void*, int64_t, void*, std::span<const int64_t>,
                    std::span<const int64_t>) override {
    FUSEDMOE_THROW(kUnsupported, "lonely bootstrap: broadcast only");
  }
  void reduce_scatter_sum(const float*, float*, std::span<const int64_t>) override {
    FUSEDMOE_THROW(kUnsupported, "lonely bootstrap: broadcast only");
  }
  void broadcast(void*, int64_t, int) override {}  // rank 0 is the root: nothing to receive
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int) override {
    FUSEDMOE_THROW(kUnsupported, "lonely bootstrap: broadcast only");
  }
  [[noreturn]] void abort(int code) override { std::exit(code); }
};

TEST(NcclCommunicator, MissingRankTimesOutWithError) {
  FUSEDMOE_REQUIRE_NCCL();
  const char* old = std::getenv("FUSEDMOE_COMM_TIMEOUT_S");
  const std::string saved = old ? old : "";
  setenv("FUSEDMOE_COMM_TIMEOUT_S", "3", 1);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    make_nccl_communicator(std::make_shared<LonelyBootstrap>(), 0);
    ADD_FAILURE() << "a two-rank NCCL communicator was created with one rank";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo) << e.what();
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("ncclCommInitRankConfig"), std::string::npos) << e.what();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 30.0) << "the deadline of 3 s was not kept";
  if (old)
    setenv("FUSEDMOE_COMM_TIMEOUT_S", saved.c_str(), 1);
  else
    unsetenv("FUSEDMOE_COMM_TIMEOUT_S");
}

// ---- an in-process device-buffer communicator: P threads on one GPU ---------------
// all_to_all_v / all_gather_v by device-to-device copies after a rendezvous.
// Only what the EP path uses (and all_gather_v) is implemented; it exercises
// the GPU dispatch / combine at ep_size > 1 on a single GPU, where NCCL allows
// one rank per device.
class ThreadGroup {
 public:
  explicit ThreadGroup(int n) : n_(n), posts_(n) {}
  int size() const { return n_; }
  struct Post {
    const char* send = nullptr;
    std::vector<int64_t> counts, displs;
  };
  void arrive() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = gen_;
    if (++waiting_ == n_) {
      waiting_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return gen_ != gen; }))
      FUSEDMOE_THROW(kIo, "thread group: a rank did not arrive within 60 s");
  }
  std::vector<Post>& posts() { return posts_; }

 private:
  int n_;
  std::vector<Post> posts_;
  std::mutex mu_;
  std::condition_variable cv_;
  int waiting_ = 0;
  uint64_t gen_ = 0;
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<ThreadGroup> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size(); }
  std::string backend() const override { return "threads"; }
  bool device_buffers() const override { return true; }
  void all_to_all_v(const void* send, std::span<const int64_t> sc, std::span<const int64_t> sd,
                    void* recv, std::span<const int64_t> rc, std::span<const int64_t> rd) override {
    const int P = size();
    g_->posts()[rank_] = {
        static_cast<const char*>(send), {sc.begin(), sc.end()}, {sd.begin(), sd.end()}};
    g_->arrive();
    for (int p = 0; p < P; ++p) {
      const ThreadGroup::Post& q = g_->posts()[p];
      FUSEDMOE_CHECK(q.counts[rank_] == rc[p], "threads all_to_all_v: rank ", p, " sends ",
                     q.counts[rank_], " bytes, rank ", rank_, " expects ", rc[p]);
      if (rc[p] > 0)
        test::cuda_ok(cudaMemcpy(static_cast<char*>(recv) + rd[p], q.send + q.displs[rank_], rc[p],
                                 cudaMemcpyDeviceToDevice),
                      "threads all_to_all_v copy");
    }
    g_->arrive();  // senders keep their buffers until every rank has copied
  }
  void all_gather_v(const void* send, int64_t bytes, void* recv, std::span<const int64_t> rc,
                    std::span<const int64_t> rd) override {
    const int P = size();
    std::vector<int64_t> sc(P, bytes), sd(P, 0);
    all_to_all_v(send, sc, sd, recv, rc, rd);
  }
  void all_reduce_sum(float*, int64_t) override {
    FUSEDMOE_THROW(kUnsupported, "threads communicator: all_to_all_v / all_gather_v only");
  }
  void reduce_scatter_sum(const float*, float*, std::span<const int64_t>) override {
    FUSEDMOE_THROW(kUnsupported, "threads communicator: all_to_all_v / all_gather_v only");
  }
  void broadcast(void*, int64_t, int) override {
    FUSEDMOE_THROW(kUnsupported, "threads communicator: all_to_all_v / all_gather_v only");
  }
  void barrier() override { g_->arrive(); }
  std::unique_ptr<Communicator> split(int, int) override {
    FUSEDMOE_THROW(kUnsupported, "threads communicator: all_to_all_v / all_gather_v only");
  }
  [[noreturn]] void abort(int code) override { std::exit(code); }

 private:
  std::shared_ptr<ThreadGroup> g_;
  int rank_;
};

RunnerOptions cuda_options(int64_t max_tokens) {
  RunnerOptions o;
  o.compute_dtype = DType::kBF16;
  o.device = Device{DeviceType::kCUDA, 0};
  o.max_num_tokens = max_tokens;
  return o;
}

// A rank's runner options for GPU expert parallelism: its GPU and communicator.
RunnerOptions ep_rank_options(int64_t max_tokens, int device, std::shared_ptr<Communicator> comm) {
  RunnerOptions o = cuda_options(max_tokens);
  o.device = Device{DeviceType::kCUDA, device};
  o.communicator = std::move(comm);
  return o;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Rows [r0, r0 + n) of a host [T, C] tensor (contiguous copy).
Tensor rows_of(const Tensor& t, int64_t r0, int64_t n) {
  const int64_t C = t.view().size(1);
  Tensor out = Tensor::empty(t.dtype(), {n, C});
  if (n > 0)
    std::memcpy(out.data(), static_cast<const char*>(t.data()) + r0 * C * dtype_size(t.dtype()),
                n * C * dtype_size(t.dtype()));
  return out;
}

// One EP case: ranks r = 0..P-1 bring tokens[r] tokens each; their concatenation
// runs on one GPU (MoERunner without communicator) and must give bit-identical
// outputs and topk ids. comms[r] is rank r's device-buffer communicator on
// devices[r]; passes the whole layer (the runner keeps its experts).
// With `logits` the router logits are given (else each rank's gate GEMM).
// tolerance > 0: the output within that relative L2 of one GPU's instead of
// bit-identical (the peer transport: each rank sums a token's slots it holds
// before sending one row back, so f32 sums in another order, ~1e-7; ranks of
// different T: its experts pick tiles for ep_size * max_tokens_per_rank rows,
// one GPU for the sum of T, so bf16 rounding, 1e-2). transport: the one every
// rank's EpStats must name, or null. payloads: the EP ranks' dispatch /
// combine payloads; with quantized_reference, one GPU runs on the hidden
// states the fp8 records carry (bf16, quantised in 1 x 128 groups with the
// CPU's quantize_fp8_groups, dequantised): what the experts see.
struct EpPayloads {
  DispatchDType dispatch = DispatchDType::kAuto;
  DType combine = DType::kF32;
  bool quantized_reference = false;
};
Tensor fp8_roundtrip(const Tensor& x) {
  const int64_t T = x.size(0), H = x.size(1), G = (H + 127) / 128;
  const Tensor xb = to_f32(test::to_bf16(x));
  std::vector<uint8_t> q(T * H);
  std::vector<float> scales(T * G);
  quantize_fp8_groups(xb.data_as<float>(), T, H, H, 128, q.data(), scales.data());
  Tensor out = Tensor::empty(DType::kF32, {T, H});
  dequantize_fp8_groups(q.data(), scales.data(), T, H, 128, out.data_as<float>(), H);
  return out;
}
void check_ep(const MoEConfig& base, const MoELayerWeights& w, const std::vector<int64_t>& tokens,
              std::vector<std::shared_ptr<Communicator>> comms, const std::vector<int>& devices,
              ExpertPlacement placement, std::mt19937_64& rng, bool give_logits,
              double tolerance = 0, const char* transport = nullptr,
              const EpPayloads& payloads = {}) {
  const int P = static_cast<int>(tokens.size());
  const int64_t H = base.hidden_size, k = base.top_k, L = base.num_router_logits();
  std::string trace = "ep_size " + std::to_string(P) + " T";
  for (int64_t t : tokens) trace += " " + std::to_string(t);
  trace += std::string(" ") + to_string(placement) + " E " + std::to_string(base.num_experts) +
           " k " + std::to_string(k) + (give_logits ? " logits given" : " own gate");
  SCOPED_TRACE(trace);
  int64_t total = 0, tmax = 1;
  std::vector<int64_t> start(P);
  for (int r = 0; r < P; ++r) {
    start[r] = total;
    total += tokens[r];
    tmax = std::max(tmax, tokens[r]);
  }
  const Tensor x = test::randn_f32(rng, {total, H});
  const Tensor logits = test::randn_f32(rng, {total, L}, 2.0f);
  // One GPU, all tokens.
  Tensor want, want_ids;
  {
    test::cuda_ok(cudaSetDevice(devices[0]), "cudaSetDevice");
    MoERunner one(base, w, cuda_options(std::max<int64_t>(total, 1)));
    DeviceTensor xd = DeviceTensor::from_host(payloads.quantized_reference ? fp8_roundtrip(x) : x);
    DeviceTensor ld = DeviceTensor::from_host(logits);
    DeviceTensor out(DType::kF32, {total, H}), ids(DType::kI32, {total, k});
    out.poison();
    ForwardOutputs fo{TensorView(), ids, TensorView()};
    const TensorView lv = ld.view();
    one.forward(xd, out, give_logits ? &lv : nullptr, nullptr, &fo);
    test::cuda_ok(cudaDeviceSynchronize(), "sync");
    want = out.to_host();
    want_ids = ids.to_host();
  }
  std::vector<Tensor> got(P), got_ids(P);
  std::vector<EpStats> stats(P);
  run_ranks(P, [&](int r) {
    test::cuda_ok(cudaSetDevice(devices[r]), "cudaSetDevice");
    MoEConfig c = rank_config(base, r, P);
    c.parallel.expert_placement = placement;
    RunnerOptions o = ep_rank_options(tmax, devices[r], comms[r]);
    o.dispatch_dtype = payloads.dispatch;
    o.combine_dtype = payloads.combine;
    MoERunner ep(c, w, o);
    const int64_t T = tokens[r];
    DeviceTensor xd = DeviceTensor::from_host(rows_of(x, start[r], T));
    DeviceTensor ld = DeviceTensor::from_host(rows_of(logits, start[r], T));
    DeviceTensor out(DType::kF32, {T, H}), ids(DType::kI32, {T, k});
    out.poison();
    ForwardOutputs fo{TensorView(), ids, TensorView()};
    const TensorView lv = ld.view();
    // Twice: the second call reuses every buffer (stale data must not leak in).
    for (int rep = 0; rep < 2; ++rep) {
      out.poison();
      ep.forward(xd, out, give_logits ? &lv : nullptr, nullptr, &fo);
      test::cuda_ok(cudaDeviceSynchronize(), "sync");
    }
    got[r] = out.to_host();
    got_ids[r] = ids.to_host();
    ASSERT_NE(ep.cuda_ep_stats(), nullptr);
    stats[r] = *ep.cuda_ep_stats();
  });
  int64_t sent = 0, received = 0, cs = 0, cr = 0;
  for (int r = 0; r < P; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Tensor w_r = rows_of(want, start[r], tokens[r]);
    const Tensor ids_r = rows_of(want_ids, start[r], tokens[r]);
    EXPECT_TRUE(same_bits(got_ids[r], ids_r)) << "topk_ids differ from one GPU's";
    EXPECT_EQ(test::count_non_finite(got[r]), 0) << "unwritten (NaN-poisoned) output";
    // Given logits (or one rank: the same gate GEMM): bit-identical. Each
    // rank's own gate GEMM over fewer tokens may sum in another order
    // (router_gemm: T <= 32 vs tiled), so logits and weights differ in f32 rounding.
    const double rel = tokens[r] ? test::rel_l2(got[r], w_r) : 0.0;
    if (transport) EXPECT_EQ(stats[r].transport, transport);
    if (tolerance > 0) {
      EXPECT_LE(rel, tolerance) << "output vs one GPU";
    } else if (give_logits || P == 1) {
      if (!same_bits(got[r], w_r))
        ADD_FAILURE() << "output not bit-identical to one GPU: rel L2 " << rel;
    } else {
      // With the router weight applied on the input (Llama-4), x * w is rounded
      // to bf16 before the experts: an f32 rounding difference in a logit can
      // move that rounding by one bf16 step (2^-8 relative) in some elements
      // (seen: 8.7e-5 relative L2, seed 14482149831746600384).
      const double own_gate_tol = base.apply_router_weight_on_input ? 1e-3 : 1e-6;
      EXPECT_LE(rel, own_gate_tol) << "own gate GEMM: output vs one GPU";
    }
    sent += stats[r].dispatch_bytes_sent;
    received += stats[r].dispatch_bytes_received;
    cs += stats[r].combine_bytes_sent;
    cr += stats[r].combine_bytes_received;
  }
  EXPECT_EQ(sent, received) << "dispatch bytes sent / received over all ranks";
  EXPECT_EQ(cs, cr) << "combine bytes sent / received over all ranks";
}

std::vector<std::pair<std::string, MoEConfig>> ep_configs() {
  std::vector<std::pair<std::string, MoEConfig>> v;
  v.emplace_back("mixtral", test::arch_config("mixtral", 10, 2, 96, 80));
  v.emplace_back("qwen2_moe", test::arch_config("qwen2_moe", 13, 4, 72, 40));
  v.emplace_back("deepseek_v3", test::arch_config("deepseek_v3", 16, 8, 64, 24));
  v.emplace_back("gpt_oss", test::arch_config("gpt_oss", 9, 2, 80, 32));
  v.emplace_back("llama4", test::arch_config("llama4", 7, 1, 64, 40));
  v.emplace_back("zero_experts", test::arch_config("zero_experts", 10, 3, 48, 32));
  {
    MoEConfig c = test::base_config(11, 8, 96, 80);  // k = 8, E not a multiple of 2, 3, 4
    c.renormalize = true;
    v.emplace_back("k8", c);
  }
  return v;
}

// Sets FUSEDMOE_EP_TRANSPORT for its lifetime.
class TransportEnv {
 public:
  explicit TransportEnv(const char* value) { setenv("FUSEDMOE_EP_TRANSPORT", value, 1); }
  ~TransportEnv() { unsetenv("FUSEDMOE_EP_TRANSPORT"); }
  TransportEnv(const TransportEnv&) = delete;
  TransportEnv& operator=(const TransportEnv&) = delete;
};

// One rank over either transport (the peer transport's window is its own).
TEST(CudaEp, OneRankNcclMatchesOneGpu) {
  FUSEDMOE_REQUIRE_NCCL();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::shared_ptr<Communicator> comm = one_rank_nccl();
  for (const char* transport : {"nccl", "peer"}) {
    SCOPED_TRACE(transport);
    TransportEnv env(transport);
    for (const auto& [name, c] : ep_configs()) {
      SCOPED_TRACE(name);
      const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
      for (int64_t T : {0, 1, 5, 37, 300}) {
        for (bool logits : {true, false}) {
          check_ep(c, w, {T}, {comm}, {0}, ExpertPlacement::kContiguous, rng, logits, 0, transport);
          if (HasFailure()) return;
        }
      }
    }
  }
}

// The refusal tests' layer: 8 experts, top-2, H 64, I 32, random bf16 weights
// from `seed`; its config is rank 0 of one.
struct SmallLayer {
  MoEConfig config;
  MoELayerWeights weights;
};
SmallLayer small_layer(uint64_t seed) {
  std::mt19937_64 rng(seed);
  SmallLayer s{test::base_config(8, 2, 64, 32), {}};
  s.weights = test::random_layer(rng, s.config, DType::kBF16);
  s.config.parallel = parallel_config_for_rank(0, 1, 1, 1);
  return s;
}

// The peer transport needs one GPU per rank: thread ranks sharing a GPU are
// refused on every rank (naming why) when it is required, and take NCCL's
// path under auto (ThreadRanksOnOneGpuMatchOneGpu).
// Each of two thread ranks on GPU 0 builds an EP runner of a small layer
// (rank r with max_num_tokens max_tokens[r]); returns each rank's
// Error(kInvalidArgument) message.
std::vector<std::string> two_rank_construction_errors(std::array<int64_t, 2> max_tokens,
                                                      uint64_t seed) {
  const auto [c, w] = small_layer(seed);
  auto group = std::make_shared<ThreadGroup>(2);
  std::vector<std::string> errors(2);
  run_ranks(2, [&](int r) {
    test::cuda_ok(cudaSetDevice(0), "cudaSetDevice");
    const MoEConfig cr = rank_config(c, r, 2);
    RunnerOptions o = cuda_options(max_tokens[r]);
    o.communicator = std::make_shared<ThreadCommunicator>(group, r);
    errors[r] = test::error_of([&] { MoERunner ep(cr, w, o); }, ErrorCode::kInvalidArgument);
  });
  return errors;
}

TEST(CudaEp, PeerTransportRefusesRanksSharingAGpu) {
  FUSEDMOE_REQUIRE_CUDA();
  TransportEnv env("peer");
  const std::vector<std::string> errors = two_rank_construction_errors({16, 16}, 11);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_HAS(errors[r], "FUSEDMOE_EP_TRANSPORT=peer (rank 0): the ranks cannot map");
    EXPECT_HAS(errors[r], "(rank 0: rank 1 shares this rank's GPU (cuda:0))");
  }
}

TEST(CudaEp, UnknownTransportIsAnError) {
  FUSEDMOE_REQUIRE_NCCL();
  const auto [c, w] = small_layer(12);
  TransportEnv env("nvshmem");
  RunnerOptions o = cuda_options(16);
  o.communicator = one_rank_nccl();
  FUSEDMOE_EXPECT_ERROR(MoERunner(c, w, o), kInvalidArgument,
                        "FUSEDMOE_EP_TRANSPORT: expected auto, nccl or peer, got 'nvshmem'");
}

TEST(CudaEp, ThreadRanksOnOneGpuMatchOneGpu) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const std::vector<std::vector<int64_t>> splits = {{7, 0},     {0, 0},         {1, 50},
                                                    {33, 0, 9}, {20, 3, 0, 41}, {130, 61, 17, 5}};
  for (const auto& [name, c] : ep_configs()) {
    SCOPED_TRACE(name);
    const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
    for (const auto& tokens : splits) {
      const int P = static_cast<int>(tokens.size());
      if (P > c.num_experts) continue;
      auto group = std::make_shared<ThreadGroup>(P);
      std::vector<std::shared_ptr<Communicator>> comms;
      for (int r = 0; r < P; ++r) comms.push_back(std::make_shared<ThreadCommunicator>(group, r));
      for (ExpertPlacement pl : {ExpertPlacement::kContiguous, ExpertPlacement::kRoundRobin}) {
        check_ep(c, w, tokens, comms, std::vector<int>(P, 0), pl, rng, true);
        if (HasFailure()) return;
      }
    }
  }
}

// Each rank's own gate GEMM on its tokens: the same logits as the gate GEMM
// over all tokens on one GPU up to f32 rounding (the summation order depends
// on the token count), so the same ids and the output within check_ep's bound.
TEST(CudaEp, ThreadRanksOwnGateMatchOneGpu) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const auto& [name, c] : ep_configs()) {
    SCOPED_TRACE(name);
    const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
    const std::vector<int64_t> tokens = {45, 0, 12};
    auto group = std::make_shared<ThreadGroup>(3);
    std::vector<std::shared_ptr<Communicator>> comms;
    for (int r = 0; r < 3; ++r) comms.push_back(std::make_shared<ThreadCommunicator>(group, r));
    check_ep(c, w, tokens, comms, {0, 0, 0}, ExpertPlacement::kContiguous, rng, false);
    if (HasFailure()) return;
  }
}

TEST(CudaEp, EveryVisibleGpuNcclMatchesOneGpu) {
  FUSEDMOE_REQUIRE_NCCL();
  const int n = cuda::device_count();
  if (n < 2) GTEST_SKIP() << "skipped: needs >= 2 CUDA devices, found " << n;
  TransportEnv env("nccl");  // auto takes the peer transport there
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const GpuRanks ranks(first_gpus(n));
  const auto& [devices, comms] = ranks;
  std::vector<int64_t> tokens(n);
  for (int r = 0; r < n; ++r) tokens[r] = r % 3 == 1 ? 0 : 17 + 29 * r;  // T = 0 on some ranks
  for (const auto& [name, c] : ep_configs()) {
    SCOPED_TRACE(name);
    if (n > c.num_experts) continue;
    const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
    for (ExpertPlacement pl : {ExpertPlacement::kContiguous, ExpertPlacement::kRoundRobin}) {
      check_ep(c, w, tokens, comms, devices, pl, rng, true);
      if (HasFailure()) break;
    }
    if (HasFailure()) break;
  }
}

// The peer transport on every visible GPU (one process, a thread a rank):
// every rank with T = max_tokens_per_rank gives one GPU's bits; ranks of
// different T (0 too) stay within bf16 rounding of it. check_ep's two forwards
// a runner reuse the windows (the epoch flags).
TEST(CudaEp, EveryVisibleGpuPeerMatchesOneGpu) {
  FUSEDMOE_REQUIRE_NCCL();
  const int n = cuda::device_count();
  if (n < 2) GTEST_SKIP() << "skipped: needs >= 2 CUDA devices, found " << n;
  TransportEnv env("peer");
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const GpuRanks ranks(first_gpus(n));
  const auto& [devices, comms] = ranks;
  std::vector<int64_t> uneven(n);
  for (int r = 0; r < n; ++r) uneven[r] = r % 3 == 1 ? 0 : 17 + 29 * r;  // T = 0 on some ranks
  for (const auto& [name, c] : ep_configs()) {
    SCOPED_TRACE(name);
    if (n > c.num_experts) continue;
    const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
    for (ExpertPlacement pl : {ExpertPlacement::kContiguous, ExpertPlacement::kRoundRobin}) {
      for (int64_t T : {1, 3, 64, 300})
        check_ep(c, w, std::vector<int64_t>(n, T), comms, devices, pl, rng, true, 1e-6, "peer");
      check_ep(c, w, uneven, comms, devices, pl, rng, true, 1e-2, "peer");
      if (HasFailure()) break;
    }
    if (HasFailure()) break;
  }
}

// Sets FUSEDMOE_CUDA_EXPERTS=sm90 and FUSEDMOE_CUDA_SM90_TILE=m64 for its
// lifetime (then back to the suite's mma): one GPU and every EP rank take the
// sm90 path with one tile, whatever their rows per expert, so each expert row
// gets the same bits on both.
class Sm90ExpertsEnv {
 public:
  Sm90ExpertsEnv() {
    setenv("FUSEDMOE_CUDA_EXPERTS", "sm90", 1);
    setenv("FUSEDMOE_CUDA_SM90_TILE", "m64", 1);
  }
  ~Sm90ExpertsEnv() {
    setenv("FUSEDMOE_CUDA_EXPERTS", "mma", 1);
    unsetenv("FUSEDMOE_CUDA_SM90_TILE");
  }
  Sm90ExpertsEnv(const Sm90ExpertsEnv&) = delete;
  Sm90ExpertsEnv& operator=(const Sm90ExpertsEnv&) = delete;
};

// The peer transport's local experts on the sm90 path: their expert-sorted
// rows (bf16, unweighted) are weighted, biased and summed by the combine
// kernel as finalize does it: on one rank bit-identical to one GPU, on every
// visible GPU within f32 rounding (each rank sums its slots first).
TEST(CudaEp, PeerSm90ExpertsMatchOneGpu) {
  FUSEDMOE_REQUIRE_NCCL();
  if (!cuda::sm90_experts_available())
    GTEST_SKIP() << "skipped: the sm90 grouped GEMM needs an sm_90 device and CUTLASS";
  TransportEnv env("peer");
  Sm90ExpertsEnv sm90;
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::shared_ptr<Communicator> one = one_rank_nccl();
  for (const auto& [name, c] : ep_configs()) {
    SCOPED_TRACE(name);
    const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
    for (int64_t T : {1, 37, 300}) {
      check_ep(c, w, {T}, {one}, {0}, ExpertPlacement::kContiguous, rng, true, 0, "peer");
      if (HasFailure()) return;
    }
  }
  one.reset();
  const int n = cuda::device_count();
  if (n < 2) return;
  const GpuRanks ranks(first_gpus(n));
  const auto& [devices, comms] = ranks;
  for (const auto& [name, c] : ep_configs()) {
    SCOPED_TRACE(name);
    if (n > c.num_experts) continue;
    const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
    for (ExpertPlacement pl : {ExpertPlacement::kContiguous, ExpertPlacement::kRoundRobin}) {
      for (int64_t T : {3, 300})
        check_ep(c, w, std::vector<int64_t>(n, T), comms, devices, pl, rng, true, 1e-6, "peer");
      if (HasFailure()) break;
    }
    if (HasFailure()) break;
  }
}

// The peer transport's payloads: fp8 records (1 x 128 group scales,
// dequantised by the receiver) and bf16 combine rows. fp8 on layers whose
// experts see exactly the dispatched hidden states (no shared expert, weight
// not on the input): one GPU on the quantised-dequantised states gives the
// same output within f32 rounding; elsewhere fp8 is within its rounding of
// one GPU (1e-1, a loose check: the exact layers are the tight one). bf16
// rows: within bf16 rounding of one GPU.
TEST(CudaEp, PeerFp8DispatchAndBf16Combine) {
  FUSEDMOE_REQUIRE_NCCL();
  TransportEnv env("peer");
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int n = cuda::device_count();
  std::vector<std::vector<int>> setups{{0}};
  if (n >= 2) setups.push_back(first_gpus(n));
  for (const std::vector<int>& setup : setups) {
    const GpuRanks ranks(setup);
    const auto& [devices, comms] = ranks;
    const int P = static_cast<int>(devices.size());
    SCOPED_TRACE(std::to_string(P) + " GPU(s)");
    // H = 88: the fp8 records' 8-values-a-thread path (H % 16 != 0); H = 4224:
    // 33 groups of 128 columns, a row longer than a dispatch block's threads
    // (256 x 16) and than a combine item (2048 columns).
    std::vector<std::pair<std::string, MoEConfig>> configs = ep_configs();
    configs.emplace_back("h88", test::base_config(9, 2, 88, 48));
    configs.emplace_back("h4224", test::base_config(4, 2, 4224, 64));
    for (const auto& [name, c] : configs) {
      SCOPED_TRACE(name);
      if (P > c.num_experts) continue;
      const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
      const bool exact = !c.has_shared_expert() && !c.apply_router_weight_on_input;
      for (int64_t T : {1, 37, 300}) {
        const std::vector<int64_t> tokens(P, T);
        for (DType combine : {DType::kF32, DType::kBF16}) {
          SCOPED_TRACE(std::string("fp8 dispatch, combine ") + dtype_name(combine));
          // Not exact: fp8's rounding itself, ~3e-2 on average but up to 6e-2
          // measured on one token of 72 values (qwen2_moe, T = 1); the CLI's
          // default fp8 tolerance.
          const double tol = exact ? (combine == DType::kBF16 ? 1e-2 : 1e-6) : 1e-1;
          check_ep(c, w, tokens, comms, devices, ExpertPlacement::kContiguous, rng, true, tol,
                   "peer", {DispatchDType::kFP8, combine, exact});
        }
        SCOPED_TRACE("bf16 dispatch, bf16 combine");
        check_ep(c, w, tokens, comms, devices, ExpertPlacement::kRoundRobin, rng, true, 1e-2,
                 "peer", {DispatchDType::kBF16, DType::kBF16, false});
        if (HasFailure()) break;
      }
      if (HasFailure()) break;
    }
    if (HasFailure()) return;
  }
}

// The payloads the GPU path cannot carry are refused, naming the option:
// f32 records, bf16 records with f16 experts, fp8 / bf16 on the nccl transport,
// and ranks asking for different payloads.
TEST(CudaEp, UnsupportedPayloadsAreRefused) {
  FUSEDMOE_REQUIRE_NCCL();
  const auto [c, w] = small_layer(test::fresh_seed());
  std::shared_ptr<Communicator> comm = one_rank_nccl();
  const auto error = [&](DispatchDType d, DType combine, DType compute) {
    RunnerOptions o = cuda_options(16);
    o.communicator = comm;
    o.dispatch_dtype = d;
    o.combine_dtype = combine;
    o.compute_dtype = compute;
    return test::error_of([&] { MoERunner ep(c, w, o); }, ErrorCode::kInvalidArgument);
  };
  {
    TransportEnv env("peer");
    EXPECT_NE(error(DispatchDType::kF32, DType::kF32, DType::kBF16).find("dispatch_dtype"),
              std::string::npos);
    EXPECT_NE(error(DispatchDType::kBF16, DType::kF32, DType::kF16).find("f16 inputs"),
              std::string::npos);
    EXPECT_NE(error(DispatchDType::kAuto, DType::kF16, DType::kBF16).find("combine_dtype"),
              std::string::npos);
  }
  {
    TransportEnv env("nccl");
    EXPECT_NE(error(DispatchDType::kFP8, DType::kF32, DType::kBF16).find("nccl"),
              std::string::npos);
    EXPECT_NE(error(DispatchDType::kAuto, DType::kBF16, DType::kBF16).find("nccl"),
              std::string::npos);
  }
  // Two thread ranks on two GPUs asking for different payloads.
  if (cuda::device_count() >= 2) {
    TransportEnv env("peer");
    const GpuRanks ranks(first_gpus(2));
    std::vector<std::string> errors(2);
    run_ranks(2, [&](int r) {
      test::cuda_ok(cudaSetDevice(r), "cudaSetDevice");
      const MoEConfig cr = rank_config(c, r, 2);
      RunnerOptions o = ep_rank_options(16, r, ranks.comms[r]);
      o.dispatch_dtype = r == 0 ? DispatchDType::kFP8 : DispatchDType::kAuto;
      errors[r] = test::error_of([&] { MoERunner ep(cr, w, o); }, ErrorCode::kInvalidArgument);
    });
    for (const std::string& e : errors)
      EXPECT_NE(e.find("every rank must use the same"), std::string::npos) << e;
  }
}

// The peer transport never synchronises with the host: each rank's forward is
// captured in a CUDA graph (its own stream) and replayed with new inputs; the
// replays give the eager forward's bits (the epoch flags advance on the device).
void check_peer_graph(const MoEConfig& base, const MoELayerWeights& w, int64_t T,
                      std::vector<std::shared_ptr<Communicator>> comms,
                      const std::vector<int>& devices, std::mt19937_64& rng) {
  const int P = static_cast<int>(comms.size());
  const int64_t H = base.hidden_size;
  std::vector<Tensor> inputs;
  for (int i = 0; i < 3 * P; ++i) inputs.push_back(test::randn_f32(rng, {T, H}));
  run_ranks(P, [&](int r) {
    test::cuda_ok(cudaSetDevice(devices[r]), "cudaSetDevice");
    cudaStream_t stream = nullptr;
    test::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    const MoEConfig c = rank_config(base, r, P);
    RunnerOptions o = ep_rank_options(T, devices[r], comms[r]);
    o.cuda_stream = stream;
    {
      MoERunner ep(c, w, o);
      DeviceTensor xd = DeviceTensor::from_host(inputs[r]), out(DType::kF32, {T, H});
      std::vector<Tensor> eager;
      for (int i = 0; i < 3; ++i) {
        test::cuda_ok(
            cudaMemcpy(xd.data(), inputs[i * P + r].data(), T * H * 4, cudaMemcpyHostToDevice),
            "upload");
        out.poison();
        ep.forward(xd, out);
        test::cuda_ok(cudaStreamSynchronize(stream), "sync");
        eager.push_back(out.to_host());
      }
      EXPECT_EQ(ep.cuda_ep_stats()->transport, "peer");
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      test::cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
      ep.forward(xd, out);
      test::cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
      test::cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
      for (int i : {2, 0, 1}) {  // replays, each rank in the same order
        test::cuda_ok(
            cudaMemcpy(xd.data(), inputs[i * P + r].data(), T * H * 4, cudaMemcpyHostToDevice),
            "upload");
        out.poison();
        test::cuda_ok(cudaGraphLaunch(exec, stream), "launch");
        test::cuda_ok(cudaStreamSynchronize(stream), "sync");
        EXPECT_TRUE(same_bits(out.to_host(), eager[i]))
            << "rank " << r << ": graph replay of input " << i << " differs from eager";
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
    cudaStreamDestroy(stream);
  });
}

TEST(CudaEp, PeerTransportIsCapturableInACudaGraph) {
  FUSEDMOE_REQUIRE_NCCL();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TransportEnv env("peer");
  const GpuRanks ranks = up_to_four_gpus();
  const auto& [devices, comms] = ranks;
  const int n = static_cast<int>(comms.size());
  for (const auto& [name, c] : ep_configs()) {
    SCOPED_TRACE(name + " on " + std::to_string(n) + " GPU(s)");
    if (n > c.num_experts) continue;
    const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
    for (int64_t T : {1, 40}) check_peer_graph(c, w, T, comms, devices, rng);
    if (HasFailure()) break;
  }
}

// Forwards of one layer back to back without a host sync, with T changing
// from forward to forward and rank to rank (0 and max_num_tokens too), each
// with its own input and output: the epoch flags must keep every forward's
// records, counts and rows apart, and rows past a source's count (left from an
// earlier, larger forward) must not be computed. Each output within bf16
// rounding of one GPU on that forward's tokens (the tiles differ: ep_size *
// max_num_tokens rows here).
TEST(CudaEp, PeerTransportForwardsWithoutSyncAndChangingT) {
  FUSEDMOE_REQUIRE_NCCL();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TransportEnv env("peer");
  const GpuRanks ranks = up_to_four_gpus();
  const auto& [devices, comms] = ranks;
  const int n = static_cast<int>(comms.size());
  const std::vector<int64_t> seq = {40, 3, 0, 17, 40, 1};
  const int64_t cap = 40, F = static_cast<int64_t>(seq.size());
  for (const auto& [name, c] : ep_configs()) {
    SCOPED_TRACE(name + " on " + std::to_string(n) + " GPU(s)");
    if (n > c.num_experts) continue;
    const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
    const int64_t H = c.hidden_size, L = c.num_router_logits();
    // tokens[f][r]; inputs and logits of forward f, all ranks' tokens in rank order.
    std::vector<std::vector<int64_t>> tokens(F, std::vector<int64_t>(n));
    std::vector<Tensor> xs, ls, want(F);
    for (int64_t f = 0; f < F; ++f) {
      int64_t total = 0;
      for (int r = 0; r < n; ++r) total += tokens[f][r] = seq[(f + r) % F];
      xs.push_back(test::randn_f32(rng, {total, H}));
      ls.push_back(test::randn_f32(rng, {total, L}, 2.0f));
      test::cuda_ok(cudaSetDevice(0), "cudaSetDevice");
      MoERunner one(c, w, cuda_options(std::max<int64_t>(total, 1)));
      DeviceTensor xd = DeviceTensor::from_host(xs[f]), ld = DeviceTensor::from_host(ls[f]);
      DeviceTensor out(DType::kF32, {total, H});
      const TensorView lv = ld.view();
      one.forward(xd, out, &lv, nullptr, nullptr);
      test::cuda_ok(cudaDeviceSynchronize(), "sync");
      want[f] = out.to_host();
    }
    std::vector<std::vector<Tensor>> got(n, std::vector<Tensor>(F));
    run_ranks(n, [&](int r) {
      test::cuda_ok(cudaSetDevice(devices[r]), "cudaSetDevice");
      const MoEConfig cr = rank_config(c, r, n);
      RunnerOptions o = ep_rank_options(cap, devices[r], comms[r]);
      MoERunner ep(cr, w, o);
      std::vector<DeviceTensor> xd, ld, out;
      for (int64_t f = 0; f < F; ++f) {
        int64_t start = 0;
        for (int q = 0; q < r; ++q) start += tokens[f][q];
        xd.push_back(DeviceTensor::from_host(rows_of(xs[f], start, tokens[f][r])));
        ld.push_back(DeviceTensor::from_host(rows_of(ls[f], start, tokens[f][r])));
        out.emplace_back(DType::kF32, std::vector<int64_t>{tokens[f][r], H});
        out.back().poison();
      }
      test::cuda_ok(cudaDeviceSynchronize(), "sync");
      for (int64_t f = 0; f < F; ++f) {  // no host sync in between
        const TensorView lv = ld[f].view();
        ep.forward(xd[f], out[f], &lv, nullptr, nullptr);
      }
      test::cuda_ok(cudaDeviceSynchronize(), "sync");
      for (int64_t f = 0; f < F; ++f) got[r][f] = out[f].to_host();
    });
    for (int64_t f = 0; f < F; ++f) {
      int64_t start = 0;
      for (int r = 0; r < n; ++r) {
        SCOPED_TRACE("forward " + std::to_string(f) + " rank " + std::to_string(r) + " T " +
                     std::to_string(tokens[f][r]));
        const Tensor w_r = rows_of(want[f], start, tokens[f][r]);
        EXPECT_EQ(test::count_non_finite(got[r][f]), 0) << "unwritten (NaN-poisoned) output";
        if (tokens[f][r] > 0) EXPECT_LE(test::rel_l2(got[r][f], w_r), 1e-2);
        start += tokens[f][r];
      }
    }
    if (HasFailure()) break;
  }
}

// RunnerOptions::cuda_graph_sizes under expert parallelism (peer transport):
// each rank replays the graph of the smallest capture size >= its own T (rows
// past T are padding: routed nowhere, dispatched to no rank), ranks picking
// different sizes in one forward, some running eagerly (T = 0, T above the
// largest size); no host sync between forwards. Each rank's ids and weights
// equal its eager runner's, the outputs are within bf16 rounding of it (the
// shared expert's tile may differ with S rows) and of one GPU on all ranks'
// tokens.
TEST(CudaEp, PeerRunnerGraphReplayPadsToCaptureSize) {
  FUSEDMOE_REQUIRE_NCCL();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TransportEnv env("peer");
  const GpuRanks ranks = up_to_four_gpus();
  const auto& [devices, comms] = ranks;
  const int n = static_cast<int>(comms.size());
  const std::vector<int64_t> seq = {3, 16, 0, 9, 1, 40, 4, 17};
  const int64_t cap = 40, F = static_cast<int64_t>(seq.size());
  for (const auto& [name, c] : ep_configs()) {
    SCOPED_TRACE(name + " on " + std::to_string(n) + " GPU(s)");
    if (n > c.num_experts) continue;
    const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
    const int64_t H = c.hidden_size, k = c.top_k;
    std::vector<std::vector<int64_t>> tokens(F, std::vector<int64_t>(n));
    std::vector<Tensor> xs, want(F);
    for (int64_t f = 0; f < F; ++f) {
      int64_t total = 0;
      for (int r = 0; r < n; ++r) total += tokens[f][r] = seq[(f + 3 * r) % F];
      xs.push_back(test::randn_f32(rng, {total, H}));
      test::cuda_ok(cudaSetDevice(0), "cudaSetDevice");
      MoERunner one(c, w, cuda_options(std::max<int64_t>(total, 1)));
      DeviceTensor xd = DeviceTensor::from_host(xs[f]), out(DType::kF32, {total, H});
      one.forward(xd, out);
      test::cuda_ok(cudaDeviceSynchronize(), "sync");
      want[f] = out.to_host();
    }
    // [rank][forward]: graphed and eager outputs, ids, weights.
    std::vector<std::vector<std::array<Tensor, 6>>> got(n, std::vector<std::array<Tensor, 6>>(F));
    std::vector<size_t> graphs(n);
    run_ranks(n, [&](int r) {
      test::cuda_ok(cudaSetDevice(devices[r]), "cudaSetDevice");
      cudaStream_t stream = nullptr;
      test::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
      {
        const MoEConfig cr = rank_config(c, r, n);
        RunnerOptions o = ep_rank_options(cap, devices[r], comms[r]);
        o.cuda_stream = stream;
        MoERunner eager(cr, w, o);
        o.cuda_graph_sizes = {16, 1, 4};
        MoERunner graphed(cr, w, o);
        std::vector<DeviceTensor> xd, dev;  // dev: 6 a forward
        for (int64_t f = 0; f < F; ++f) {
          const int64_t T = tokens[f][r];
          int64_t start = 0;
          for (int q = 0; q < r; ++q) start += tokens[f][q];
          xd.push_back(DeviceTensor::from_host(rows_of(xs[f], start, T)));
          for (int g = 0; g < 2; ++g) {
            dev.emplace_back(DType::kF32, std::vector<int64_t>{T, H});
            dev.emplace_back(DType::kI32, std::vector<int64_t>{T, k});
            dev.emplace_back(DType::kF32, std::vector<int64_t>{T, k});
          }
        }
        for (DeviceTensor& d : dev) d.poison();
        test::cuda_ok(cudaDeviceSynchronize(), "sync");
        for (int64_t f = 0; f < F; ++f) {  // no host sync in between
          DeviceTensor* d = &dev[6 * f];
          ForwardOutputs fg{TensorView(), d[1], d[2]}, fe{TensorView(), d[4], d[5]};
          graphed.forward(xd[f], d[0], nullptr, nullptr, &fg);
          eager.forward(xd[f], d[3], nullptr, nullptr, &fe);
        }
        test::cuda_ok(cudaStreamSynchronize(stream), "sync");
        for (int64_t f = 0; f < F; ++f)
          for (int i = 0; i < 6; ++i) got[r][f][i] = dev[6 * f + i].to_host();
        graphs[r] = graphed.num_cuda_graphs();
        // cuda_ep_stats() after each forward, replays too: the graphed runner's
        // rows and bytes are the eager one's (padding rows go nowhere), its
        // times those the graph's event nodes recorded.
        for (int64_t f = 0; f < F; ++f) {
          DeviceTensor* d = &dev[6 * f];
          graphed.forward(xd[f], d[0]);
          const EpStats g = *graphed.cuda_ep_stats();
          eager.forward(xd[f], d[3]);
          const EpStats e = *eager.cuda_ep_stats();
          const std::string at = "rank " + std::to_string(r) + " forward " + std::to_string(f);
          EXPECT_EQ(g.transport, "peer") << at;
          EXPECT_EQ(g.dispatch_rows_sent, e.dispatch_rows_sent) << at;
          EXPECT_EQ(g.dispatch_rows_received, e.dispatch_rows_received) << at;
          EXPECT_EQ(g.dispatch_bytes_sent, e.dispatch_bytes_sent) << at;
          EXPECT_EQ(g.dispatch_bytes_received, e.dispatch_bytes_received) << at;
          EXPECT_EQ(g.combine_bytes_sent, e.combine_bytes_sent) << at;
          EXPECT_EQ(g.combine_bytes_received, e.combine_bytes_received) << at;
          if (tokens[f][r] > 0) {
            EXPECT_GT(g.dispatch_seconds, 0) << at;
            EXPECT_GT(g.combine_seconds, 0) << at;
          }
        }
      }
      cudaStreamDestroy(stream);
    });
    for (int r = 0; r < n; ++r) EXPECT_GE(graphs[r], 1u) << "rank " << r << " replayed no graph";
    for (int64_t f = 0; f < F; ++f) {
      int64_t start = 0;
      for (int r = 0; r < n; ++r) {
        const int64_t T = tokens[f][r];
        SCOPED_TRACE("forward " + std::to_string(f) + " rank " + std::to_string(r) + " T " +
                     std::to_string(T));
        const std::array<Tensor, 6>& g = got[r][f];
        EXPECT_EQ(test::count_non_finite(g[0]), 0) << "unwritten (NaN-poisoned) output";
        EXPECT_TRUE(same_bits(g[1], g[4])) << "topk_ids: graph replay vs eager";
        EXPECT_TRUE(same_bits(g[2], g[5])) << "topk_weights: graph replay vs eager";
        if (T > 0) {
          EXPECT_LE(test::rel_l2(g[0], g[3]), 1e-2) << "graph replay vs eager";
          EXPECT_LE(test::rel_l2(g[0], rows_of(want[f], start, T)), 1e-2) << "vs one GPU";
        }
        start += T;
      }
    }
    if (HasFailure()) break;
  }
}

// The nccl transport synchronises with the host: the runner's graph replay is
// refused at construction, naming the transport to use.
TEST(CudaEp, NcclRunnerRefusesGraphSizes) {
  FUSEDMOE_REQUIRE_NCCL();
  std::mt19937_64 rng(test::fresh_seed());
  TransportEnv env("nccl");
  const MoEConfig c = test::base_config(8, 2, 64, 48);
  const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
  std::shared_ptr<Communicator> comm = one_rank_nccl();
  RunnerOptions o = cuda_options(16);
  o.communicator = comm;
  o.cuda_graph_sizes = {1, 4};
  const std::string err =
      test::error_of([&] { MoERunner ep(c, w, o); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(err.find("cuda_graph_sizes: graph replay under GPU expert parallelism needs the peer "
                     "transport"),
            std::string::npos)
      << err;
}

// RunnerOptions::cuda_workspace under expert parallelism (peer transport):
// each rank's layers of two shapes share one workspace (the local experts'
// scratch for ep_size * max_num_tokens rows) and the two layers of one shape
// its peer window too (the second allocates none); forwards interleaved
// across the layers with no host sync give the bits of layers with their own.
TEST(CudaEp, PeerLayersSharingAWorkspaceMatchTheirOwn) {
  FUSEDMOE_REQUIRE_NCCL();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TransportEnv env("peer");
  const GpuRanks ranks = up_to_four_gpus();
  const auto& [devices, comms] = ranks;
  const int n = static_cast<int>(comms.size());
  const std::vector<std::pair<std::string, MoEConfig>> all = ep_configs();
  // deepseek_v3, mixtral, deepseek_v3 (other weights: the first one's window)
  const std::vector<MoEConfig> cfgs = {all[2].second, all[0].second, all[2].second};
  std::vector<MoELayerWeights> ws;
  for (const MoEConfig& c : cfgs) ws.push_back(test::random_layer(rng, c, DType::kBF16));
  const int64_t cap = 48;
  const std::vector<std::pair<int, int64_t>> calls = {{0, 48}, {2, 7}, {1, 5}, {2, 48},
                                                      {1, 48}, {0, 1}, {2, 0}, {0, 30}};
  std::vector<Tensor> xs;
  for (const auto& [l, T] : calls) xs.push_back(test::randn_f32(rng, {T, cfgs[l].hidden_size}));
  std::vector<std::vector<Tensor>> shared_out(n), own_out(n);
  run_ranks(n, [&](int r) {
    test::cuda_ok(cudaSetDevice(devices[r]), "cudaSetDevice");
    auto workspace = std::make_shared<cuda::SharedWorkspace>();
    std::vector<std::unique_ptr<MoERunner>> shared, own;
    for (size_t l = 0; l < cfgs.size(); ++l) {
      const MoEConfig c = rank_config(cfgs[l], r, n);
      RunnerOptions o = ep_rank_options(cap, devices[r], comms[r]);
      own.push_back(std::make_unique<MoERunner>(c, ws[l], o));
      o.cuda_workspace = workspace;
      shared.push_back(std::make_unique<MoERunner>(c, ws[l], o));
      EXPECT_GT(own.back()->cuda_ep_window_bytes(), 0u) << "layer " << l;
      if (l == 2)  // layer 0's
        EXPECT_EQ(shared.back()->cuda_ep_window_bytes(), 0u) << "layer 2: a window of its own";
      else
        EXPECT_GT(shared.back()->cuda_ep_window_bytes(), 0u) << "layer " << l;
    }
    for (auto* set : {&shared, &own}) {
      std::vector<DeviceTensor> xd, out;
      for (size_t i = 0; i < calls.size(); ++i) {
        xd.push_back(DeviceTensor::from_host(xs[i]));
        out.emplace_back(DType::kF32,
                         std::vector<int64_t>{calls[i].second, cfgs[calls[i].first].hidden_size});
        out.back().poison();
      }
      test::cuda_ok(cudaDeviceSynchronize(), "sync");
      for (size_t i = 0; i < calls.size(); ++i)  // no host sync in between
        (*set)[calls[i].first]->forward(xd[i], out[i]);
      test::cuda_ok(cudaDeviceSynchronize(), "sync");
      for (size_t i = 0; i < calls.size(); ++i)
        (set == &shared ? shared_out : own_out)[r].push_back(out[i].to_host());
    }
  });
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < calls.size(); ++i) {
      SCOPED_TRACE("rank " + std::to_string(r) + " call " + std::to_string(i));
      EXPECT_EQ(test::count_non_finite(shared_out[r][i]), 0) << "unwritten (NaN-poisoned) output";
      EXPECT_TRUE(same_bits(shared_out[r][i], own_out[r][i]))
          << "shared workspace vs own: rel L2 " << test::rel_l2(shared_out[r][i], own_out[r][i]);
    }
}

// Every rank must use the same max_num_tokens: refused at set-up, on every rank.
TEST(CudaEp, RanksWithDifferentMaxTokensAreRefused) {
  FUSEDMOE_REQUIRE_CUDA();
  const std::vector<std::string> errors = two_rank_construction_errors({16, 24}, 14);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_HAS(errors[r], "every rank must use the same max_num_tokens");
    EXPECT_HAS(errors[r], "rank 0 has 16, 64, 2, rank 1 has 24, 64, 2");
  }
}

// The nccl transport synchronises with the host: capturing it is refused.
TEST(CudaEp, NcclTransportRefusesCapture) {
  FUSEDMOE_REQUIRE_NCCL();
  const auto [c, w] = small_layer(13);
  std::mt19937_64 rng(13);
  TransportEnv env("nccl");
  cudaStream_t stream = nullptr;
  test::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  RunnerOptions o = cuda_options(4);
  o.communicator = one_rank_nccl();
  o.cuda_stream = stream;
  {
    MoERunner ep(c, w, o);
    DeviceTensor xd = DeviceTensor::from_host(test::randn_f32(rng, {4, 64}));
    DeviceTensor out(DType::kF32, {4, 64});
    test::cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
    const std::string err = test::error_of([&] { ep.forward(xd, out); }, ErrorCode::kUnsupported);
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    EXPECT_HAS(err, "cannot be captured in a CUDA graph");
  }
  cudaStreamDestroy(stream);
}

// HF fixtures (real weights and configs) through EP: one-rank NCCL and two thread ranks.
TEST(CudaEp, HfFixturesMatchOneGpu) {
  FUSEDMOE_REQUIRE_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::shared_ptr<Communicator> nccl = nccl_built() ? one_rank_nccl() : nullptr;
  for (const std::string arch : {"deepseek_v3", "qwen2_moe", "gpt_oss", "mixtral"}) {
    const std::string dir = test::hf_fixture_dir(arch);
    const ModelInfo info = load_model_info(dir);
    const Checkpoint ckpt = Checkpoint::open(dir);
    const int64_t layer = info.moe_layers.front();
    const MoEConfig& cfg = info.layer_config(layer);
    const MoELayerWeights w = load_moe_layer(ckpt, info, layer, LoadOptions{false});
    SCOPED_TRACE(arch);
    if (nccl) check_ep(cfg, w, {23}, {nccl}, {0}, ExpertPlacement::kContiguous, rng, false);
    auto group = std::make_shared<ThreadGroup>(2);
    std::vector<std::shared_ptr<Communicator>> comms{
        std::make_shared<ThreadCommunicator>(group, 0),
        std::make_shared<ThreadCommunicator>(group, 1)};
    check_ep(cfg, w, {19, 4}, comms, {0, 0}, ExpertPlacement::kContiguous, rng, false);
    if (HasFailure()) return;
  }
}

TEST(CudaEp, RejectsHostCommunicatorAndMismatchedSizes) {
  FUSEDMOE_REQUIRE_CUDA();
  std::mt19937_64 rng(7);
  MoEConfig c = test::base_config(8, 2, 64, 32);
  const MoELayerWeights w = test::random_layer(rng, c, DType::kBF16);
  // ep_size 2 with a host communicator on the CUDA backend.
  c.parallel = parallel_config_for_rank(0, 2, 1, 1);
  RunnerOptions o = cuda_options(16);
  FUSEDMOE_EXPECT_ERROR(MoERunner(c, w, o), kUnsupported, "communicator over device memory");
  // ep_size 2 with a one-rank device communicator.
  auto group = std::make_shared<ThreadGroup>(1);
  o.communicator = std::make_shared<ThreadCommunicator>(group, 0);
  FUSEDMOE_EXPECT_ERROR(MoERunner(c, w, o), kInvalidArgument, "ep_size");
  // TP on the CUDA backend.
  c.parallel = parallel_config_for_rank(0, 1, 2, 1);
  FUSEDMOE_EXPECT_ERROR(MoERunner(c, w, o), kInvalidArgument, "tp_size");
}

}  // namespace
}  // namespace fusedmoe
