// Packed tree (Tree Training): one forward over the DFS-serialized unique tokens with a tree mask
// and original position ids; each rollout gathers its log-probabilities from the shared tokens, so
// autograd sums every shared token's gradient over the rollouts through it.
#include <torch/csrc/autograd/grad_mode.h>

#include "executor/engine/methods.h"
#include "executor/engine/packed_layout.h"
#include "executor/tree/prefix_tree.h"
#include "executor/tree/tree_partition.h"

namespace dta::engine {

namespace {

// One packed forward (and backward) over the rollouts `subset`; their results go to `result`.
void RunPackedBatch(const Qwen3Model& model, absl::Span<const Rollout> rollouts, absl::Span<const RolloutIndex> subset,
                    const LossPlan* plan, const ExecutorOptions& options, GradientResult& result) {
  PrefixTreeBuilder builder;
  for (RolloutIndex r : subset) TORCH_CHECK(builder.AddRollout(rollouts[r].tokens).ok(), rollouts[r].id);
  const PrefixTree tree = std::move(builder).Build();
  const PackedLayout layout = MakePackedLayout(tree, 0);
  const int64_t n = tree.num_tree_tokens();
  std::vector<int64_t> predicted, predictor;
  for (int64_t t = 0; t < n; ++t) {
    if (layout.previous[t] >= 0) predicted.push_back(t), predictor.push_back(layout.previous[t]);
  }
  const at::Device device = model.options().device();
  auto as_tensor = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(device); };
  const at::Tensor token_ids = as_tensor(layout.tokens);
  const ChunkOutput out = model.Forward(
      {.tokens = token_ids, .positions = as_tensor(layout.positions), .key_end = as_tensor(layout.key_end)});
  const at::Tensor predicted_ids = as_tensor(predicted);
  const bool entropy = plan && plan->needs_entropy();
  at::Tensor entropy_values;
  const at::Tensor values = model.Logprobs(out.hidden.index_select(0, as_tensor(predictor)),
                                           token_ids.index_select(0, predicted_ids),
                                           entropy ? &entropy_values : nullptr, options.logprob_slice_rows);
  // Tokens without a predictor (position 0) hold 0.
  const at::Tensor zeros = at::zeros({n}, values.options());
  const at::Tensor tree_logprobs = zeros.index_put({predicted_ids}, values);
  const at::Tensor tree_entropy = entropy ? zeros.index_put({predicted_ids}, entropy_values) : at::Tensor();

  result.forwarded_tokens += n;
  at::Tensor total;
  for (RolloutIndex local = 0; local < tree.num_rollouts(); ++local) {
    const RolloutIndex r = subset[local];
    const at::Tensor path = as_tensor(layout.paths[local]);
    const at::Tensor logprobs = tree_logprobs.index_select(0, path);
    result.logprobs[r] = logprobs.detach();
    result.rollout_tokens += tree.rollout_length(local);
    if (plan) {
      const at::Tensor loss = plan->Loss(r, logprobs, entropy ? tree_entropy.index_select(0, path) : at::Tensor());
      total = total.defined() ? total + loss : loss;
    }
  }
  if (plan && total.defined()) {
    total.backward();
    result.loss += total.item<double>();
  }
}

}  // namespace

GradientResult RunPacked(const Qwen3Model& model, absl::Span<const Rollout> rollouts, const LossPlan* plan,
                         const ExecutorOptions& options) {
  torch::autograd::AutoGradMode grad_mode(plan != nullptr);
  GradientResult result;
  result.logprobs.resize(rollouts.size());
  std::vector<RolloutIndex> all(rollouts.size());
  for (size_t r = 0; r < rollouts.size(); ++r) all[r] = static_cast<RolloutIndex>(r);
  if (options.token_capacity <= 0) {
    RunPackedBatch(model, rollouts, all, plan, options, result);
    return result;
  }
  // Tree Training's partitioning: subtrees of at most token_capacity unique tokens, one packed
  // forward each (shared prefixes across batches are computed again: see the partition's ERR).
  PrefixTreeBuilder builder;
  for (const Rollout& rollout : rollouts) TORCH_CHECK(builder.AddRollout(rollout.tokens).ok(), rollout.id);
  const PrefixTree tree = std::move(builder).Build();
  absl::StatusOr<TreePartition> partition = PartitionTreeGreedy(tree, options.token_capacity);
  TORCH_CHECK(partition.ok(), "packed: ", std::string(partition.status().message()));
  for (const TreeBatch& batch : partition->batches) RunPackedBatch(model, rollouts, batch.rollouts, plan, options, result);
  return result;
}

}  // namespace dta::engine
