// fusedmoe internal: the routing simulator's per-token draw (RoutingMethod::
// kSimulated), one piece of code for the CPU router (simulated_router.cpp) and
// the CUDA kernel (kernels/cuda/simulated_routing.cu), so both give the same
// ids for the same (simulation_seed, token).
//
// Each token draws its k distinct columns of the E + Z router columns with a
// private splitmix64 generator seeded from (seed, token index):
//   kUniform : k distinct columns uniformly at random (Floyd's algorithm,
//              Bentley & Floyd, "Programming Pearls: A Sample of Brilliance", 1987)
//   kZipf    : sequential draws without replacement, P(c) ~ 1 / (c + 1)^zipf_s
//   kAllToOne: columns 0..k-1
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/host_device.h"
#include "fusedmoe/config/moe_config.h"

namespace fusedmoe::routing::simulated {

// splitmix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number
// generators", OOPSLA 2014).
FUSEDMOE_HOST_DEVICE inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct TokenRng {
  FUSEDMOE_HOST_DEVICE TokenRng(uint64_t seed, int64_t token) {
    uint64_t s = seed ^ (static_cast<uint64_t>(token) * 0xd1b54a32d192ed03ull);
    state = splitmix64(s);
  }
  FUSEDMOE_HOST_DEVICE uint64_t next() { return splitmix64(state); }
  // Uniform integer in [0, n) (multiply-shift; bias < n / 2^64).
  FUSEDMOE_HOST_DEVICE int64_t below(int64_t n) {
    return static_cast<int64_t>(
        (static_cast<unsigned __int128>(next()) * static_cast<uint64_t>(n)) >> 64);
  }
  // Uniform double in [0, 1).
  FUSEDMOE_HOST_DEVICE double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  uint64_t state;
};

FUSEDMOE_HOST_DEVICE inline bool contains(const int32_t* v, int64_t n, int32_t x) {
  for (int64_t i = 0; i < n; ++i)
    if (v[i] == x) return true;
  return false;
}

// kZipf tables over n columns: pmf[c] = (c + 1)^-s, cdf[c] = pmf[0] + ... + pmf[c].
// Host only (std::pow): the CUDA layer uploads the host's tables, so both agree.
inline void zipf_tables(int64_t n, double s, std::vector<double>& pmf, std::vector<double>& cdf) {
  pmf.resize(static_cast<size_t>(n));
  cdf.resize(static_cast<size_t>(n));
  double acc = 0.0;
  for (int64_t c = 0; c < n; ++c) {
    pmf[c] = std::pow(static_cast<double>(c + 1), -s);
    cdf[c] = (acc += pmf[c]);
  }
}

// One draw from the Zipf pmf conditioned on not being in taken[0..m):
// rejection from the full distribution, then (if unlucky) an exact walk over
// the remaining mass. Both give the same conditional distribution.
FUSEDMOE_HOST_DEVICE inline int32_t draw_zipf(TokenRng& rng, const double* pmf, const double* cdf,
                                              int64_t n, const int32_t* taken, int64_t m) {
  const double total = cdf[n - 1];
  for (int attempt = 0; attempt < 32; ++attempt) {
    const double u = rng.uniform() * total;
    int64_t lo = 0, hi = n;  // first c with cdf[c] > u (std::upper_bound)
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (cdf[mid] > u)
        hi = mid;
      else
        lo = mid + 1;
    }
    const int64_t c = lo < n - 1 ? lo : n - 1;
    if (!contains(taken, m, static_cast<int32_t>(c))) return static_cast<int32_t>(c);
  }
  double remaining = total;
  for (int64_t i = 0; i < m; ++i) remaining -= pmf[taken[i]];
  const double u = rng.uniform() * remaining;
  double acc = 0.0;
  int32_t last = -1;
  for (int64_t c = 0; c < n; ++c) {
    if (contains(taken, m, static_cast<int32_t>(c))) continue;
    last = static_cast<int32_t>(c);
    acc += pmf[c];
    if (acc > u) return last;
  }
  return last;  // rounding: the last free column
}

// Token t's k distinct columns (of n = E + Z) into sel[0..k). pmf/cdf: the
// zipf_tables (kZipf only; may be null otherwise).
FUSEDMOE_HOST_DEVICE inline void draw_token(SimulatedRouting kind, uint64_t seed, int64_t t,
                                            int64_t n, int64_t k, const double* pmf,
                                            const double* cdf, int32_t* sel) {
  TokenRng rng(seed, t);
  switch (kind) {
    case SimulatedRouting::kUniform:
      // Floyd: for j = n-k .. n-1 draw r in [0, j]; take r, or j if r was taken.
      for (int64_t j = n - k, m = 0; j < n; ++j, ++m) {
        const int32_t r = static_cast<int32_t>(rng.below(j + 1));
        sel[m] = contains(sel, m, r) ? static_cast<int32_t>(j) : r;
      }
      break;
    case SimulatedRouting::kZipf:
      for (int64_t m = 0; m < k; ++m) sel[m] = draw_zipf(rng, pmf, cdf, n, sel, m);
      break;
    case SimulatedRouting::kAllToOne:
      for (int64_t m = 0; m < k; ++m) sel[m] = static_cast<int32_t>(m);
      break;
  }
}

}  // namespace fusedmoe::routing::simulated
