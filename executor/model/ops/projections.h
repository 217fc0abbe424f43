// The decoder's projections: norm-and-project onto one or more weights (Projections; the q/k/v,
// gate/up, Gated DeltaNet input and shared-expert projections), and the wide projection into the
// float32 residual stream (ProjectWide; o_proj, out_proj), as Megatron's column- and row-parallel
// linear layers under tensor parallelism. Weights stored stacked (gate_proj over up_proj: their
// rows consecutive blocks of one tensor) are projected onto in one GEMM, and their gradients
// accumulated in one.
//
// Example (the MLP's gate and up, after the post-attention norm):
//   const at::Tensor weights[] = {gate_proj, up_proj};
//   variable_list gate_up = Projections::apply(
//       h, /*addend=*/std::nullopt, std::optional<at::Tensor>(post_norm), eps,
//       /*wide_output=*/false, /*group=*/0, ProjectionKind::kColumnParallel,
//       at::TensorList(weights), at::TensorList(), std::nullopt, /*residual=*/false,
//       /*replicated=*/0);
//   // gate_up[0] = n(h) @ gate_proj^T, gate_up[1] = n(h) @ up_proj^T
//
// Thread safety: stateless; backward accumulates into the weights' .grad.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <optional>

namespace dta {

// DTA_FUSED_RESIDUAL=0 leaves the residual stream's gradient to autograd's sum instead of the
// norm's backward kernel (see Projections' `residual`). For before/after measurements in one build
// (read at every call).
bool FusedResidualEnabled();

// Whether the blocks fold the residual add before the post-attention norm into it (Projections'
// `addend`): FusedResidualEnabled() and DTA_FUSED_RESIDUAL_ADD not "0" (read at every call; the
// before/after switch of benchmarks).
bool FoldedResidualAddEnabled();

// How a projection sits in a tensor-parallel layer (Megatron's column- and row-parallel linear).
enum class ProjectionKind : int64_t {
  kColumnParallel,  // replicated input, output split by columns: all-reduce dx in backward
  kRowParallel,     // input split, output a partial sum: all-reduce y in forward
};

// y_i = n(x) @ weights_i^T (+ biases_i) for one input x [T, in] and one or more weights [out_i, in]
// (biases: none, or one [out_i] per weight), where n is an RMSNorm with weight `norm` (the input
// and post-attention norms) or, without it, a rounding of x to the weights' dtype. x may be wider
// than the weights (the float32 residual stream): the norm is computed in the compute dtype and
// rounded once. Backward keeps x (which the residual stream holds anyway) and the norm's rstd, not
// the rounded n(x): it recomputes n(x), bitwise the same, saving a [T, in] activation per norm. The
// projections' dx are summed, and the norm backpropagated, in the compute dtype; dx is returned in
// x's dtype, so the residual stream's gradient is never rounded to bfloat16. With wide_output, y is
// formed in the compute dtype straight from the matmul (o_proj, which feeds the float32 residual
// stream). A bias is added by the matmul itself (one rounding, as torch's linear) for a
// column-parallel projection, each rank its part of the bias; a row-parallel projection's partial
// sums are summed over the ranks first and the whole bias added once, in the output's dtype. A
// bias's gradient, the sum of its output's gradient over the rows, is accumulated into its .grad
// like the weights'. The norm weight's gradient goes into `norm_accumulator` when given (a
// zero-centred norm's 1 + w: into w's .grad), else into the norm weight's .grad.
//
// With `residual` (a norm required), x itself comes back as one more output, after the
// projections: the residual connection x + f(n(x)) takes it in place of x, so that the residual's
// gradient reaches this backward, which adds it to dx inside the norm's backward kernel instead
// of autograd adding the two afterwards (one launch and one pass over [T, hidden] fewer per
// norm; the same bits). Autograd returns it as a view of x (no copy).
//
// With an `addend` (x's shape; `residual` required) the projected input is x + addend, formed
// inside the norm's kernel (kernels::RmsNormForward's addend): the residual connection before this
// norm (the attention or Gated DeltaNet block's output added to the stream) folded into it, one
// pass over [T, hidden] and one launch fewer. The residual output is then that sum, and backward
// returns its gradient to both x and addend (rounded to addend's dtype), as autograd's add would:
// the same bits as adding first.
//
// `group` is the tensor-parallel group's handle (GroupHandle in numerics.h; 0: none). The last
// `replicated` weights of a column-parallel projection are whole on every rank, which compute
// their outputs alike (the shared expert's gate): their share of dx is the same on every rank, so
// it is added after the sum over the ranks, once; biases and stacked weights are not supported
// with them.
class Projections : public torch::autograd::Function<Projections> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& x,
      const std::optional<at::Tensor>& addend, const std::optional<at::Tensor>& norm, double eps,
      bool wide_output, int64_t group, ProjectionKind kind, at::TensorList weights,
      at::TensorList biases, const std::optional<at::Tensor>& norm_accumulator, bool residual,
      int64_t replicated);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

// x @ weight^T (+ bias) in the compute dtype, summed over the tensor-parallel ranks (o_proj:
// row-parallel, it feeds the float32 residual stream; the bias, if any, added once after the sum).
// group: GroupHandle (numerics.h) of the tensor-parallel group, 0 without one.
at::Tensor ProjectWide(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       int64_t group);

// Tensors [rows, c_i] side by side in one buffer's rows (the halves of a stacked projection's
// output, or of their gradient from SwiGluBackward): one [rows, sum c_i] view; undefined otherwise.
at::Tensor StackedColumns(at::TensorList parts);

}  // namespace dta
