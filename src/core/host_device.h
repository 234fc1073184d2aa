// fusedmoe internal: code shared by the CPU and the CUDA kernels (the routers'
// scores, the routing simulator): FUSEDMOE_HOST_DEVICE marks a function for
// both compilers (__host__ __device__ under nvcc, nothing for the C++ compiler).
#pragma once

#if defined(__CUDACC__)
#define FUSEDMOE_HOST_DEVICE __host__ __device__
#else
#define FUSEDMOE_HOST_DEVICE
#endif
