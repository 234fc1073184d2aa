// Tests of the benchmark helpers (src/cli/bench_common.h): the roofline share
// `fusedmoe bench` prints.
#include <gtest/gtest.h>

#include "cli/bench_common.h"

namespace fusedmoe::bench {
namespace {

// A run faster than a ceiling measured at start-up (weights in the caches, a
// machine busier during the measurement) printed more than 100 % of the roofline;
// each ceiling is taken as at least what the run achieved now.
TEST(BenchRoofline, ShareIsAtMostOneAndSaysWhenACeilingWasRaised) {
  Ceilings c;
  c.read_gbps = 10;     // 10 GB/s
  c.peak_gflops = 100;  // 100 GFLOP/s
  Roofline r;
  r.bytes = 1e9;  // 0.1 s at the bandwidth
  r.flops = 1e9;  // 0.01 s at the peak
  // Slower than both ceilings: floor / time, nothing raised.
  RooflineShare s = roofline_share(r, 0.2, c);
  EXPECT_DOUBLE_EQ(s.frac, 0.5);
  EXPECT_FALSE(s.raised);
  // 20 GB/s, twice the measured bandwidth: 100 %, not 200 %, and marked.
  s = roofline_share(r, 0.05, c);
  EXPECT_DOUBLE_EQ(s.frac, 1.0);
  EXPECT_TRUE(s.raised);
  // Compute bound, above the measured peak: likewise.
  r.bytes = 1e6;
  r.flops = 2e10;  // 0.2 s at the peak
  s = roofline_share(r, 0.1, c);
  EXPECT_DOUBLE_EQ(s.frac, 1.0);
  EXPECT_TRUE(s.raised);
  s = roofline_share(r, 0.4, c);
  EXPECT_DOUBLE_EQ(s.frac, 0.5);
  EXPECT_FALSE(s.raised);
  // No time, no share.
  EXPECT_EQ(roofline_share(r, 0.0, c).frac, 0.0);
}

}  // namespace
}  // namespace fusedmoe::bench
