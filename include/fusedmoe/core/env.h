// fusedmoe: reading the tuning switches in the environment (README "Switches").
#pragma once

#include <initializer_list>

namespace fusedmoe {

// The value of the environment variable `name` among `values`: its index, or -1
// where the variable is unset or empty. Any other value throws
// Error(kInvalidArgument) "NAME: expected a, b or c, got 'X'" (X as printable() shows it).
int env_choice(const char* name, std::initializer_list<const char*> values);

// The CUDA backend's switches; cuda_switch(s) is env_choice of s's variable
// over the values listed here (the index of the one given, -1 unset):
enum class CudaSwitch {
  kExperts,      // FUSEDMOE_CUDA_EXPERTS: sm90, mma
  kSm90Tile,     // FUSEDMOE_CUDA_SM90_TILE: m64, m128
  kSm90Contig,   // FUSEDMOE_CUDA_SM90_CONTIG: on, off
  kSm90Glu,      // FUSEDMOE_CUDA_SM90_GLU: epilogue, pass
  kW13Layout,    // FUSEDMOE_CUDA_W13_LAYOUT: interleaved, standard
  kM16Stages,    // FUSEDMOE_CUDA_M16_STAGES: 3, 4
  kAlign,        // FUSEDMOE_CUDA_ALIGN: fused, chunks, grid
  kDecode,       // FUSEDMOE_CUDA_DECODE: 0, 1
  kPdl,          // FUSEDMOE_CUDA_PDL: 0, 1
  kMmaSchedule,  // FUSEDMOE_CUDA_MMA_SCHEDULE: dynamic, static
  kCount         // the number of switches (not one)
};
int cuda_switch(CudaSwitch s);

// Checks every CUDA switch, on any backend and in builds without CUDA, so a bad
// value is never silently ignored where the CUDA kernels do not run. Throws as
// env_choice.
void check_cuda_switches();

}  // namespace fusedmoe
