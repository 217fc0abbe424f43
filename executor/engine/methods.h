// Internal to executor/engine: what the three methods share, and their entry points.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "core/tree/prefix_tree.h"
#include "executor/engine/executor.h"

namespace dta::engine {

// Everything about the loss that is fixed for the batch before execution: the normaliser, GRPO
// advantages, whether entropy is needed, proximal log-probabilities for decoupled PPO.
class LossPlan {
 public:
  LossPlan(const Qwen3Model& model, absl::Span<const Rollout> rollouts, const LossOptions& options,
           const ExecutorOptions& executor, const BatchLossContext& batch);

  bool needs_entropy() const {
    return options_.with_entropy || (options_.entropy_coef != 0.0 && !options_.custom);
  }
  // Rollout r's normalised loss as a differentiable function of its log-probabilities (and
  // entropy, when needed; otherwise pass an undefined tensor).
  at::Tensor Loss(int32_t r, const at::Tensor& logprobs, const at::Tensor& entropy) const;
  // The same, with d loss / d logprobs (and d loss / d entropy) by autograd on the small vectors.
  RolloutLossGrad LossAndGrad(int32_t r, const at::Tensor& logprobs,
                              const at::Tensor& entropy) const;
  // The diagnostics of the losses computed so far (each rollout's loss is computed once).
  LossDiagnostics ReadDiagnostics() const { return diagnostics_.Read(); }

 private:
  RolloutLossInputs Inputs(int32_t r, const at::Tensor& logprobs, const at::Tensor& entropy) const;

  absl::Span<const Rollout> rollouts_;
  LossOptions options_;
  BatchLossContext batch_;
  std::vector<std::vector<float>> advantages_;
  std::vector<at::Tensor> proximal_;
  // Gathered as Loss and LossAndGrad run: statistics, not state the losses depend on.
  mutable DiagnosticsAccumulator diagnostics_;
};

// The log-probability head's options of an execution.
inline LogprobOptions LogprobOptionsOf(const ExecutorOptions& options) {
  return {.slice_rows = options.logprob_slice_rows, .temperature = options.temperature};
}

// Every rollout's tokens as an [L] int64 tensor on the model's device: views of one buffer,
// uploaded in one asynchronous copy.
std::vector<at::Tensor> TokenTensors(absl::Span<const Rollout> rollouts,
                                     const at::TensorOptions& model_options);

// The prefix tree of rollouts[subset[0]], rollouts[subset[1]], ... (local indices follow
// `subset`), or of all rollouts.
PrefixTree BuildTree(absl::Span<const Rollout> rollouts, absl::Span<const RolloutIndex> subset);
PrefixTree BuildTree(absl::Span<const Rollout> rollouts);

// Checks token ids against the vocabulary, naming the rollout.
void CheckRollouts(const Qwen3Model& model, absl::Span<const Rollout> rollouts);

// When `plan` is null, only log-probabilities are computed (no graph, no gradients).
GradientResult RunDense(const Qwen3Model& model, absl::Span<const Rollout> rollouts,
                        const LossPlan* plan, const ExecutorOptions& options);
GradientResult RunPacked(const Qwen3Model& model, absl::Span<const Rollout> rollouts,
                         const LossPlan* plan, const ExecutorOptions& options);
GradientResult RunDta(const Qwen3Model& model, absl::Span<const Rollout> rollouts,
                      const LossPlan* plan, const ExecutorOptions& options);

}  // namespace dta::engine
