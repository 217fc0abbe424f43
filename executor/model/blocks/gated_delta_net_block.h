// The linear-attention half of a Qwen3-Next or Qwen3.5 layer (layer_types "linear_attention", as
// transformers' Qwen3NextGatedDeltaNet and Qwen3_5GatedDeltaNet): in_proj_qkvz and in_proj_ba (or
// Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a) as one fused projection after the
// input norm, read in one layout (ops/gated_delta_net.h's LinearProjections); the tree convolution
// and delta rule, the gated norm, out_proj into the float32 residual stream. Its cache is the
// convolution inputs (LayerPrefix::keys) and the recurrent state (LayerPrefix::state); the small
// parameters (conv1d, dt_bias, A_log, the gated norm) enter as float32 (float64) leaves whose
// gradients go into their .grad. Under tensor parallelism each rank runs its own key heads and
// their value heads (shared.linear_shape counts them; decoder.h): the input projections
// column-parallel, out_proj row-parallel, the gated norm's gradient a partial sum
// (BlockShared::partial_norm_grads).
#pragma once

#include <ATen/ATen.h>

#include "executor/model/blocks/block_shared.h"
#include "executor/model/chunk_io.h"
#include "executor/model/ops/gated_delta_net.h"

namespace dta {

// h plus the mixer's output, on the residual stream h [T, hidden] (the compute dtype), with the
// layer's cache rows and state: sets hidden, keys (the convolution inputs), state and point_states
// (per ChunkContext::point_runs entry) of the result. input_norm_weight: the layer's input RMSNorm
// weight; weights: the layer's weights (the shape is shared.linear_shape).
LayerOutput GatedDeltaNetBlock(const at::Tensor& h, const at::Tensor& input_norm_weight,
                               const GatedDeltaNetWeights& weights, const ChunkContext& context,
                               const LayerPrefix& prefix, const BlockShared& shared);

}  // namespace dta
