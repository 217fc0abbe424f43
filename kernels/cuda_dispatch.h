// What the op wrappers of kernels/ ask before they launch a CUDA kernel of their own: whether one
// may run for an operand, and whether an operand has the layout the kernels take.
#ifndef DTA_KERNELS_CUDA_DISPATCH_H_
#define DTA_KERNELS_CUDA_DISPATCH_H_

#include <ATen/ATen.h>

#include "core/base/env_switch.h"

namespace dta::kernels::internal {

// Whether the CUDA kernels run for operands on t's device: built with them, t on a CUDA device,
// and the environment variable `env_switch` not "0" (read at every call).
inline bool CudaKernelsFor(const at::Tensor& t, const char* env_switch) {
#ifdef DTA_KERNELS_HAVE_CUDA
  return t.is_cuda() && EnvSwitchOn(env_switch);
#else
  (void)t;
  (void)env_switch;
  return false;
#endif
}

// A contiguous tensor of `type` on `device`.
inline bool Dense(const at::Tensor& t, at::ScalarType type, const at::Device& device) {
  return t.scalar_type() == type && t.is_contiguous() && t.device() == device;
}

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_CUDA_DISPATCH_H_
