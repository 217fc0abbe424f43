// The CUDA path of kernels/adamw_step.h, defined in adamw_step.cu when the library is built with
// nvcc (DTA_KERNELS_HAVE_CUDA). Not part of the public API.
#ifndef DTA_KERNELS_ADAMW_STEP_INTERNAL_H_
#define DTA_KERNELS_ADAMW_STEP_INTERNAL_H_

#include <cstdint>

#include "kernels/adamw_step.h"

namespace dta::kernels::internal {

// The update of `n` elements of contiguous float32 arrays on the current stream of `device`.
void AdamWStepCuda(float* master, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n,
                   const AdamWStepFloats& floats, const at::Device& device);

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_ADAMW_STEP_INTERNAL_H_
