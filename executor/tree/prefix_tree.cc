#include "executor/tree/prefix_tree.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dta {

PrefixTreeBuilder::PrefixTreeBuilder() {
  nodes_.push_back(Node{.begin = 0, .length = 0, .depth = 0, .parent = kNoNode, .through = 0});
}

absl::StatusOr<int64_t> PrefixTreeBuilder::AddRollout(absl::Span<const TokenId> tokens) {
  if (tokens.empty()) {
    return absl::InvalidArgumentError("rollout has no tokens");
  }
  // Validate before touching the trie so a rejected rollout leaves no trace.
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", i, " has negative id ", tokens[i]));
    }
  }
  if (rollout_end_.size() >= static_cast<size_t>(std::numeric_limits<RolloutIndex>::max())) {
    return absl::ResourceExhaustedError("more than 2^31 - 1 rollouts in one tree");
  }

  const int64_t n = static_cast<int64_t>(tokens.size());
  NodeId node = kRootNode;
  nodes_[kRootNode].through++;
  int64_t pos = 0;
  int64_t added = 0;
  while (pos < n) {
    auto it = child_of_.find(ChildKey(node, tokens[pos]));
    if (it == child_of_.end()) {
      // Nothing shares the rest: it becomes one new leaf segment.
      const NodeId leaf = static_cast<NodeId>(nodes_.size());
      nodes_.push_back(Node{.begin = static_cast<int64_t>(arena_.size()),
                            .length = n - pos,
                            .depth = pos,
                            .parent = node,
                            .through = 1});
      arena_.insert(arena_.end(), tokens.begin() + pos, tokens.end());
      child_of_.emplace(ChildKey(node, tokens[pos]), leaf);
      added = n - pos;
      node = leaf;
      break;
    }
    const NodeId child = it->second;
    const int64_t begin = nodes_[child].begin;
    const int64_t length = nodes_[child].length;
    const int64_t limit = std::min(length, n - pos);
    const TokenId* segment = arena_.data() + begin;
    const TokenId* query = tokens.data() + pos;
    const int64_t matched = std::mismatch(segment, segment + limit, query).first - segment;
    if (matched < length) {
      // Split: a new upper node takes the matched part; the child keeps its id for the lower
      // part, so its own children and the rollouts ending at it stay valid untouched.
      const NodeId upper = static_cast<NodeId>(nodes_.size());
      Node& lower = nodes_[child];
      nodes_.push_back(Node{.begin = begin,
                            .length = matched,
                            .depth = lower.depth,
                            .parent = lower.parent,
                            .through = lower.through});
      it->second = upper;  // same key: (parent, first token) is unchanged
      Node& lower_after = nodes_[child];  // push_back may have moved the vector
      lower_after.begin += matched;
      lower_after.length -= matched;
      lower_after.depth += matched;
      lower_after.parent = upper;
      child_of_.emplace(ChildKey(upper, arena_[lower_after.begin]), child);
      node = upper;
    } else {
      node = child;
    }
    nodes_[node].through++;
    pos += matched;
  }
  rollout_end_.push_back(node);
  num_rollout_tokens_ += n;
  return added;
}

