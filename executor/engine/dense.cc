// Dense: every rollout on its own, the reference the other methods are tested against, with
// optional activation checkpointing (the papers' "Dense+CKPT" baseline).
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "executor/engine/methods.h"

namespace dta::engine {
namespace {

// Runs the decoder keeping only each layer's input; returns the final residual stream as a leaf
// (requires grad) and the saved inputs. BackwardThroughLayers then replays each layer.
struct Checkpointed {
  std::vector<at::Tensor> layer_inputs;  // [num_layers] detached
  at::Tensor last;                       // leaf: the residual stream after the last layer
};

Checkpointed ForwardCheckpointed(const Qwen3Model& model, const ChunkInput& input, const ChunkContext& context) {
  torch::autograd::AutoGradMode no_grad(false);
  Checkpointed saved;
  at::Tensor h = model.Embed(input.tokens);
  for (int64_t l = 0; l < model.config().num_hidden_layers; ++l) {
    saved.layer_inputs.push_back(h);
    h = model.ForwardLayer(l, h, context).hidden;
  }
  saved.last = h.detach().requires_grad_(true);
  return saved;
}

void BackwardThroughLayers(const Qwen3Model& model, const ChunkInput& input, const ChunkContext& context,
                           const Checkpointed& saved) {
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

}  // namespace

GradientResult RunDense(const Qwen3Model& model, absl::Span<const Rollout> rollouts, const LossPlan* plan,
                        const ExecutorOptions& options) {
  torch::autograd::AutoGradMode grad_mode(plan != nullptr);
  const bool checkpointing = plan != nullptr && options.checkpointing;
  GradientResult result;
  for (int32_t r = 0; r < static_cast<int32_t>(rollouts.size()); ++r) {
    const at::Tensor tokens = TokenTensor(rollouts[r], model.options());
    const int64_t length = tokens.size(0);
    const ChunkInput input{.tokens = tokens, .positions = at::arange(length, tokens.options())};
    ChunkContext context;
    Checkpointed saved;
    at::Tensor hidden;
    if (checkpointing) {
      context = model.MakeContext(input);
      saved = ForwardCheckpointed(model, input, context);
      hidden = model.FinalNorm(saved.last);
    } else {
      hidden = model.Forward(input).hidden;
    }
    // Token t is predicted from position t - 1; token 0 has no prediction and holds 0.
    at::Tensor entropy_tail;
    const bool entropy = plan && plan->needs_entropy();
    const at::Tensor tail = model.Logprobs(hidden.slice(0, 0, length - 1), tokens.slice(0, 1, length),
                                           entropy ? &entropy_tail : nullptr, options.logprob_slice_rows);
    const at::Tensor zero = at::zeros({1}, tail.options());
    const at::Tensor logprobs = at::cat({zero, tail});
    result.logprobs.push_back(logprobs.detach());
    result.rollout_tokens += length;
    result.forwarded_tokens += checkpointing ? 2 * length : length;
    if (plan) {
      const at::Tensor loss = plan->Loss(r, logprobs, entropy ? at::cat({zero, entropy_tail}) : at::Tensor());
      loss.backward();
      if (checkpointing) BackwardThroughLayers(model, input, context, saved);
      result.loss += loss.item<double>();
    }
  }
  return result;
}

}  // namespace dta::engine
