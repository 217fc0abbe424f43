// The experts' weight gradients of a mixture-of-experts layer on Hopper (sm_90a): for every expert
// e, accumulator[e] += dy[rows of e]^T x[rows of e], with bfloat16 operands, float32 accumulation
// in the tensor cores and the float32 accumulator read and written in place (beta = 1) by the
// epilogue; or, overwriting, accumulator[e] = dy[rows of e]^T x[rows of e] (beta = 0: the
// accumulator is not read, so a gradient's zero fill before its first chunk can be skipped). One
// CUTLASS ptr-array grouped GEMM (TMA, warp-specialized cooperative wgmma) whose per-expert
// problems a small kernel forms on the device from the experts' row ends, so nothing is read back
// on the host. What at::_grouped_mm cannot do: its output has its inputs' dtype, so a float32
// gradient needed float32 copies of both operands and its float32 path, 15x slower.
//
// Framework-free: plain pointers in, cudaError_t out. Thread safety: stateless.
// Only compiled when CMake finds the CUTLASS headers (DTA_KERNELS_HAVE_HOPPER).
#ifndef DTA_KERNELS_HOPPER_GROUPED_GEMM_HOPPER_H_
#define DTA_KERNELS_HOPPER_GROUPED_GEMM_HOPPER_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dta::kernels {

struct GroupedWeightGradParams {
  float* accumulator = nullptr;  // [experts, m, n] float32, row-major
  const void* dy = nullptr;      // [rows, m] bfloat16, row-major: the pairs' output gradients
  const void* x = nullptr;       // [rows, n] bfloat16, row-major: the pairs' inputs
  const int64_t* ends =
      nullptr;  // [experts] on the device: expert e owns rows [ends[e-1], ends[e])
  int experts = 0;
  int m = 0;         // a multiple of 8 (16-byte rows for TMA)
  int n = 0;         // a multiple of 8
  int sm_count = 0;  // the device's multiprocessors the kernel may use
  // Write the products instead of adding them: the accumulator's contents are never read, and
  // experts without rows get zeros.
  bool overwrite = false;
};

// Device bytes the launch needs as `buffer`: the per-expert problems, pointers and strides, and
// CUTLASS's workspace.
size_t HopperGroupedWeightGradBufferBytes(const GroupedWeightGradParams& p);

// Launches the accumulation on `stream` (compute capability 9.0), with `buffer` of at least
// HopperGroupedWeightGradBufferBytes(p) device bytes, not used by a concurrent launch. Experts with
// no rows are left untouched (accumulating) or zeroed (overwriting). Returns cudaErrorInvalidValue
// for m or n not a multiple of 8, more than 4096 experts or misaligned pointers (16 bytes), else
// the error of the launch.
cudaError_t LaunchHopperGroupedWeightGrad(const GroupedWeightGradParams& p, void* buffer,
                                          size_t buffer_bytes, cudaStream_t stream);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_HOPPER_GROUPED_GEMM_HOPPER_H_
