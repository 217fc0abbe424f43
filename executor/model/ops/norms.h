// The decoder's RMSNorms: the final norm (RmsNormFunction, or RmsNorm), Qwen3's per-head q/k norm
// fused with RoPE (NormRope), and RoPE alone (RopeOnly) for the families without q/k norms and
// after the q/k norm under partial rotary. The input and post-attention norms run inside the
// projections they feed (projections.h, moe.h). RMSNorm and the q/k norms with RoPE run
// kernels/fused_layers (one CUDA kernel per direction; the same ATen expressions elsewhere); RoPE
// without a norm runs the ATen expressions of rope.h.
//
// Example (the final norm of a bfloat16 model, in float32):
//   at::Tensor y = RmsNorm(h, final_norm, eps, at::kFloat);
//
// Thread safety: stateless; backward accumulates into the weights' .grad (or the accumulator
// given).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>

namespace dta {

// Qwen3RMSNorm, weight * (x / rms(x)), computed in at least float32 and rounded once to out_type
// (x's dtype for the q/k norms under partial rotary, the compute dtype for the final norm, which
// Logprobs rounds).
// Hugging Face rounds the normalised x to the input dtype first, then multiplies: identical for
// float32/float64 models, one rounding fewer in bfloat16. The input may be wider than the weight
// (the float32 residual stream of a bfloat16 model). Backward in the compute dtype.
// The weight's gradient goes into `accumulator` when it is defined (a partial sum, completed
// later), else into the weight's .grad.
class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, double eps, at::ScalarType out_type,
                            const std::optional<at::Tensor>& accumulator);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

// RmsNormFunction::apply, with an undefined `accumulator` for none (the weight's .grad).
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps,
                   at::ScalarType out_type, const at::Tensor& accumulator = at::Tensor());

// Qwen3's q/k norm over each head followed by rotary embedding, y = rope(RmsNorm(x)), in one
// kernel each way (kernels/fused_layers.h: the norm's output is rounded to x's dtype before RoPE,
// RoPE's input gradient to dy's before the norm's backward). Keeps x, the norm's rstd and the
// tables. The weight's gradient goes into `accumulator` when it is defined (a partial sum under
// tensor parallelism, completed later), else into the weight's .grad.
class NormRope : public torch::autograd::Function<NormRope> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, double eps, const at::Tensor& cos,
                            const at::Tensor& sin, const std::optional<at::Tensor>& accumulator);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

// RoPE alone, y = rope(x) (rope.h: computed in the tables' dtype, rounded once to x's), for the
// families without q/k norms (Qwen2, Llama) and after the q/k norm under partial rotary
// (Qwen3-Next). Keeps only the tables: backward is linear in dy.
class RopeOnly : public torch::autograd::Function<RopeOnly> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& cos, const at::Tensor& sin);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

}  // namespace dta
