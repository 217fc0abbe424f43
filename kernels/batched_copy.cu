// The CUDA path of kernels/batched_copy.h: one launch for up to kBatchedCopyMaxPieces row blocks,
// blockIdx.y picking the piece.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/batched_copy.h"
#include "kernels/batched_copy_internal.h"
#include "kernels/dependent_launch.cuh"

namespace dta::kernels::internal {
namespace {

struct Pieces {
  CopyPiece piece[kBatchedCopyMaxPieces];
};
static_assert(sizeof(Pieces) <= 4000, "kernel arguments are limited to 4 KB");

constexpr int kThreads = 256;

// Same type: the bits; otherwise through float, rounding to nearest even as copy_ does (every
// pair here is float32 or narrower, or double to double).
template <typename S, typename D>
__device__ D Convert(S x) {
  if constexpr (std::is_same_v<S, D>) {
    return x;
  } else {
    return D(static_cast<float>(x));
  }
}

// Rows across blocks, columns across a block's threads. A piece marked `wide` (same dtype, rows of
// whole 16-byte words at 16-byte aligned addresses) is copied in 16-byte words; its cols and
// strides are then in words.
template <typename S, typename D>
__global__ void __launch_bounds__(kThreads) BatchedCopyKernel(Pieces pieces, uint64_t wide) {
  WaitForPreviousKernels();
  const CopyPiece& p = pieces.piece[blockIdx.y];
  if ((wide >> blockIdx.y) & 1) {
    const uint4* source = static_cast<const uint4*>(p.source);
    uint4* destination = static_cast<uint4*>(p.destination);
    for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
      for (int64_t col = threadIdx.x; col < p.cols; col += kThreads) {
        destination[row * p.destination_row_stride + col] =
            source ? source[row * p.source_row_stride + col] : make_uint4(0, 0, 0, 0);
      }
    }
    return;
  }
  const S* source = static_cast<const S*>(p.source);
  D* destination = static_cast<D*>(p.destination);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    for (int64_t col = threadIdx.x; col < p.cols; col += kThreads) {
      destination[row * p.destination_row_stride + col] =
          source ? Convert<S, D>(source[row * p.source_row_stride + col]) : D(0);
    }
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename S, typename D>
void Launch(absl::Span<const CopyPiece> pieces, cudaStream_t stream) {
  static_assert(kBatchedCopyMaxPieces <= 64, "`wide` has a bit per piece");
  Pieces args;
  uint64_t wide = 0;
  int64_t most_rows = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    CopyPiece p = pieces[i];
    // A zero fill writes D's zero bits, the same for every dtype here: always word-sized then.
    constexpr int64_t kWord = 16 / sizeof(D);
    if ((std::is_same_v<S, D> || p.source == nullptr) && p.cols % kWord == 0 &&
        p.destination_row_stride % kWord == 0 && Aligned16(p.destination) &&
        (p.source == nullptr || (p.source_row_stride % kWord == 0 && Aligned16(p.source)))) {
      p.cols /= kWord;
      p.destination_row_stride /= kWord;
      p.source_row_stride /= kWord;
      wide |= uint64_t{1} << i;
    }
    args.piece[i] = p;
    most_rows = std::max(most_rows, p.rows);
  }
  const int64_t blocks = std::clamp<int64_t>(most_rows, 1, 2048);
  C10_CUDA_CHECK(
      LaunchAfterPrevious(BatchedCopyKernel<S, D>,
                          dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(pieces.size())),
                          kThreads, 0, stream, args, wide));
}

template <typename S>
void LaunchTo(absl::Span<const CopyPiece> pieces, at::ScalarType destination, cudaStream_t stream) {
  switch (destination) {
    case at::kFloat:
      return Launch<S, float>(pieces, stream);
    case at::kBFloat16:
      return Launch<S, __nv_bfloat16>(pieces, stream);
    case at::kHalf:
      return Launch<S, __half>(pieces, stream);
    default:
      TORCH_CHECK(false, "BatchedCopyCuda: unsupported destination ", destination);
  }
}

bool Narrow(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

}  // namespace

bool BatchedCopySupports(at::ScalarType source_type, at::ScalarType destination_type) {
  return (Narrow(source_type) && Narrow(destination_type)) ||
         (source_type == at::kDouble && destination_type == at::kDouble);
}

void BatchedCopyCuda(absl::Span<const CopyPiece> pieces, at::ScalarType source_type,
                     at::ScalarType destination_type, const at::Device& device) {
  TORCH_CHECK(static_cast<int64_t>(pieces.size()) <= kBatchedCopyMaxPieces,
              "BatchedCopyCuda: too many pieces");
  TORCH_CHECK(BatchedCopySupports(source_type, destination_type), "BatchedCopyCuda: unsupported ",
              source_type, " to ", destination_type);
  if (pieces.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  switch (source_type) {
    case at::kFloat:
      return LaunchTo<float>(pieces, destination_type, stream);
    case at::kBFloat16:
      return LaunchTo<__nv_bfloat16>(pieces, destination_type, stream);
    case at::kHalf:
      return LaunchTo<__half>(pieces, destination_type, stream);
    case at::kDouble:
      return Launch<double, double>(pieces, stream);
    default:
      TORCH_CHECK(false, "BatchedCopyCuda: unsupported source ", source_type);
  }
}

}  // namespace dta::kernels::internal
