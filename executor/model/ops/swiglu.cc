#include "executor/model/ops/swiglu.h"

#include "executor/model/ops/numerics.h"
#include "executor/model/ops/projections.h"
#include "kernels/fused_layers.h"

namespace dta {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor SwiGluDown::forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up,
                               const at::Tensor& down, int64_t group) {
  ctx->save_for_backward({gate, up, down});
  // Row-parallel: each rank's intermediate slice gives a partial sum of y.
  at::Tensor y =
      MatmulTo(kernels::SwiGluForward(gate, up), down.t(), ComputeType(down.scalar_type()));
  SumOverRanks(GroupOf(group), y);
  return y;
}

variable_list SwiGluDown::backward(AutogradContext* ctx, variable_list grads) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& down = saved[2];
  const at::ScalarType ct = ComputeType(down.scalar_type());
  const at::Tensor dy = grads[0].to(down.scalar_type());
  // gate and up side by side (a stacked projection's output): their gradients too, so that
  // the projection's backward takes them as one.
  const bool stacked = StackedColumns({saved[0], saved[1]}).defined();
  kernels::SwiGluGrads g = kernels::SwiGluBackward(MatmulTo(dy, down, ct), saved[0], saved[1],
                                                   /*with_product=*/true, stacked);
  AddMatmul(GradAccumulator(down), dy.t(), g.product);
  return {g.dgate, g.dup, at::Tensor(), at::Tensor()};
}

}  // namespace dta
