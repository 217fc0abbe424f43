#include "executor/model/ops/attention.h"

#include <vector>

#include "kernels/chunk_attention.h"
#include "kernels/tree_attention.h"

namespace dta {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor TreeAttention::forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& v, const at::Tensor& tree_key_end,
                                  const LayerPrefix& prefix, double scale, bool chain) {
  const at::Tensor key_end = chain ? at::Tensor() : tree_key_end;
  kernels::ChunkAttentionResult result =
      kernels::ChunkAttentionForward(q, k, v, prefix.keys, prefix.values, key_end, scale);
  std::vector<at::Tensor> saved = {q, k, v, key_end};
  saved.insert(saved.end(), result.saved.tensors.begin(), result.saved.tensors.end());
  ctx->save_for_backward(saved);
  ctx->saved_data["path"] = result.saved.path;
  ctx->saved_data["scale"] = scale;
  ctx->saved_data["prefix_k"] = prefix.keys;
  ctx->saved_data["prefix_v"] = prefix.values;
  ctx->saved_data["grad_prefix_k"] = prefix.grad_keys;
  ctx->saved_data["grad_prefix_v"] = prefix.grad_values;
  return result.out;
}

variable_list TreeAttention::backward(AutogradContext* ctx, variable_list grads) {
  const auto saved = ctx->get_saved_variables();
  const kernels::ChunkAttentionSaved state{
      .path = ctx->saved_data["path"].toInt(),
      .tensors = std::vector<at::Tensor>(saved.begin() + 4, saved.end())};
  const kernels::TreeAttentionGrads g = kernels::ChunkAttentionBackward(
      grads[0], saved[0], saved[1], saved[2], ctx->saved_data["prefix_k"].toTensor(),
      ctx->saved_data["prefix_v"].toTensor(), saved[3], state, ctx->saved_data["scale"].toDouble(),
      ctx->saved_data["grad_prefix_k"].toTensor(), ctx->saved_data["grad_prefix_v"].toTensor());
  return {g.dq, g.dk, g.dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
}

}  // namespace dta
