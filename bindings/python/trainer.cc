#include "bindings/python/trainer.h"

#include <c10/util/Exception.h>

#include <filesystem>
#include <utility>

#include "absl/status/statusor.h"
#include "core/checkpoint/qwen3_config.h"
#include "core/tree/prefix_tree.h"
#include "executor/model/qwen3_checkpoint.h"

namespace dta::python {

Trainer::Trainer(Qwen3Model model, const AdamWOptions& adamw, bool offload_optimizer)
    : model_(std::move(model)),
      optimizer_(model_.named_parameters(), /*group=*/nullptr,
                 TrainingLayout{.offload_optimizer = offload_optimizer}, adamw) {}

std::unique_ptr<Trainer> Trainer::FromDirectory(const std::string& directory,
                                                at::TensorOptions options,
                                                const AdamWOptions& adamw, bool offload_optimizer) {
  return std::unique_ptr<Trainer>(
      new Trainer(LoadQwen3Model(directory, options), adamw, offload_optimizer));
}

std::unique_ptr<Trainer> Trainer::FromConfig(const std::string& config, uint64_t seed,
                                             double init_std, at::TensorOptions options,
                                             const AdamWOptions& adamw, bool offload_optimizer) {
  absl::StatusOr<Qwen3Config> parsed = Qwen3ConfigFromName(config);
  TORCH_CHECK(parsed.ok(), std::string(parsed.status().message()));
  Qwen3Model model(*parsed, options);
  model.InitRandom(seed, init_std);
  return std::unique_ptr<Trainer>(new Trainer(std::move(model), adamw, offload_optimizer));
}

GradientStats Trainer::ComputeGradients(absl::Span<const Rollout> rollouts, const LossOptions& loss,
                                        const ExecutorOptions& executor) {
  GradientStats stats;
  if (rollouts.empty()) return stats;
  const GradientResult result = dta::ComputeGradients(model_, rollouts, loss, executor);
  stats.loss = result.loss;
  stats.rollout_tokens = result.rollout_tokens;
  stats.forwarded_tokens = result.forwarded_tokens;
  // Only the count: the trie points into the rollouts instead of copying their tokens again.
  PrefixTreeBuilder builder(TokenStorage::kBorrow);
  for (const Rollout& r : rollouts)
    TORCH_CHECK(builder.AddRollout(r.tokens).ok(), "rollout '", r.id, "'");
  stats.tree_tokens = builder.num_tree_tokens();
  return stats;
}

StepStats Trainer::Step() { return optimizer_.Step(); }

void Trainer::ZeroGrad() { optimizer_.ZeroGrad(); }

std::vector<at::Tensor> Trainer::ComputeLogprobs(absl::Span<const Rollout> rollouts,
                                                 const ExecutorOptions& executor) {
  if (rollouts.empty()) return {};
  return dta::ComputeLogprobs(model_, rollouts, executor);
}

void Trainer::Save(const std::string& directory, std::optional<at::ScalarType> dtype,
                   bool with_optimizer) const {
  SaveQwen3Model(model_, directory, dtype);
  if (with_optimizer) optimizer_.SaveState(directory);
}

void Trainer::LoadOptimizer(const std::string& path) { optimizer_.LoadState(path); }

}  // namespace dta::python
