// Attention of a chunk's queries on the chunk's keys (under its tree mask, or causal) and on a
// cached prefix, differentiable in q, k and v and adding the prefix's K/V gradients into the
// caller's accumulators. It runs kernels/chunk_attention.h, which picks the path: tree attention
// (FlashAttention-style tree-masked kernels on the GPU, an exact ATen reference elsewhere), cuDNN's
// fused attention for a causal chain without a prefix on the GPU, and optionally cuDNN for the
// prefix merged with the chunk's part by log-sum-exp.
//
// Example:
//   at::Tensor out = TreeAttention::apply(q, k, v, key_end, prefix, 1.0 / std::sqrt(head_dim),
//                                         /*chain=*/false);
//
// Thread safety: stateless; backward adds into the prefix's gradient accumulators.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "executor/model/chunk_io.h"

namespace dta {

// Attention of a chunk on a cached prefix (kernels/chunk_attention.h: cuDNN for the prefix and for
// chains, tree attention for tree masks, merged by log-sum-exp). Returns [T, heads, head_dim]. The
// prefix is a constant of the graph (a non-tensor argument, so autograd neither tracks nor
// version-checks it: it is a view of a stack that later chunks write above, never into, while this
// graph lives); with accumulators, backward adds the prefix's K/V gradients into them in place.
// With `chain`, key_end (always defined: autograd functions refuse undefined tensor arguments) is
// ignored and the chunk is a causal chain.
// q [T, heads, D]; k, v [T, kv_heads, D]; tree_key_end [T] int64 (ChunkInput::key_end).
class TreeAttention : public torch::autograd::Function<TreeAttention> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& tree_key_end, const LayerPrefix& prefix, double scale,
                            bool chain);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

}  // namespace dta
