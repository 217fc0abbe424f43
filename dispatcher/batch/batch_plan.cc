#include "dispatcher/batch/batch_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/tree/prefix_tree.h"

namespace dta {

absl::Status ValidateBatchOptions(const BatchOptions& options) {
  if (options.rollouts < 0 || options.tokens < 0 ||
      (options.rollouts > 0) == (options.tokens > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("batch: exactly one of 'rollouts' (",
                                                   options.rollouts, ") and 'tokens' (",
                                                   options.tokens, ") must be positive"));
  }
  if (options.max_staleness < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch: 'max_staleness' is ", options.max_staleness, "; use -1 for no limit"));
  }
  return absl::OkStatus();
}

int64_t Staleness(const Rollout& rollout, int64_t policy_version) {
  int64_t oldest = -1;
  for (int32_t version : rollout.versions) {
    if (version >= 0 && (oldest < 0 || version < oldest)) oldest = version;
  }
  return oldest < 0 ? 0 : policy_version - oldest;
}

BatchSelection SelectBatch(absl::Span<const Rollout* const> pending, int64_t policy_version,
                           const BatchOptions& options) {
  BatchSelection selection;
  std::vector<int64_t> stale;
  for (int64_t i = 0; i < static_cast<int64_t>(pending.size()); ++i) {
    const Rollout& rollout = *pending[i];
    if (options.max_staleness >= 0 && Staleness(rollout, policy_version) > options.max_staleness) {
      stale.push_back(i);
      continue;
    }
    selection.batch.push_back(i);
    selection.fresh_rollouts += 1;
    selection.fresh_tokens += static_cast<int64_t>(rollout.tokens.size());
    const bool full = options.rollouts > 0 ? selection.fresh_rollouts >= options.rollouts
                                           : selection.fresh_tokens >= options.tokens;
    if (full) {
      selection.ready = true;
      selection.stale = std::move(stale);
      return selection;
    }
  }
  selection.batch.clear();
  return selection;
}

absl::StatusOr<PartitionPlan> PlanPartitions(absl::Span<const Rollout* const> batch, int world_size,
                                             bool with_advantages,
                                             const AdvantageOptions& advantage_options,
                                             const BalanceCost& balance) {
  if (world_size < 1)
    return absl::InvalidArgumentError(absl::StrCat("world size ", world_size, " < 1"));
  // The batch outlives the plan's computation, so the trie points into its tokens instead of
  // copying them, and only the order and LCPs come out (the split needs nothing else).
  PrefixTreeBuilder builder(TokenStorage::kBorrow);
  for (const Rollout* rollout : batch) {
    if (absl::StatusOr<int64_t> added = builder.AddRollout(rollout->tokens); !added.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rollout '", rollout->id, "': ", added.status().message()));
    }
  }
  PartitionPlan plan;
  plan.context = MakeBatchContext(batch);
  if (with_advantages) {
    absl::StatusOr<std::vector<float>> advantages = GroupRewardAdvantages(batch, advantage_options);
    if (!advantages.ok()) return advantages.status();
    plan.advantages = *std::move(advantages);
  }
  absl::StatusOr<Partition> partition =
      PartitionDfsContiguous(builder.SortRollouts(), world_size, balance);
  if (!partition.ok()) return partition.status();
  plan.partition = *std::move(partition);
  plan.ranks.resize(world_size);
  for (int k = 0; k < world_size; ++k) {
    plan.ranks[k].assign(plan.partition.groups[k].begin(), plan.partition.groups[k].end());
  }
  return plan;
}

std::vector<float> PlannedAdvantages(const PartitionPlan& plan, int64_t i, const Rollout& rollout) {
  if (!rollout.advantages.empty()) return rollout.advantages;
  if (plan.advantages.empty()) return {};
  return std::vector<float>(rollout.tokens.size(), plan.advantages[i]);
}

RankShare ShareOfRank(const PartitionPlan& plan, int rank, absl::Span<const Rollout> batch) {
  RankShare share;
  share.positions = plan.ranks.at(rank);
  share.rollouts.reserve(share.positions.size());
  for (const int64_t i : share.positions) {
    share.rollouts.push_back(batch[i]);
    share.rollouts.back().advantages = PlannedAdvantages(plan, i, batch[i]);
  }
  return share;
}

}  // namespace dta
