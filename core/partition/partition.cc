#include "core/partition/partition.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/tree/leaf_order.h"

namespace dta {
namespace {

absl::Status CheckGroups(int num_groups) {
  if (num_groups < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_groups must be >= 1, got ", num_groups));
  }
  return absl::OkStatus();
}

// The sequences' costs under a BalanceCost: a group's first sequence costs its whole path, each
// next one the part of its path beyond the LCP with the one before.
struct SequenceCosts {
  std::vector<int64_t> whole;  // whole[i]: PathCost(lengths[i])
  std::vector<int64_t> added;  // added[i]: PathCost(lengths[i]) - PathCost(lcp[i]) (added[0] whole)
};

SequenceCosts CostsOf(absl::Span<const int64_t> lengths, absl::Span<const int64_t> lcp,
                      const BalanceCost& cost) {
  SequenceCosts costs;
  for (size_t i = 0; i < lengths.size(); ++i) {
    costs.whole.push_back(cost.PathCost(lengths[i]));
    costs.added.push_back(costs.whole.back() - (i > 0 ? cost.PathCost(lcp[i]) : 0));
  }
  return costs;
}

// Number of groups the greedy scan needs when no group may cost more than `limit`; fills `bounds`
// with the cut when it is not null.
int64_t GreedyGroups(const SequenceCosts& costs, int64_t limit, std::vector<int64_t>* bounds) {
  const int64_t n = static_cast<int64_t>(costs.whole.size());
  if (bounds) bounds->assign({0});
  int64_t groups = 1;
  int64_t cost = costs.whole[0];
  for (int64_t i = 1; i < n; ++i) {
    if (cost + costs.added[i] > limit) {
      groups++;
      cost = costs.whole[i];
      if (bounds) bounds->push_back(i);
    } else {
      cost += costs.added[i];
    }
  }
  if (bounds) bounds->push_back(n);
  return groups;
}

// The cost of any contiguous range in O(1): the first sequence whole, then each next one beyond
// its LCP with the one before.
class RangeCosts {
 public:
  explicit RangeCosts(SequenceCosts costs)
      : costs_(std::move(costs)), added_before_(costs_.whole.size() + 1, 0) {
    for (size_t i = 0; i < costs_.whole.size(); ++i) {
      added_before_[i + 1] = added_before_[i] + costs_.added[i];
    }
  }
  int64_t operator()(int64_t begin, int64_t end) const {
    if (begin == end) return 0;
    return costs_.whole[begin] + added_before_[end] - added_before_[begin + 1];
  }
  const SequenceCosts& costs() const { return costs_; }

 private:
  SequenceCosts costs_;
  std::vector<int64_t> added_before_;
};

}  // namespace

absl::Status BalanceCost::Validate() const {
  if (per_token < 0 || per_key < 0 || (per_token == 0 && per_key == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a balance cost needs per_token and per_key >= 0, not both 0; got per_token ",
                     per_token, ", per_key ", per_key));
  }
  return absl::OkStatus();
}

