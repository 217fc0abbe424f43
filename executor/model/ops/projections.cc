#include "executor/model/ops/projections.h"

#include <memory>
#include <utility>
#include <vector>

#include "core/base/env_switch.h"
#include "executor/model/ops/numerics.h"
#include "kernels/fused_layers.h"

namespace dta {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

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

// DTA_STACKED_PROJECTIONS=0 projects onto stacked weights one weight at a time, as for separate
// ones. For before/after measurements in one build (read at every call).
bool StackedProjectionsEnabled() { return EnvSwitchOn("DTA_STACKED_PROJECTIONS"); }

}  // namespace

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

bool FusedResidualEnabled() { return EnvSwitchOn("DTA_FUSED_RESIDUAL"); }

bool FoldedResidualAddEnabled() {
  return FusedResidualEnabled() && EnvSwitchOn("DTA_FUSED_RESIDUAL_ADD");
}

variable_list Projections::forward(AutogradContext* ctx, const at::Tensor& x,
                                   const std::optional<at::Tensor>& addend,
                                   const std::optional<at::Tensor>& norm, double eps,
                                   bool wide_output, int64_t group, ProjectionKind kind,
                                   at::TensorList weights, at::TensorList biases,
                                   const std::optional<at::Tensor>& norm_accumulator, bool residual,
                                   int64_t replicated) {
  TORCH_CHECK(!weights.empty() && (biases.empty() || biases.size() == weights.size()),
              "Projections: one bias per weight, or none");
  TORCH_CHECK(!residual || norm.has_value(), "Projections: a residual output needs a norm");
  TORCH_CHECK(!addend.has_value() || residual,
              "Projections: an addend needs the residual output (its sum with x)");
  TORCH_CHECK(replicated >= 0 && replicated <= static_cast<int64_t>(weights.size()) &&
                  (replicated == 0 || (biases.empty() && kind == ProjectionKind::kColumnParallel)),
              "Projections: ", replicated, " replicated weights of ", weights.size(),
              " (column-parallel, without biases)");
  ctx->saved_data["replicated"] = replicated;
  ctx->saved_data["accumulator"] = norm_accumulator.value_or(at::Tensor());
  ctx->saved_data["residual"] = residual;
  const at::Tensor norm_weight = norm.value_or(at::Tensor());
  const at::ScalarType type = weights[0].scalar_type();
  std::vector<at::Tensor> saved;
  at::Tensor xb;
  // The residual stream this norm reads: x, or x + addend formed by the norm's kernel.
  at::Tensor stream = x;
  if (norm_weight.defined()) {
    kernels::RmsNormResult normed = kernels::RmsNormForward(
        x, norm_weight, eps, type, addend.has_value() ? *addend : at::Tensor());
    xb = std::move(normed.y);
    if (addend.has_value()) {
      stream = std::move(normed.sum);
      ctx->saved_data["addend_type"] = static_cast<int64_t>(addend->scalar_type());
    }
    saved = {stream, norm_weight, normed.rstd};
  } else {
    xb = x.to(type);
    saved = {xb, at::Tensor(), at::Tensor()};
  }
  saved.insert(saved.end(), weights.begin(), weights.end());
  saved.insert(saved.end(), biases.begin(), biases.end());
  ctx->save_for_backward(saved);
  ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
  ctx->saved_data["tensor_parallel"] = kind == ProjectionKind::kColumnParallel ? group : int64_t{0};
  variable_list out;
  // Weights stored stacked (gate_proj over up_proj): one GEMM, its output's column blocks the
  // projections (read in place by SwiGLU; their gradients come back side by side).
  const at::Tensor stacked = biases.empty() && replicated == 0 && !wide_output &&
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
    if (residual) out.push_back(stream);
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
  if (residual) out.push_back(stream);
  return out;
}

variable_list Projections::backward(AutogradContext* ctx, variable_list grads) {
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
  // The weights split over the ranks come first, the replicated ones after them.
  const size_t split = count - static_cast<size_t>(ctx->saved_data["replicated"].toInt());
  const bool has_biases = saved.size() == 3 + 2 * count;
  const at::Tensor xb =
      has_norm ? kernels::RmsNormApply(saved[0], norm_weight, rstd, type) : saved[0];
  std::vector<at::Tensor> dys;
  for (size_t i = 0; i < count; ++i) dys.push_back(grads[i].to(type));
  const at::TensorList weights = at::TensorList(saved).slice(3, count);
  // Stacked weights whose outputs' gradients came back side by side: one GEMM for dx and one
  // for the weights' gradients.
  at::Tensor stacked, dy_stacked;
  if (!has_biases && split == count && StackedProjectionsEnabled()) {
    stacked = StackedRows(weights);
    if (stacked.defined()) dy_stacked = StackedColumns(dys);
  }
  const at::ScalarType dx_type = has_norm ? rstd.scalar_type() : x_type;
  at::Tensor dx;
  auto add_to_dx = [&](size_t i) {
    if (!dx.defined()) {
      dx = MatmulTo(dys[i], weights[i], dx_type);
    } else {
      AddMatmul(dx, dys[i], weights[i]);
    }
  };
  if (dy_stacked.defined()) {
    dx = MatmulTo(dy_stacked, stacked, dx_type);
  } else {
    for (size_t i = 0; i < split; ++i) add_to_dx(i);
  }
  // A column-parallel layer's input feeds every rank's columns: its gradient is their sum, taken
  // before the norm's backward (whose weight gradient is then whole on every rank). The sum runs
  // while the weight gradients, which do not need it, are computed (Megatron's overlap of the
  // input gradient's all-reduce with the weight-gradient GEMMs).
  std::unique_ptr<PendingCollective> dx_sum =
      dx.defined() ? StartSumOverRanks(GroupOf(ctx), dx) : nullptr;
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
  for (size_t i = split; i < count; ++i) add_to_dx(i);
  if (has_norm) {
    at::Tensor accumulator = NormWeightAccumulator(ctx, norm_weight);
    // In the compute type, as autograd would have summed dx.to(x_type) and the residual's
    // gradient (x_type is the compute type wherever a residual stream feeds a norm).
    if (residual_grad.defined()) residual_grad = residual_grad.to(rstd.scalar_type());
    dx = kernels::RmsNormBackward(dx, saved[0], norm_weight, rstd, accumulator, residual_grad)
             .to(x_type);
  }
  // x's gradient, and the addend's when the residual add was folded in (as autograd's add gives
  // it: the sum's gradient in the addend's dtype).
  variable_list result = {dx, at::Tensor()};
  if (ctx->saved_data.count("addend_type") > 0) {
    result[1] = dx.to(static_cast<at::ScalarType>(ctx->saved_data["addend_type"].toInt()));
  }
  // No gradient for the weights and biases: accumulated above.
  result.resize(10 + 2 * count);
  return result;
}

at::Tensor ProjectWide(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       int64_t group) {
  std::vector<at::Tensor> biases;
  if (bias.defined()) biases.push_back(bias);
  return Projections::apply(x, std::nullopt, std::nullopt, 0.0, /*wide_output=*/true, group,
                            ProjectionKind::kRowParallel, at::TensorList(weight),
                            at::TensorList(biases), std::nullopt, /*residual=*/false,
                            /*replicated=*/0)[0];
}

}  // namespace dta
