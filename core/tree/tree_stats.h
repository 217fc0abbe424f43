// How much a batch of rollouts shares, in the papers' terms.
#pragma once

#include <cstdint>

#include "core/tree/prefix_tree.h"

namespace dta {

struct TreeStats {
  int32_t num_rollouts = 0;
  // Nodes excluding the root; leaves are nodes without children.
  int32_t num_nodes = 0;
  int32_t num_leaves = 0;
  // Rollouts that end at an internal node (a prefix of another rollout).
  int32_t num_prefix_rollouts = 0;
  // Rollouts equal to a rollout with a smaller index.
  int32_t num_duplicate_rollouts = 0;
  int64_t rollout_tokens = 0;  // every rollout's length, summed
  int64_t tree_tokens = 0;     // unique tokens
  // Tokens of the distinct leaf sequences: rollouts that are prefixes of others (duplicates
  // included) collapsed into the leaf they lead to.
  int64_t leaf_tokens = 0;
  int64_t longest_rollout = 0;  // the longest root-to-leaf path, in tokens
  int32_t max_children = 0;     // the widest branch
  int32_t max_level = 0;        // the deepest leaf, in nodes

  // C = rollout tokens / tree tokens (AReaL-DTA).
  double compression = 0;
  // S = 1 - 1/C: the fraction of rollout tokens that are shared.
  double prefix_sharing = 0;
  // Leaf-only C = leaf tokens / tree tokens (AReaL-DTA's 5.56x for tau2-bench).
  double leaf_compression = 0;
  // POR = 1 - tree tokens / leaf tokens (Tree Training: the overlap among root-to-leaf paths).
  double potential_overlap_ratio = 0;
  // Attention work: the sum over tokens of their context length (position + 1), for every
  // rollout on its own (dense) and for each unique token once (tree), and their ratio C_attn.
  double dense_attention_work = 0;
  double tree_attention_work = 0;
  double attention_compression = 0;
};

// O(nodes + rollouts).
TreeStats ComputeTreeStats(const PrefixTree& tree);

}  // namespace dta
