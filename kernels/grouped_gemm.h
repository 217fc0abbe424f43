// The experts' weight gradients of a mixture-of-experts layer in one kernel where the GPU allows:
// accumulator[e] += dy[rows of e]^T x[rows of e] for every expert e, bfloat16 operands, float32
// accumulation into the float32 gradient in place (kernels/hopper/grouped_gemm_hopper.h), no host
// synchronisation. With `overwrite`, accumulator[e] = dy[rows of e]^T x[rows of e] instead (zeros
// for experts without rows), the accumulator's old contents unread: a step's first chunk writes the
// gradient without a zero fill before it.
//
// Example:
//   if (!kernels::AddGroupedWeightGrad(grad, dy, x, ends)) { ...the ATen path... }
//
// Thread safety: stateless; writes `accumulator`.
#pragma once

#include <ATen/ATen.h>

namespace dta::kernels {

// accumulator [E, M, N] float32 contiguous; dy [R, M] and x [R, N] bfloat16 contiguous; ends [E]
// int64 on the same device (expert e owns rows [ends[e - 1], ends[e])). True when done: on a device
// of compute capability 9.x in builds with the CUTLASS headers, for M and N multiples of 8 and at
// most 4096 experts, unless the environment variable DTA_GROUPED_WGRAD is "0" (read at every call,
// for before/after measurements). False otherwise, with nothing done: the caller's path runs.
bool AddGroupedWeightGrad(at::Tensor& accumulator, const at::Tensor& dy, const at::Tensor& x,
                          const at::Tensor& ends, bool overwrite = false);

}  // namespace dta::kernels
