// Core: dtype conversions, tensor views, thread pool, boundary checks.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "core/parse_number.h"
#include "expect_error.h"
#include "fusedmoe/core/dtype.h"
#include "fusedmoe/core/tensor.h"
#include "fusedmoe/core/thread_pool.h"
#include "test_util.h"

using namespace fusedmoe;

namespace {

// Exhaustive float64 reference rounding: the representable value of a format nearest to x,
// ties to the one with an even code. `values` lists all finite non-negative values in code order.
double nearest_even(double x, const std::vector<double>& values) {
  size_t best = 0;
  for (size_t i = 1; i < values.size(); ++i) {
    const double db = std::fabs(values[best] - x), di = std::fabs(values[i] - x);
    if (di < db || (di == db && (i % 2 == 0))) best = i;
  }
  return values[best];
}

}  // namespace

TEST(DType, SizesNamesParse) {
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF8E4M3FN), 1u);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(parse_dtype("f32"), DType::kF32);
  try {
    parse_dtype("f13");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'f13'"), std::string::npos) << e.what();
  }
}

TEST(DType, Bf16RoundTripAllCodes) {
  for (uint32_t c = 0; c < 65536; ++c) {
    const float f = bf16_to_f32(static_cast<uint16_t>(c));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
    } else {
      EXPECT_EQ(f32_to_bf16(f), c);
    }
  }
}

TEST(DType, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: ties to even -> 1.0.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even) -> 1 + 2^-6.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::infinity()))));
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // Largest float rounds up to Inf in bf16.
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::max()))));
}

TEST(DType, F16AllCodesAndRounding) {
  std::vector<double> values;
  for (uint32_t c = 0; c < 0x7c00; ++c) {
    const float f = f16_to_f32(static_cast<uint16_t>(c));
    values.push_back(f);
    EXPECT_EQ(f32_to_f16(f), c) << c;
    EXPECT_EQ(f32_to_f16(-f), c | 0x8000u) << c;
  }
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_f32(0x7c00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::nanf("")))));
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bffu);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00u);  // tie to even -> Inf
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<double> d(-20,
                                           15.99);  // below 65504 (values holds finite codes only)
  for (int i = 0; i < 2000; ++i) {
    const float x = static_cast<float>(std::exp2(d(rng)));
    const double want = nearest_even(x, values);
    EXPECT_EQ(f16_to_f32(f32_to_f16(x)), static_cast<float>(want)) << x;
  }
}

