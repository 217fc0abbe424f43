// The CUDA path of kernels/batched_copy.h, defined in batched_copy.cu when the library is built
// with nvcc (DTA_KERNELS_HAVE_CUDA). Not part of the public API.
#ifndef DTA_KERNELS_BATCHED_COPY_INTERNAL_H_
#define DTA_KERNELS_BATCHED_COPY_INTERNAL_H_

#include <ATen/ATen.h>

#include <cstdint>

#include "absl/types/span.h"

namespace dta::kernels::internal {

// One row block: rows x cols elements, rows `*_row_stride` elements apart, each row contiguous.
// source == nullptr: zero fill.
struct CopyPiece {
  const void* source = nullptr;
  void* destination = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t source_row_stride = 0;
  int64_t destination_row_stride = 0;
};

// Whether the kernel converts source_type to destination_type (source_type is ignored for zero
// fills).
bool BatchedCopySupports(at::ScalarType source_type, at::ScalarType destination_type);

// Runs the pieces (at most kBatchedCopyMaxPieces, all of the two dtypes) in one launch on the
// current stream of `device`.
void BatchedCopyCuda(absl::Span<const CopyPiece> pieces, at::ScalarType source_type,
                     at::ScalarType destination_type, const at::Device& device);

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_BATCHED_COPY_INTERNAL_H_
