#include "core/tree/leaf_order.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace dta {

std::vector<RolloutIndex> LexicographicOrder(const PrefixTree& tree) {
  // Node ids are a lexicographic preorder, and a node's own rollouts precede its descendants'.
  std::vector<RolloutIndex> order;
  order.reserve(tree.num_rollouts());
  for (NodeId v = 0; v < tree.num_nodes(); ++v) {
    const auto ending = tree.rollouts_ending_at(v);
    order.insert(order.end(), ending.begin(), ending.end());
  }
  return order;
}

std::vector<RolloutIndex> BackwardDfsOrder(const PrefixTree& tree) {
  const int32_t num_nodes = tree.num_nodes();
  // Bottom-up (children have larger ids): tail and the sorted child order of every node.
  std::vector<int64_t> tail(num_nodes);
  std::vector<NodeId> sorted_children(tree.num_nodes() > 0 ? num_nodes - 1 : 0);
  std::vector<int32_t> offset(num_nodes + 1, 0);
  for (NodeId v = 0; v < num_nodes; ++v) {
    offset[v + 1] = offset[v] + static_cast<int32_t>(tree.children(v).size());
  }
  for (NodeId v = num_nodes - 1; v >= 0; --v) {
    const auto kids = tree.children(v);
    if (kids.empty()) {
      tail[v] = tree.end_depth(v);
      continue;
    }
    auto first = sorted_children.begin() + offset[v];
    std::copy(kids.begin(), kids.end(), first);
    std::sort(first, first + kids.size(), [&](NodeId a, NodeId b) {
      return std::make_tuple(!tree.is_leaf(a), tail[a], a) <
             std::make_tuple(!tree.is_leaf(b), tail[b], b);
    });
    tail[v] = tail[*first];
  }

  // DFS under that child order, emitting each node's rollouts on entry; then reverse.
  std::vector<RolloutIndex> order;
  order.reserve(tree.num_rollouts());
  std::vector<NodeId> stack = {kRootNode};
  while (!stack.empty()) {
    const NodeId v = stack.back();
    stack.pop_back();
    const auto ending = tree.rollouts_ending_at(v);
    // Reversed below, so emit equal rollouts in decreasing index order to end up increasing.
    order.insert(order.end(), ending.rbegin(), ending.rend());
    for (int32_t i = offset[v + 1] - 1; i >= offset[v]; --i) stack.push_back(sorted_children[i]);
  }
  std::reverse(order.begin(), order.end());
  return order;
}

absl::Status CheckDfsLeafOrder(const PrefixTree& tree, absl::Span<const RolloutIndex> order) {
  const int32_t n = tree.num_rollouts();
  if (static_cast<int64_t>(order.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("order has ", order.size(), " rollouts, the tree has ", n));
  }
  std::vector<int32_t> seen(n, 0);
  for (RolloutIndex r : order) {
    if (r < 0 || r >= n)
      return absl::InvalidArgumentError(absl::StrCat("rollout ", r, " is out of range"));
    if (seen[r]++) return absl::InvalidArgumentError(absl::StrCat("rollout ", r, " appears twice"));
  }
  // Contiguity: the positions of the rollouts through node v span exactly through(v) slots. The
  // first and last positions are propagated bottom-up.
  const int32_t num_nodes = tree.num_nodes();
  std::vector<int32_t> first(num_nodes, n), last(num_nodes, -1);
  for (int32_t i = 0; i < n; ++i) {
    const NodeId v = tree.end_node(order[i]);
    first[v] = std::min(first[v], i);
    last[v] = std::max(last[v], i);
  }
  for (NodeId v = num_nodes - 1; v > 0; --v) {
    const NodeId p = tree.parent(v);
    first[p] = std::min(first[p], first[v]);
    last[p] = std::max(last[p], last[v]);
  }
  for (NodeId v = 1; v < num_nodes; ++v) {
    if (last[v] - first[v] + 1 != tree.num_rollouts_through(v)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "not a DFS leaf order: the ", tree.num_rollouts_through(v), " rollouts through node ", v,
          " (depth ", tree.depth(v), ") are spread over positions ", first[v], "..", last[v]));
    }
  }
  return absl::OkStatus();
}

std::vector<int64_t> ConsecutiveLcps(const PrefixTree& tree, absl::Span<const RolloutIndex> order) {
  std::vector<int64_t> lcp(order.size(), 0);
  for (size_t i = 1; i < order.size(); ++i) lcp[i] = tree.Lcp(order[i - 1], order[i]);
  return lcp;
}

SortedRollouts SortRollouts(const PrefixTree& tree) {
  SortedRollouts sorted;
  sorted.order = LexicographicOrder(tree);
  sorted.lcp = ConsecutiveLcps(tree, sorted.order);
  sorted.length.reserve(sorted.order.size());
  for (RolloutIndex r : sorted.order) sorted.length.push_back(tree.rollout_length(r));
  sorted.tree_tokens = tree.num_tree_tokens();
  return sorted;
}

}  // namespace dta
