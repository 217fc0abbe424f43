#include "executor/model/qwen3_model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>

#include "core/base/env_switch.h"
#include "core/base/parallel_for.h"
#include "executor/model/gather_rows.h"
#include "executor/model/rope.h"
#include "kernels/chunk_attention.h"
#include "kernels/fused_layers.h"
#include "kernels/tree_attention.h"

namespace dta {
namespace {

// Norms, RoPE tables, softmax and log-softmax run in at least float32, as in Hugging Face.
at::ScalarType ComputeType(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// Gradients accumulate in float32 (float64 for float64 parameters).
at::ScalarType AccumulatorType(at::ScalarType dtype) { return ComputeType(dtype); }

// Every parameter's gradient is accumulated by the autograd functions below straight into its
// .grad tensor (float32 for low-precision parameters, the parameter's dtype otherwise), as
// Megatron's fused weight-gradient accumulation does: a chunk's backward never materializes a
// fresh full-size weight gradient that autograd would then add, and many chunk backwards into one
// step's gradient do not round to bfloat16 each time. The parameters still require grad (so the
// functions are recorded), but autograd never accumulates into them itself.
at::Tensor& GradAccumulator(const at::Tensor& parameter) {
  at::Tensor& grad = const_cast<at::Tensor&>(parameter).mutable_grad();
  if (!grad.defined())
    grad = at::zeros(parameter.sizes(),
                     parameter.options().dtype(AccumulatorType(parameter.scalar_type())));
  return grad;
}

// accumulator += a @ b, with a and b in the compute dtype and the product accumulated in the
// accumulator's precision (cuBLAS with a float32 C on CUDA).
void AddMatmul(at::Tensor& accumulator, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == accumulator.scalar_type()) {
    accumulator.addmm_(a, b);
  } else if (accumulator.is_cuda()) {
    at::addmm_out(accumulator, accumulator, a, b, accumulator.scalar_type());
  } else {
    accumulator.addmm_(a.to(accumulator.scalar_type()), b.to(accumulator.scalar_type()));
  }
}

// a @ b with the result in `dtype` (float32 logits from bfloat16 inputs without a rounding step).
at::Tensor MatmulTo(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype) {
  if (a.scalar_type() == dtype) return at::mm(a, b);
  if (a.is_cuda()) return at::mm(a, b, dtype);
  return at::mm(a.to(dtype), b.to(dtype));  // the CPU has no mixed-precision mm
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The tensor-parallel group travels through autograd functions' saved_data as an integer: the
// model owns the group and outlives the graphs it builds.
int64_t GroupHandle(const TensorParallelGroup* group) {
  return group != nullptr && group->size() > 1 ? reinterpret_cast<int64_t>(group) : 0;
}
const TensorParallelGroup* GroupOf(int64_t handle) {
  return reinterpret_cast<const TensorParallelGroup*>(handle);
}
const TensorParallelGroup* GroupOf(AutogradContext* ctx) {
  return GroupOf(ctx->saved_data["tensor_parallel"].toInt());
}

// The sum over the tensor-parallel ranks, in place, started without waiting (null without a
// group).
std::unique_ptr<PendingCollective> StartSumOverRanks(const TensorParallelGroup* group,
                                                     at::Tensor& tensor) {
  if (group == nullptr) return nullptr;
  if (!tensor.is_contiguous()) tensor = tensor.contiguous();
  return group->StartAllReduce(tensor, TensorParallelReduce::kSum);
}

// The sum over the tensor-parallel ranks, in place (nothing without a group).
void SumOverRanks(const TensorParallelGroup* group, at::Tensor& tensor) {
  if (std::unique_ptr<PendingCollective> sum = StartSumOverRanks(group, tensor)) sum->Wait();
}

// Where a norm function adds its weight's gradient: the accumulator it was given (a partial sum
// under tensor parallelism), else the weight's .grad.
at::Tensor NormWeightAccumulator(AutogradContext* ctx, const at::Tensor& weight) {
  at::Tensor accumulator = ctx->saved_data["accumulator"].toTensor();
  return accumulator.defined() ? accumulator : GradAccumulator(weight);
}

// Tensors [r_i, cols], contiguous, one after the other in one buffer (the stacked gate_proj and
// up_proj, or their gradients): one [sum r_i, cols] view of them all; undefined otherwise.
at::Tensor StackedRows(at::TensorList parts) {
  if (parts.size() < 2) return at::Tensor();
  const at::Tensor& first = parts[0];
  int64_t rows = 0;
  for (const at::Tensor& t : parts) {
    if (!t.defined() || t.dim() != 2 || !t.is_contiguous() || t.size(1) != first.size(1) ||
        t.scalar_type() != first.scalar_type() || !t.is_alias_of(first) ||
        t.storage_offset() != first.storage_offset() + rows * first.size(1)) {
      return at::Tensor();
    }
    rows += t.size(0);
  }
  return first.detach().as_strided({rows, first.size(1)}, {first.size(1), 1});
}

// Tensors [rows, c_i] side by side in one buffer's rows (the halves of a stacked projection's
// output, or of their gradient from SwiGluBackward): one [rows, sum c_i] view; undefined otherwise.
at::Tensor StackedColumns(at::TensorList parts) {
  if (parts.size() < 2) return at::Tensor();
  const at::Tensor& first = parts[0];
  if (!first.defined() || first.dim() != 2 || first.size(0) < 2) return at::Tensor();
  int64_t cols = 0;
  for (const at::Tensor& t : parts) {
    if (!t.defined() || t.dim() != 2 || t.size(0) != first.size(0) || t.stride(1) != 1 ||
        t.stride(0) != first.stride(0) || t.scalar_type() != first.scalar_type() ||
        !t.is_alias_of(first) || t.storage_offset() != first.storage_offset() + cols) {
      return at::Tensor();
    }
    cols += t.size(1);
  }
  if (cols > first.stride(0)) return at::Tensor();
  return first.detach().as_strided({first.size(0), cols}, {first.stride(0), 1});
}

// The weights' gradient accumulators as one stacked [sum r_i, cols] tensor: when none exists yet
// they are created so; when they exist but are not stacked (a caller replaced them), undefined.
at::Tensor StackedGradAccumulator(at::TensorList weights) {
  bool none = true;
  for (const at::Tensor& w : weights) none = none && !w.grad().defined();
  if (!none) {
    std::vector<at::Tensor> grads;
    for (const at::Tensor& w : weights) grads.push_back(w.grad());
    return StackedRows(grads);
  }
  int64_t rows = 0;
  for (const at::Tensor& w : weights) rows += w.size(0);
  const at::Tensor& first = weights[0];
  at::Tensor stack =
      at::zeros({rows, first.size(1)}, first.options().dtype(AccumulatorType(first.scalar_type())));
  rows = 0;
  for (const at::Tensor& w : weights) {
    const_cast<at::Tensor&>(w).mutable_grad() = stack.narrow(0, rows, w.size(0));
    rows += w.size(0);
  }
  return stack;
}

// The switches below are for before/after measurements in one build (read at every call).
// DTA_STACKED_PROJECTIONS=0 projects onto stacked weights one weight at a time, as for separate
// ones.
bool StackedProjectionsEnabled() { return EnvSwitchOn("DTA_STACKED_PROJECTIONS"); }

// DTA_FUSED_RESIDUAL=0 leaves the residual stream's gradient to autograd's sum instead of the
// norm's backward kernel (see Projections' `residual`).
bool FusedResidualEnabled() { return EnvSwitchOn("DTA_FUSED_RESIDUAL"); }

// How a projection sits in a tensor-parallel layer (Megatron's column- and row-parallel linear).
enum class ProjectionKind : int64_t {
  kColumnParallel,  // replicated input, output split by columns: all-reduce dx in backward
  kRowParallel,     // input split, output a partial sum: all-reduce y in forward
};

// y_i = n(x) @ weights_i^T (+ biases_i) for one input x [T, in] and one or more weights [out_i, in]
// (biases: none, or one [out_i] per weight), where n is an RMSNorm with `norm_weight` (the input
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
class Projections : public torch::autograd::Function<Projections> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const std::optional<at::Tensor>& norm, double eps, bool wide_output,
                               int64_t group, ProjectionKind kind, at::TensorList weights,
                               at::TensorList biases,
                               const std::optional<at::Tensor>& norm_accumulator, bool residual) {
    TORCH_CHECK(!weights.empty() && (biases.empty() || biases.size() == weights.size()),
                "Projections: one bias per weight, or none");
    TORCH_CHECK(!residual || norm.has_value(), "Projections: a residual output needs a norm");
    ctx->saved_data["accumulator"] = norm_accumulator.value_or(at::Tensor());
    ctx->saved_data["residual"] = residual;
    const at::Tensor norm_weight = norm.value_or(at::Tensor());
    const at::ScalarType type = weights[0].scalar_type();
    std::vector<at::Tensor> saved;
    at::Tensor xb;
    if (norm_weight.defined()) {
      kernels::RmsNormResult normed = kernels::RmsNormForward(x, norm_weight, eps, type);
      xb = std::move(normed.y);
      saved = {x, norm_weight, normed.rstd};
    } else {
      xb = x.to(type);
      saved = {xb, at::Tensor(), at::Tensor()};
    }
    saved.insert(saved.end(), weights.begin(), weights.end());
    saved.insert(saved.end(), biases.begin(), biases.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["tensor_parallel"] =
        kind == ProjectionKind::kColumnParallel ? group : int64_t{0};
    variable_list out;
    // Weights stored stacked (gate_proj over up_proj): one GEMM, its output's column blocks the
    // projections (read in place by SwiGLU; their gradients come back side by side).
    const at::Tensor stacked = biases.empty() && !wide_output &&
                                       kind == ProjectionKind::kColumnParallel &&
                                       StackedProjectionsEnabled()
                                   ? StackedRows(weights)
                                   : at::Tensor();
    if (stacked.defined()) {
      const at::Tensor y = at::mm(xb, stacked.t());
      int64_t column = 0;
      for (const at::Tensor& weight : weights) {
        out.push_back(y.narrow(1, column, weight.size(0)));
        column += weight.size(0);
      }
      if (residual) out.push_back(x);
      return out;
    }
    for (size_t i = 0; i < weights.size(); ++i) {
      const at::Tensor& weight = weights[i];
      const at::Tensor bias = biases.empty() ? at::Tensor() : biases[i];
      const bool bias_in_matmul =
          bias.defined() && !wide_output && kind == ProjectionKind::kColumnParallel;
      at::Tensor y = wide_output      ? MatmulTo(xb, weight.t(), ComputeType(type))
                     : bias_in_matmul ? at::addmm(bias, xb, weight.t())
                                      : at::mm(xb, weight.t());
      if (kind == ProjectionKind::kRowParallel) SumOverRanks(GroupOf(group), y);
      if (bias.defined() && !bias_in_matmul) y.add_(bias);
      out.push_back(std::move(y));
    }
    if (residual) out.push_back(x);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& norm_weight = saved[1];
    const at::Tensor& rstd = saved[2];
    const at::ScalarType type = saved[3].scalar_type();
    const auto x_type = static_cast<at::ScalarType>(ctx->saved_data["x_type"].toInt());
    const bool has_norm = norm_weight.defined();
    // The residual output's gradient (materialised: zeros when it got none), then the
    // projections'.
    at::Tensor residual_grad;
    if (ctx->saved_data["residual"].toBool()) {
      residual_grad = grads.back();
      grads.pop_back();
    }
    const size_t count = grads.size();
    const bool has_biases = saved.size() == 3 + 2 * count;
    const at::Tensor xb =
        has_norm ? kernels::RmsNormApply(saved[0], norm_weight, rstd, type) : saved[0];
    std::vector<at::Tensor> dys;
    for (size_t i = 0; i < count; ++i) dys.push_back(grads[i].to(type));
    const at::TensorList weights = at::TensorList(saved).slice(3, count);
    // Stacked weights whose outputs' gradients came back side by side: one GEMM for dx and one
    // for the weights' gradients.
    at::Tensor stacked, dy_stacked;
    if (!has_biases && StackedProjectionsEnabled()) {
      stacked = StackedRows(weights);
      if (stacked.defined()) dy_stacked = StackedColumns(dys);
    }
    const at::ScalarType dx_type = has_norm ? rstd.scalar_type() : x_type;
    at::Tensor dx;
    if (dy_stacked.defined()) {
      dx = MatmulTo(dy_stacked, stacked, dx_type);
    } else {
      for (size_t i = 0; i < count; ++i) {
        if (!dx.defined()) {
          dx = MatmulTo(dys[i], weights[i], dx_type);
        } else {
          AddMatmul(dx, dys[i], weights[i]);
        }
      }
    }
    // A column-parallel layer's input feeds every rank's columns: its gradient is their sum, taken
    // before the norm's backward (whose weight gradient is then whole on every rank). The sum runs
    // while the weight gradients, which do not need it, are computed (Megatron's overlap of the
    // input gradient's all-reduce with the weight-gradient GEMMs).
    std::unique_ptr<PendingCollective> dx_sum = StartSumOverRanks(GroupOf(ctx), dx);
    // Stacked weights get stacked gradients even when this call's dy is not side by side (a
    // one-row chunk), so that later calls can still accumulate into both with one GEMM.
    at::Tensor stacked_grad = stacked.defined() ? StackedGradAccumulator(weights) : at::Tensor();
    if (dy_stacked.defined() && stacked_grad.defined()) {
      AddMatmul(stacked_grad, dy_stacked.t(), xb);
    } else {
      for (size_t i = 0; i < count; ++i) {
        AddMatmul(GradAccumulator(weights[i]), dys[i].t(), xb);
        if (has_biases) {
          at::Tensor& accumulator = GradAccumulator(saved[i + 3 + count]);
          // Summed from the output's gradient as it came (float32 for o_proj), in the
          // accumulator's precision.
          accumulator.add_(at::sum(grads[i], {0}, false, accumulator.scalar_type()));
        }
      }
    }
    if (dx_sum != nullptr) dx_sum->Wait();
    if (has_norm) {
      at::Tensor accumulator = NormWeightAccumulator(ctx, norm_weight);
      // In the compute type, as autograd would have summed dx.to(x_type) and the residual's
      // gradient (x_type is the compute type wherever a residual stream feeds a norm).
      if (residual_grad.defined()) residual_grad = residual_grad.to(rstd.scalar_type());
      dx = kernels::RmsNormBackward(dx, saved[0], norm_weight, rstd, accumulator, residual_grad)
               .to(x_type);
    }
    variable_list result = {dx};
    // No gradient for the weights and biases: accumulated above.
    result.resize(8 + 2 * count);
    return result;
  }
};

// x @ weight^T (+ bias) in the compute dtype, summed over the tensor-parallel ranks (o_proj:
// row-parallel, it feeds the float32 residual stream; the bias, if any, added once after the sum).
at::Tensor ProjectWide(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       int64_t group) {
  std::vector<at::Tensor> biases;
  if (bias.defined()) biases.push_back(bias);
  return Projections::apply(x, std::nullopt, 0.0, /*wide_output=*/true, group,
                            ProjectionKind::kRowParallel, at::TensorList(weight),
                            at::TensorList(biases), std::nullopt, /*residual=*/false)[0];
}

// Token ids relative to this rank's vocabulary slice [first, first + rows): the row of each id
// (0 for ids outside), and which ids are inside (undefined when the slice is the whole
// vocabulary).
struct VocabularyRows {
  at::Tensor rows, owned;
};
VocabularyRows RowsOfSlice(const at::Tensor& ids, int64_t first, int64_t rows, bool split) {
  if (!split) return {ids, at::Tensor()};
  const at::Tensor local = ids - first;
  const at::Tensor owned = local.ge(0).logical_and_(local.lt(rows));
  return {at::where(owned, local, 0), owned};
}

// Rows of the embedding table, in the compute dtype (the residual stream's: float32 for bfloat16
// models), so backward receives the residual gradient unrounded. Vocabulary-parallel: each rank
// looks up the ids in its slice (zeros elsewhere) and the rows are summed over the ranks.
class Embedding : public torch::autograd::Function<Embedding> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& table, const at::Tensor& ids,
                            int64_t group, int64_t vocab_first) {
    const VocabularyRows v = RowsOfSlice(ids, vocab_first, table.size(0), group != 0);
    ctx->save_for_backward({table, v.rows, v.owned});
    at::Tensor out = table.index_select(0, v.rows).to(ComputeType(table.scalar_type()));
    if (v.owned.defined()) {
      out.mul_(v.owned.unsqueeze(1));
      SumOverRanks(GroupOf(group), out);
    }
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor& accumulator = GradAccumulator(saved[0]);
    at::Tensor g = grads[0].to(accumulator.scalar_type());
    if (saved[2].defined()) g = g * saved[2].unsqueeze(1);
    AddRowsInto(accumulator, saved[1], g);  // repeated ids summed in a fixed order
    return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Qwen3RMSNorm, weight * (x / rms(x)), computed in at least float32 and rounded once to out_type
// (the weight's dtype for q/k norms, the compute dtype for the final norm, which Logprobs rounds).
// Hugging Face rounds the normalised x to the input dtype first, then multiplies: identical for
// float32/float64 models, one rounding fewer in bfloat16. The input may be wider than the weight
// (the float32 residual stream of a bfloat16 model). Backward in the compute dtype.
// The weight's gradient goes into `accumulator` when it is defined (a partial sum, completed
// later), else into the weight's .grad.
class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps, at::ScalarType out_type,
                            const std::optional<at::Tensor>& accumulator) {
    kernels::RmsNormResult normed = kernels::RmsNormForward(x, weight, eps, out_type);
    ctx->save_for_backward({x, weight, normed.rstd});
    ctx->saved_data["accumulator"] = accumulator.value_or(at::Tensor());
    return normed.y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    at::Tensor accumulator = NormWeightAccumulator(ctx, saved[1]);
    const at::Tensor dx = kernels::RmsNormBackward(grads[0], x, saved[1], saved[2], accumulator);
    return {dx.to(x.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Qwen3's q/k norm over each head followed by rotary embedding, y = rope(RmsNorm(x)), in one
// kernel each way (kernels/fused_layers.h: the norm's output is rounded to x's dtype before RoPE,
// RoPE's input gradient to dy's before the norm's backward). Keeps x, the norm's rstd and the
// tables. The weight's gradient goes into `accumulator` when it is defined (a partial sum under
// tensor parallelism, completed later), else into the weight's .grad.
class NormRope : public torch::autograd::Function<NormRope> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps, const at::Tensor& cos, const at::Tensor& sin,
                            const std::optional<at::Tensor>& accumulator) {
    kernels::RmsNormResult result = kernels::RmsNormRopeForward(x, weight, eps, cos, sin);
    ctx->save_for_backward({x, weight, result.rstd});
    ctx->saved_data["cos"] = cos;
    ctx->saved_data["sin"] = sin;
    ctx->saved_data["accumulator"] = accumulator.value_or(at::Tensor());
    return result.y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor accumulator = NormWeightAccumulator(ctx, saved[1]);
    const at::Tensor dx = kernels::RmsNormRopeBackward(
        grads[0], saved[0], saved[1], saved[2], ctx->saved_data["cos"].toTensor(),
        ctx->saved_data["sin"].toTensor(), accumulator);
    return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// RoPE alone, y = rope(x) (executor/model/rope.h: computed in the tables' dtype, rounded once to
// x's), for the families without q/k norms (Qwen2, Llama). Keeps only the tables: backward is
// linear in dy.
class RopeOnly : public torch::autograd::Function<RopeOnly> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->saved_data["cos"] = cos;
    ctx->saved_data["sin"] = sin;
    return RopeForward(x, cos, sin);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {RopeBackward(grads[0], ctx->saved_data["cos"].toTensor(),
                         ctx->saved_data["sin"].toTensor()),
            at::Tensor(), at::Tensor()};
  }
};

// The MLP's second half, y = SwiGlu(gate, up) @ down^T, formed in the compute dtype (it feeds the
// float32 residual stream). Backward keeps gate and up only and recomputes the product (bitwise the
// same) for down's weight gradient: eager autograd would keep silu(gate) and the product as well,
// two more [T, intermediate] tensors, the largest activations of the layer. d product is not
// rounded before the SwiGLU backward.
class SwiGluDown : public torch::autograd::Function<SwiGluDown> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up,
                            const at::Tensor& down, int64_t group) {
    ctx->save_for_backward({gate, up, down});
    // Row-parallel: each rank's intermediate slice gives a partial sum of y.
    at::Tensor y =
        MatmulTo(kernels::SwiGluForward(gate, up), down.t(), ComputeType(down.scalar_type()));
    SumOverRanks(GroupOf(group), y);
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
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
};

// Grouped GEMMs over rows sorted by expert: rows [ends[e - 1], ends[e]) belong to expert e (ends:
// [E] int64, the running sum of the experts' row counts, on the rows' device). On CUDA one
// at::_grouped_mm each (no host read-back of the routing; its output has its inputs' dtype); on
// the CPU, where it takes no float64, a loop over the experts that have rows.
// (CUDA's grouped GEMM takes no float64 either: float64 models, the exact references, loop there
// too.)
bool UseGroupedMm(const at::Tensor& t) { return t.is_cuda() && t.scalar_type() != at::kDouble; }

// The experts' row ranges on the host (CPU path only).
std::vector<int64_t> HostEnds(const at::Tensor& ends) {
  const at::Tensor host = ends.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(host.const_data_ptr<int64_t>(),
                              host.const_data_ptr<int64_t>() + host.numel());
}

// y[rows of e] = x[rows of e] @ (transpose ? w[e]^T : w[e]), in `dtype` (CUDA: w's dtype, then
// converted). x [N, K]; w [E, M, K] with transpose, [E, K, M] without.
at::Tensor GroupedMatmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ends,
                         bool transpose, at::ScalarType dtype) {
  const at::Tensor weights = transpose ? w.transpose(1, 2) : w;  // [E, K, M]
  if (UseGroupedMm(x)) {
    return at::_grouped_mm(x.to(w.scalar_type()), weights, ends.to(at::kInt)).to(dtype);
  }
  at::Tensor y = at::empty({x.size(0), weights.size(2)}, x.options().dtype(dtype));
  const std::vector<int64_t> host = HostEnds(ends);
  int64_t begin = 0;
  for (size_t e = 0; e < host.size(); ++e) {
    const int64_t end = host[e];
    if (end > begin)
      y.slice(0, begin, end).copy_(MatmulTo(x.slice(0, begin, end), weights[e], dtype));
    begin = end;
  }
  return y;
}

