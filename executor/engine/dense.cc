// Dense: every rollout on its own, the reference the other methods are tested against.
#include <torch/csrc/autograd/grad_mode.h>

#include "executor/engine/methods.h"

namespace dta::engine {

GradientResult RunDense(const Qwen3Model& model, absl::Span<const Rollout> rollouts, const LossPlan* plan,
                        const ExecutorOptions& options) {
  torch::autograd::AutoGradMode grad_mode(plan != nullptr);
  GradientResult result;
  for (int32_t r = 0; r < static_cast<int32_t>(rollouts.size()); ++r) {
    const at::Tensor tokens = TokenTensor(rollouts[r], model.options());
    const int64_t length = tokens.size(0);
    const ChunkOutput out = model.Forward({.tokens = tokens, .positions = at::arange(length, tokens.options())});
    // Token t is predicted from position t - 1; token 0 has no prediction and holds 0.
    at::Tensor entropy_tail;
    const bool entropy = plan && plan->needs_entropy();
    const at::Tensor tail = model.Logprobs(out.hidden.slice(0, 0, length - 1), tokens.slice(0, 1, length),
                                           entropy ? &entropy_tail : nullptr, options.logprob_slice_rows);
    const at::Tensor zero = at::zeros({1}, tail.options());
    const at::Tensor logprobs = at::cat({zero, tail});
    result.logprobs.push_back(logprobs.detach());
    result.rollout_tokens += length;
    result.forwarded_tokens += length;
    if (plan) {
      const at::Tensor loss = plan->Loss(r, logprobs, entropy ? at::cat({zero, entropy_tail}) : at::Tensor());
      loss.backward();
      result.loss += loss.item<double>();
    }
  }
  return result;
}

}  // namespace dta::engine
