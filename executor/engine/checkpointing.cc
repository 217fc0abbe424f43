#include "executor/engine/checkpointing.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace dta::engine {

LayerCheckpoints ForwardKeepingLayerInputs(const Decoder& model, const ChunkInput& input,
                                           const ChunkContext& context) {
  TORCH_CHECK(input.prefix.empty(),
              "activation checkpointing takes chunks without a cached prefix");
  torch::autograd::AutoGradMode no_grad(false);
  LayerCheckpoints saved;
  at::Tensor h = model.Embed(input.tokens);
  for (int64_t l = 0; l < model.config().num_hidden_layers; ++l) {
    saved.layer_inputs.push_back(h);
    LayerOutput out = model.ForwardLayer(l, h, context);
    h = std::move(out.hidden);
    if (out.router_probs.defined()) {
      const bool first = !saved.router_probs.defined();
      saved.router_probs = first ? out.router_probs : saved.router_probs + out.router_probs;
      saved.router_counts = first ? out.router_counts : saved.router_counts + out.router_counts;
    }
  }
  saved.last = h.detach().requires_grad_(true);
  return saved;
}

void BackwardThroughLayers(const Decoder& model, const ChunkInput& input,
                           const ChunkContext& context, const LayerCheckpoints& saved,
                           const at::Tensor& router_grad) {
  torch::autograd::AutoGradMode grad_mode(true);
  at::Tensor grad = saved.last.grad();
  if (!grad.defined()) return;
  for (int64_t l = model.config().num_hidden_layers - 1; l >= 0; --l) {
    const at::Tensor x = saved.layer_inputs[l].detach().requires_grad_(true);
    const LayerOutput out = model.ForwardLayer(l, x, context);
    if (router_grad.defined() && out.router_probs.defined()) {
      torch::autograd::backward({out.hidden, out.router_probs},
                                {grad, router_grad.to(out.router_probs.scalar_type())});
    } else {
      torch::autograd::backward({out.hidden}, {grad});
    }
    grad = x.grad();
  }
  torch::autograd::backward({model.Embed(input.tokens)}, {grad});
}

}  // namespace dta::engine
