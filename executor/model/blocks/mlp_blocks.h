// The MLP half of a decoder layer, after the post-attention norm (fused into its projections): a
// dense SwiGLU MLP, or a sparse mixture-of-experts block (Qwen3-MoE's sparse layers, ModelConfig's
// IsSparseLayer; ops/moe.h) with, in Qwen3-Next, a shared SwiGLU expert beside the routed ones
// scaled by sigmoid(n(x) @ shared_expert_gate^T). With ChunkContext::router_statistics a sparse
// block also returns each token's router statistics, from which the loss adds the router's
// load-balancing term (LossOptions::router_aux_loss_coef, transformers' aux_loss per rollout).
//
// Numerics are the ops' (ops/projections.h, ops/swiglu.h, ops/moe.h); under tensor parallelism
// each rank runs its slice of the intermediate rows (decoder.h).
#pragma once

#include <ATen/ATen.h>

#include "executor/model/blocks/block_shared.h"
#include "executor/model/chunk_io.h"

namespace dta {

// One layer's MLP parameters (this rank's part of each under tensor parallelism): the dense ones
// or the sparse ones, the others undefined.
struct MlpWeights {
  // A dense layer's SwiGLU MLP: [I, H], [I, H], [H, I].
  at::Tensor gate_proj, up_proj, down_proj;
  // A sparse mixture-of-experts layer (IsSparseLayer) has these instead: the router [E, H] and
  // the experts stacked, [E, I, H], [E, I, H], [E, H, I].
  at::Tensor router, experts_gate, experts_up, experts_down;
  // Qwen3-Next's shared expert beside the routed ones (HasSharedExpert): a SwiGLU MLP [S, H],
  // [S, H], [H, S] and its gate [1, H].
  at::Tensor shared_gate, shared_up, shared_down, shared_expert_gate;
};

// The MLP on the residual stream h [T, hidden] (the compute dtype), added to h: sets result.hidden
// (and, for a sparse layer with router statistics, result.router_probs and result.router_counts).
// When the block before left its output pending (result.hidden_addend), h is stream +
// result.hidden_addend: a dense MLP forms it inside its norm (Projections' addend), a sparse one
// adds first; hidden_addend is consumed. post_norm_weight: the layer's post-attention RMSNorm
// weight.
void MlpBlock(const at::Tensor& stream, const at::Tensor& post_norm_weight, const MlpWeights& mlp,
              const ChunkContext& context, const BlockShared& shared, LayerOutput& result);

}  // namespace dta
