// fusedmoe internal: CUDA runtime error checks for host code (.cpp and .cu).
#pragma once

#include <cuda_runtime_api.h>

#include "fusedmoe/core/error.h"

// Throws fusedmoe::Error(kInternal) naming the call and CUDA's message.
#define FUSEDMOE_CUDA_CHECK(expr)                                                                \
  do {                                                                                           \
    const cudaError_t fusedmoe_err_ = (expr);                                                    \
    if (fusedmoe_err_ != cudaSuccess)                                                            \
      FUSEDMOE_THROW(kInternal, "CUDA error in ", #expr, ": ", cudaGetErrorName(fusedmoe_err_),  \
                     " (", cudaGetErrorString(fusedmoe_err_), ") at ", __FILE__, ":", __LINE__); \
  } while (0)

// After a launch: configuration errors surface here (asynchronous faults later).
#define FUSEDMOE_CUDA_CHECK_LAUNCH() FUSEDMOE_CUDA_CHECK(cudaGetLastError())
