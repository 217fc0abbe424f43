// Packed tree (Tree Training): one forward over the DFS-serialized unique tokens with a tree mask
// and original position ids; each rollout gathers its log-probabilities from the shared tokens, so
// autograd sums every shared token's gradient over the rollouts through it.
#include <torch/csrc/autograd/grad_mode.h>

#include "core/tree/prefix_tree.h"
#include "core/tree/tree_partition.h"
#include "executor/engine/lockstep.h"
#include "executor/engine/methods.h"
#include "executor/engine/packed_layout.h"

namespace dta::engine {

namespace {

// One packed forward (and backward) over the rollouts `subset`; their results go to `result`, the
// loss (a device scalar) to `total_loss`.
void RunPackedBatch(const Decoder& model, absl::Span<const Rollout> rollouts,
                    const RoutingReplay& replay, absl::Span<const RolloutIndex> subset,
                    const LossPlan* plan, const LogprobPositions& read,
                    const ExecutorOptions& options, GradientResult& result, at::Tensor& total_loss,
                    at::Tensor& total_balance) {
  const PrefixTree tree = BuildTree(replay, subset);
  const PackedLayout layout = MakePackedLayout(tree, 0, replay, subset, read);
  const int64_t n = tree.num_tree_tokens();
  const bool entropy = plan && plan->needs_entropy();
  const bool checkpointing = plan != nullptr && options.checkpointing;
  const bool balance = plan != nullptr && plan->balances_routers();
  const PackedOutput packed = ForwardPacked(model, layout, replay, {}, at::Tensor(), entropy,
                                            LogprobOptionsOf(options), checkpointing, balance);
  std::vector<at::Tensor> paths;  // per local rollout, on the device

  result.forwarded_tokens += checkpointing ? 2 * n : n;
  at::Tensor total;
  for (RolloutIndex local = 0; local < tree.num_rollouts(); ++local) {
    const RolloutIndex r = subset[local];
    const at::Tensor path = IndexTensor(layout.paths[local], model.options().device());
    paths.push_back(path);
    const at::Tensor logprobs = packed.logprobs.index_select(0, path);
    result.logprobs[r] = logprobs.detach();
    result.rollout_tokens += tree.rollout_length(local);
    if (plan) {
      const at::Tensor loss =
          plan->Loss(r, logprobs, entropy ? packed.entropy.index_select(0, path) : at::Tensor());
      total = total.defined() ? total + loss : loss;
    }
  }
  at::Tensor router_grad;  // every packed token's gradient of router_probs
  if (plan && total.defined() && balance) {
    router_grad = RouterBalanceRows(*plan, packed.router_counts, subset, paths);
    // Without checkpointing the term's graph seeds router_grad; with it, BackwardThroughLayers.
    const at::Tensor term = (packed.router_probs * router_grad).sum();
    total_balance = total_balance.defined() ? total_balance + term.detach() : term.detach();
    total = total + term;
  }
  if (plan && total.defined()) {
    total.backward();
    if (checkpointing)
      BackwardThroughLayers(model, *packed.input, packed.context, packed.checkpoints, router_grad);
    total_loss = total_loss.defined() ? total_loss + total.detach() : total.detach();
  }
}

}  // namespace

GradientResult RunPacked(const Decoder& model, absl::Span<const Rollout> rollouts,
                         const RoutingReplay& replay, const LossPlan* plan,
                         const LogprobPositions& read, const ExecutorOptions& options) {
  torch::autograd::AutoGradMode grad_mode(plan != nullptr);
  GradientResult result;
  result.logprobs.resize(rollouts.size());
  std::vector<RolloutIndex> all(rollouts.size());
  for (size_t r = 0; r < rollouts.size(); ++r) all[r] = static_cast<RolloutIndex>(r);
  at::Tensor total_loss, total_balance;
  const int64_t passes = plan != nullptr && options.checkpointing ? 2 : 1;
  // The packed batches: all rollouts in one, or Tree Training's partitioning into subtrees of at
  // most token_capacity unique tokens, one packed forward each (shared prefixes across batches are
  // computed again: see the partition's ERR).
  std::vector<std::vector<RolloutIndex>> batches;
  std::vector<int64_t> batch_tokens;
  if (!rollouts.empty()) {
    const PrefixTree tree = BuildTree(replay);
    if (options.token_capacity <= 0) {
      batches.push_back(all);
      batch_tokens.push_back(tree.num_tree_tokens());
    } else {
      absl::StatusOr<TreePartition> partition = PartitionTreeGreedy(tree, options.token_capacity);
      TORCH_CHECK(partition.ok(), "packed: ", std::string(partition.status().message()));
      for (const TreeBatch& batch : partition->batches) {
        batches.push_back(batch.rollouts);
        batch_tokens.push_back(batch.tokens);
      }
    }
  }
  int64_t total_work = 0;
  for (const int64_t tokens : batch_tokens) total_work += passes * tokens;
  // One model call per packed batch, in lockstep with the other expert-parallel ranks.
  std::vector<ModelCall> word;
  for (const int64_t tokens : batch_tokens) {
    word.push_back(plan == nullptr         ? ForwardCall(tokens)
                   : options.checkpointing ? LayerReplayCall(tokens)
                                           : ForwardBackwardCall(tokens));
  }
  Lockstep(model, std::move(word)).Run([&](int64_t call) {
    RunPackedBatch(model, rollouts, replay, batches[call], plan, read, options, result, total_loss,
                   total_balance);
    if (options.progress) options.progress(result.forwarded_tokens, total_work);
  });
  if (total_loss.defined()) result.loss = total_loss.item<double>();
  if (total_balance.defined())
    result.router_aux_loss = total_balance.item<double>() / plan->router_aux_loss_coef();
  return result;
}

}  // namespace dta::engine
