#include "kernels/grouped_gemm.h"

#ifdef DTA_KERNELS_HAVE_HOPPER
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/hopper/grouped_gemm_hopper.h"
#endif

#include "core/base/env_switch.h"

namespace dta::kernels {

bool AddGroupedWeightGrad(at::Tensor& accumulator, const at::Tensor& dy, const at::Tensor& x,
                          const at::Tensor& ends, bool overwrite) {
#ifdef DTA_KERNELS_HAVE_HOPPER
  if (!accumulator.is_cuda() || accumulator.scalar_type() != at::kFloat ||
      dy.scalar_type() != at::kBFloat16 || x.scalar_type() != at::kBFloat16 ||
      ends.scalar_type() != at::kLong || accumulator.dim() != 3 || dy.dim() != 2 || x.dim() != 2 ||
      !accumulator.is_contiguous() || !dy.is_contiguous() || !x.is_contiguous() ||
      !ends.is_contiguous() || dy.size(0) != x.size(0) || accumulator.size(0) != ends.size(0) ||
      accumulator.size(1) != dy.size(1) || accumulator.size(2) != x.size(1) || dy.size(0) == 0) {
    return false;
  }
  if (!EnvSwitchOn("DTA_GROUPED_WGRAD")) return false;
  const cudaDeviceProp* device = at::cuda::getDeviceProperties(accumulator.get_device());
  if (device->major != 9) return false;
  const c10::cuda::CUDAGuard guard(
      accumulator.device());  // the launch goes to accumulator's device
  const GroupedWeightGradParams p{.accumulator = accumulator.data_ptr<float>(),
                                  .dy = dy.const_data_ptr(),
                                  .x = x.const_data_ptr(),
                                  .ends = ends.const_data_ptr<int64_t>(),
                                  .experts = static_cast<int>(accumulator.size(0)),
                                  .m = static_cast<int>(accumulator.size(1)),
                                  .n = static_cast<int>(accumulator.size(2)),
                                  .sm_count = device->multiProcessorCount,
                                  .overwrite = overwrite};
  if (p.m % 8 != 0 || p.n % 8 != 0 || p.experts > 4096) return false;
  const size_t bytes = HopperGroupedWeightGradBufferBytes(p);
  // From the caching allocator, so that the buffer stays valid for the launch on this stream.
  const at::DataPtr buffer = c10::cuda::CUDACachingAllocator::get()->allocate(bytes);
  const cudaError_t error = LaunchHopperGroupedWeightGrad(
      p, buffer.get(), bytes, at::cuda::getCurrentCUDAStream(accumulator.get_device()).stream());
  TORCH_CHECK(error == cudaSuccess, "grouped weight gradient: ", cudaGetErrorString(error));
  return true;
#else
  (void)accumulator;
  (void)dy;
  (void)x;
  (void)ends;
  (void)overwrite;
  return false;
#endif
}

}  // namespace dta::kernels
