// Float32 accumulation of bfloat16 matrix products on a GPU (the weight gradients' grad += dy^T x,
// chunk after chunk, and an input gradient's dx += dy W) through the fastest GEMM for the problem.
// cuBLAS's heuristic picks one kernel per problem; at the executor's shapes another of the kernels
// cuBLASLt offers for the same problem is often 10-20% faster (docs/benchmarks.md, "Tuned float32
// accumulations"). Only candidates that give ATen's bits are ever kept, so the choice, made by
// timing the calls themselves, never changes a result.
//
// The tuning: problems are grouped into classes (device, the operands' layouts and leading
// dimensions, and M, N and K each rounded up to a quarter octave, so that chunks of similar lengths
// share one). A class's candidates are ATen's GEMM (at::addmm_out) and up to 7 of cuBLASLt's
// heuristic algorithms for its first problem (no split-K reduction, 16-byte alignment, a 32 MiB
// workspace). Its first calls run each candidate in turn, twice, bracketed by CUDA events; each
// such call of a cuBLASLt candidate is also run by ATen's GEMM on a copy of the accumulator, and a
// candidate whose bits differ is dropped for the class (the call keeps ATen's result; this waits
// for the GPU, once per checked call). Once every timed call has finished (queried without
// blocking), the class runs the candidate with the least time per FLOP. A candidate cuBLASLt
// rejects for a problem (cublasLtMatmulAlgoCheck) leaves the call to ATen's GEMM. Accumulators
// of 4M to 128M elements are taken: below, the heuristic offers kernels that split K across blocks,
// whose sums differ from ATen's (measured on an H200); above, the checks' copy would cost more
// than 512 MiB. cuBLASLt is the library LibTorch loaded, found at run time (never a second copy).
// DTA_TUNED_MATMUL_REPORT=1 prints each class's choice to stderr.
//
// Example:
//   at::Tensor& grad = weight.mutable_grad();      // float32 [out, in]
//   if (!kernels::AddMatmulTuned(grad, dy.t(), x))  // bfloat16 [out, T] x [T, in]
//     at::addmm_out(grad, grad, dy.t(), x, at::kFloat);
//
// Thread safety: safe from any thread; the classes' state is shared behind a mutex. Work runs on
// the current stream of the accumulator's device.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace dta::kernels {

// accumulator += a @ b for a [M, K] and b [K, N], returning true, when: the build has CUDA, the
// tensors are on one GPU, a and b are bfloat16 with a unit stride in either dimension (row-major or
// a transposed view), the accumulator is float32 with unit column stride and 4M to 128M elements,
// every data pointer and leading dimension is 16-byte aligned, K is positive, the current stream is
// not capturing a CUDA graph, cuBLASLt is loaded, and DTA_TUNED_MATMUL is not "0" (read at every
// call: the before/after switch of benchmarks).
// Otherwise returns false and does nothing.
bool AddMatmulTuned(at::Tensor& accumulator, const at::Tensor& a, const at::Tensor& b);

// Calls of AddMatmulTuned so far that ran one of cuBLASLt's algorithms (not ATen's GEMM), over the
// process: what tests check to know the candidates ran.
int64_t TunedMatmulLtCalls();

}  // namespace dta::kernels
