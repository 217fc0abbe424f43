// Dense: every rollout on its own, the reference the other methods are tested against, with
// optional activation checkpointing (the papers' "Dense+CKPT" baseline).
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "executor/engine/checkpointing.h"
#include "executor/engine/lockstep.h"
#include "executor/engine/methods.h"

namespace dta::engine {

GradientResult RunDense(const Decoder& model, absl::Span<const Rollout> rollouts,
                        const RoutingReplay& replay, const LossPlan* plan,
                        const LogprobPositions& read, const ExecutorOptions& options) {
  torch::autograd::AutoGradMode grad_mode(plan != nullptr);
  const bool checkpointing = plan != nullptr && options.checkpointing;
  GradientResult result;
  const std::vector<at::Tensor> token_tensors = TokenTensors(rollouts, model.options());
  at::Tensor total_loss;  // a device scalar, read once at the end
  const bool balance = plan != nullptr && plan->balances_routers();
  at::Tensor total_balance;  // the router-balance terms, part of total_loss
  int64_t total_work = 0;
  for (const Rollout& rollout : rollouts)
    total_work += (checkpointing ? 2 : 1) * static_cast<int64_t>(rollout.tokens.size());
  // One model call per rollout, in lockstep with the other expert-parallel ranks.
  std::vector<ModelCall> word;
  for (const Rollout& rollout : rollouts) {
    const int64_t length = static_cast<int64_t>(rollout.tokens.size());
    word.push_back(plan == nullptr ? ForwardCall(length)
                   : checkpointing ? LayerReplayCall(length)
                                   : ForwardBackwardCall(length));
  }
  Lockstep(model, std::move(word)).Run([&](int64_t call) {
    const auto r = static_cast<int32_t>(call);
    const at::Tensor& tokens = token_tensors[r];
    const int64_t length = tokens.size(0);
    const ChunkInput input{.tokens = tokens,
                           .positions = at::arange(length, tokens.options()),
                           .router_statistics = balance,
                           .routed_experts = replay.Rows(r, 0, length, tokens.device())};
    ChunkContext context;
    LayerCheckpoints saved;
    at::Tensor hidden, router_probs, router_counts;
    if (checkpointing) {
      context = model.MakeContext(input);
      saved = ForwardKeepingLayerInputs(model, input, context);
      hidden = model.FinalNorm(saved.last);
      router_probs = saved.router_probs;
      router_counts = saved.router_counts;
    } else {
      ChunkOutput out = model.Forward(input);
      hidden = std::move(out.hidden);
      router_probs = std::move(out.router_probs);
      router_counts = std::move(out.router_counts);
    }
    // Token t is predicted from position t - 1; token 0 has no prediction and holds 0.
    at::Tensor entropy_tail;
    const bool entropy = plan && plan->needs_entropy();
    const at::Tensor tail = LogprobsOfReadRows(
        model, hidden.slice(0, 0, length - 1), tokens.slice(0, 1, length), read.Of(r, 1, length),
        entropy ? &entropy_tail : nullptr, LogprobOptionsOf(options));
    const at::Tensor zero = at::zeros({1}, tail.options());
    const at::Tensor logprobs = at::cat({zero, tail});
    result.logprobs.push_back(logprobs.detach());
    result.rollout_tokens += length;
    result.forwarded_tokens += checkpointing ? 2 * length : length;
    if (plan) {
      at::Tensor loss =
          plan->Loss(r, logprobs, entropy ? at::cat({zero, entropy_tail}) : at::Tensor());
      at::Tensor router_grad;  // every token's gradient of router_probs
      if (balance) {
        const at::Tensor row = plan->RouterBalanceRow(r, router_counts.sum(0));
        // With checkpointing router_probs has no graph: the gradient is seeded layer by layer.
        const at::Tensor term = (router_probs.sum(0) * row).sum();
        total_balance = total_balance.defined() ? total_balance + term.detach() : term.detach();
        loss = loss + term;
        router_grad = row.expand_as(router_counts);
      }
      loss.backward();
      if (checkpointing) BackwardThroughLayers(model, input, context, saved, router_grad);
      total_loss = total_loss.defined() ? total_loss + loss.detach() : loss.detach();
    }
    if (options.progress) options.progress(result.forwarded_tokens, total_work);
  });
  if (total_loss.defined()) result.loss = total_loss.item<double>();
  if (total_balance.defined())
    result.router_aux_loss = total_balance.item<double>() / plan->router_aux_loss_coef();
  return result;
}

}  // namespace dta::engine
