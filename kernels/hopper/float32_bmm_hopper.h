// Batched float32 matrix products on tensor cores with float32's accuracy: CUTLASS's 3xTF32 GEMM
// (each operand split into a TF32 "big" part and a TF32 remainder, three tensor-core products
// summed in float32: big x big + big x small + small x big), about twice cuBLAS's float32 (SIMT)
// batched GEMM on an H200 at the chunked Gated DeltaNet's shapes (C x Dk x Dv = 64 x 128 x 128 per
// chunk and head), with an error of float32's order (TF32 alone, 10 mantissa bits, is not).
//
// C[b] = op(A[b]) op(B[b]) for b < batch, row-major C, where each operand is row-major or
// column-major (a transposed view) with its own leading dimension and batch stride.
//
// Framework-free: plain pointers in, cudaError_t out. Thread safety: stateless.
// Only compiled when CMake finds the CUTLASS headers (DTA_KERNELS_HAVE_HOPPER).
#ifndef DTA_KERNELS_HOPPER_FLOAT32_BMM_HOPPER_H_
#define DTA_KERNELS_HOPPER_FLOAT32_BMM_HOPPER_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace dta::kernels {

struct Float32BmmOperand {
  const float* data = nullptr;
  bool column_major = false;  // element (i, j) at i + j * leading (else i * leading + j)
  int64_t leading = 0;        // a multiple of 4 (16-byte rows or columns)
  int64_t batch_stride = 0;   // elements between consecutive batch entries
};

struct Float32BmmParams {
  Float32BmmOperand a;         // [M, K] per batch entry
  Float32BmmOperand b;         // [K, N] per batch entry
  float* c = nullptr;          // [M, N] row-major per batch entry, leading dimension n
  int64_t c_batch_stride = 0;  //
  int m = 0, n = 0, k = 0;     // n a multiple of 4
  int64_t batch = 0;           // any count (launched in slices of the grid's limit)
};

// Launches the products on `stream` (compute capability 8.0 or later; this library builds sm_90a
// code only). cudaErrorInvalidValue where the operands' layouts are both column-major (not built),
// a leading dimension, n or a pointer is not 16-byte aligned, or a size is not positive; else the
// error of the launch.
cudaError_t LaunchFloat32Bmm(const Float32BmmParams& p, cudaStream_t stream);

}  // namespace dta::kernels

#endif  // DTA_KERNELS_HOPPER_FLOAT32_BMM_HOPPER_H_
