// The attention half of a decoder layer (every layer but Qwen3-Next's linear-attention ones): the
// input norm fused into the q/k/v projections (with their biases where the family has them), q/k
// norm (Qwen3's, per head) and RoPE, attention on the chunk and its cached prefix, o_proj into the
// float32 residual stream.
//
// Gated attention (Qwen3-Next's other layers): q_proj yields each head's query and output gate
// interleaved per head, the attention output is multiplied by sigmoid(gate) (compute dtype,
// rounded once); RoPE rotates the first partial_rotary_factor share of each head (the fused q/k
// norm + RoPE kernel then gives way to the norm followed by rope.h's RoPE).
//
// Numerics are the ops' (ops/projections.h, ops/norms.h, ops/attention.h); under tensor
// parallelism each rank runs its own heads (decoder.h).
#pragma once

#include <ATen/ATen.h>

#include "executor/model/blocks/block_shared.h"
#include "executor/model/chunk_io.h"

namespace dta {

// One attention layer's parameters (this rank's part of each under tensor parallelism).
struct AttentionWeights {
  at::Tensor q_proj, k_proj, v_proj, o_proj;
  // Qwen3's per-head q/k norm weights [head_dim]; undefined without (core/model/family.h).
  at::Tensor q_norm, k_norm;
  // Undefined where the family has none (core/model/family.h).
  at::Tensor q_bias, k_bias, v_bias, o_bias;
};

// h plus the attention's output, on the residual stream h [T, hidden] (the compute dtype), with the
// layer's cache rows (LayerOutput::keys, after the k norm and RoPE, and values): sets hidden, keys
// and values of the result. input_norm_weight: the layer's input RMSNorm weight.
LayerOutput AttentionBlock(const at::Tensor& h, const at::Tensor& input_norm_weight,
                           const AttentionWeights& weights, const ChunkContext& context,
                           const LayerPrefix& prefix, const BlockShared& shared);

}  // namespace dta
