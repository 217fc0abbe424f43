#include "executor/model/ops/output_gate.h"

#include <utility>

#include "kernels/fused_layers.h"

namespace dta {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor OutputGate::forward(AutogradContext* ctx, const at::Tensor& attention,
                               const at::Tensor& gate) {
  ctx->save_for_backward({attention, gate});
  return kernels::SigmoidGateForward(attention, gate);
}

variable_list OutputGate::backward(AutogradContext* ctx, variable_list grads) {
  const variable_list saved = ctx->get_saved_variables();
  kernels::SigmoidGateGrads g = kernels::SigmoidGateBackward(grads[0], saved[0], saved[1]);
  return {std::move(g.dattention), std::move(g.dgate)};
}

}  // namespace dta
