#include "executor/model/ops/norms.h"

#include "executor/model/ops/numerics.h"
#include "executor/model/ops/rope.h"
#include "kernels/fused_layers.h"

namespace dta {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor RmsNormFunction::forward(AutogradContext* ctx, const at::Tensor& x,
                                    const at::Tensor& weight, double eps, at::ScalarType out_type,
                                    const std::optional<at::Tensor>& accumulator) {
  kernels::RmsNormResult normed = kernels::RmsNormForward(x, weight, eps, out_type);
  ctx->save_for_backward({x, weight, normed.rstd});
  ctx->saved_data["accumulator"] = accumulator.value_or(at::Tensor());
  return normed.y;
}

variable_list RmsNormFunction::backward(AutogradContext* ctx, variable_list grads) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& x = saved[0];
  at::Tensor accumulator = NormWeightAccumulator(ctx, saved[1]);
  const at::Tensor dx = kernels::RmsNormBackward(grads[0], x, saved[1], saved[2], accumulator);
  return {dx.to(x.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps,
                   at::ScalarType out_type, const at::Tensor& accumulator) {
  return RmsNormFunction::apply(x, weight, eps, out_type, Optional(accumulator));
}

at::Tensor NormRope::forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                             double eps, const at::Tensor& cos, const at::Tensor& sin,
                             const std::optional<at::Tensor>& accumulator) {
  kernels::RmsNormResult result = kernels::RmsNormRopeForward(x, weight, eps, cos, sin);
  ctx->save_for_backward({x, weight, result.rstd});
  ctx->saved_data["cos"] = cos;
  ctx->saved_data["sin"] = sin;
  ctx->saved_data["accumulator"] = accumulator.value_or(at::Tensor());
  return result.y;
}

variable_list NormRope::backward(AutogradContext* ctx, variable_list grads) {
  const auto saved = ctx->get_saved_variables();
  at::Tensor accumulator = NormWeightAccumulator(ctx, saved[1]);
  const at::Tensor dx = kernels::RmsNormRopeBackward(
      grads[0], saved[0], saved[1], saved[2], ctx->saved_data["cos"].toTensor(),
      ctx->saved_data["sin"].toTensor(), accumulator);
  return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
}

at::Tensor RopeOnly::forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                             const at::Tensor& sin) {
  ctx->saved_data["cos"] = cos;
  ctx->saved_data["sin"] = sin;
  return RopeForward(x, cos, sin);
}

variable_list RopeOnly::backward(AutogradContext* ctx, variable_list grads) {
  return {
      RopeBackward(grads[0], ctx->saved_data["cos"].toTensor(), ctx->saved_data["sin"].toTensor()),
      at::Tensor(), at::Tensor()};
}

}  // namespace dta
