// Orders in which the push/pop executor visits rollouts. Each is a DFS leaf order: the rollouts
// through any node are contiguous in it, so once the traversal leaves a node it never returns and
// the node's tokens can be backpropagated and popped.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/tree/prefix_tree.h"

namespace dta {

// Lexicographic order of the rollouts' token sequences (AReaL-DTA Algorithm 4's pi): a prefix
// comes before its extensions, equal rollouts by index. O(nodes + rollouts).
std::vector<RolloutIndex> LexicographicOrder(const PrefixTree& tree);

// AReaL-DTA Algorithm 1: children ordered by (is internal, tail) with leaf children first and
// smaller tails first, where tail(leaf) = its end depth and tail(internal) = the tail of its first
// child; the DFS leaf order under that child order, reversed. Rollouts that end at an internal node
// are emitted when the DFS enters that node, so after the reversal they follow their extensions.
// O(nodes log children + rollouts).
std::vector<RolloutIndex> BackwardDfsOrder(const PrefixTree& tree);

// OK if `order` is a permutation of the tree's rollouts in which the rollouts through every node
// are contiguous; INVALID_ARGUMENT naming the first offending rollout or node otherwise.
absl::Status CheckDfsLeafOrder(const PrefixTree& tree, absl::Span<const RolloutIndex> order);

// lcp[i] = LCP(order[i - 1], order[i]) for i > 0, and lcp[0] = 0. For a DFS leaf order the total
// cost is O(nodes + rollouts): consecutive rollouts' LCAs are found by walking up the tree.
std::vector<int64_t> ConsecutiveLcps(const PrefixTree& tree, absl::Span<const RolloutIndex> order);

// The lexicographic order with its lengths and consecutive LCPs (what
// PrefixTreeBuilder::SortRollouts gives without building the tree). O(nodes + rollouts).
SortedRollouts SortRollouts(const PrefixTree& tree);

}  // namespace dta
