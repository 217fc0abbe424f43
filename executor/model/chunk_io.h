// The types of one forward call over a chunk of tokens on top of a cached prefix, as the engines
// (executor/engine/) build and read them and the decoder's layers (decoder.h, blocks/) pass them
// on: the prefix's cache per layer (PrefixKv, LayerPrefix), the chunk's tokens and tree
// (ChunkInput), what every layer of the call shares (ChunkContext: RoPE tables, the tree mask,
// the linear-attention layers' runs) and what a layer and the whole call return (LayerOutput,
// ChunkOutput).
//
// Header-only; part of dta::model_ops (ops/attention.h takes a LayerPrefix).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "executor/model/ops/gated_delta_net.h"

namespace dta {
// The cached prefix one forward call attends to, per layer.
struct PrefixKv {
  // K and V of the prefix, [P, kv_heads, head_dim] each (typically views of a preallocated
  // path-length buffer: never copied or concatenated). At a linear-attention layer
  // (ops/gated_delta_net.h) keys holds the prefix's last convolution inputs [R, conv_dim], at
  // least R = min(P, conv_kernel - 1) of them (the rows the layer reads; dta keeps no more), and
  // values is undefined.
  std::vector<at::Tensor> keys = {};
  std::vector<at::Tensor> values = {};
  // Gradient accumulators of the same shape (float32; float64 for float64 models), or empty.
  // The prefix tensors are constants of the graph: backward adds d loss / d prefix K and V into
  // these accumulators in place, or drops them when there are none.
  std::vector<at::Tensor> grad_keys = {};
  std::vector<at::Tensor> grad_values = {};
  // Linear-attention layers: the recurrent state after the prefix's last token [value_heads,
  // key_head_dim, value_head_dim] and its gradient accumulator (backward adds d loss / d state);
  // undefined at attention layers. Empty for models without linear layers.
  std::vector<at::Tensor> states = {};
  std::vector<at::Tensor> grad_states = {};

  bool empty() const { return keys.empty(); }
};

// One layer's slice of a PrefixKv (undefined tensors when there is no prefix).
struct LayerPrefix {
  at::Tensor keys = {}, values = {}, grad_keys = {}, grad_values = {};
  at::Tensor state = {}, grad_state = {};  // linear-attention layers (see PrefixKv)
};

// The tokens of one forward call and the context they sit on.
struct ChunkInput {
  at::Tensor tokens = {};     // [T] int64 token ids
  at::Tensor positions = {};  // [T] int64 original position ids (offsets in their rollouts)
  // Tree structure inside the chunk, tokens in DFS order: key j is visible to queries
  // j .. key_end[j] - 1 (its subtree). [T] int64; undefined means a plain causal chain.
  at::Tensor key_end = {};
  // The same tree as each token's parent (its index in the chunk, -1 for a root), on the host:
  // what linear-attention layers route their recurrent state along. Required with key_end when the
  // model has linear layers; empty means a chain.
  std::vector<int64_t> parents = {};
  // Linear-attention layers, chains only: also return the recurrent states after the first p
  // tokens for each p here (sorted, in (0, T)): where later chunks start inside this one.
  std::vector<int64_t> state_points = {};
  // The cached prefix every chunk token attends to; empty means none.
  PrefixKv prefix = {};
  // Sparse (MoE) layers report their routing (ChunkOutput::router_probs and router_counts): what
  // the router's load-balancing loss is computed from.
  bool router_statistics = false;
  // Routing replay: [T, sparse layers, top_k] int32, the experts each token is routed to at each
  // sparse layer (in layer order), kNotRecorded (-1) rows where the router picks its own top-k;
  // undefined: every token routes itself. The routing weights still come from the router (see
  // SparseMoe in ops/moe.h).
  at::Tensor routed_experts = {};
};

struct ChunkOutput {
  at::Tensor hidden;               // [T, hidden_size], after the final norm, in the compute dtype
  std::vector<at::Tensor> keys;    // per layer [T, kv_heads, head_dim], after k-norm and RoPE
  std::vector<at::Tensor> values;  // per layer [T, kv_heads, head_dim]
  // Linear-attention layers: keys holds the convolution inputs [T, conv_dim] and values is
  // undefined; states the recurrent state after the chunk's last token (undefined at attention
  // layers; empty without linear layers).
  std::vector<at::Tensor> states;
  // Per ChunkInput::state_points entry, the states after that many tokens (per layer, as states).
  std::vector<std::vector<at::Tensor>> point_states;
  // With ChunkInput::router_statistics, summed over the sparse layers, per token [T, num_experts]
  // in the compute dtype: the router's softmax probabilities (differentiable: a gradient seeded
  // here reaches the routers and everything below them) and how many of the layers put each expert
  // in the token's top-k (a constant). Undefined otherwise.
  at::Tensor router_probs, router_counts;
};

// What every layer of one Forward call shares: RoPE tables and the chunk's tree mask.
struct ChunkContext {
  at::Tensor cos, sin;  // [T, 1, R], R = RotaryDim(config) (head_dim without partial rotary)
  at::Tensor key_end;   // [T]
  bool chain = false;   // a plain causal chain (ChunkInput::key_end undefined)
  // Linear-attention layers (none: undefined and empty): the rows each token's convolution reads
  // (ConvAncestorIndex over the context's last conv_context_rows rows) and the chunk's chains.
  at::Tensor conv_index;
  std::vector<TokenRun> runs;
  int64_t conv_context_rows = 0;
  // Per ChunkInput::state_points entry, the run of `runs` that ends there.
  std::vector<int64_t> point_runs;
  bool router_statistics = false;  // ChunkInput::router_statistics
  at::Tensor routed_experts;       // ChunkInput::routed_experts
};

struct LayerOutput {
  at::Tensor hidden;  // [T, hidden_size], the residual stream after the layer
  // Between a layer's two blocks only: the attention or Gated DeltaNet block's output, which the
  // MLP block adds to `hidden` inside its norm (Projections' addend; FoldedResidualAddEnabled):
  // the stream is then hidden + hidden_addend. Undefined otherwise.
  at::Tensor hidden_addend;
  at::Tensor keys;                       // [T, kv_heads, head_dim]
  at::Tensor values;                     // [T, kv_heads, head_dim]
  at::Tensor state;                      // linear-attention layers (see ChunkOutput)
  std::vector<at::Tensor> point_states;  // per ChunkContext::point_runs entry
  // A sparse layer with ChunkContext::router_statistics: its router's softmax probabilities and
  // top-k indicators [T, num_experts] (see ChunkOutput); undefined otherwise.
  at::Tensor router_probs, router_counts;
};

}  // namespace dta
