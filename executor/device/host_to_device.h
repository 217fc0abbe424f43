// Host-to-device copies that never synchronize the host with the GPU.
//
// A plain `tensor.to(cuda)` from pageable host memory waits for the copy (and so for all work
// queued before it). The executor uploads small index and loss tensors inside its loop, where such
// a wait would stall the CPU until the GPU drains; these helpers stage through pinned memory
// (PyTorch's caching host allocator, which keeps the staging block alive until the copy has run)
// and copy asynchronously on the current stream. On the CPU they are ordinary copies.
//
// Example:
//   at::Tensor ids = CopyToDevice(absl::MakeConstSpan(host_ids),
//   at::TensorOptions().device(at::kCUDA));
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace dta {

// A copy of a CPU tensor with `options` (dtype and device); never an alias of `host`.
at::Tensor CopyToDevice(const at::Tensor& host, const at::TensorOptions& options);

// Copies of host vectors: int64 values keep int64; floats take options' dtype.
at::Tensor CopyToDevice(absl::Span<const int64_t> values, const at::TensorOptions& options);
at::Tensor CopyToDevice(absl::Span<const float> values, const at::TensorOptions& options);

}  // namespace dta
