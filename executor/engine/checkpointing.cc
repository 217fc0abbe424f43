#include "executor/engine/checkpointing.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace dta::engine {

LayerCheckpoints ForwardKeepingLayerInputs(const Qwen3Model& model, const ChunkInput& input,
                                           const ChunkContext& context) {
  TORCH_CHECK(input.prefix.empty(),
              "activation checkpointing takes chunks without a cached prefix");
  torch::autograd::AutoGradMode no_grad(false);
  LayerCheckpoints saved;
  at::Tensor h = model.Embed(input.tokens);
  for (int64_t l = 0; l < model.config().num_hidden_layers; ++l) {
    saved.layer_inputs.push_back(h);
    h = model.ForwardLayer(l, h, context).hidden;
  }
  saved.last = h.detach().requires_grad_(true);
  return saved;
}

void BackwardThroughLayers(const Qwen3Model& model, const ChunkInput& input,
                           const ChunkContext& context, const LayerCheckpoints& saved) {
  torch::autograd::AutoGradMode grad_mode(true);
  at::Tensor grad = saved.last.grad();
  if (!grad.defined()) return;
  for (int64_t l = model.config().num_hidden_layers - 1; l >= 0; --l) {
    const at::Tensor x = saved.layer_inputs[l].detach().requires_grad_(true);
    const at::Tensor out = model.ForwardLayer(l, x, context).hidden;
    torch::autograd::backward({out}, {grad});
    grad = x.grad();
  }
  torch::autograd::backward({model.Embed(input.tokens)}, {grad});
}

}  // namespace dta::engine
