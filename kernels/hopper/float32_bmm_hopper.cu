#include "kernels/hopper/float32_bmm_hopper.h"

#include <algorithm>
#include <cstdint>

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm_batched.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

namespace dta::kernels {
namespace {

using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// 64 x 128 tiles: one tile covers a chunk's [C = 64, Dv = 128] output; four warps of 32 x 64.
// Three stages of 16-deep slices (36 KiB of shared memory) leave room for several blocks an SM.
template <class LayoutA, class LayoutB>
using Gemm = cutlass::gemm::device::GemmBatched<
    float, LayoutA, float, LayoutB, float, RowMajor, float, cutlass::arch::OpClassTensorOp,
    cutlass::arch::Sm80, cutlass::gemm::GemmShape<64, 128, 16>,
    cutlass::gemm::GemmShape<32, 64, 16>, cutlass::gemm::GemmShape<16, 8, 8>,
    cutlass::epilogue::thread::LinearCombination<float, 4>,
    cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle, /*Stages=*/3,
    /*AlignmentA=*/4, /*AlignmentB=*/4, cutlass::arch::OpMultiplyAddFastF32>;

// The grid's z dimension holds the batch: at most 65,535 entries a launch.
constexpr int64_t kMaxBatchPerLaunch = 65535;

template <class LayoutA, class LayoutB>
cudaError_t Run(const Float32BmmParams& p, cudaStream_t stream) {
  using Op = Gemm<LayoutA, LayoutB>;
  for (int64_t first = 0; first < p.batch; first += kMaxBatchPerLaunch) {
    const int count = static_cast<int>(std::min(kMaxBatchPerLaunch, p.batch - first));
    float* c = p.c + first * p.c_batch_stride;
    typename Op::Arguments arguments(
        {p.m, p.n, p.k}, {p.a.data + first * p.a.batch_stride, LayoutA(p.a.leading)},
        p.a.batch_stride, {p.b.data + first * p.b.batch_stride, LayoutB(p.b.leading)},
        p.b.batch_stride, {c, RowMajor(p.n)}, p.c_batch_stride, {c, RowMajor(p.n)},
        p.c_batch_stride, {1.0f, 0.0f}, count);
    Op op;
    if (op.can_implement(arguments) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
    if (op.initialize(arguments, nullptr, stream) != cutlass::Status::kSuccess)
      return cudaErrorInvalidValue;
    if (op.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
    if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

bool Aligned(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

bool OperandOk(const Float32BmmOperand& x) {
  return Aligned(x.data) && x.leading > 0 && x.leading % 4 == 0 && x.batch_stride % 4 == 0;
}

}  // namespace

cudaError_t LaunchFloat32Bmm(const Float32BmmParams& p, cudaStream_t stream) {
  if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.batch <= 0 || p.n % 4 != 0 || !OperandOk(p.a) ||
      !OperandOk(p.b) || !Aligned(p.c) || p.c_batch_stride % 4 != 0 ||
      (p.a.column_major && p.b.column_major)) {
    return cudaErrorInvalidValue;
  }
  if (p.a.column_major) return Run<ColumnMajor, RowMajor>(p, stream);
  if (p.b.column_major) return Run<RowMajor, ColumnMajor>(p, stream);
  return Run<RowMajor, RowMajor>(p, stream);
}

}  // namespace dta::kernels
