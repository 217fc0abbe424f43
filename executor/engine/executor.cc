#include "executor/engine/executor.h"

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "executor/engine/methods.h"

namespace dta {
namespace engine {

at::Tensor TokenTensor(const Rollout& rollout, const at::TensorOptions& model_options) {
  std::vector<int64_t> ids(rollout.tokens.begin(), rollout.tokens.end());
  return at::tensor(ids, at::TensorOptions().dtype(at::kLong)).to(model_options.device());
}

PrefixTree BuildTree(absl::Span<const Rollout> rollouts, absl::Span<const RolloutIndex> subset) {
  PrefixTreeBuilder builder;
  for (RolloutIndex r : subset) TORCH_CHECK(builder.AddRollout(rollouts[r].tokens).ok(), "rollout '", rollouts[r].id, "'");
  return std::move(builder).Build();
}

PrefixTree BuildTree(absl::Span<const Rollout> rollouts) {
  PrefixTreeBuilder builder;
  for (const Rollout& rollout : rollouts) TORCH_CHECK(builder.AddRollout(rollout.tokens).ok(), "rollout '", rollout.id, "'");
  return std::move(builder).Build();
}

void CheckRollouts(const Qwen3Model& model, absl::Span<const Rollout> rollouts) {
  for (const Rollout& rollout : rollouts) {
    const absl::Status status = ValidateRollout(rollout, model.config().vocab_size);
    TORCH_CHECK(status.ok(), "rollout '", rollout.id, "': ", std::string(status.message()));
  }
}

LossPlan::LossPlan(const Qwen3Model& model, absl::Span<const Rollout> rollouts, const LossOptions& options,
                   const ExecutorOptions& executor)
    : rollouts_(rollouts), options_(options), batch_(MakeBatchContext(rollouts)) {
  if (options.kind != LossKind::kSft) advantages_ = ComputeAdvantages(rollouts);
  if (options.kind == LossKind::kDecoupledPpo) {
    // The proximal policy is the current one before this step: its log-probabilities come from a
    // forward-only pass, each unique token once.
    ExecutorOptions forward = executor;
    if (forward.method == Method::kDense) forward.method = Method::kDta;
    proximal_ = ComputeLogprobs(model, rollouts, forward);
  }
}

RolloutLossInputs LossPlan::Inputs(int32_t r, const at::Tensor& logprobs, const at::Tensor& entropy) const {
  RolloutLossInputs in;
  in.rollout = &rollouts_[r];
  in.logprobs = logprobs;
  in.entropy = entropy;
  if (!proximal_.empty()) in.proximal_logprobs = proximal_[r];
  if (!advantages_.empty()) in.advantages = &advantages_[r];
  return in;
}

at::Tensor LossPlan::Loss(int32_t r, const at::Tensor& logprobs, const at::Tensor& entropy) const {
  return RolloutLoss(Inputs(r, logprobs, entropy), options_, batch_);
}

RolloutLossGrad LossPlan::LossAndGrad(int32_t r, const at::Tensor& logprobs, const at::Tensor& entropy) const {
  return RolloutLossAndGrad(Inputs(r, logprobs, entropy), options_, batch_);
}

GradientResult Run(const Qwen3Model& model, absl::Span<const Rollout> rollouts, const LossPlan* plan,
                   const ExecutorOptions& options) {
  TORCH_CHECK(options.logprob_slice_rows > 0, "logprob_slice_rows must be positive");
  switch (options.method) {
    case Method::kDense:
      return RunDense(model, rollouts, plan, options);
    case Method::kPacked:
      return RunPacked(model, rollouts, plan, options);
    case Method::kDta:
      return RunDta(model, rollouts, plan, options);
  }
  TORCH_CHECK(false, "unknown method");
}

}  // namespace engine

GradientResult ComputeGradients(const Qwen3Model& model, absl::Span<const Rollout> rollouts,
                                const LossOptions& loss, const ExecutorOptions& options) {
  engine::CheckRollouts(model, rollouts);
  const engine::LossPlan plan(model, rollouts, loss, options);
  return engine::Run(model, rollouts, &plan, options);
}

std::vector<at::Tensor> ComputeLogprobs(const Qwen3Model& model, absl::Span<const Rollout> rollouts,
                                        const ExecutorOptions& options) {
  engine::CheckRollouts(model, rollouts);
  return engine::Run(model, rollouts, nullptr, options).logprobs;
}

}  // namespace dta