TEST(DType, F8E4M3FN) {
  std::vector<double> values;
  for (uint32_t c = 0; c < 0x7f; ++c) values.push_back(f8e4m3fn_to_f32(static_cast<uint8_t>(c)));
  EXPECT_EQ(f8e4m3fn_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f8e4m3fn_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(f8e4m3fn_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(f8e4m3fn_to_f32(0xff)));
  for (uint32_t c = 0; c < 0x7f; ++c) {
    EXPECT_EQ(f32_to_f8e4m3fn(f8e4m3fn_to_f32(static_cast<uint8_t>(c))), c);
    EXPECT_EQ(f32_to_f8e4m3fn(-f8e4m3fn_to_f32(static_cast<uint8_t>(c))), c | 0x80u);
  }
  // Saturation: beyond range and Inf -> +-448 by default; NaN stays NaN.
  EXPECT_EQ(f32_to_f8e4m3fn(1e6f), 0x7eu);
  EXPECT_EQ(f32_to_f8e4m3fn(-std::numeric_limits<float>::infinity()), 0xfeu);
  EXPECT_EQ(f32_to_f8e4m3fn(464.0f), 0x7eu);         // tie -> even (448)
  EXPECT_EQ(f32_to_f8e4m3fn(465.0f, false), 0x7fu);  // non-saturating overflow -> NaN
  EXPECT_EQ(f32_to_f8e4m3fn(std::nanf("")) & 0x7fu, 0x7fu);
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<double> d(-12, 8.8);
  for (int i = 0; i < 2000; ++i) {
    const float x = static_cast<float>(std::exp2(d(rng)));
    EXPECT_EQ(f8e4m3fn_to_f32(f32_to_f8e4m3fn(x)), static_cast<float>(nearest_even(x, values)))
        << x;
  }
}

TEST(DType, F8E5M2) {
  std::vector<double> values;
  for (uint32_t c = 0; c < 0x7c; ++c) values.push_back(f8e5m2_to_f32(static_cast<uint8_t>(c)));
  EXPECT_EQ(f8e5m2_to_f32(0x7b), 57344.0f);
  EXPECT_TRUE(std::isinf(f8e5m2_to_f32(0x7c)));
  EXPECT_TRUE(std::isnan(f8e5m2_to_f32(0x7d)));
  for (uint32_t c = 0; c < 0x7c; ++c)
    EXPECT_EQ(f32_to_f8e5m2(f8e5m2_to_f32(static_cast<uint8_t>(c))), c);
  EXPECT_EQ(f32_to_f8e5m2(std::numeric_limits<float>::infinity()), 0x7cu);
  EXPECT_EQ(f32_to_f8e5m2(1e6f), 0x7cu);
  EXPECT_EQ(f32_to_f8e5m2(1e6f, true), 0x7bu);
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<double> d(-17, 15.8);
  for (int i = 0; i < 2000; ++i) {
    const float x = static_cast<float>(std::exp2(d(rng)));
    EXPECT_EQ(f8e5m2_to_f32(f32_to_f8e5m2(x)), static_cast<float>(nearest_even(x, values))) << x;
  }
}

TEST(Tensor, ViewsAndCopies) {
  Tensor t = Tensor::empty(DType::kF32, {4, 6});
  for (int i = 0; i < 24; ++i) t.data_as<float>()[i] = static_cast<float>(i);
  TensorView col = t.view().narrow(1, 2, 3);
  EXPECT_FALSE(col.is_contiguous());
  EXPECT_TRUE(col.rows_contiguous());
  Tensor c = Tensor::copy_of(col);
  EXPECT_EQ(c.shape_str(), "[4, 3]");
  EXPECT_EQ(c.data_as<float>()[4], 9.0f);  // row 1, col 2+1
  TensorView row = t.view().select(0, 2);
  EXPECT_EQ(row.shape_str(), "[6]");
  EXPECT_EQ(row.data_as<float>()[0], 12.0f);
  EXPECT_THROW(t.view().narrow(1, 4, 3), Error);
  EXPECT_THROW(t.view().reshape({5, 5}), Error);
  // Out of memory (a size that overflows, an allocation that fails: 2^60 bytes,
  // beyond any address space): Error(kOutOfMemory) naming the tensor and the bytes.
  EXPECT_HAS(test::error_of(
                 [] {
                   Tensor::empty(DType::kF32, {int64_t{1} << 40, int64_t{1} << 40});
                 },
                 ErrorCode::kOutOfMemory),
             "Tensor::empty: out of memory: f32 [1099511627776, 1099511627776] is too large to "
             "allocate (2^62 bytes or more)");
  EXPECT_HAS(test::error_of([] { Tensor::empty(DType::kF32, {int64_t{1} << 58}); },
                            ErrorCode::kOutOfMemory),
             "Tensor::empty: out of memory: cannot allocate 1152921504606846976 bytes (1 EiB) for "
             "f32 [288230376151711744]");
  EXPECT_EQ(t.view().reshape({24}).numel(), 24);
  Tensor b = from_f32(t, DType::kBF16);
  Tensor back = to_f32(b);
  EXPECT_EQ(back.data_as<float>()[23], 23.0f);
}

TEST(Tensor, CheckTensorMessages) {
  Tensor t = Tensor::empty(DType::kF32, {5, 64});
  EXPECT_NO_THROW(check_tensor(t, "hidden_states", DType::kF32, {5, -1}));
  try {
    check_tensor(t, "hidden_states", DType::kF32, {5, 128});
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "hidden_states: expected f32 [5, 128], got f32 [5, 64]");
  }
  try {
    check_tensor(t, "topk_ids", DType::kI32, {-1, 2});
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "topk_ids: expected i32 [*, 2], got f32 [5, 64]");
  }
  int64_t shape[] = {5, 3}, strides[] = {6, 2};
  TensorView strided(t.data(), DType::kF32, shape, strides);
  EXPECT_THROW(check_tensor(strided, "x", DType::kF32, {5, 3}), Error);
}

TEST(ThreadPool, CoversRangeOnceAndPropagatesErrors) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> hits(1000);
  pool.parallel_for(1000, [&](int64_t b, int64_t e, int tid) {
    EXPECT_GE(tid, 0);
    EXPECT_LT(tid, 3);
    for (int64_t i = b; i < e; ++i) hits[i]++;
  });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  // Nested calls run inline and still cover their range.
  std::atomic<int64_t> total{0};
  pool.parallel_for(8, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i)
      pool.parallel_for(10, [&](int64_t b2, int64_t e2, int) { total += e2 - b2; });
  });
  EXPECT_EQ(total.load(), 80);
  EXPECT_THROW(pool.parallel_for(100,
                                 [&](int64_t b, int64_t, int) {
                                   if (b == 0) throw Error(ErrorCode::kInternal, "boom");
                                 }),
               Error);
  // Still usable afterwards.
  std::atomic<int64_t> n{0};
  pool.parallel_for(50, [&](int64_t b, int64_t e, int) { n += e - b; });
  EXPECT_EQ(n.load(), 50);
  pool.parallel_for(0, [&](int64_t, int64_t, int) { FAIL(); });
}

