// fusedmoe internal: Programmatic Dependent Launch (Hopper, sm_90) for the
// small kernels of the decode chain (router GEMM -> route -> to-bf16 -> align
// -> w13 GEMV -> w2 GEMV -> finalize).
//
// A kernel launched with launch_pdl() may start while the kernel before it in
// the stream is still running, as soon as every block of that kernel has run
// pdl_launch_dependents() (or exited): its blocks are scheduled, and its
// launch latency and ramp-up overlap the predecessor's tail. It must call
// pdl_wait() — which returns once the predecessor grid has completed and its
// memory is visible — before it reads anything an earlier kernel of the
// stream writes, or writes anything an earlier kernel reads. Rule kept by
// every kernel here: pdl_wait() first (in every thread, before any early
// return), pdl_launch_dependents() only after it. Then when a kernel starts,
// every kernel before its immediate predecessor has completed, and a kernel's
// completion implies its predecessors' (a chain of waits).
//
// Outside a graph the launch behaves the same (the attribute applies to the
// previous kernel of the same stream; memcpy, memset and event waits in
// between serialize as usual); under stream capture it becomes a programmatic
// graph edge. Both instructions are no-ops in a kernel launched normally.
// FUSEDMOE_CUDA_PDL=0 in the environment launches normally (A/B timing).
// Source: CUDA C++ Programming Guide, "Programmatic Dependent Launch and
// Synchronization"; PTX ISA, griddepcontrol.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "fusedmoe/core/env.h"
#include "kernels/cuda/cuda_check.h"

namespace fusedmoe::cuda {

#ifdef __CUDACC__
// Waits until the previous kernel of the stream has completed (memory visible).
__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
// Lets the next kernel of the stream (launched with launch_pdl) start.
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
#endif

inline bool pdl_enabled() {
  static const bool on = cuda_switch(CudaSwitch::kPdl) != 0;  // 0 turns it off
  return on;
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream
// serialization allowed (see above); throws fusedmoe::Error on a launch error.
template <typename... KArgs, typename... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  FUSEDMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace fusedmoe::cuda