// accumulator[e] += dy[rows of e]^T @ x[rows of e]: a stacked weight's gradient. dy [N, M],
// x [N, K], accumulator [E, M, K]. On CUDA at::_grouped_mm returns its inputs' dtype, so the
// product is formed from float32 copies of dy and x (in the accumulator's precision): a bfloat16
// product would round every chunk's expert gradient to bfloat16 before the float32 sum, an error
// that grows with the number of chunks (dta with small B). Slower than a bfloat16 GEMM with a
// float32 output, which needs a grouped GEMM of our own (CUTLASS).
void AddGroupedWeightGrad(at::Tensor& accumulator, const at::Tensor& dy, const at::Tensor& x,
                          const at::Tensor& ends) {
  if (UseGroupedMm(dy)) {
    const at::ScalarType wide = accumulator.scalar_type();
    accumulator.add_(at::_grouped_mm(dy.to(wide).t(), x.to(wide), ends.to(at::kInt)));
    return;
  }
  const std::vector<int64_t> host = HostEnds(ends);
  int64_t begin = 0;
  for (size_t e = 0; e < host.size(); ++e) {
    const int64_t end = host[e];
    if (end > begin) {
      at::Tensor slot = accumulator[e];
      AddMatmul(slot, dy.slice(0, begin, end).t(), x.slice(0, begin, end));
    }
    begin = end;
  }
}

