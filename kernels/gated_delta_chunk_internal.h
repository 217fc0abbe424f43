// What kernels/gated_delta_chunk.cc calls in kernels/gated_delta_chunk.cu (built with nvcc only).
#ifndef DTA_KERNELS_GATED_DELTA_CHUNK_INTERNAL_H_
#define DTA_KERNELS_GATED_DELTA_CHUNK_INTERNAL_H_

#include <ATen/ATen.h>

#include <cstdint>

#include "kernels/gated_delta_chunk.h"

namespace dta::kernels::internal {

// The largest chunk the kernels take (a thread a row in their row phases; the [C, C] matrices in
// shared memory).
inline constexpr int64_t kGatedDeltaMaxChunk = 64;

// x rounded up to the kernels' tile (16): the padded chunk Cp and key dim Kp of their shared
// matrices and of the backward's q and k gradients.
constexpr int64_t PadToMmaTile(int64_t x) { return (x + 15) / 16 * 16; }

// Whether the forward kernel takes chunks of `chunk` tokens with key dim `dk` in `type` on CUDA
// device `device` (its shared memory fits).
bool GatedDeltaChunkFits(at::ScalarType type, int64_t chunk, int64_t dk, int device);

// One launch: every term of `out` (allocated, contiguous, [H, N, C, *] and [H, N]) from contiguous
// q, k [T, Hk, Dk], v [T, H, Dv], g, beta [T, H] of one type on one device.
void GatedDeltaChunkForwardCuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& g, const at::Tensor& beta, ChunkTerms& out);

// Whether the backward kernel takes chunks of `chunk` tokens with key dim `dk` in `type` on CUDA
// device `device` (its shared memory fits; Dv is not bounded).
bool GatedDeltaChunkBackwardFits(at::ScalarType type, int64_t chunk, int64_t dk, int device);

// The backward kernel's inputs: contiguous q, k [T, Hk, Dk], v [T, H, Dv], g, beta [T, H] and the
// forward's outputs U [H, N, C, Dv] and W [H, N, C, Dk], of one type on one device.
struct BackwardInputs {
  at::Tensor q, k, v, g, beta, new_values, k_cumdecay;
};

// Its outputs, allocated and contiguous: q and k [N * Cp, H, Kp] per value head (chunk n's token
// i in row n * Cp + i, padding rows and columns written but not gradients; the caller narrows them
// and sums a key head's group), v [T, H, Dv], g and beta [T, H].
struct BackwardOutputs {
  at::Tensor q, k, v, g, beta;
};

// One launch: the gradients of the inputs from the terms' gradients `grad` (contiguous; an
// undefined one is zeros).
void GatedDeltaChunkBackwardCuda(const BackwardInputs& in, const ChunkTerms& grad,
                                 const BackwardOutputs& out);

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_GATED_DELTA_CHUNK_INTERNAL_H_
