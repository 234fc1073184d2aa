// fusedmoe: the environment's tuning switches (core/env.h).
#include "fusedmoe/core/env.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "fusedmoe/core/error.h"

namespace fusedmoe {

int env_choice(const char* name, std::initializer_list<const char*> values) {
  const char* env = std::getenv(name);
  if (env == nullptr || env[0] == '\0') return -1;
  int i = 0;
  for (const char* v : values) {
    if (std::strcmp(env, v) == 0) return i;
    ++i;
  }
  std::string expected;
  i = 0;
  for (const char* v : values) {
    if (i > 0) expected += i + 1 == static_cast<int>(values.size()) ? " or " : ", ";
    expected += v;
    ++i;
  }
  FUSEDMOE_THROW(kInvalidArgument, name, ": expected ", expected, ", got '", printable(env), "'");
}

int cuda_switch(CudaSwitch s) {
  switch (s) {
    case CudaSwitch::kExperts:
      return env_choice("FUSEDMOE_CUDA_EXPERTS", {"sm90", "mma"});
    case CudaSwitch::kSm90Tile:
      return env_choice("FUSEDMOE_CUDA_SM90_TILE", {"m64", "m128"});
    case CudaSwitch::kSm90Contig:
      return env_choice("FUSEDMOE_CUDA_SM90_CONTIG", {"on", "off"});
    case CudaSwitch::kSm90Glu:
      return env_choice("FUSEDMOE_CUDA_SM90_GLU", {"epilogue", "pass"});
    case CudaSwitch::kW13Layout:
      return env_choice("FUSEDMOE_CUDA_W13_LAYOUT", {"interleaved", "standard"});
    case CudaSwitch::kM16Stages:
      return env_choice("FUSEDMOE_CUDA_M16_STAGES", {"3", "4"});
    case CudaSwitch::kAlign:
      return env_choice("FUSEDMOE_CUDA_ALIGN", {"fused", "chunks", "grid"});
    case CudaSwitch::kDecode:
      return env_choice("FUSEDMOE_CUDA_DECODE", {"0", "1"});
    case CudaSwitch::kPdl:
      return env_choice("FUSEDMOE_CUDA_PDL", {"0", "1"});
    case CudaSwitch::kCount:
      break;
  }
  FUSEDMOE_THROW(kInvalidArgument, "cuda_switch: unknown switch ", static_cast<int>(s));
}

void check_cuda_switches() {
  for (int s = 0; s < static_cast<int>(CudaSwitch::kCount); ++s)
    cuda_switch(static_cast<CudaSwitch>(s));
}

}  // namespace fusedmoe
