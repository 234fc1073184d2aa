// fusedmoe: the environment's tuning switches (core/env.h).
#include "fusedmoe/core/env.h"

#include <array>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>

#include "fusedmoe/core/error.h"

namespace fusedmoe {

namespace {

// env_choice over values[0..n).
int choice(const char* name, const char* const* values, int n) {
  const char* env = std::getenv(name);
  if (env == nullptr || env[0] == '\0') return -1;
  for (int i = 0; i < n; ++i)
    if (std::strcmp(env, values[i]) == 0) return i;
  std::string expected;
  for (int i = 0; i < n; ++i) {
    if (i > 0) expected += i + 1 == n ? " or " : ", ";
    expected += values[i];
  }
  FUSEDMOE_THROW(kInvalidArgument, name, ": expected ", expected, ", got '", printable(env), "'");
}

// The CUDA switches in CudaSwitch's order (env.h lists the same).
struct Switch {
  const char* name;
  std::array<const char*, 3> values;
  int count;
};
constexpr Switch kCudaSwitches[] = {
    {"FUSEDMOE_CUDA_EXPERTS", {"sm90", "mma"}, 2},
    {"FUSEDMOE_CUDA_SM90_TILE", {"m64", "m128"}, 2},
    {"FUSEDMOE_CUDA_SM90_CONTIG", {"on", "off"}, 2},
    {"FUSEDMOE_CUDA_SM90_GLU", {"epilogue", "pass"}, 2},
    {"FUSEDMOE_CUDA_W13_LAYOUT", {"interleaved", "standard"}, 2},
    {"FUSEDMOE_CUDA_M16_STAGES", {"3", "4"}, 2},
    {"FUSEDMOE_CUDA_ALIGN", {"fused", "chunks", "grid"}, 3},
    {"FUSEDMOE_CUDA_DECODE", {"0", "1"}, 2},
    {"FUSEDMOE_CUDA_PDL", {"0", "1"}, 2},
    {"FUSEDMOE_CUDA_MMA_SCHEDULE", {"dynamic", "static"}, 2},
};
static_assert(std::size(kCudaSwitches) == static_cast<size_t>(CudaSwitch::kCount),
              "one entry a CudaSwitch");

}  // namespace

int env_choice(const char* name, std::initializer_list<const char*> values) {
  return choice(name, values.begin(), static_cast<int>(values.size()));
}

int cuda_switch(CudaSwitch s) {
  const int i = static_cast<int>(s);
  FUSEDMOE_CHECK(i >= 0 && i < static_cast<int>(CudaSwitch::kCount), "cuda_switch: unknown switch ",
                 i);
  const Switch& w = kCudaSwitches[i];
  return choice(w.name, w.values.data(), w.count);
}

void check_cuda_switches() {
  for (int s = 0; s < static_cast<int>(CudaSwitch::kCount); ++s)
    cuda_switch(static_cast<CudaSwitch>(s));
}

}  // namespace fusedmoe
