// Batched float32 matrix products where they dominate the chunked Gated DeltaNet's output (Qd h +
// intra v_new and their gradients): on Hopper one CUTLASS 3xTF32 GEMM on tensor cores
// (kernels/hopper/float32_bmm_hopper.h), float32-accurate and about twice cuBLAS's float32 GEMM;
// at::matmul everywhere else.
//
// Example:
//   at::Tensor out = kernels::Float32Bmm(q_decayed, states);  // [H, N, C, Dk] x [H, N, Dk, Dv]
//
// Thread safety: stateless; CUDA work runs on the current stream of the inputs' device.
#pragma once

#include <ATen/ATen.h>

namespace dta::kernels {

// at::matmul(a, b) for a [..., M, K] and b [..., K, N] with the same batch dimensions. The kernel
// runs for float32 tensors on a device of compute capability 9.x in builds with the CUTLASS headers
// when each operand's batch dimensions collapse to one stride, its last two dimensions are
// row-major or column-major (a transposed view; not both operands column-major) with a leading
// dimension, N and the addresses 16-byte aligned, and DTA_FLOAT32_BMM is not "0" (read at every
// call: the before/after switch of benchmarks); the result is then a new contiguous tensor.
// Otherwise at::matmul(a, b).
at::Tensor Float32Bmm(const at::Tensor& a, const at::Tensor& b);

// Whether Float32Bmm(a, b) runs the kernel (all of the conditions above but CUTLASS's own check of
// the sizes' alignment, which the conditions imply for float32).
bool Float32BmmUsesKernel(const at::Tensor& a, const at::Tensor& b);

}  // namespace dta::kernels
