#include "core/tree/tree_stats.h"

#include <algorithm>

namespace dta {
namespace {

// Sum of (k + 1) for k in [begin, end): the attention context of positions begin..end-1.
double ContextSum(int64_t begin, int64_t end) {
  const double b = static_cast<double>(begin);
  const double e = static_cast<double>(end);
  return (e * (e + 1) - b * (b + 1)) / 2;
}

}  // namespace

TreeStats ComputeTreeStats(const PrefixTree& tree) {
  TreeStats stats;
  stats.num_rollouts = tree.num_rollouts();
  stats.num_nodes = tree.num_nodes() - 1;
  stats.rollout_tokens = tree.num_rollout_tokens();
  stats.tree_tokens = tree.num_tree_tokens();
  for (NodeId v = 0; v < tree.num_nodes(); ++v) {
    const auto ending = tree.rollouts_ending_at(v);
    if (tree.is_leaf(v)) {
      if (v != kRootNode) {
        stats.num_leaves++;
        stats.leaf_tokens += tree.end_depth(v);
      }
    } else {
      stats.num_prefix_rollouts += static_cast<int32_t>(ending.size());
    }
    if (!ending.empty()) stats.num_duplicate_rollouts += static_cast<int32_t>(ending.size()) - 1;
    stats.longest_rollout = std::max(stats.longest_rollout, tree.end_depth(v));
    stats.max_children =
        std::max(stats.max_children, static_cast<int32_t>(tree.children(v).size()));
    stats.max_level = std::max(stats.max_level, tree.level(v));
    stats.tree_attention_work += ContextSum(tree.depth(v), tree.end_depth(v));
  }
  for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
    stats.dense_attention_work += ContextSum(0, tree.rollout_length(r));
  }
  if (stats.tree_tokens > 0) {
    stats.compression = static_cast<double>(stats.rollout_tokens) / stats.tree_tokens;
    stats.prefix_sharing = 1.0 - 1.0 / stats.compression;
    stats.leaf_compression = static_cast<double>(stats.leaf_tokens) / stats.tree_tokens;
    stats.potential_overlap_ratio =
        1.0 - static_cast<double>(stats.tree_tokens) / stats.leaf_tokens;
    stats.attention_compression = stats.dense_attention_work / stats.tree_attention_work;
  }
  return stats;
}

}  // namespace dta
