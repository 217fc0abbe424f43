// Splitting a batch of rollouts across K trainer GPUs.
//
// PartitionDfsContiguous is AReaL-DTA's Algorithm 4: rollouts in lexicographic order (a DFS leaf
// order of the combined prefix tree) are cut into K contiguous groups minimizing the largest
// group cost, where a group's cost is the tree tokens of its own prefix tree, or with a
// BalanceCost also the keys they attend to (a time model: a rank whose share holds long paths
// spends far more time in attention than its tree tokens say). Contiguous DFS groups keep almost
// all prefix sharing: the groups together hold at most (K - 1) x the longest rollout more tree
// tokens than the combined tree.
//
// The two greedy baselines of the paper's Figures 7-9 are here for comparison: each rollout, in
// batch order, goes to the group with the least load so far, measured in rollout tokens or in tree
// tokens of the group's own tree.
//
// All functions are pure and thread-compatible.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/tree/prefix_tree.h"

namespace dta {

// What a group of rollouts costs the rank that trains it, as the split balances it: per_token for
// each tree token of the group's own prefix tree plus per_key for each key that token attends to
// (a token at depth d, counted from 0, attends to d + 1: its ancestors and itself). {1, 0} counts
// tree tokens (Algorithm 4 as published). With weights fitted on the device
// (bench/balance_by_time.py: picoseconds per token and per key) a group's cost predicts its step
// time. Any integer unit; the costs of a batch must stay below 2^62.
struct BalanceCost {
  int64_t per_token = 1;
  int64_t per_key = 0;

  // The cost of a path of n tokens: n per_token + n (n + 1) / 2 per_key.
  int64_t PathCost(int64_t n) const { return per_token * n + per_key * (n * (n + 1) / 2); }
  // INVALID_ARGUMENT naming the weights if one is negative or both are 0.
  absl::Status Validate() const;
  bool operator==(const BalanceCost&) const = default;
};

struct Partition {
  // groups[k]: the rollouts trained by rank k, in the order the rank should see them (lexicographic
  // for PartitionDfsContiguous, batch order for the baselines). A group is empty only when there
  // are fewer rollouts than groups.
  std::vector<std::vector<RolloutIndex>> groups;
  std::vector<int64_t> cost;         // each group's BalanceCost (tree tokens by default)
  std::vector<int64_t> tree_tokens;  // tree tokens of each group's own prefix tree
  int64_t max_cost = 0;
  int64_t combined_tree_tokens = 0;  // tree tokens of all rollouts in one tree
  // Sum of the groups' tree tokens minus combined_tree_tokens: prefix tokens computed on more than
  // one rank.
  int64_t extra_tokens = 0;
  // max_cost / mean cost (1 = perfectly balanced).
  double imbalance = 0;
};

// The cut of a sequence of rollouts into contiguous groups: group k holds positions
// [bounds[k], bounds[k + 1]) of the sequence.
struct ContiguousCut {
  std::vector<int64_t> bounds;  // num_groups + 1 entries, bounds.front() = 0, bounds.back() = n
  std::vector<int64_t> cost;    // the BalanceCost of each group
  std::vector<int64_t> tree_tokens;  // tree tokens of each group
};

// The core of Algorithm 4 on a DFS-ordered sequence described by its lengths and by lcp[i] =
// LCP(sequence i - 1, sequence i) (lcp[0] ignored): binary search on the largest allowed cost with
// a greedy scan, then non-singleton groups split until there are exactly `num_groups` (trailing
// groups are empty only if num_groups > n). The result minimizes the largest group cost among all
// contiguous cuts. INVALID_ARGUMENT if num_groups < 1, the spans differ in size, an lcp is
// negative or exceeds a neighbouring length, or the cost is invalid or overflows.
// O(n log(total cost)).
absl::StatusOr<ContiguousCut> CutContiguous(absl::Span<const int64_t> lengths,
                                            absl::Span<const int64_t> lcp, int num_groups,
                                            const BalanceCost& cost = {});

// Algorithm 4 on a tree's rollouts. INVALID_ARGUMENT if num_groups < 1 or the cost is invalid.
absl::StatusOr<Partition> PartitionDfsContiguous(const PrefixTree& tree, int num_groups,
                                                 const BalanceCost& cost = {});
// The same from the rollouts' order and LCPs alone (PrefixTreeBuilder::SortRollouts: no tree).
absl::StatusOr<Partition> PartitionDfsContiguous(const SortedRollouts& sorted, int num_groups,
                                                 const BalanceCost& cost = {});

// Baselines: least-loaded by rollout tokens, and least-loaded by the group tree's tokens (a
// rollout adds only the tokens the group's tree does not hold yet). Ties go to the lower rank.
// `cost` only describes the result (Partition::cost), for comparison with a split balancing it.
absl::StatusOr<Partition> PartitionGreedyByRolloutTokens(const PrefixTree& tree, int num_groups,
                                                         const BalanceCost& cost = {});
absl::StatusOr<Partition> PartitionGreedyByTreeTokens(const PrefixTree& tree, int num_groups,
                                                      const BalanceCost& cost = {});

// Fills cost, tree_tokens, max_cost, combined_tree_tokens, extra_tokens and imbalance of `groups`
// (the groups must partition the tree's rollouts; `cost` must be valid).
Partition DescribePartition(const PrefixTree& tree, std::vector<std::vector<RolloutIndex>> groups,
                            const BalanceCost& cost = {});

}  // namespace dta
