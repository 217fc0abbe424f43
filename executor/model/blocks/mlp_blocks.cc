#include "executor/model/blocks/mlp_blocks.h"

#include <optional>
#include <utility>
#include <vector>

#include "executor/model/ops/moe.h"
#include "executor/model/ops/numerics.h"
#include "executor/model/ops/projections.h"
#include "executor/model/ops/swiglu.h"

namespace dta {

using torch::autograd::variable_list;

void MlpBlock(const at::Tensor& stream, const at::Tensor& post_norm_weight, const MlpWeights& mlp,
              const ChunkContext& context, const BlockShared& shared, LayerOutput& result) {
  const ModelConfig& config = *shared.config;
  // The residual add before this block: folded into the dense MLP's norm (Projections' addend),
  // done here for the sparse block, which normalises h inside SparseMoe.
  const at::Tensor addend = std::exchange(result.hidden_addend, {});
  const bool fused_residual = FusedResidualEnabled();
  const bool fold = addend.defined() && !mlp.router.defined() && fused_residual;
  const at::Tensor h = addend.defined() && !fold ? stream + addend : stream;
  const double eps = config.rms_norm_eps;
  const int64_t group = shared.group;
  const NormScale post_norm = NormScaleOf(post_norm_weight, HasZeroCentredNorms(config));
  // The MLP's output, and h for the residual connection: h as the projections' function returns
  // it (see Projections) when `residual`, else h. The shared expert's gate of its output is whole
  // on every rank (replicated), its gate and up split like a dense MLP's.
  auto swiglu = [&](const at::Tensor& gate_proj, const at::Tensor& up_proj,
                    const at::Tensor& down_proj, const at::Tensor& gate_of_output, bool residual) {
    std::vector<at::Tensor> weights = {gate_proj, up_proj};
    if (gate_of_output.defined()) weights.push_back(gate_of_output);
    const variable_list gate_up =
        Projections::apply(h, fold ? std::optional<at::Tensor>(addend) : std::nullopt,
                           std::optional<at::Tensor>(post_norm.weight), eps, /*wide_output=*/false,
                           group, ProjectionKind::kColumnParallel, at::TensorList(weights),
                           at::TensorList(), Optional(post_norm.accumulator), residual,
                           /*replicated=*/gate_of_output.defined() ? 1 : 0);
    at::Tensor y = SwiGluDown::apply(gate_up[0], gate_up[1], down_proj, group);
    // The shared expert's output scaled by sigmoid(x @ shared_expert_gate^T), in y's (compute)
    // dtype.
    if (gate_of_output.defined()) y = y * at::sigmoid(gate_up[2].to(y.scalar_type()));
    return std::make_pair(y, residual ? gate_up.back() : h);
  };
  if (!mlp.router.defined()) {
    auto [y, residual] =
        swiglu(mlp.gate_proj, mlp.up_proj, mlp.down_proj, at::Tensor(), fused_residual);
    result.hidden = residual + y;
    return;
  }
  // The shared expert normalises h again in its own projection (an elementwise pass over [T, H],
  // small beside the experts' GEMMs), so that both reuse the fused norm-and-project functions.
  // With the fused residual, sparse[3] is h itself, for the residual connection. Not beside a
  // shared expert: h's gradient is then a sum of three, and autograd's order of it is kept (the
  // same bits either way).
  const bool sparse_residual = fused_residual && !mlp.shared_gate.defined();
  std::optional<at::Tensor> replay;
  if (context.routed_experts.defined())
    replay = context.routed_experts.select(1, shared.sparse_layer).to(at::kLong);
  const variable_list sparse = SparseMoe::apply(
      h, post_norm.weight, eps, mlp.router, mlp.experts_gate, mlp.experts_up, mlp.experts_down,
      config.num_experts_per_tok, config.norm_topk_prob, group, shared.expert_group,
      Optional(post_norm.accumulator), sparse_residual, replay, shared.fresh_gradients);
  at::Tensor out = (sparse_residual ? sparse[3] : h) + sparse[0];
  if (mlp.shared_gate.defined()) {
    out = out + swiglu(mlp.shared_gate, mlp.shared_up, mlp.shared_down, mlp.shared_expert_gate,
                       /*residual=*/false)
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

}  // namespace dta
