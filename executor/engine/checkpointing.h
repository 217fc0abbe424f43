// Internal to executor/engine: activation checkpointing by layer replay, the papers' "+CKPT"
// baselines (dense and packed tree). The forward keeps only each decoder layer's input; after the
// loss has been backpropagated to the last layer's output, each layer is recomputed from its input
// and backpropagated, top to bottom, so at most one layer's activations are alive at a time.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "executor/model/decoder.h"

namespace dta::engine {

struct LayerCheckpoints {
  std::vector<at::Tensor> layer_inputs;  // [num_layers], no graph
  at::Tensor last;                       // leaf: the residual stream after the last layer
  // With ChunkInput::router_statistics: ChunkOutput's router_probs (no graph) and router_counts.
  at::Tensor router_probs, router_counts;
};

// The decoder without a graph (no prefix), keeping each layer's input. The caller continues from
// FinalNorm(checkpoints.last), backpropagates, then calls BackwardThroughLayers.
LayerCheckpoints ForwardKeepingLayerInputs(const Decoder& model, const ChunkInput& input,
                                           const ChunkContext& context);

// Replays and backpropagates every layer (and the embedding) with the gradient that reached
// checkpoints.last, and with `router_grad` [T, E] (if defined) as the gradient of every sparse
// layer's router probabilities (ChunkOutput::router_probs is their sum). Nothing happens if no
// gradient reached checkpoints.last.
void BackwardThroughLayers(const Decoder& model, const ChunkInput& input,
                           const ChunkContext& context, const LayerCheckpoints& checkpoints,
                           const at::Tensor& router_grad = at::Tensor());

}  // namespace dta::engine
