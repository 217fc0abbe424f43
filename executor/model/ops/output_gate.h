// Gated attention's output gate (Qwen3-Next, Qwen3.5): each head's attention output scaled by
// sigmoid of its gate, the second half of the head's [query, gate] projection rows, in the compute
// dtype and rounded once (kernels/fused_layers.h: one CUDA kernel each way on a GPU, reading the
// gate in place; the ATen expressions elsewhere, with the same bits).
//
// Example (in the attention block):
//   at::Tensor gated = OutputGate::apply(attention, q_rows.slice(-1, head_dim));
//
// Thread safety: stateless.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace dta {

// attention [T, H, D]; gate of its shape (any strides). Backward keeps both as they are (gate a
// view of the projection's output, which the query's norm keeps anyway), where eager autograd kept
// two float32 [T, H, D] tensors.
class OutputGate : public torch::autograd::Function<OutputGate> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& attention,
                            const at::Tensor& gate);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

}  // namespace dta
