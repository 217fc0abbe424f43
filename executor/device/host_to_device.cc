#include "executor/device/host_to_device.h"

namespace dta {

at::Tensor CopyToDevice(const at::Tensor& host, const at::TensorOptions& options) {
  TORCH_CHECK(host.device().is_cpu(), "CopyToDevice: source must be a CPU tensor");
  if (!options.device().is_cuda()) return host.to(options, /*non_blocking=*/false, /*copy=*/true);
  // The dtype conversion happens on the host so the pinned staging buffer holds the final bytes.
  const at::Tensor pinned = host.to(options.dtype().toScalarType()).pin_memory();
  return pinned.to(options, /*non_blocking=*/true, /*copy=*/true);
}

at::Tensor CopyToDevice(absl::Span<const int64_t> values, const at::TensorOptions& options) {
  const at::Tensor host = at::from_blob(const_cast<int64_t*>(values.data()),
                                        {static_cast<int64_t>(values.size())}, at::kLong);
  return CopyToDevice(host, options.dtype(at::kLong));
}

at::Tensor CopyToDevice(absl::Span<const float> values, const at::TensorOptions& options) {
  const at::Tensor host = at::from_blob(const_cast<float*>(values.data()),
                                        {static_cast<int64_t>(values.size())}, at::kFloat);
  return CopyToDevice(host, options);
}

}  // namespace dta