absl::StatusOr<ContiguousCut> CutContiguous(absl::Span<const int64_t> lengths,
                                            absl::Span<const int64_t> lcp, int num_groups,
                                            const BalanceCost& cost) {
  RETURN_IF_ERROR(CheckGroups(num_groups));
  RETURN_IF_ERROR(cost.Validate());
  if (lengths.size() != lcp.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(lengths.size(), " lengths but ", lcp.size(), " LCPs"));
  }
  const int64_t n = static_cast<int64_t>(lengths.size());
  for (int64_t i = 0; i < n; ++i) {
    if (lengths[i] < 0)
      return absl::InvalidArgumentError(absl::StrCat("length ", i, " is negative"));
    if (i > 0 && (lcp[i] < 0 || lcp[i] > std::min(lengths[i - 1], lengths[i]))) {
      return absl::InvalidArgumentError(absl::StrCat("lcp ", i, " = ", lcp[i],
                                                     " is outside [0, min(", lengths[i - 1], ", ",
                                                     lengths[i], ")]"));
    }
  }

  ContiguousCut cut;
  if (n == 0) {
    cut.bounds.assign(num_groups + 1, 0);
    cut.cost.assign(num_groups, 0);
    cut.tree_tokens.assign(num_groups, 0);
    return cut;
  }
  // The batch's whole cost (every path whole, an upper bound of any group's) must fit in int64.
  long double bound = 0;
  for (const int64_t length : lengths) {
    const auto l = static_cast<long double>(length);
    bound += cost.per_token * l + cost.per_key * l * (l + 1) / 2;
  }
  if (bound >= 0x1p62L) {
    return absl::InvalidArgumentError(absl::StrCat("the batch's cost overflows at per_token ",
                                                   cost.per_token, ", per_key ", cost.per_key, " (",
                                                   n, " sequences): use coarser units"));
  }
  const RangeCosts range_cost(CostsOf(lengths, lcp, cost));
  const RangeCosts range_tokens(CostsOf(lengths, lcp, BalanceCost{}));
  // The answer lies between the costliest sequence (a group holds at least one) and everything.
  const std::vector<int64_t>& whole = range_cost.costs().whole;
  int64_t lo = *std::max_element(whole.begin(), whole.end());
  int64_t hi = range_cost(0, n);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (GreedyGroups(range_cost.costs(), mid, nullptr) <= num_groups) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  GreedyGroups(range_cost.costs(), lo, &cut.bounds);

  // Exactly num_groups groups: split the costliest splittable group at its most balanced point.
  // Both halves cost no more than the whole, so the optimum is kept.
  while (static_cast<int64_t>(cut.bounds.size()) - 1 < num_groups) {
    int64_t best = -1;
    int64_t best_cost = -1;
    for (size_t k = 0; k + 1 < cut.bounds.size(); ++k) {
      if (cut.bounds[k + 1] - cut.bounds[k] < 2) continue;
      const int64_t cost = range_cost(cut.bounds[k], cut.bounds[k + 1]);
      if (cost > best_cost) best = static_cast<int64_t>(k), best_cost = cost;
    }
    if (best < 0) {
      cut.bounds.push_back(n);  // every group is one sequence: the rest stay empty
      continue;
    }
    const int64_t begin = cut.bounds[best];
    const int64_t end = cut.bounds[best + 1];
    int64_t split = begin + 1;
    int64_t split_cost = std::max(range_cost(begin, split), range_cost(split, end));
    for (int64_t s = begin + 2; s < end; ++s) {
      const int64_t cost = std::max(range_cost(begin, s), range_cost(s, end));
      if (cost < split_cost) split = s, split_cost = cost;
    }
    cut.bounds.insert(cut.bounds.begin() + best + 1, split);
  }
  for (size_t k = 0; k + 1 < cut.bounds.size(); ++k) {
    cut.cost.push_back(range_cost(cut.bounds[k], cut.bounds[k + 1]));
    cut.tree_tokens.push_back(range_tokens(cut.bounds[k], cut.bounds[k + 1]));
  }
  return cut;
}

namespace {

// The summary fields of a partition whose groups, costs and tree tokens are set.
void Summarise(Partition& partition) {
  partition.max_cost =
      partition.cost.empty() ? 0 : *std::max_element(partition.cost.begin(), partition.cost.end());
  const int64_t tokens =
      std::accumulate(partition.tree_tokens.begin(), partition.tree_tokens.end(), int64_t{0});
  partition.extra_tokens = tokens - partition.combined_tree_tokens;
  const int64_t total = std::accumulate(partition.cost.begin(), partition.cost.end(), int64_t{0});
  const double mean = static_cast<double>(total) / std::max<size_t>(partition.cost.size(), 1);
  partition.imbalance = mean > 0 ? partition.max_cost / mean : 1.0;
}

}  // namespace