// Qwen3-MoE's sparse block on the residual stream x [T, H], as transformers'
// Qwen3MoeSparseMoeBlock after the post-attention norm n: router logits n(x) @ router^T in the
// weights' dtype; softmax in the compute dtype; the top-k (torch.topk) probabilities, renormalised
// to sum to 1 with norm_topk, rounded to the weights' dtype; y = sum_k w_k down_e(silu(gate_e n(x))
// * up_e n(x)) over the token's experts e, formed in the compute dtype (it feeds the residual
// stream). The token-expert pairs are sorted by expert (a stable sort: deterministic) and the
// experts run as grouped GEMMs; each token's k outputs are gathered back and summed in slot order,
// without atomics. Backward keeps the pairs' gate and up outputs (not their product, nor n(x) or
// its gathered copy, which it recomputes), the softmax probabilities and the sort.
//
// Tensor parallelism: every rank holds a slice of each expert's intermediate rows (columns of
// down) and the whole router, so routing is the same on every rank. y is a sum of the ranks'
// partial sums (one all-reduce in forward, as SwiGluDown). In backward the routing weights'
// gradient <dy, expert output> is a partial sum per rank (each sees its intermediate slice), and
// so is the gradient of n(x) through the experts: both are summed over the ranks; the router's
// part of n(x)'s gradient and the router's weight gradient are then whole on every rank.
//
// Outputs: y [T, H]; the softmax probabilities [T, E] (compute dtype), through which a gradient
// seeded by the router's load-balancing loss reaches the router; the top-k expert indices [T, k]
// (int64, not differentiable); with `residual`, x itself for the residual connection, whose
// gradient the norm's backward kernel then adds (as Projections' `residual`).
class SparseMoe : public torch::autograd::Function<SparseMoe> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& norm_weight, double eps, const at::Tensor& router,
                               const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                               int64_t top_k, bool norm_topk, int64_t group,
                               const std::optional<at::Tensor>& norm_accumulator, bool residual) {
    const at::ScalarType type = gate.scalar_type();
    const at::ScalarType ct = ComputeType(type);
    const int64_t t = x.size(0);
    const int64_t experts = router.size(0);
    kernels::RmsNormResult normed = kernels::RmsNormForward(x, norm_weight, eps, type);
    const at::Tensor& xb = normed.y;
    const at::Tensor probs = at::softmax(at::mm(xb, router.t()).to(ct), -1);  // [T, E]
    const auto [top, index] = at::topk(probs, top_k, -1);                     // [T, k]
    at::Tensor weights = norm_topk ? top / top.sum(-1, true) : top;
    weights = weights.to(type).to(ct);
    // Pairs (token, slot) sorted by expert; `inverse` maps pair t k + slot to its sorted place.
    const at::Tensor flat = index.reshape({-1});
    const auto [sorted, order] = at::sort(flat, /*stable=*/true, 0, false);
    const at::Tensor inverse =
        at::empty_like(order).scatter_(0, order, at::arange(order.size(0), order.options()));
    const at::Tensor token = at::div(order, top_k, "floor");
    // Each expert's end in the sorted pairs, found on the device (no atomics, no host read).
    const at::Tensor ends =
        at::searchsorted(sorted, at::arange(experts, flat.options()), /*out_int32=*/false,
                         /*right=*/true);
    const at::Tensor xs = xb.index_select(0, token);
    const at::Tensor gate_out = GroupedMatmul(xs, gate, ends, /*transpose=*/true, type);
    const at::Tensor up_out = GroupedMatmul(xs, up, ends, /*transpose=*/true, type);
    const at::Tensor out = GroupedMatmul(kernels::SwiGluForward(gate_out, up_out), down, ends,
                                         /*transpose=*/true, ct);  // [T k, H]
    at::Tensor y =
        (out.index_select(0, inverse).view({t, top_k, -1}) * weights.unsqueeze(2)).sum(1);
    SumOverRanks(GroupOf(group), y);
    ctx->save_for_backward({x, norm_weight, normed.rstd, router, gate, up, down, probs, index,
                            weights, order, inverse, token, ends, gate_out, up_out});
    ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["norm_topk"] = norm_topk;
    ctx->saved_data["tensor_parallel"] = group;
    ctx->saved_data["accumulator"] = norm_accumulator.value_or(at::Tensor());
    ctx->saved_data["residual"] = residual;
    ctx->mark_non_differentiable({index});
    if (residual) return {y, probs, index, x};
    return {y, probs, index};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &norm_weight = saved[1], &rstd = saved[2], &router = saved[3],
                     &gate = saved[4], &up = saved[5], &down = saved[6], &probs = saved[7],
                     &index = saved[8], &weights = saved[9], &order = saved[10],
                     &inverse = saved[11], &token = saved[12], &ends = saved[13],
                     &gate_out = saved[14], &up_out = saved[15];
    const TensorParallelGroup* ranks = GroupOf(ctx);
    const at::ScalarType type = gate.scalar_type();
    const at::ScalarType ct = ComputeType(type);
    const int64_t t = x.size(0);
    const int64_t top_k = index.size(1);
    const at::Tensor xb = kernels::RmsNormApply(x, norm_weight, rstd, type);
    const at::Tensor xs = xb.index_select(0, token);
    const at::Tensor dy = grads[0].to(ct).index_select(0, token);  // [T k, H], sorted pairs
    const at::Tensor w = weights.reshape({-1}).index_select(0, order).unsqueeze(1);  // [T k, 1]
    // g = dy @ down_e, the gradient of the expert's SwiGLU product before its routing weight.
    const at::Tensor g = GroupedMatmul(dy.to(type), down, ends, /*transpose=*/false, ct);
    kernels::SwiGluGrads swiglu =
        kernels::SwiGluBackward(g * w, gate_out, up_out, /*with_product=*/true);
    // d weight = <dy, down_e product> = <g, product>: partial over the ranks' intermediate slices.
    at::Tensor dweights = (g * swiglu.product.to(ct)).sum(-1);
    std::unique_ptr<PendingCollective> dweights_sum = StartSumOverRanks(ranks, dweights);
    AddGroupedWeightGrad(GradAccumulator(down), (dy * w).to(type), swiglu.product, ends);
    AddGroupedWeightGrad(GradAccumulator(gate), swiglu.dgate, xs, ends);
    AddGroupedWeightGrad(GradAccumulator(up), swiglu.dup, xs, ends);
    at::Tensor dxs = GroupedMatmul(swiglu.dgate, gate, ends, /*transpose=*/false, ct);
    dxs.add_(GroupedMatmul(swiglu.dup, up, ends, /*transpose=*/false, ct));
    at::Tensor dxb = dxs.index_select(0, inverse).view({t, top_k, -1}).sum(1);  // [T, H]
    std::unique_ptr<PendingCollective> dxb_sum = StartSumOverRanks(ranks, dxb);
    if (dweights_sum != nullptr) dweights_sum->Wait();
    // Through the top-k selection (and its renormalisation) and the softmax.
    at::Tensor dtop = dweights.index_select(0, inverse).view({t, top_k});
    if (ctx->saved_data["norm_topk"].toBool()) {
      const at::Tensor top = probs.gather(1, index);
      const at::Tensor sum = top.sum(-1, true);
      dtop = (dtop - (dtop * (top / sum)).sum(-1, true)) / sum;
    }
    at::Tensor dprobs = at::zeros_like(probs).scatter_(1, index, dtop);
    // The load-balancing loss's gradient, whole on every rank (it is computed from the routing,
    // which every rank shares).
    if (grads[1].defined()) dprobs.add_(grads[1].to(ct));
    const at::Tensor dlogits = (probs * (dprobs - (dprobs * probs).sum(-1, true))).to(type);
    AddMatmul(GradAccumulator(router), dlogits.t(), xb);
    if (dxb_sum != nullptr) dxb_sum->Wait();
    AddMatmul(dxb, dlogits, router);
    at::Tensor norm_accumulator = NormWeightAccumulator(ctx, norm_weight);
    // The residual output's gradient (materialised: zeros when it got none).
    const at::Tensor residual_grad =
        ctx->saved_data["residual"].toBool() ? grads[3].to(rstd.scalar_type()) : at::Tensor();
    const at::Tensor dx = kernels::RmsNormBackward(dxb.to(rstd.scalar_type()), x, norm_weight, rstd,
                                                   norm_accumulator, residual_grad)
                              .to(static_cast<at::ScalarType>(ctx->saved_data["x_type"].toInt()));
    variable_list result = {dx};
    result.resize(12);  // the weights' gradients are accumulated above
    return result;
  }
};

