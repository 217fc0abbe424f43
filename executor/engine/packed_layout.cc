#include "executor/engine/packed_layout.h"

namespace dta::engine {

PackedLayout MakePackedLayout(const PrefixTree& tree, int64_t offset) {
  const int64_t n = tree.num_tree_tokens();
  PackedLayout layout;
  layout.tokens.resize(n);
  layout.positions.resize(n);
  layout.key_end.resize(n);
  layout.previous.resize(n);
  for (NodeId v = 1; v < tree.num_nodes(); ++v) {
    const int64_t first = tree.token_offset(v);
    const NodeId parent = tree.parent(v);
    const int64_t subtree_end = tree.token_offset(tree.subtree_end(v));
    for (int64_t o = 0; o < tree.length(v); ++o) {
      layout.tokens[first + o] = tree.serialized_tokens()[first + o];
      layout.positions[first + o] = offset + tree.depth(v) + o;
      layout.key_end[first + o] = subtree_end;
      layout.previous[first + o] =
          o > 0 ? first + o - 1 : (parent == kRootNode ? -1 : tree.token_offset(parent) + tree.length(parent) - 1);
    }
  }
  layout.paths.resize(tree.num_rollouts());
  for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
    std::vector<int64_t>& path = layout.paths[r];
    path.resize(tree.rollout_length(r));
    for (NodeId v = tree.end_node(r); v != kRootNode; v = tree.parent(v)) {
      for (int64_t o = 0; o < tree.length(v); ++o) path[tree.depth(v) + o] = tree.token_offset(v) + o;
    }
  }
  return layout;
}

}  // namespace dta::engine
