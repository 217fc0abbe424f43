// Host memory that a GPU copies to and from at full speed: page-locked with cudaHostRegister,
// allocated at exactly the size asked for. For optimizer state offloaded to the host and streamed
// through the GPU (ShardedAdamW), tens of gigabytes: PyTorch's pinned allocator rounds each block
// up to a power of two (a 30.5 GiB moment would take 32 GiB, a 59 GB one 64 GiB) and keeps freed
// blocks cached, and pageable memory crosses the bus at a fraction of the speed (7-14 GB/s against
// 54 GB/s each way, measured on an H100 machine).
//
//   absl::StatusOr<at::Tensor> state = PinnedHostZeros(n, at::kFloat);
//   if (state.ok()) ... else fall back to pageable memory (status names the CUDA error)
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "absl/status/statusor.h"

namespace dta {

// A contiguous CPU tensor of `numel` zeros of `dtype`, page-locked for the GPUs of this process;
// freeing the tensor's storage unregisters and frees the memory. The pages are touched (zeroed)
// by several threads before they are locked, which is where most of the time goes (on the order of
// seconds per 10 GiB). RESOURCE_EXHAUSTED when the memory cannot be allocated, UNAVAILABLE when
// CUDA cannot lock it (no CUDA, no device, or the driver refuses), naming the size and the error.
absl::StatusOr<at::Tensor> PinnedHostZeros(int64_t numel, at::ScalarType dtype);

}  // namespace dta
