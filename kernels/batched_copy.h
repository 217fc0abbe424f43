// Many small row-block copies, casts and zero fills in one launch. dta's stack does these per
// layer several times per chunk (a chunk's K/V pushed onto the stack, its K/V gradient
// accumulators cast into backward's seeds, the accumulators zeroed when the chunk is popped): two
// per layer, three times per chunk, each a separate ATen call and kernel launch otherwise, which
// is much of the host time of a step whose chunks are small.
//
//   CopyAll({k0, v0, k1, v1}, {stack_k0.slice(0, b, e), stack_v0.slice(0, b, e), ...});
//   ZeroAll({grad_k0.slice(0, b, e), grad_v0.slice(0, b, e), ...});
//
// On CUDA, tensors whose dimensions after the first are contiguous (rows of a stack's slice, any
// row stride) with float32, bfloat16, float16 or float64 elements go through one kernel per run
// of up to kBatchedCopyMaxPieces of them; anything else (the CPU, other layouts or dtypes) through
// ATen's copy_ and zero_, with the same result: the copy converts dtypes as copy_ does (rounding
// to nearest even). Runs on the current stream; every tensor on one device. DTA_BATCHED_COPY=0 in
// the environment sends everything through ATen (to measure the difference in one build).
#ifndef DTA_KERNELS_BATCHED_COPY_H_
#define DTA_KERNELS_BATCHED_COPY_H_

#include <ATen/ATen.h>

#include <cstdint>

#include "absl/types/span.h"

namespace dta::kernels {

// Pieces per launch (the kernel's arguments hold their addresses and strides).
inline constexpr int64_t kBatchedCopyMaxPieces = 64;

// destinations[i].copy_(sources[i]) for every i: equal shapes (sizes), any floating dtypes.
// Destinations must not overlap each other or the sources.
void CopyAll(absl::Span<const at::Tensor> sources, absl::Span<const at::Tensor> destinations);

// t.zero_() for every t.
void ZeroAll(absl::Span<const at::Tensor> tensors);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_BATCHED_COPY_H_
