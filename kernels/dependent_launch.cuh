// Programmatic dependent launch (Hopper and later) for dta's small kernels: a kernel launched with
// LaunchAfterPrevious may be scheduled while the kernel before it on the stream is still finishing,
// so its launch latency (2-3 us per kernel boundary, thousands of boundaries per step) overlaps the
// previous kernel's tail instead of leaving the GPU idle.
//
// The contract: every kernel launched with LaunchAfterPrevious calls WaitForPreviousKernels()
// before its first access to global memory. The wait returns once the kernels before it on the
// stream have completed and their writes are visible, so each kernel reads and writes exactly as
// under plain stream order (reads of the previous kernel's outputs and writes to what it reads
// both come after it). The wait then lets the next dependent launch be scheduled: its blocks start
// as this kernel's blocks finish and wait in turn. Kernels launched otherwise (cuBLAS, ATen) keep
// stream order as always.
//
// DTA_DEPENDENT_LAUNCH=0 launches without the attribute (plain stream order; read at every launch,
// for before/after measurements in one process). Framework-free (kernels/hopper includes it too).
#ifndef DTA_KERNELS_DEPENDENT_LAUNCH_CUH_
#define DTA_KERNELS_DEPENDENT_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <utility>

#include "core/base/env_switch.h"

namespace dta::kernels::internal {

// The first statement of a kernel launched with LaunchAfterPrevious (a no-op without the launch
// attribute, and before compute capability 9.0).
__device__ __forceinline__ void WaitForPreviousKernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

inline bool DependentLaunchEnabled() { return EnvSwitchOn("DTA_DEPENDENT_LAUNCH"); }

// kernel<<<grid, block, shared_bytes, stream>>>(args...) with programmatic stream serialization;
// returns the launch's error. `kernel` must keep the contract above.
template <typename... Params, typename... Args>
[[nodiscard]] cudaError_t LaunchAfterPrevious(void (*kernel)(Params...), dim3 grid, dim3 block,
                                              size_t shared_bytes, cudaStream_t stream,
                                              Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = DependentLaunchEnabled() ? 1 : 0;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_DEPENDENT_LAUNCH_CUH_
