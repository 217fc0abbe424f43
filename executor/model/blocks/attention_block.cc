#include "executor/model/blocks/attention_block.h"

#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "executor/model/ops/attention.h"
#include "executor/model/ops/norms.h"
#include "executor/model/ops/numerics.h"
#include "executor/model/ops/output_gate.h"
#include "executor/model/ops/projections.h"

namespace dta {

using torch::autograd::variable_list;

LayerOutput AttentionBlock(const at::Tensor& h, const at::Tensor& input_norm_weight,
                           const AttentionWeights& weights, const ChunkContext& context,
                           const LayerPrefix& prefix, const BlockShared& shared) {
  const ModelConfig& config = *shared.config;
  const int64_t t = h.size(0);
  const int64_t heads = shared.local_heads;
  const int64_t kv_heads = shared.local_kv_heads;
  const int64_t dim = config.head_dim;
  const double eps = config.rms_norm_eps;
  const int64_t group = shared.group;
  const bool zero_centred = HasZeroCentredNorms(config);
  std::vector<at::Tensor> qkv_biases;
  if (weights.q_bias.defined()) qkv_biases = {weights.q_bias, weights.k_bias, weights.v_bias};
  const at::Tensor qkv_weights[] = {weights.q_proj, weights.k_proj, weights.v_proj};
  const NormScale input_norm = NormScaleOf(input_norm_weight, zero_centred);
  // With the fused residual, qkv[3] is h itself, for the residual connection (see Projections).
  const bool fused_residual = FusedResidualEnabled();
  const variable_list qkv =
      Projections::apply(h, std::nullopt, std::optional<at::Tensor>(input_norm.weight), eps,
                         /*wide_output=*/false, group, ProjectionKind::kColumnParallel,
                         at::TensorList(qkv_weights), at::TensorList(qkv_biases),
                         Optional(input_norm.accumulator), fused_residual, /*replicated=*/0);
  // Gated attention: each head's rows are [query, output gate].
  const bool gated = HasGatedAttention(config);
  const at::Tensor q_rows = gated ? qkv[0].view({t, heads, 2 * dim}) : qkv[0].view({t, heads, dim});
  const at::Tensor q_in = gated ? q_rows.slice(-1, 0, dim) : q_rows;
  const at::Tensor k_in = qkv[1].view({t, kv_heads, dim});
  at::Tensor q, k;
  if (weights.q_norm.defined()) {
    // Under tensor parallelism the q/k norms see this rank's heads only: partial gradients.
    const at::Tensor& partial = shared.partial_norm_grads;
    const at::Tensor q_norm_grad = partial.defined() ? partial[0] : at::Tensor();
    const at::Tensor k_norm_grad = partial.defined() ? partial[1] : at::Tensor();
    const bool partial_rope = context.cos.size(-1) != dim;
    auto norm_rope = [&](const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& partial_grad) {
      const NormScale scale = NormScaleOf(weight, zero_centred);
      const at::Tensor accumulator = partial_grad.defined() ? partial_grad : scale.accumulator;
      // The fused kernel rotates whole heads; partial rotary composes the same two steps (the
      // norm rounded to x's dtype, then RoPE).
      if (partial_rope) {
        return RopeOnly::apply(RmsNorm(x, scale.weight, eps, x.scalar_type(), accumulator),
                               context.cos, context.sin);
      }
      return NormRope::apply(x, scale.weight, eps, context.cos, context.sin, Optional(accumulator));
    };
    q = norm_rope(q_in, weights.q_norm, q_norm_grad);
    k = norm_rope(k_in, weights.k_norm, k_norm_grad);
  } else {
    q = RopeOnly::apply(q_in, context.cos, context.sin);
    k = RopeOnly::apply(k_in, context.cos, context.sin);
  }
  const at::Tensor v = qkv[2].view({t, kv_heads, dim});
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  at::Tensor attention =
      TreeAttention::apply(q, k, v, context.key_end, prefix, scale, context.chain);
  // attention * sigmoid(gate), in the compute dtype, rounded once.
  if (gated) attention = OutputGate::apply(attention, q_rows.slice(-1, dim));
  LayerOutput out;
  out.hidden = fused_residual ? qkv[3] : h;
  out.hidden_addend =
      ProjectWide(attention.reshape({t, heads * dim}), weights.o_proj, weights.o_bias, group);
  if (!FoldedResidualAddEnabled()) out.hidden = out.hidden + std::exchange(out.hidden_addend, {});
  out.keys = k;
  out.values = v;
  return out;
}

}  // namespace dta
