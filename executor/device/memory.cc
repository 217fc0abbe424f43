#include "executor/device/memory.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

namespace dta {

int64_t FreeDeviceMemory(const at::Device& device) {
  if (!device.is_cuda()) return 0;
  const c10::cuda::CUDAGuard guard(device);
  size_t free_bytes = 0, total_bytes = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(guard.current_device().index());
  const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const int64_t cached =
      stats.reserved_bytes[aggregate].current - stats.allocated_bytes[aggregate].current;
  return static_cast<int64_t>(free_bytes) + cached;
}

int64_t AllocatedDeviceMemory(const at::Device& device) {
  if (!device.is_cuda()) return 0;
  const c10::cuda::CUDAGuard guard(device);
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(guard.current_device().index());
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
      .current;
}

}  // namespace dta