// Many small jobs back to back: a worker that wakes late for a job (it is
// over, or it finds the next one) must neither run a chunk of a job that has
// ended nor miss or repeat one of the current job; and a thread index runs
// one task at a time. Jobs of 1-40 items, some chunks throwing.
TEST(ThreadPool, BackToBackJobsEachRunEveryIndexOnce) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(64);
  std::array<std::atomic<int>, 4> busy{};
  std::atomic<int> overlaps{0};
  for (int job = 0; job < 20000; ++job) {
    const int64_t n = 1 + job % 40;
    for (int64_t i = 0; i < n; ++i) hits[i] = 0;
    const bool throws = job % 97 == 0;
    try {
      pool.parallel_for(n, [&](int64_t b, int64_t e, int tid) {
        if (busy[tid].fetch_add(1) != 0) ++overlaps;
        for (int64_t i = b; i < e; ++i) hits[i]++;
        busy[tid].fetch_sub(1);
        if (throws && b == 0) throw Error(ErrorCode::kInternal, "boom");
      });
      EXPECT_FALSE(throws) << "job " << job;
    } catch (const Error&) {
      EXPECT_TRUE(throws) << "job " << job;
    }
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "job " << job << " index " << i;
  }
  EXPECT_EQ(overlaps.load(), 0);
}

// set_global_num_threads while another thread runs on the global pool (the
// pool it replaces must stay alive for that call): no crash, no hang, every
// item counted.
TEST(ThreadPool, ResizingTheGlobalPoolWhileInUse) {
  std::atomic<bool> done{false};
  std::atomic<int64_t> total{0};
  std::thread user([&] {
    for (int i = 0; i < 400; ++i)
      ThreadPool::global().parallel_for(
          1000, [&](int64_t b, int64_t e, int) { total += e - b; }, 10);
    done = true;
  });
  for (int i = 0; !done && i < 2000; ++i) ThreadPool::set_global_num_threads(1 + i % 3);
  user.join();
  EXPECT_EQ(total.load(), 400 * 1000);
  ThreadPool::set_global_num_threads(0);
}

// fork() after a pool has run jobs: the child has none of the parent's
// workers, so each pool (the global one, a private one) starts new ones with
// its next job instead of waiting for them forever. The child gets 20 s
// (alarm) and reports by its exit status; the parent's pools still work after.
TEST(ThreadPool, UsableInAForkedChild) {
  ThreadPool pool(3);
  std::atomic<int64_t> n{0};
  const auto count = [&](int64_t b, int64_t e, int) { n += e - b; };
  pool.parallel_for(1000, count);
  ThreadPool::global().parallel_for(1000, count);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0) << "fork failed";
  if (pid == 0) {
    alarm(20);
    n = 0;
    std::atomic<int> tids{0};
    for (int i = 0; i < 3; ++i) {
      pool.parallel_for(1000, [&](int64_t b, int64_t e, int tid) {
        n += e - b;
        tids |= 1 << tid;
      });
      ThreadPool::global().parallel_for(1000, count);
    }
    ThreadPool other(2);  // a pool made in the child
    other.parallel_for(1000, count);
    _exit(n.load() == 7000 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status)) << "the child did not exit (signal "
                                 << (WIFSIGNALED(status) ? WTERMSIG(status) : 0)
                                 << "; SIGALRM: a pool waited for workers it does not have)";
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 0) << "wrong item count in the child";
  n = 0;
  pool.parallel_for(1000, count);
  ThreadPool::global().parallel_for(1000, count);
  EXPECT_EQ(n.load(), 2000);
}

// A fork while another thread resizes the global pool (session 26's second
// trial: the child waited for ever on the global pools' mutex, 14 times in 20).
TEST(ThreadPool, ForkWhileAnotherThreadResizesTheGlobalPool) {
  std::atomic<bool> stop{false};
  std::thread resizer([&] {
    for (int i = 0; !stop.load(); ++i) ThreadPool::set_global_num_threads(1 + i % 4);
  });
  int hung = 0, failed = 0;
  for (int f = 0; f < 20; ++f) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) {
      alarm(20);
      ThreadPool::set_global_num_threads(2);
      std::atomic<int64_t> n{0};
      ThreadPool::global().parallel_for(1000, [&](int64_t b, int64_t e, int) { n += e - b; });
      _exit(n.load() == 1000 ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    if (WIFSIGNALED(status))
      ++hung;  // SIGALRM
    else if (WEXITSTATUS(status) != 0)
      ++failed;
  }
  stop = true;
  resizer.join();
  ThreadPool::set_global_num_threads(0);
  EXPECT_EQ(hung, 0) << "children that hung (SIGALRM) out of 20";
  EXPECT_EQ(failed, 0);
}

