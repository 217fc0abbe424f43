#include "executor/model/blocks/gated_delta_net_block.h"

#include <ATen/core/grad_mode.h>

#include <optional>
#include <utility>
#include <vector>

#include "executor/model/ops/numerics.h"
#include "executor/model/ops/projections.h"

namespace dta {

using torch::autograd::variable_list;

LayerOutput GatedDeltaNetBlock(const at::Tensor& h, const at::Tensor& input_norm_weight,
                               const GatedDeltaNetWeights& weights, const ChunkContext& context,
                               const LayerPrefix& prefix, const BlockShared& shared) {
  const NormScale input_norm = NormScaleOf(input_norm_weight, HasZeroCentredNorms(*shared.config));
  // Qwen3-Next's two grouped projections, or Qwen3.5's four.
  const bool grouped = weights.in_proj_qkvz.defined();
  const std::vector<at::Tensor> in_weights =
      grouped ? std::vector<at::Tensor>{weights.in_proj_qkvz, weights.in_proj_ba}
              : std::vector<at::Tensor>{weights.in_proj_qkv, weights.in_proj_z, weights.in_proj_b,
                                        weights.in_proj_a};
  // With the fused residual, projected[in_weights.size()] is h itself, for the residual
  // connection (see Projections).
  const bool fused_residual = FusedResidualEnabled();
  const variable_list projected = Projections::apply(
      h, std::nullopt, std::optional<at::Tensor>(input_norm.weight), shared.config->rms_norm_eps,
      /*wide_output=*/false, shared.group, ProjectionKind::kColumnParallel,
      at::TensorList(in_weights), at::TensorList(), Optional(input_norm.accumulator),
      fused_residual, /*replicated=*/0);
  const GatedDeltaNetShape& shape = *shared.linear_shape;
  const LinearProjections inputs =
      grouped ? UngroupedProjections(shape, projected[0], projected[1])
              : LinearProjections{
                    .qkv = projected[0], .z = projected[1], .b = projected[2], .a = projected[3]};
  // The small parameters enter as float32 (float64) leaves whose gradients go straight into their
  // .grad accumulators (autograd would otherwise round them to the parameters' dtype).
  // Under tensor parallelism the gated norm's weight, shared by the heads, sees only this rank's:
  // its gradient goes to the layer's partial sum (the decoder completes it).
  auto trainable = [&](const at::Tensor& p, const at::Tensor& partial = at::Tensor()) {
    if (!at::GradMode::is_enabled()) return p;
    return GradientInto(p.detach().to(ComputeType(p.scalar_type())),
                        partial.defined() ? partial : GradAccumulator(p));
  };
  const GatedDeltaNetWeights small{.conv1d = trainable(weights.conv1d),
                                   .dt_bias = trainable(weights.dt_bias),
                                   .a_log = trainable(weights.a_log),
                                   .norm = trainable(weights.norm, shared.partial_norm_grads)};
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
  LinearMixerOutput mixed =
      GatedDeltaNetMix(small, shape, inputs, context.conv_index, context.runs, linear);
  LayerOutput out;
  out.hidden = fused_residual ? projected[in_weights.size()] : h;
  out.hidden_addend = ProjectWide(mixed.out, weights.out_proj, at::Tensor(), shared.group);
  if (!FoldedResidualAddEnabled()) out.hidden = out.hidden + std::exchange(out.hidden_addend, {});
  out.keys = std::move(mixed.conv_inputs);
  out.state = std::move(mixed.final_state);
  for (const int64_t run : context.point_runs) out.point_states.push_back(mixed.run_states[run]);
  return out;
}

}  // namespace dta
