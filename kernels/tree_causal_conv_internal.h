// Internal to kernels/tree_causal_conv: the CUDA launchers (tree_causal_conv.cu), for the tensors
// TreeCausalConvKernelRuns admits, on the current stream.
#ifndef DTA_KERNELS_TREE_CAUSAL_CONV_INTERNAL_H_
#define DTA_KERNELS_TREE_CAUSAL_CONV_INTERNAL_H_

#include <ATen/ATen.h>

namespace dta::kernels::internal {

// out [T, C] = silu(pre).
void LaunchConvForward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& context,
                       const at::Tensor& index, at::Tensor& out);
// dpre [T, C] float32 = grad_out * silu'(pre), pre recomputed.
void LaunchConvPreGrad(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& context, const at::Tensor& index, at::Tensor& dpre);
// dx and dcontext from dpre: pairs [T * kernel] the pair ids t * kernel + j sorted stably by their
// table row, starts [1 + P + T + 1] where each row's pairs begin.
void LaunchConvTableGrad(const at::Tensor& dpre, const at::Tensor& weight, const at::Tensor& pairs,
                         const at::Tensor& starts, at::Tensor& dx, at::Tensor& dcontext);
// dweight from dpre and the taps.
void LaunchConvWeightGrad(const at::Tensor& dpre, const at::Tensor& x, const at::Tensor& context,
                          const at::Tensor& index, at::Tensor& dweight);

}  // namespace dta::kernels::internal

#endif  // DTA_KERNELS_TREE_CAUSAL_CONV_INTERNAL_H_