PrefixTree PrefixTreeBuilder::Build() && {
  const int32_t num_nodes = static_cast<int32_t>(nodes_.size());

  // Children of every node, grouped by parent (counting sort), then each group sorted by its
  // first token so that preorder is lexicographic.
  std::vector<int32_t> child_count(num_nodes + 1, 0);
  for (NodeId v = 1; v < num_nodes; ++v) child_count[nodes_[v].parent + 1]++;
  for (int32_t v = 0; v < num_nodes; ++v) child_count[v + 1] += child_count[v];
  std::vector<NodeId> children(num_nodes > 0 ? num_nodes - 1 : 0);
  {
    std::vector<int32_t> fill(child_count.begin(), child_count.end() - 1);
    for (NodeId v = 1; v < num_nodes; ++v) children[fill[nodes_[v].parent]++] = v;
  }
  for (NodeId v = 0; v < num_nodes; ++v) {
    std::sort(children.begin() + child_count[v], children.begin() + child_count[v + 1],
              [&](NodeId a, NodeId b) { return arena_[nodes_[a].begin] < arena_[nodes_[b].begin]; });
  }

  // Iterative preorder: old id -> new id.
  std::vector<NodeId> new_id(num_nodes);
  std::vector<NodeId> preorder;
  preorder.reserve(num_nodes);
  {
    std::vector<NodeId> stack = {kRootNode};
    while (!stack.empty()) {
      const NodeId v = stack.back();
      stack.pop_back();
      new_id[v] = static_cast<NodeId>(preorder.size());
      preorder.push_back(v);
      // Push in reverse so the smallest first token is visited first.
      for (int32_t i = child_count[v + 1] - 1; i >= child_count[v]; --i) stack.push_back(children[i]);
    }
  }

  PrefixTree tree;
  tree.parent_.resize(num_nodes);
  tree.depth_.resize(num_nodes);
  tree.level_.resize(num_nodes);
  tree.token_offset_.resize(num_nodes + 1);
  tree.through_.resize(num_nodes);
  tree.tokens_.reserve(arena_.size());
  tree.child_offset_.resize(num_nodes + 1);
  tree.children_.resize(children.size());
  tree.token_offset_[0] = 0;
  tree.child_offset_[0] = 0;
  for (NodeId id = 0; id < num_nodes; ++id) {
    const NodeId old = preorder[id];
    const Node& node = nodes_[old];
    tree.parent_[id] = node.parent == kNoNode ? kNoNode : new_id[node.parent];
    tree.depth_[id] = node.depth;
    tree.level_[id] = id == kRootNode ? 0 : tree.level_[tree.parent_[id]] + 1;
    tree.through_[id] = node.through;
    tree.tokens_.insert(tree.tokens_.end(), arena_.begin() + node.begin,
                        arena_.begin() + node.begin + node.length);
    tree.token_offset_[id + 1] = static_cast<int64_t>(tree.tokens_.size());
    const int32_t first = child_count[old];
    const int32_t count = child_count[old + 1] - first;
    tree.child_offset_[id + 1] = tree.child_offset_[id] + count;
    for (int32_t i = 0; i < count; ++i) {
      tree.children_[tree.child_offset_[id] + i] = new_id[children[first + i]];
    }
  }

  // In preorder a subtree ends where the next node that is not a descendant starts; children have
  // larger ids, so one reverse pass computes it bottom-up.
  tree.subtree_end_.resize(num_nodes);
  for (NodeId id = num_nodes - 1; id >= 0; --id) {
    const auto kids = tree.children(id);
    tree.subtree_end_[id] = kids.empty() ? id + 1 : tree.subtree_end_[kids.back()];
  }

  // Rollouts ending at each node, in index order (counting sort is stable).
  const int32_t num_rollouts = static_cast<int32_t>(rollout_end_.size());
  tree.end_node_.resize(num_rollouts);
  tree.ending_offset_.assign(num_nodes + 1, 0);
  for (RolloutIndex r = 0; r < num_rollouts; ++r) {
    tree.end_node_[r] = new_id[rollout_end_[r]];
    tree.ending_offset_[tree.end_node_[r] + 1]++;
  }
  for (int32_t v = 0; v < num_nodes; ++v) tree.ending_offset_[v + 1] += tree.ending_offset_[v];
  tree.ending_.resize(num_rollouts);
  {
    std::vector<int32_t> fill(tree.ending_offset_.begin(), tree.ending_offset_.end() - 1);
    for (RolloutIndex r = 0; r < num_rollouts; ++r) tree.ending_[fill[tree.end_node_[r]]++] = r;
  }
  tree.num_rollout_tokens_ = num_rollout_tokens_;

  // Leave the builder empty but valid.
  *this = PrefixTreeBuilder();
  return tree;
}

absl::StatusOr<PrefixTree> PrefixTree::FromRollouts(absl::Span<const std::vector<TokenId>> rollouts) {
  PrefixTreeBuilder builder;
  for (size_t r = 0; r < rollouts.size(); ++r) {
    if (auto added = builder.AddRollout(rollouts[r]); !added.ok()) {
      return absl::Status(added.status().code(),
                          absl::StrCat("rollout ", r, ": ", added.status().message()));
    }
  }
  return std::move(builder).Build();
}

NodeId PrefixTree::Lca(NodeId a, NodeId b) const {
  while (!IsAncestorOrSelf(a, b)) a = parent_[a];
  return a;
}

NodeId PrefixTree::NodeAt(RolloutIndex r, int64_t position) const {
  NodeId node = end_node_[r];
  while (depth_[node] > position) node = parent_[node];
  return node;
}

std::vector<TokenId> PrefixTree::RolloutTokens(RolloutIndex r) const {
  std::vector<TokenId> tokens(rollout_length(r));
  for (NodeId v = end_node_[r]; v != kRootNode; v = parent_[v]) {
    const auto piece = segment(v);
    std::copy(piece.begin(), piece.end(), tokens.begin() + depth_[v]);
  }
  return tokens;
}

}  // namespace dta
