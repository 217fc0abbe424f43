// The second half of a SwiGLU MLP (the dense layers' MLP and Qwen3-Next's shared expert): the
// SwiGLU product of the gate and up projections' outputs, projected by down_proj into the float32
// residual stream. SwiGLU runs kernels/fused_layers (one CUDA kernel per direction; the same ATen
// expressions elsewhere).
//
// Example (after projections.h's gate and up):
//   at::Tensor y = SwiGluDown::apply(gate_up[0], gate_up[1], down_proj, /*group=*/0);
//
// Thread safety: stateless; backward accumulates into down's .grad.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>

namespace dta {

// The MLP's second half, y = SwiGlu(gate, up) @ down^T, formed in the compute dtype (it feeds the
// float32 residual stream). Backward keeps gate and up only and recomputes the product (bitwise the
// same) for down's weight gradient: eager autograd would keep silu(gate) and the product as well,
// two more [T, intermediate] tensors, the largest activations of the layer. d product is not
// rounded before the SwiGLU backward.
// gate, up [T, I]; down [H, I]; group: the tensor-parallel group's handle (GroupHandle in
// numerics.h; 0: none), under which each rank holds an intermediate slice (row-parallel down).
class SwiGluDown : public torch::autograd::Function<SwiGluDown> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate,
                            const at::Tensor& up, const at::Tensor& down, int64_t group);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

}  // namespace dta
