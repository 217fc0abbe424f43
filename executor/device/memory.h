// How much device memory the executor may still use.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace dta {

// Bytes a new allocation on `device` can still get: the driver's free memory plus what PyTorch's
// caching allocator holds reserved but unused. 0 for non-CUDA devices.
int64_t FreeDeviceMemory(const at::Device& device);

// Bytes PyTorch's caching allocator has handed out on `device` now (tensors alive). 0 for non-CUDA
// devices.
int64_t AllocatedDeviceMemory(const at::Device& device);

}  // namespace dta