// "All cores" is the CPUs the process may run on: under an affinity mask of one
// CPU (taskset -c 0), one thread; it was hardware_concurrency() (trial).
TEST(ThreadPool, AllCoresFollowsTheAffinityMask) {
  const int all = usable_cpus();
  EXPECT_GE(all, 1);
  EXPECT_EQ(ThreadPool(0).num_threads(), all);
  const pid_t pid = fork();  // the mask is set in a child: this process keeps its own
  ASSERT_GE(pid, 0) << "fork failed";
  if (pid == 0) {
    alarm(20);
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu() >= 0 ? sched_getcpu() : 0, &one);
    if (sched_setaffinity(0, sizeof one, &one) != 0) _exit(2);
    _exit(usable_cpus() == 1 && ThreadPool(0).num_threads() == 1 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: sched_setaffinity failed; 1: not one thread";
}

TEST(ThreadPool, RejectsAbsurdThreadCounts) {
  try {
    ThreadPool pool(1000000);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_threads: expected 1..1024"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ThreadPool::set_global_num_threads(1000000), Error);
  std::atomic<int64_t> n{0};  // the global pool is still usable
  ThreadPool::global().parallel_for(10, [&](int64_t b, int64_t e, int) { n += e - b; });
  EXPECT_EQ(n.load(), 10);
}

// Numbers from command lines and FUSEDMOE_* variables: plain decimal, the whole text.
TEST(ParseDecimal, IntegersPlainDecimalOnly) {
  int64_t v = -1;
  for (const auto& [text, want] :
       std::vector<std::pair<const char*, int64_t>>{{"0", 0},
                                                    {"16", 16},
                                                    {"+7", 7},
                                                    {"-3", -3},
                                                    {"010", 10},
                                                    {"-0", 0},
                                                    {"9223372036854775807", INT64_MAX},
                                                    {"-9223372036854775808", INT64_MIN}}) {
    ASSERT_EQ(parse_decimal(text, v), ParseNumber::kOk) << text;
    EXPECT_EQ(v, want) << text;
  }
  for (const char* bad :
       {"",      " 16",   "16 ", "1 6", "0x10", "0X10", "0b1", "0o7", "1e3",  "1.0",
        "1,000", "1_000", "+-1", "--1", "+",    "-",    "inf", "nan", "16\n", "\t1"}) {
    v = 42;
    EXPECT_EQ(parse_decimal(bad, v), ParseNumber::kNotDecimal) << '"' << bad << '"';
    EXPECT_EQ(v, 42) << bad;  // untouched
  }
  EXPECT_EQ(parse_decimal("9223372036854775808", v), ParseNumber::kOutOfRange);
  EXPECT_EQ(parse_decimal("-99999999999999999999", v), ParseNumber::kOutOfRange);
  uint64_t u = 0;
  ASSERT_EQ(parse_decimal("18446744073709551615", u), ParseNumber::kOk);
  EXPECT_EQ(u, UINT64_MAX);
  EXPECT_EQ(parse_decimal("18446744073709551616", u), ParseNumber::kOutOfRange);
  EXPECT_EQ(parse_decimal("-1", u), ParseNumber::kOutOfRange);
  EXPECT_EQ(parse_decimal("0x10", u), ParseNumber::kNotDecimal);
}

TEST(ParseDecimal, RealsPlainDecimalFinite) {
  double v = -1;
  for (const auto& [text, want] : std::vector<std::pair<const char*, double>>{{"0", 0.0},
                                                                              {"2.5", 2.5},
                                                                              {"+2.5", 2.5},
                                                                              {"-2.5", -2.5},
                                                                              {".5", 0.5},
                                                                              {"5.", 5.0},
                                                                              {"1e-5", 1e-5},
                                                                              {"2.5E+3", 2500.0},
                                                                              {"010", 10.0},
                                                                              {"1e308", 1e308}}) {
    ASSERT_EQ(parse_decimal(text, v), ParseNumber::kOk) << text;
    EXPECT_EQ(v, want) << text;
  }
  for (const char* bad : {"", " 1", "1 ", ".", "e5", "1e", "1e+", "0x1p3", "0x10", "inf", "-inf",
                          "nan", "infinity", "1,5", "1.5.2", "1e5.0", "+-1", "1f", "--1"}) {
    v = 42;
    EXPECT_EQ(parse_decimal(bad, v), ParseNumber::kNotDecimal) << '"' << bad << '"';
    EXPECT_EQ(v, 42) << bad;
  }
  EXPECT_EQ(parse_decimal("1e309", v), ParseNumber::kOutOfRange);
  EXPECT_EQ(parse_decimal("-1e999", v), ParseNumber::kOutOfRange);
}
