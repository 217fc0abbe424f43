// What kernels/gated_delta_chunk.cc calls in kernels/gated_delta_chunk.cu (built with nvcc only).
#ifndef DTA_KERNELS_GATED_DELTA_CHUNK_INTERNAL_H_
#define DTA_KERNELS_GATED_DELTA_CHUNK_INTERNAL_H_

#include <ATen/ATen.h>

#include <cstdint>

#include "kernels/gated_delta_chunk.h"

namespace dta::kernels::internal {

// The largest chunk the kernel takes (its block's threads cover a chunk's pairs of rows).
inline constexpr int64_t kGatedDeltaMaxChunk = 64;

// Whether the forward kernel takes chunks of `chunk` tokens with key dim `dk` in `type` on CUDA
// device `device` (its shared memory fits).
bool GatedDeltaChunkFits(at::ScalarType type, int64_t chunk, int64_t dk, int device);

// One launch: every term of `out` (allocated, contiguous, [H, N, C, *] and [H, N]) from contiguous
// q, k [T, Hk, Dk], v [T, H, Dv], g, beta [T, H] of one type on one device.
void GatedDeltaChunkForwardCuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& g, const at::Tensor& beta, ChunkTerms& out);

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_GATED_DELTA_CHUNK_INTERNAL_H_
