// What a decoder (executor/model/decoder.h) shares with the blocks of one of its layers
// (attention_block.h, gated_delta_net_block.h, mlp_blocks.h): the configuration, this rank's part
// of the tensor-parallel layout, and the layer's partial-gradient buffers. The decoder builds one
// per layer call; it points into the decoder, which outlives the call.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "core/model/model_config.h"
#include "executor/model/ops/gated_delta_net.h"

namespace dta {

struct BlockShared {
  const ModelConfig* config = nullptr;
  // The tensor-parallel group's handle (GroupHandle in ops/numerics.h): 0 without tensor
  // parallelism.
  int64_t group = 0;
  // This rank's heads and KV heads (all of them without tensor parallelism).
  int64_t local_heads = 0;
  int64_t local_kv_heads = 0;
  // A sparse layer's index among the sparse layers (its slice of ChunkContext::routed_experts);
  // -1 at dense layers.
  int64_t sparse_layer = -1;
  // The expert-parallel group's handle (ExpertGroupHandle in ops/numerics.h): 0 without expert
  // parallelism.
  int64_t expert_group = 0;
  // The linear-attention layers' sizes with this rank's heads (the decoder's linear_shape()); null
  // without any.
  const GatedDeltaNetShape* linear_shape = nullptr;
  // Under tensor parallelism, this layer's partial gradients of the norm weights that it sees
  // through this rank's heads only (the accumulator dtype), which the decoder completes later
  // (ReduceTensorParallelGradients): q_norm's and k_norm's [2, head_dim] with q/k norms, the gated
  // norm's [value_head_dim] at a linear-attention layer; undefined otherwise.
  at::Tensor partial_norm_grads = {};
  // The run's FreshGradients handle (ops/fresh_gradients.h) when it replaces gradients; else 0.
  int64_t fresh_gradients = 0;
};

}  // namespace dta
