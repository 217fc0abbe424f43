#include "executor/device/pinned_host.h"

#include <ATen/Parallel.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/base/parallel_for.h"

namespace dta {
namespace {

constexpr size_t kPage = 4096;

void UnregisterAndFree(void* data) {
  cudaHostUnregister(data);  // nothing to do about a failure while freeing
  std::free(data);
}

}  // namespace

absl::StatusOr<at::Tensor> PinnedHostZeros(int64_t numel, at::ScalarType dtype) {
  if (numel < 0) return absl::InvalidArgumentError(absl::StrCat("PinnedHostZeros: numel ", numel));
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(numel, 1)) * c10::elementSize(dtype);
  const size_t rounded = (bytes + kPage - 1) / kPage * kPage;
  void* data = std::aligned_alloc(kPage, rounded);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", rounded, " bytes of host memory to pin"));
  }
  // The first touch of fresh pages (the kernel's page faults and zeroing) runs at 1-2 GB/s per
  // thread: zero them on every thread before locking them.
  char* bytes_at = static_cast<char*>(data);
  ParallelFor(static_cast<int64_t>(rounded / kPage), 16384, at::get_num_threads(),
              [&](int64_t begin, int64_t end) {
                std::memset(bytes_at + begin * kPage, 0, (end - begin) * kPage);
              });
  const cudaError_t error = cudaHostRegister(data, rounded, cudaHostRegisterDefault);
  if (error != cudaSuccess) {
    cudaGetLastError();  // reset CUDA's last error, so that later checks do not report this one
    std::free(data);
    return absl::UnavailableError(absl::StrCat(
        "cannot page-lock ", rounded, " bytes of host memory: ", cudaGetErrorString(error)));
  }
  return at::from_blob(data, {numel}, UnregisterAndFree, at::TensorOptions().dtype(dtype));
}

}  // namespace dta
