#include "kernels/tree_causal_conv.h"

#include <c10/util/Exception.h>

#include <optional>

#include "kernels/cuda_dispatch.h"
#include "kernels/tree_causal_conv_internal.h"

namespace dta::kernels {
namespace {

bool KernelFloat(at::ScalarType type) {
  return type == at::kBFloat16 || type == at::kHalf || type == at::kFloat;
}

}  // namespace

bool TreeCausalConvKernelRuns(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& context, const at::Tensor& index) {
  if (!x.defined() || !weight.defined() || !context.defined() || !index.defined()) return false;
  if (!internal::CudaKernelsFor(x, "DTA_CONV_KERNEL")) return false;
  const at::Device device = x.device();
  const at::ScalarType type = x.scalar_type();
  if (!KernelFloat(type) || x.dim() != 2 || !x.is_contiguous()) return false;
  const int64_t tokens = x.size(0), channels = x.size(1);
  if (weight.dim() != 2 || weight.size(0) != channels || !KernelFloat(weight.scalar_type()) ||
      !weight.is_contiguous() || weight.device() != device) {
    return false;
  }
  const int64_t kernel = weight.size(1);
  if (kernel < 1 || kernel > kMaxConvTaps) return false;
  if (context.dim() != 2 || context.size(1) != channels ||
      !internal::Dense(context, type, device)) {
    return false;
  }
  return internal::Dense(index, at::kLong, device) &&
         index.sizes() == at::IntArrayRef({tokens, kernel});
}

at::Tensor TreeCausalConvForward(const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& context, const at::Tensor& index) {
  TORCH_CHECK(TreeCausalConvKernelRuns(x, weight, context, index),
              "TreeCausalConvForward: operands the kernel does not take");
  at::Tensor out = at::empty_like(x);
  if (x.numel() > 0) internal::LaunchConvForward(x, weight, context, index, out);
  return out;
}

TreeCausalConvGrads TreeCausalConvBackward(const at::Tensor& grad_out, const at::Tensor& x,
                                           const at::Tensor& weight, const at::Tensor& context,
                                           const at::Tensor& index) {
  TORCH_CHECK(TreeCausalConvKernelRuns(x, weight, context, index),
              "TreeCausalConvBackward: operands the kernel does not take");
  TORCH_CHECK(
      internal::Dense(grad_out, x.scalar_type(), x.device()) && grad_out.sizes() == x.sizes(),
      "TreeCausalConvBackward: grad_out must be contiguous ", x.scalar_type(), " ", x.sizes(),
      ", got ", grad_out.scalar_type(), " ", grad_out.sizes());
  TreeCausalConvGrads grads{
      .x = at::empty_like(x), .weight = at::empty_like(weight), .context = at::empty_like(context)};
  if (x.numel() == 0) {
    grads.weight.zero_();
    grads.context.zero_();
    return grads;
  }
  at::Tensor dpre = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  internal::LaunchConvPreGrad(grad_out, x, weight, context, index, dpre);
  // Each table row's pairs t * kernel + j, in that order (a stable sort by row), and where each
  // row's pairs begin: the backward of the gather as a gather, no atomics.
  const at::Tensor rows = index.reshape({-1});
  const auto [sorted_rows, pairs] =
      at::sort(rows, /*stable=*/std::optional<bool>(true), /*dim=*/0, /*descending=*/false);
  const int64_t table_rows = 1 + context.size(0) + x.size(0);
  const at::Tensor starts =
      at::searchsorted(sorted_rows, at::arange(table_rows + 1, rows.options()));
  internal::LaunchConvTableGrad(dpre, weight, pairs, starts, grads.x, grads.context);
  internal::LaunchConvWeightGrad(dpre, x, context, index, grads.weight);
  return grads;
}

}  // namespace dta::kernels
