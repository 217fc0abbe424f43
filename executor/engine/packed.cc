// Packed tree (Tree Training): one forward over the DFS-serialized unique tokens with a tree mask
// and original position ids; each rollout gathers its log-probabilities from the shared tokens, so
// autograd sums every shared token's gradient over the rollouts through it.
#include <torch/csrc/autograd/grad_mode.h>

#include "executor/engine/methods.h"
#include "executor/tree/prefix_tree.h"

namespace dta::engine {

GradientResult RunPacked(const Qwen3Model& model, absl::Span<const Rollout> rollouts, const LossPlan* plan,
                         const ExecutorOptions& options) {
  torch::autograd::AutoGradMode grad_mode(plan != nullptr);
  PrefixTreeBuilder builder;
  for (const Rollout& rollout : rollouts) TORCH_CHECK(builder.AddRollout(rollout.tokens).ok(), rollout.id);
  const PrefixTree tree = std::move(builder).Build();
  const int64_t n = tree.num_tree_tokens();

  // Per serialized token: its original position, the end of its subtree (the mask), and the
  // token whose hidden state predicts it (the previous token on its path; -1 for a first token).
  std::vector<int64_t> positions(n), key_end(n), previous(n), tokens(n);
  for (NodeId v = 1; v < tree.num_nodes(); ++v) {
    const int64_t first = tree.token_offset(v);
    const NodeId parent = tree.parent(v);
    for (int64_t o = 0; o < tree.length(v); ++o) {
      positions[first + o] = tree.depth(v) + o;
      key_end[first + o] = tree.token_offset(tree.subtree_end(v));
      previous[first + o] = o > 0 ? first + o - 1 : (parent == kRootNode ? -1 : tree.token_offset(parent) + tree.length(parent) - 1);
      tokens[first + o] = tree.serialized_tokens()[first + o];
    }
  }
  std::vector<int64_t> predicted, predictor;
  for (int64_t t = 0; t < n; ++t) {
    if (previous[t] >= 0) predicted.push_back(t), predictor.push_back(previous[t]);
  }
  const at::TensorOptions index = at::TensorOptions().dtype(at::kLong).device(model.options().device());
  auto as_tensor = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(index.device()); };
  const at::Tensor token_ids = as_tensor(tokens);
  const ChunkOutput out =
      model.Forward({.tokens = token_ids, .positions = as_tensor(positions), .key_end = as_tensor(key_end)});
  const at::Tensor predicted_ids = as_tensor(predicted);
  const bool entropy = plan && plan->needs_entropy();
  at::Tensor entropy_values;
  const at::Tensor values = model.Logprobs(out.hidden.index_select(0, as_tensor(predictor)),
                                           token_ids.index_select(0, predicted_ids),
                                           entropy ? &entropy_values : nullptr, options.logprob_slice_rows);
  const at::Tensor zeros = at::zeros({n}, values.options());
  const at::Tensor tree_logprobs = zeros.index_put({predicted_ids}, values);
  const at::Tensor tree_entropy = entropy ? zeros.index_put({predicted_ids}, entropy_values) : at::Tensor();

  GradientResult result;
  result.forwarded_tokens = n;
  at::Tensor total;
  for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
    std::vector<int64_t> path(tree.rollout_length(r));
    for (NodeId v = tree.end_node(r); v != kRootNode; v = tree.parent(v)) {
      for (int64_t o = 0; o < tree.length(v); ++o) path[tree.depth(v) + o] = tree.token_offset(v) + o;
    }
    const at::Tensor path_ids = as_tensor(path);
    const at::Tensor logprobs = tree_logprobs.index_select(0, path_ids);
    result.logprobs.push_back(logprobs.detach());
    result.rollout_tokens += tree.rollout_length(r);
    if (plan) {
      const at::Tensor loss = plan->Loss(r, logprobs, entropy ? tree_entropy.index_select(0, path_ids) : at::Tensor());
      total = total.defined() ? total + loss : loss;
    }
  }
  if (plan && total.defined()) {
    total.backward();
    result.loss = total.item<double>();
  }
  return result;
}

}  // namespace dta::engine