// Attention of a chunk on a cached prefix (kernels/chunk_attention.h: cuDNN for the prefix and for
// chains, tree attention for tree masks, merged by log-sum-exp). Returns [T, heads, head_dim]. The
// prefix is a constant of the graph (a non-tensor argument, so autograd neither tracks nor
// version-checks it: it is a view of a stack that later chunks write above, never into, while this
// graph lives); with accumulators, backward adds the prefix's K/V gradients into them in place.
// With `chain`, key_end (always defined: autograd functions refuse undefined tensor arguments) is
// ignored and the chunk is a causal chain.
class TreeAttention : public torch::autograd::Function<TreeAttention> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& tree_key_end,
                            const LayerPrefix& prefix, double scale, bool chain) {
    const at::Tensor key_end = chain ? at::Tensor() : tree_key_end;
    kernels::ChunkAttentionResult result =
        kernels::ChunkAttentionForward(q, k, v, prefix.keys, prefix.values, key_end, scale);
    std::vector<at::Tensor> saved = {q, k, v, key_end};
    saved.insert(saved.end(), result.saved.tensors.begin(), result.saved.tensors.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["path"] = result.saved.path;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["prefix_k"] = prefix.keys;
    ctx->saved_data["prefix_v"] = prefix.values;
    ctx->saved_data["grad_prefix_k"] = prefix.grad_keys;
    ctx->saved_data["grad_prefix_v"] = prefix.grad_values;
    return result.out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const kernels::ChunkAttentionSaved state{
        .path = ctx->saved_data["path"].toInt(),
        .tensors = std::vector<at::Tensor>(saved.begin() + 4, saved.end())};
    const kernels::TreeAttentionGrads g = kernels::ChunkAttentionBackward(
        grads[0], saved[0], saved[1], saved[2], ctx->saved_data["prefix_k"].toTensor(),
        ctx->saved_data["prefix_v"].toTensor(), saved[3], state,
        ctx->saved_data["scale"].toDouble(), ctx->saved_data["grad_prefix_k"].toTensor(),
        ctx->saved_data["grad_prefix_v"].toTensor());
    return {g.dq, g.dk, g.dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

LayerPrefix PrefixOfLayer(const PrefixKv& prefix, int64_t l) {
  if (prefix.empty()) return {};
  LayerPrefix layer{
      .keys = prefix.keys[l], .values = prefix.values[l], .grad_keys = {}, .grad_values = {}};
  if (!prefix.grad_keys.empty()) {
    layer.grad_keys = prefix.grad_keys[l];
    layer.grad_values = prefix.grad_values[l];
  }
  if (!prefix.states.empty()) layer.state = prefix.states[l];
  if (!prefix.grad_states.empty()) layer.grad_state = prefix.grad_states[l];
  return layer;
}

// Row-wise dot products of two [rows, n] tensors as a batched matrix product, without the [rows, n]
// elementwise product.
at::Tensor RowDot(const at::Tensor& a, const at::Tensor& b) {
  return at::bmm(a.unsqueeze(1), b.unsqueeze(2)).view({a.size(0)});
}

// log p(target) (and entropy) of each row of hidden @ weight^T, over the vocabulary. Neither pass
// keeps a [rows x vocab] tensor beyond one slice: backward recomputes each slice's logits. Logits
// are formed in float32 (float64 for float64 models) directly from the matmul. hidden may be wider
// than the weight (the final norm's float32 output): it is rounded once to the weight's dtype, that
// copy is what backward keeps, and the gradient comes back in hidden's dtype, so a row that
// predicts several children in a packed tree sums their gradients without rounding each.
//
// Vocabulary-parallel: weight holds this rank's vocabulary rows [vocab_first, + rows). Per slice of
// rows, the ranks agree on each row's max logit m (an all-reduce max), then sum their shares of
// S = sum exp(z - m), of the target's logit (from the rank that holds it) and, for the entropy, of
// U = sum exp(z - m) z (one all-reduce of [3, slice]): lse = m + log S, log p = z_y - lse,
// H = lse - U / S. Backward needs no collective until the hidden state's gradient, whose per-rank
// parts are summed once.
class SlicedLogprobs : public torch::autograd::Function<SlicedLogprobs> {
 public:
  // inverse_temperature: the logits are z / T = (hidden . weight) * inverse_temperature.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& wide_hidden,
                               const at::Tensor& weight, const at::Tensor& targets,
                               int64_t slice_rows, double inverse_temperature, bool want_entropy,
                               int64_t group, int64_t vocab_first) {
    const TensorParallelGroup* ranks = GroupOf(group);
    const at::Tensor hidden = wide_hidden.to(weight.scalar_type());
    const at::ScalarType ct = ComputeType(hidden.scalar_type());
    const int64_t rows = hidden.size(0);
    const VocabularyRows target_rows =
        RowsOfSlice(targets, vocab_first, weight.size(0), group != 0);
    at::Tensor logprobs = at::empty({rows}, hidden.options().dtype(ct));
    at::Tensor entropy = at::zeros({rows}, hidden.options().dtype(ct));
    // Kept for backward: each row's log-sum-exp and, for the entropy, E_p[z].
    at::Tensor lse = at::empty({rows}, hidden.options().dtype(ct));
    at::Tensor mean_logit =
        want_entropy ? at::empty({rows}, hidden.options().dtype(ct)) : at::Tensor();
    // At most two [slice, vocab] tensors at a time: the logits and exp(z - m) (one on one rank,
    // where the fused row statistics read the logits once).
    for (int64_t begin = 0; begin < rows; begin += slice_rows) {
      const int64_t end = std::min(rows, begin + slice_rows);
      at::Tensor logits = MatmulTo(hidden.slice(0, begin, end), weight.t(), ct);
      if (inverse_temperature != 1.0) logits.mul_(inverse_temperature);
      const at::Tensor slice_targets = target_rows.rows.slice(0, begin, end);
      at::Tensor row_lse, target, mean;
      if (ranks == nullptr) {
        kernels::LogitRowStats stats =
            kernels::LogitRowStatsForward(logits, slice_targets, want_entropy);
        row_lse = std::move(stats.lse);
        target = std::move(stats.target);
        mean = std::move(stats.mean);
      } else {
        at::Tensor max = logits.amax(-1);
        ranks->AllReduce(max, TensorParallelReduce::kMax);
        const at::Tensor exp = (logits - max.unsqueeze(1)).exp_();
        target = logits.gather(1, slice_targets.unsqueeze(1)).squeeze(1);
        if (target_rows.owned.defined()) target.mul_(target_rows.owned.slice(0, begin, end));
        std::vector<at::Tensor> sums = {exp.sum(-1), target};
        if (want_entropy) sums.push_back(RowDot(exp, logits));
        at::Tensor summed = at::stack(sums);
        SumOverRanks(ranks, summed);
        row_lse = max + summed[0].log();
        target = summed[1];
        if (want_entropy) mean = summed[2] / summed[0];
      }
      lse.slice(0, begin, end).copy_(row_lse);
      logprobs.slice(0, begin, end).copy_(target - row_lse);
      if (want_entropy) {
        mean_logit.slice(0, begin, end).copy_(mean);
        entropy.slice(0, begin, end).copy_(row_lse - mean);
      }
    }
    ctx->save_for_backward({hidden, weight, target_rows.rows, target_rows.owned, lse, mean_logit});
    ctx->saved_data["hidden_type"] = static_cast<int64_t>(wide_hidden.scalar_type());
    ctx->saved_data["slice_rows"] = slice_rows;
    ctx->saved_data["inverse_temperature"] = inverse_temperature;
    ctx->saved_data["tensor_parallel"] = group;
    return {logprobs, entropy};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& targets = saved[2];  // rows of this rank's slice
    const at::Tensor& owned = saved[3];    // undefined: every target is in the slice
    const at::Tensor& lse = saved[4];
    const at::Tensor& mean_logit = saved[5];
    const int64_t slice_rows = ctx->saved_data["slice_rows"].toInt();
    const double inverse_temperature = ctx->saved_data["inverse_temperature"].toDouble();
    const at::ScalarType ct = ComputeType(hidden.scalar_type());
    at::Tensor& grad_weight = GradAccumulator(weight);
    const auto hidden_type = static_cast<at::ScalarType>(ctx->saved_data["hidden_type"].toInt());
    at::Tensor grad_hidden = at::empty(hidden.sizes(), hidden.options().dtype(hidden_type));
    const int64_t rows = hidden.size(0);
    std::vector<std::unique_ptr<PendingCollective>> pending;
    // Per slice: the float32 logits and their gradient in the model dtype (on the CPU and in
    // float64, a second float32 slice: kernels/fused_layers.h).
    for (int64_t begin = 0; begin < rows; begin += slice_rows) {
      const int64_t end = std::min(rows, begin + slice_rows);
      const at::Tensor h = hidden.slice(0, begin, end);
      at::Tensor logits = MatmulTo(h, weight.t(), ct);
      if (inverse_temperature != 1.0) logits.mul_(inverse_temperature);
      // d logp(y) / d z = onehot(y) - p;  d entropy / d z = -p (z - E_p[z]); the gradient so far
      // is with respect to z / T. The two matmuls run in the model dtype (bfloat16 tensor cores
      // on the GPU), d hidden comes out in hidden's dtype.
      const bool with_entropy = mean_logit.defined() && grads[1].defined();
      const at::Tensor g =
          kernels::LogitGradient(logits, lse.slice(0, begin, end), targets.slice(0, begin, end),
                                 owned.defined() ? owned.slice(0, begin, end).to(ct) : at::Tensor(),
                                 grads[0].slice(0, begin, end).to(ct),
                                 with_entropy ? mean_logit.slice(0, begin, end) : at::Tensor(),
                                 with_entropy ? grads[1].slice(0, begin, end).to(ct) : at::Tensor(),
                                 inverse_temperature, hidden.scalar_type());
      logits.reset();
      at::Tensor grad_rows = grad_hidden.slice(0, begin, end);
      grad_rows.copy_(MatmulTo(g, weight, hidden_type));
      // Each rank's vocabulary slice contributes its part of d hidden: the rows' sum runs while
      // the weight gradient and the next slice are computed.
      if (auto sum = StartSumOverRanks(GroupOf(ctx), grad_rows)) pending.push_back(std::move(sum));
      AddMatmul(grad_weight, g.t(), h);
    }
    for (const auto& sum : pending) sum->Wait();
    return {grad_hidden,  at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

Decoder::Decoder(const ModelConfig& config, at::TensorOptions options,
                 std::shared_ptr<const TensorParallelGroup> tensor_parallel)
    : config_(config), options_(options), tensor_parallel_(std::move(tensor_parallel)) {
  const absl::Status valid = ValidateModelConfig(config);
  TORCH_CHECK(valid.ok(), "Decoder: ", std::string(valid.message()));
  TORCH_CHECK(config.head_dim % 2 == 0, "head_dim must be even for RoPE");
  const int tp = tensor_parallel_size();
  const int rank = tensor_parallel_ ? tensor_parallel_->rank() : 0;
  // Qwen3-Next's layers have no tensor-parallel split yet (its linear layers' heads, the gated
  // q_proj's interleaved rows, the shared expert).
  TORCH_CHECK(tp == 1 || !(HasGatedAttention(config) || HasSharedExpert(config)),
              "tensor parallelism is not supported for ", config.model_type,
              " models yet; run it with a tensor-parallel size of 1");
  // Whole heads per rank, and each rank's query heads share its own KV heads (grouped-query
  // attention maps query head h to KV head h / (heads / kv_heads)).
  TORCH_CHECK(config.num_key_value_heads % tp == 0, "tensor parallelism over ", tp,
              " ranks needs a multiple of ", tp, " KV heads; the model has ",
              config.num_key_value_heads, " (use a tensor-parallel size that divides it)");
  heads_ = SplitRange(config.num_attention_heads, rank, tp);
  kv_heads_ = SplitRange(config.num_key_value_heads, rank, tp);
  intermediate_ = SplitRange(config.intermediate_size, rank, tp);
  moe_intermediate_ = SplitRange(config.moe_intermediate_size, rank, tp);
  vocab_ = SplitRange(config.vocab_size, rank, tp);
  const int64_t hidden = config.hidden_size;
  const int64_t dim = config.head_dim;
  const IndexRange q_rows{heads_.begin * dim, heads_.end * dim};
  const IndexRange kv_rows{kv_heads_.begin * dim, kv_heads_.end * dim};
  const int64_t q_dim = config.num_attention_heads * dim;
  // Gated attention: q_proj's rows are each head's query and output gate, [q_h, gate_h] per head.
  const int64_t q_proj_rows = HasGatedAttention(config) ? 2 * q_dim : q_dim;
  const IndexRange q_proj_split{q_rows.begin * (q_proj_rows / q_dim),
                                q_rows.end * (q_proj_rows / q_dim)};
  const int64_t kv_dim = config.num_key_value_heads * dim;
  const int64_t inter = config.intermediate_size;
  const bool qk_norm = HasQkNorm(config);
  const bool qkv_bias = config.attention_bias;
  const bool o_bias = HasOProjBias(config);
  embed_ = Add("model.embed_tokens.weight", {config.vocab_size, hidden}, 0, vocab_);
  bool any_linear = false;
  for (int64_t i = 0; i < config.num_hidden_layers; ++i)
    any_linear |= IsLinearAttentionLayer(config, i);
  if (any_linear) {
    linear_layers_.assign(config.num_hidden_layers, false);
    linear_shape_ = {.key_heads = config.linear_num_key_heads,
                     .value_heads = config.linear_num_value_heads,
                     .key_head_dim = config.linear_key_head_dim,
                     .value_head_dim = config.linear_value_head_dim,
                     .conv_kernel = config.linear_conv_kernel_dim,
                     .eps = config.rms_norm_eps};
  }
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer layer;
    layer.input_norm = Add(p + "input_layernorm.weight", {hidden});
    if (IsLinearAttentionLayer(config, i)) {
      // Gated DeltaNet, named as transformers' Qwen3NextGatedDeltaNet.
      const GatedDeltaNetShape& s = linear_shape_;
      const std::string a = p + "linear_attn.";
      GatedDeltaNetWeights& w = layer.linear;
      w.in_proj_qkvz =
          Add(a + "in_proj_qkvz.weight", {2 * s.key_dim() + 2 * s.value_dim(), hidden});
      w.in_proj_ba = Add(a + "in_proj_ba.weight", {2 * s.value_heads, hidden});
      w.conv1d = Add(a + "conv1d.weight", {s.conv_dim(), 1, s.conv_kernel});
      w.dt_bias = Add(a + "dt_bias", {s.value_heads});
      w.a_log = Add(a + "A_log", {s.value_heads});
      w.norm = Add(a + "norm.weight", {s.value_head_dim});
      w.out_proj = Add(a + "out_proj.weight", {hidden, s.value_dim()});
      linear_layers_[i] = true;
    } else {
      // Column-parallel biases split as their projection's rows; o_proj's is whole on every rank.
      layer.q_proj = Add(p + "self_attn.q_proj.weight", {q_proj_rows, hidden}, 0, q_proj_split);
      if (qkv_bias) layer.q_bias = Add(p + "self_attn.q_proj.bias", {q_proj_rows}, 0, q_proj_split);
      layer.k_proj = Add(p + "self_attn.k_proj.weight", {kv_dim, hidden}, 0, kv_rows);
      if (qkv_bias) layer.k_bias = Add(p + "self_attn.k_proj.bias", {kv_dim}, 0, kv_rows);
      layer.v_proj = Add(p + "self_attn.v_proj.weight", {kv_dim, hidden}, 0, kv_rows);
      if (qkv_bias) layer.v_bias = Add(p + "self_attn.v_proj.bias", {kv_dim}, 0, kv_rows);
      layer.o_proj = Add(p + "self_attn.o_proj.weight", {hidden, q_dim}, 1, q_rows);
      if (o_bias) layer.o_bias = Add(p + "self_attn.o_proj.bias", {hidden});
      if (qk_norm) {
        layer.q_norm = Add(p + "self_attn.q_norm.weight", {dim});
        layer.k_norm = Add(p + "self_attn.k_norm.weight", {dim});
      }
    }
    layer.post_norm = Add(p + "post_attention_layernorm.weight", {hidden});
    if (IsSparseLayer(config, i)) {
      // The experts stacked per layer (qwen3_checkpoint.h maps them to the Hub's per-expert
      // tensors); each rank holds a slice of every expert's intermediate rows.
      const int64_t experts = config.num_experts;
      const int64_t moe = config.moe_intermediate_size;
      layer.experts_gate =
          Add(p + "mlp.experts.gate_proj", {experts, moe, hidden}, 1, moe_intermediate_);
      layer.experts_up =
          Add(p + "mlp.experts.up_proj", {experts, moe, hidden}, 1, moe_intermediate_);
      layer.experts_down =
          Add(p + "mlp.experts.down_proj", {experts, hidden, moe}, 2, moe_intermediate_);
      layer.router = Add(p + "mlp.gate.weight", {experts, hidden});
      if (HasSharedExpert(config)) {
        const int64_t shared = config.shared_expert_intermediate_size;
        layer.shared_gate = Add(p + "mlp.shared_expert.gate_proj.weight", {shared, hidden});
        layer.shared_up = Add(p + "mlp.shared_expert.up_proj.weight", {shared, hidden});
        layer.shared_down = Add(p + "mlp.shared_expert.down_proj.weight", {hidden, shared});
        layer.shared_expert_gate = Add(p + "mlp.shared_expert_gate.weight", {1, hidden});
      }
    } else {
      const std::vector<at::Tensor> gate_up =
          AddStacked({p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"},
                     {{inter, hidden}, {inter, hidden}}, intermediate_);
      layer.gate_proj = gate_up[0];
      layer.up_proj = gate_up[1];
      layer.down_proj = Add(p + "mlp.down_proj.weight", {hidden, inter}, 1, intermediate_);
    }
    layers_.push_back(std::move(layer));
  }
  final_norm_ = Add("model.norm.weight", {hidden});
  lm_head_ = config.tie_word_embeddings
                 ? embed_
                 : Add("lm_head.weight", {config.vocab_size, hidden}, 0, vocab_);
  if (tp > 1 && qk_norm) {
    const at::ScalarType type = AccumulatorType(options.dtype().toScalarType());
    partial_norm_grads_ = at::zeros({config.num_hidden_layers, 2, dim}, options.dtype(type));
  }
  inv_freq_ = RopeInverseFrequencies(
      config, options.dtype(ComputeType(options.dtype().toScalarType())).requires_grad(false));
}

at::Tensor Decoder::Add(const std::string& name, std::vector<int64_t> full_shape, int64_t dim,
                        IndexRange range) {
  std::vector<int64_t> shape = full_shape;
  if (dim >= 0) shape[dim] = range.size();
  at::Tensor parameter = at::zeros(shape, options_).requires_grad_(true);
  named_.emplace_back(name, parameter);
  splits_.push_back({.dim = dim, .full_shape = std::move(full_shape), .range = range});
  return parameter;
}

std::vector<at::Tensor> Decoder::AddStacked(const std::vector<std::string>& names,
                                            const std::vector<std::vector<int64_t>>& full_shapes,
                                            IndexRange range) {
  TORCH_CHECK(names.size() == full_shapes.size() && !names.empty(),
              "AddStacked: one shape per name");
  const int64_t cols = full_shapes[0].at(1);
  at::Tensor stack = at::zeros({static_cast<int64_t>(names.size()) * range.size(), cols}, options_);
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < names.size(); ++i) {
    TORCH_CHECK(full_shapes[i].size() == 2 && full_shapes[i][1] == cols,
                "AddStacked: the parts must be [rows, ", cols, "], got ", full_shapes[i].size(),
                "-D for ", names[i]);
    // A view of the stack that is a leaf of its own (the stack itself needs no gradient).
    at::Tensor parameter =
        stack.narrow(0, static_cast<int64_t>(i) * range.size(), range.size()).requires_grad_(true);
    named_.emplace_back(names[i], parameter);
    splits_.push_back({.dim = 0, .full_shape = full_shapes[i], .range = range});
    parts.push_back(std::move(parameter));
  }
  return parts;
}

at::Tensor Decoder::parameter(const std::string& name) const {
  for (const auto& [n, p] : named_) {
    if (n == name) return p;
  }
  TORCH_CHECK(false, "the model has no parameter named '", name, "'");
}

TensorParallelNorm Decoder::gradient_norm_scope() const {
  TensorParallelNorm scope{.group = tensor_parallel_size() > 1 ? tensor_parallel() : nullptr,
                           .replicated = {}};
  for (const ParameterSplit& split : splits_) scope.replicated.push_back(split.replicated());
  return scope;
}

at::Tensor Decoder::LocalPart(size_t index, const at::Tensor& full) const {
  TORCH_CHECK(index < named_.size(), "Decoder::LocalPart: no parameter ", index);
  const ParameterSplit& split = splits_[index];
  TORCH_CHECK(full.sizes() == at::IntArrayRef(split.full_shape), "Decoder::LocalPart: '",
              named_[index].first, "' has shape ", at::IntArrayRef(split.full_shape), ", not ",
              full.sizes());
  if (split.replicated()) return full;
  return full.narrow(split.dim, split.range.begin, split.range.size());
}

at::Tensor Decoder::GatherParameter(size_t index) const {
  TORCH_CHECK(index < named_.size(), "Decoder::GatherParameter: no parameter ", index);
  const ParameterSplit& split = splits_[index];
  const at::Tensor local = named_[index].second.detach();
  if (split.replicated() || tensor_parallel_size() == 1) return local;
  // Ranks' parts differ in size by at most one row: gather them padded to the largest.
  const int tp = tensor_parallel_size();
  const int64_t full = split.full_shape[split.dim];
  const int64_t most = (full + tp - 1) / tp;
  const at::Tensor rows = local.movedim(split.dim, 0);
  std::vector<int64_t> padded_shape = rows.sizes().vec();
  padded_shape[0] = most;
  at::Tensor padded = at::zeros(padded_shape, local.options());
  padded.slice(0, 0, rows.size(0)).copy_(rows);
  const at::Tensor gathered = tensor_parallel_->AllGather(padded);
  std::vector<at::Tensor> parts;
  for (int r = 0; r < tp; ++r) {
    parts.push_back(gathered.slice(0, r * most, r * most + SplitRange(full, r, tp).size()));
  }
  const at::Tensor whole = at::cat(parts);
  return split.dim == 0 ? whole : whole.movedim(0, split.dim).contiguous();
}

void Decoder::ReduceTensorParallelGradients() const {
  if (!partial_norm_grads_.defined()) return;
  torch::autograd::AutoGradMode no_grad(false);
  at::Tensor sums = partial_norm_grads_;
  tensor_parallel_->AllReduce(sums, TensorParallelReduce::kSum);
  for (size_t l = 0; l < layers_.size(); ++l) {
    GradAccumulator(layers_[l].q_norm).add_(sums[l][0]);
    GradAccumulator(layers_[l].k_norm).add_(sums[l][1]);
  }
  partial_norm_grads_.zero_();
}

void Decoder::InitRandom(uint64_t seed, double std) {
  // Drawn whole on the CPU in float64 and then converted and split, so a seed means the same
  // weights on every device, dtype and tensor-parallel size. Each parameter is drawn in pieces of
  // kPiece elements, each from its own generator seeded by (seed, parameter, piece): the pieces
  // are drawn on every host thread (one generator drew Qwen3-8B in minutes), and the values do not
  // depend on how many threads there are.
  constexpr int64_t kPiece = int64_t{1} << 20;
  auto piece_seed = [seed](uint64_t parameter, uint64_t piece) {  // splitmix64 of the three
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * ((parameter << 32) + piece + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  const at::TensorOptions cpu = at::TensorOptions().dtype(at::kDouble);
  torch::autograd::AutoGradMode no_grad(false);
  for (size_t i = 0; i < named_.size(); ++i) {
    at::Tensor& parameter = named_[i].second;
    const std::string& name = named_[i].first;
    // Vectors other than biases (norm weights, dt_bias, A_log) are drawn narrow around an offset.
    const bool is_norm = parameter.dim() == 1 && !name.ends_with(".bias");
    double offset = is_norm ? 1.0 : 0.0;
    if (name.ends_with(".A_log")) {
      offset = -2.0;  // exp(A_log) ~ 0.14: a decay of about 0.85 per token with dt_bias ~ 1
    } else if (is_norm && HasZeroCentredNorms(config_) &&
               !name.ends_with("linear_attn.norm.weight")) {
      offset = 0.0;  // scales by 1 + w
    }
    const at::Tensor values = at::empty(splits_[i].full_shape, cpu);
    const at::Tensor flat = values.view(-1);
    const int64_t n = flat.numel();
    ParallelFor((n + kPiece - 1) / kPiece, 1, at::get_num_threads(),
                [&](int64_t begin, int64_t end) {
                  for (int64_t p = begin; p < end; ++p) {
                    at::Generator generator = at::detail::createCPUGenerator(piece_seed(i, p));
                    flat.narrow(0, p * kPiece, std::min(kPiece, n - p * kPiece))
                        .normal_(0.0, is_norm ? std / 4 : std, generator);
                  }
                });
    if (offset != 0.0) values.add_(offset);
    // Rounded on the host first, so that fewer bytes cross to the device.
    parameter.copy_(LocalPart(i, values).to(parameter.scalar_type()));
  }
}

at::Tensor Decoder::RmsNorm(const at::Tensor& x, const at::Tensor& weight,
                            std::optional<at::ScalarType> out_type,
                            const at::Tensor& accumulator) const {
  return RmsNormFunction::apply(
      x, weight, config_.rms_norm_eps, out_type.value_or(weight.scalar_type()),
      accumulator.defined() ? std::optional<at::Tensor>(accumulator) : std::nullopt);
}

std::pair<at::Tensor, at::Tensor> Decoder::Rope(const at::Tensor& positions) const {
  return RopeTables(inv_freq_.to(positions.device()), positions,
                    RopeAttentionFactor(config_.rope_scaling));
}

ChunkContext Decoder::MakeContext(const ChunkInput& input) const {
  const int64_t t = input.tokens.size(0);
  TORCH_CHECK(input.tokens.dim() == 1 && input.positions.sizes() == input.tokens.sizes(),
              "tokens and positions must be [T] tensors of the same length");
  const size_t num_layers = layers_.size();
  const PrefixKv& prefix = input.prefix;
  TORCH_CHECK(
      prefix.empty() || (prefix.keys.size() == num_layers && prefix.values.size() == num_layers),
      "prefix K/V must have one entry per layer");
  TORCH_CHECK(prefix.grad_keys.size() == prefix.grad_values.size() &&
                  (prefix.grad_keys.empty() || prefix.grad_keys.size() == num_layers),
              "prefix gradient accumulators must have one entry per layer, or none");
  ChunkContext context;
  context.chain = !input.key_end.defined();
  context.key_end = input.key_end.defined()
                        ? input.key_end
                        : at::full({t}, t, input.tokens.options().dtype(at::kLong));
  const auto [cos, sin] = Rope(input.positions);
  context.cos = cos.unsqueeze(1);
  context.sin = sin.unsqueeze(1);
  context.router_statistics = input.router_statistics;
  if (has_linear_layers()) {
    TORCH_CHECK(context.chain || static_cast<int64_t>(input.parents.size()) == t,
                "a tree chunk (key_end given) of a model with linear-attention layers needs each "
                "token's parent (ChunkInput::parents): ",
                input.parents.size(), " for ", t, " tokens");
    TORCH_CHECK(prefix.empty() || prefix.states.size() == num_layers,
                "a prefix of a model with linear-attention layers needs its recurrent states "
                "(PrefixKv::states, one entry per layer)");
    // The convolution reads at most conv_kernel - 1 rows of the path before the chunk.
    const int64_t prefix_rows = prefix.empty() ? 0 : prefix.keys[0].size(0);
    context.conv_context_rows = std::min(prefix_rows, linear_shape_.conv_kernel - 1);
    const TokenParents parents = context.chain ? TokenParents() : TokenParents(input.parents);
    if (input.state_points.empty()) {
      context.runs = ChainRuns(parents, t);
    } else {
      TORCH_CHECK(context.chain, "state points are for chain chunks only");
      context.runs = CutChain(t, input.state_points);
      for (size_t i = 0; i < input.state_points.size(); ++i) context.point_runs.push_back(i);
    }
    context.conv_index = ConvAncestorIndex(parents, t, context.conv_context_rows,
                                           linear_shape_.conv_kernel, input.tokens.device());
  }
  return context;
}

at::Tensor Decoder::Embed(const at::Tensor& tokens) const {
  return Embedding::apply(embed_, tokens, GroupHandle(tensor_parallel()), vocab_.begin);
}

Decoder::NormScale Decoder::ScaleOf(const at::Tensor& norm_weight) const {
  if (!HasZeroCentredNorms(config_)) return {norm_weight, at::Tensor()};
  // 1 + w in the compute dtype (transformers' (1.0 + weight.float())): d(1 + w)/dw = 1, so the
  // norm's weight gradient goes straight into w's accumulator.
  const at::ScalarType ct = ComputeType(norm_weight.scalar_type());
  return {norm_weight.detach().to(ct) + 1.0,
          at::GradMode::is_enabled() ? GradAccumulator(norm_weight) : at::Tensor()};
}

namespace {
std::optional<at::Tensor> Optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}
}  // namespace

LayerOutput Decoder::ForwardLayer(int64_t l, const at::Tensor& h, const ChunkContext& context,
                                  const LayerPrefix& prefix) const {
  LayerOutput out = is_linear_layer(l) ? LinearAttentionHalf(l, h, context, prefix)
                                       : AttentionHalf(l, h, context, prefix);
  MlpHalf(l, out.hidden, context, out);
  return out;
}

LayerOutput Decoder::AttentionHalf(int64_t l, const at::Tensor& h, const ChunkContext& context,
                                   const LayerPrefix& prefix) const {
  const int64_t t = h.size(0);
  const Layer& layer = layers_[l];
  const int64_t heads = local_heads();
  const int64_t kv_heads = local_kv_heads();
  const int64_t dim = config_.head_dim;
  const double eps = config_.rms_norm_eps;
  const int64_t group = GroupHandle(tensor_parallel());
  std::vector<at::Tensor> qkv_biases;
  if (layer.q_bias.defined()) qkv_biases = {layer.q_bias, layer.k_bias, layer.v_bias};
  const at::Tensor qkv_weights[] = {layer.q_proj, layer.k_proj, layer.v_proj};
  const NormScale input_norm = ScaleOf(layer.input_norm);
  // With the fused residual, qkv[3] is h itself, for the residual connection (see Projections).
  const bool fused_residual = FusedResidualEnabled();
  const variable_list qkv = Projections::apply(
      h, std::optional<at::Tensor>(input_norm.weight), eps, /*wide_output=*/false, group,
      ProjectionKind::kColumnParallel, at::TensorList(qkv_weights), at::TensorList(qkv_biases),
      Optional(input_norm.accumulator), fused_residual);
  // Gated attention: each head's rows are [query, output gate].
  const bool gated = HasGatedAttention(config_);
  const at::Tensor q_rows = gated ? qkv[0].view({t, heads, 2 * dim}) : qkv[0].view({t, heads, dim});
  const at::Tensor q_in = gated ? q_rows.slice(-1, 0, dim) : q_rows;
  const at::Tensor k_in = qkv[1].view({t, kv_heads, dim});
  at::Tensor q, k;
  if (layer.q_norm.defined()) {
    // Under tensor parallelism the q/k norms see this rank's heads only: partial gradients.
    const at::Tensor q_norm_grad =
        partial_norm_grads_.defined() ? partial_norm_grads_[l][0] : at::Tensor();
    const at::Tensor k_norm_grad =
        partial_norm_grads_.defined() ? partial_norm_grads_[l][1] : at::Tensor();
    const bool partial_rope = context.cos.size(-1) != dim;
    auto norm_rope = [&](const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& partial_grad) {
      const NormScale scale = ScaleOf(weight);
      const at::Tensor accumulator = partial_grad.defined() ? partial_grad : scale.accumulator;
      // The fused kernel rotates whole heads; partial rotary composes the same two steps (the
      // norm rounded to x's dtype, then RoPE).
      if (partial_rope) {
        return RopeOnly::apply(RmsNorm(x, scale.weight, x.scalar_type(), accumulator), context.cos,
                               context.sin);
      }
      return NormRope::apply(x, scale.weight, eps, context.cos, context.sin, Optional(accumulator));
    };
    q = norm_rope(q_in, layer.q_norm, q_norm_grad);
    k = norm_rope(k_in, layer.k_norm, k_norm_grad);
  } else {
    q = RopeOnly::apply(q_in, context.cos, context.sin);
    k = RopeOnly::apply(k_in, context.cos, context.sin);
  }
  const at::Tensor v = qkv[2].view({t, kv_heads, dim});
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  at::Tensor attention =
      TreeAttention::apply(q, k, v, context.key_end, prefix, scale, context.chain);
  if (gated) {
    // attention * sigmoid(gate), in the compute dtype, rounded once.
    const at::ScalarType ct = ComputeType(attention.scalar_type());
    attention =
        (attention.to(ct) * at::sigmoid(q_rows.slice(-1, dim).to(ct))).to(attention.scalar_type());
  }
  LayerOutput out;
  out.hidden = (fused_residual ? qkv[3] : h) +
               ProjectWide(attention.reshape({t, heads * dim}), layer.o_proj, layer.o_bias, group);
  out.keys = k;
  out.values = v;
  return out;
}

LayerOutput Decoder::LinearAttentionHalf(int64_t l, const at::Tensor& h,
                                         const ChunkContext& context,
                                         const LayerPrefix& prefix) const {
  const Layer& layer = layers_[l];
  const GatedDeltaNetWeights& w = layer.linear;
  const NormScale input_norm = ScaleOf(layer.input_norm);
  const at::Tensor in_weights[] = {w.in_proj_qkvz, w.in_proj_ba};
  // With the fused residual, projected[2] is h itself, for the residual connection (see
  // Projections).
  const bool fused_residual = FusedResidualEnabled();
  const variable_list projected =
      Projections::apply(h, std::optional<at::Tensor>(input_norm.weight), config_.rms_norm_eps,
                         /*wide_output=*/false, /*group=*/0, ProjectionKind::kColumnParallel,
                         at::TensorList(in_weights), at::TensorList(),
                         Optional(input_norm.accumulator), fused_residual);
  // The small parameters enter as float32 (float64) leaves whose gradients go straight into their
  // .grad accumulators (autograd would otherwise round them to the parameters' dtype).
  auto trainable = [&](const at::Tensor& p) {
    if (!at::GradMode::is_enabled()) return p;
    return GradientInto(p.detach().to(ComputeType(p.scalar_type())), GradAccumulator(p));
  };
  const GatedDeltaNetWeights small{.conv1d = trainable(w.conv1d),
                                   .dt_bias = trainable(w.dt_bias),
                                   .a_log = trainable(w.a_log),
                                   .norm = trainable(w.norm)};
  // The context: the path's last convolution inputs and its recurrent state.
  LinearContext linear;
  const int64_t rows = context.conv_context_rows;
  if (rows > 0) {
    const int64_t p = prefix.keys.size(0);
    linear.conv_inputs = prefix.keys.slice(0, p - rows, p);
    if (prefix.grad_keys.defined())
      linear.grad_conv_inputs = prefix.grad_keys.slice(0, p - rows, p);
  }
  linear.state = prefix.state;
  linear.grad_state = prefix.grad_state;
  LinearMixerOutput mixed = GatedDeltaNetMix(small, linear_shape_, projected[0], projected[1],
                                             context.conv_index, context.runs, linear);
  LayerOutput out;
  out.hidden = (fused_residual ? projected[2] : h) +
               ProjectWide(mixed.out, w.out_proj, at::Tensor(), /*group=*/0);
  out.keys = std::move(mixed.conv_inputs);
  out.state = std::move(mixed.final_state);
  for (const int64_t run : context.point_runs) out.point_states.push_back(mixed.run_states[run]);
  return out;
}

void Decoder::MlpHalf(int64_t l, const at::Tensor& h, const ChunkContext& context,
                      LayerOutput& result) const {
  const Layer& layer = layers_[l];
  const double eps = config_.rms_norm_eps;
  const int64_t group = GroupHandle(tensor_parallel());
  const NormScale post_norm = ScaleOf(layer.post_norm);
  // The MLP's output, and h for the residual connection: h as the projections' function returns
  // it (see Projections) when `residual`, else h.
  auto swiglu = [&](const at::Tensor& gate_proj, const at::Tensor& up_proj,
                    const at::Tensor& down_proj, const at::Tensor& gate_of_output, bool residual) {
    std::vector<at::Tensor> weights = {gate_proj, up_proj};
    if (gate_of_output.defined()) weights.push_back(gate_of_output);
    const variable_list gate_up = Projections::apply(
        h, std::optional<at::Tensor>(post_norm.weight), eps, /*wide_output=*/false, group,
        ProjectionKind::kColumnParallel, at::TensorList(weights), at::TensorList(),
        Optional(post_norm.accumulator), residual);
    at::Tensor y = SwiGluDown::apply(gate_up[0], gate_up[1], down_proj, group);
    // The shared expert's output scaled by sigmoid(x @ shared_expert_gate^T), in y's (compute)
    // dtype.
    if (gate_of_output.defined()) y = y * at::sigmoid(gate_up[2].to(y.scalar_type()));
    return std::make_pair(y, residual ? gate_up.back() : h);
  };
  if (!layer.router.defined()) {
    auto [y, residual] = swiglu(layer.gate_proj, layer.up_proj, layer.down_proj, at::Tensor(),
                                FusedResidualEnabled());
    result.hidden = residual + y;
    return;
  }
  // The shared expert normalises h again in its own projection (an elementwise pass over [T, H],
  // small beside the experts' GEMMs), so that both reuse the fused norm-and-project functions.
  // With the fused residual, sparse[3] is h itself, for the residual connection. Not beside a
  // shared expert: h's gradient is then a sum of three, and autograd's order of it is kept (the
  // same bits either way).
  const bool fused_residual = FusedResidualEnabled() && !layer.shared_gate.defined();
  const variable_list sparse =
      SparseMoe::apply(h, post_norm.weight, eps, layer.router, layer.experts_gate, layer.experts_up,
                       layer.experts_down, config_.num_experts_per_tok, config_.norm_topk_prob,
                       group, Optional(post_norm.accumulator), fused_residual);
  at::Tensor out = (fused_residual ? sparse[3] : h) + sparse[0];
  if (layer.shared_gate.defined()) {
    out = out + swiglu(layer.shared_gate, layer.shared_up, layer.shared_down,
                       layer.shared_expert_gate, /*residual=*/false)
                    .first;
  }
  result.hidden = std::move(out);
  if (context.router_statistics) {
    const at::Tensor& probs = sparse[1];
    result.router_probs = probs;
    result.router_counts =
        at::zeros_like(probs, probs.options().requires_grad(false)).scatter_(1, sparse[2], 1.0);
  }
}

// In the compute dtype: Logprobs rounds it once to lm_head's dtype, and its gradient stays wide.
at::Tensor Decoder::FinalNorm(const at::Tensor& h) const {
  const NormScale scale = ScaleOf(final_norm_);
  return RmsNorm(h, scale.weight, ComputeType(options_.dtype().toScalarType()), scale.accumulator);
}

ChunkOutput Decoder::Forward(const ChunkInput& input) const {
  const ChunkContext context = MakeContext(input);
  ChunkOutput out;
  at::Tensor h = Embed(input.tokens);
  out.point_states.resize(context.point_runs.size());
  for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {
    LayerOutput layer = ForwardLayer(l, h, context, PrefixOfLayer(input.prefix, l));
    h = std::move(layer.hidden);
    out.keys.push_back(std::move(layer.keys));
    out.values.push_back(std::move(layer.values));
    if (has_linear_layers()) out.states.push_back(std::move(layer.state));
    if (layer.router_probs.defined()) {
      out.router_probs =
          out.router_probs.defined() ? out.router_probs + layer.router_probs : layer.router_probs;
      out.router_counts = out.router_counts.defined() ? out.router_counts + layer.router_counts
                                                      : layer.router_counts;
    }
    // Attention layers have no states (an empty layer.point_states).
    for (size_t i = 0; i < out.point_states.size(); ++i) {
      out.point_states[i].push_back(layer.point_states.empty() ? at::Tensor()
                                                               : layer.point_states[i]);
    }
  }
  out.hidden = FinalNorm(h);
  return out;
}

at::Tensor Decoder::Logprobs(const at::Tensor& hidden, const at::Tensor& targets,
                             at::Tensor* entropy, const LogprobOptions& options) const {
  TORCH_CHECK(hidden.dim() == 2 && targets.dim() == 1 && hidden.size(0) == targets.size(0),
              "Logprobs takes hidden [N, hidden_size] and targets [N]");
  TORCH_CHECK(options.slice_rows > 0, "slice_rows must be positive");
  TORCH_CHECK(options.temperature > 0 && std::isfinite(options.temperature),
              "the temperature must be positive and finite, got ", options.temperature);
  auto outputs = SlicedLogprobs::apply(hidden, lm_head_, targets, options.slice_rows,
                                       1.0 / options.temperature, entropy != nullptr,
                                       GroupHandle(tensor_parallel()), vocab_.begin);
  if (entropy) *entropy = outputs[1];
  return outputs[0];
}

}  // namespace dta
