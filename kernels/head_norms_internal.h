// The CUDA entry points of kernels/head_norms.h, defined in head_norms.cu when the library is
// built with nvcc (DTA_KERNELS_HAVE_CUDA). Inputs are checked and on one CUDA device; each
// function runs on the current stream. Not part of the public API.
#ifndef DTA_KERNELS_HEAD_NORMS_INTERNAL_H_
#define DTA_KERNELS_HEAD_NORMS_INTERNAL_H_

#include <ATen/ATen.h>

#include <cstdint>

namespace dta::kernels::internal {

// The head dims the kernels take.
inline bool HeadNormKernelDim(int64_t d) { return d == 64 || d == 128 || d == 256; }

// x, and z when defined, [T, H, D] with unit stride over D and D over heads (any token stride);
// y and rstd contiguous ([T, H, D] and [T * H] float32). With weight and z defined, the gated
// RMSNorm (mean of squares); with both undefined, the L2 norm (sum of squares).
void HeadNormForwardCuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& z,
                         double eps, at::Tensor& y, at::Tensor& rstd);
// dy contiguous; dx contiguous; with the gate, dz contiguous and weight_partials
// [HeadNormBackwardBlocks(T * H), D] float32, summed by the caller.
void HeadNormBackwardCuda(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                          const at::Tensor& z, const at::Tensor& rstd, at::Tensor& dx,
                          at::Tensor& dz, at::Tensor& weight_partials);
// The number of blocks (weight_partials' rows) of the gated backward for `rows` rows.
int64_t HeadNormBackwardBlocks(int64_t rows);

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_HEAD_NORMS_INTERNAL_H_
