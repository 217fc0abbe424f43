// Tree Training's Tree Partitioning (arXiv:2511.00413, Section 3.2 and Appendix A): when a batch's
// prefix tree is too large for one packed forward, split its rollouts into batches whose own prefix
// trees each hold at most `capacity` unique tokens, keeping as much prefix sharing as possible.
//
// Cost model: a batch is trained as one packed forward of its own prefix tree, so it costs that
// tree's unique tokens; a partition costs the sum over its batches (total_tokens). The whole tree
// (tree_tokens) is the ideal and every distinct leaf sequence on its own (flattened_tokens) is
// Tree Training's baseline. The paper's metrics follow: POR = 1 - tree / flattened (the redundancy
// a partition can remove at best) and ERR (the share of it that the partition does remove).
//
// Only leaves (distinct leaf sequences) decide the cost: a rollout that ends at an internal node is
// a prefix of every leaf below it and duplicates end at the same node, so both are placed, for
// free, in a batch that holds a leaf below (or at) their end node. Partitioning the leaves is
// NP-hard in general (it contains bin packing), hence a greedy for real trees and an exhaustive
// optimum for small ones (ground truth for tests).
//
// Example (tokens abbreviated): A = 19 shared tokens, then two branches of 12 tokens, each with two
// 10-token leaves; tree 83, flattened 164 (POR 0.49). With capacity 64 the partition is one batch
// per branch, 51 + 51 = 102 tokens, ERR (164 - 102) / (164 - 83) = 0.77: Figure 5 of the paper.
//
// All functions are pure and thread-compatible.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/tree/prefix_tree.h"

namespace dta {

// A set of rollouts trained in one packed forward: their own prefix tree has `tokens` unique
// tokens, at most the capacity.
struct TreeBatch {
  std::vector<RolloutIndex> rollouts;  // in lexicographic order (as LexicographicOrder)
  int64_t tokens = 0;
};

struct TreePartition {
  // Ordered by their first rollout in lexicographic order. Never empty batches.
  std::vector<TreeBatch> batches;
  int64_t total_tokens = 0;  // sum of batch tokens (what packed training computes)
  int64_t tree_tokens = 0;   // the whole tree's unique tokens (the ideal)
  int64_t flattened_tokens =
      0;  // Tree Training's baseline: every leaf path (distinct leaf sequence) on its own
  // ERR: the fraction of the redundant tokens (flattened - tree) that the partition eliminates,
  // (flattened - total) / (flattened - tree); 1 when nothing is redundant.
  double effective_reuse_ratio = 1;
};

// Tree Training's greedy heuristic, in its bin-packing form (Appendix A's multi-path DP with the
// exact bin packing replaced by best-fit decreasing). Bottom-up, every node packs the partial
// batches coming from its children: merging two partial batches at node v saves v's root path
// (end_depth(v) tokens), so deep merges, which save the most, are made first; at each node the
// largest partial batches (the deepest leaves) are placed first, each into the fullest partial
// batch it still fits with (which groups leaves of similar depths), and a partial batch that fits
// nowhere starts a new batch. The result is then compared with the best cut of a DFS leaf order
// (children deepest first) into contiguous batches, the paper's "new traversal whenever the
// accumulated length exceeds the capacity" made optimal by a linear DP, and the cheaper of the two
// is returned.
//
// Guarantees: every rollout is in exactly one batch; every batch's tokens are exact and within
// capacity; total_tokens <= flattened_tokens (never worse than one leaf sequence per batch); one
// batch holding the whole tree (ERR 1) whenever tree_tokens <= capacity (and there are rollouts).
// Quality, measured against PartitionTreeExact on random and prompt-shaped trees of up to 16
// leaves: within 0.3% on average and optimal in over 95% of cases; the worst case seen is 36% above
// the optimum (a shared prompt paid by one batch too many).
// INVALID_ARGUMENT if capacity < 1 or capacity < the longest rollout (it fits in no batch).
// O(N log N + R + L log^2 L + B) for N nodes, R rollouts, L leaves and B the nodes of the batches'
// own trees (counting their exact tokens; at most total_tokens).
absl::StatusOr<TreePartition> PartitionTreeGreedy(const PrefixTree& tree, int64_t capacity);

// The exact optimum: the minimum total_tokens over all partitions of the rollouts into batches each
// within capacity, by a DP over subsets of the leaves (O(3^L) time, O(2^L) memory); among optimal
// partitions, one with the fewest batches.
// Errors as PartitionTreeGreedy, then FAILED_PRECONDITION above 16 distinct leaf sequences.
absl::StatusOr<TreePartition> PartitionTreeExact(const PrefixTree& tree, int64_t capacity);

}  // namespace dta