Partition DescribePartition(const PrefixTree& tree, std::vector<std::vector<RolloutIndex>> groups,
                            const BalanceCost& cost) {
  // A group's own tree: its rollouts in lexicographic order, each adding its path beyond the LCP
  // with the one before.
  std::vector<int32_t> rank(tree.num_rollouts());
  {
    const std::vector<RolloutIndex> order = LexicographicOrder(tree);
    for (int32_t i = 0; i < static_cast<int32_t>(order.size()); ++i) rank[order[i]] = i;
  }
  Partition partition;
  partition.groups = std::move(groups);
  partition.combined_tree_tokens = tree.num_tree_tokens();
  for (const auto& group : partition.groups) {
    std::vector<RolloutIndex> sorted = group;
    std::sort(sorted.begin(), sorted.end(),
              [&](RolloutIndex a, RolloutIndex b) { return rank[a] < rank[b]; });
    std::vector<int64_t> lengths, lcp;
    for (size_t i = 0; i < sorted.size(); ++i) {
      lengths.push_back(tree.rollout_length(sorted[i]));
      lcp.push_back(i > 0 ? tree.Lcp(sorted[i - 1], sorted[i]) : 0);
    }
    const RangeCosts group_cost(CostsOf(lengths, lcp, cost));
    const RangeCosts group_tokens(CostsOf(lengths, lcp, BalanceCost{}));
    const auto n = static_cast<int64_t>(sorted.size());
    partition.cost.push_back(group_cost(0, n));
    partition.tree_tokens.push_back(group_tokens(0, n));
  }
  Summarise(partition);
  return partition;
}

absl::StatusOr<Partition> PartitionDfsContiguous(const PrefixTree& tree, int num_groups,
                                                 const BalanceCost& cost) {
  return PartitionDfsContiguous(SortRollouts(tree), num_groups, cost);
}

absl::StatusOr<Partition> PartitionDfsContiguous(const SortedRollouts& sorted, int num_groups,
                                                 const BalanceCost& cost) {
  const std::vector<RolloutIndex>& order = sorted.order;
  absl::StatusOr<ContiguousCut> cut = CutContiguous(sorted.length, sorted.lcp, num_groups, cost);
  if (!cut.ok()) return cut.status();
  std::vector<std::vector<RolloutIndex>> groups(num_groups);
  for (int k = 0; k < num_groups; ++k) {
    groups[k].assign(order.begin() + cut->bounds[k], order.begin() + cut->bounds[k + 1]);
  }
  Partition partition;
  partition.groups = std::move(groups);
  partition.cost = std::move(cut->cost);
  partition.tree_tokens = std::move(cut->tree_tokens);
  partition.combined_tree_tokens = sorted.tree_tokens;
  Summarise(partition);
  return partition;
}

absl::StatusOr<Partition> PartitionGreedyByRolloutTokens(const PrefixTree& tree, int num_groups,
                                                         const BalanceCost& cost) {
  RETURN_IF_ERROR(CheckGroups(num_groups));
  RETURN_IF_ERROR(cost.Validate());
  std::vector<std::vector<RolloutIndex>> groups(num_groups);
  std::vector<int64_t> load(num_groups, 0);
  for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
    const int k = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    groups[k].push_back(r);
    load[k] += tree.rollout_length(r);
  }
  return DescribePartition(tree, std::move(groups), cost);
}

absl::StatusOr<Partition> PartitionGreedyByTreeTokens(const PrefixTree& tree, int num_groups,
                                                      const BalanceCost& cost) {
  RETURN_IF_ERROR(CheckGroups(num_groups));
  RETURN_IF_ERROR(cost.Validate());
  std::vector<std::vector<RolloutIndex>> groups(num_groups);
  std::vector<PrefixTreeBuilder> trees(num_groups);
  for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
    int k = 0;
    for (int j = 1; j < num_groups; ++j) {
      if (trees[j].num_tree_tokens() < trees[k].num_tree_tokens()) k = j;
    }
    groups[k].push_back(r);
    // The tree's rollouts are valid (non-empty, non-negative), so this cannot fail.
    (void)trees[k].AddRollout(tree.RolloutTokens(r));
  }
  return DescribePartition(tree, std::move(groups), cost);
}

}  // namespace dta
