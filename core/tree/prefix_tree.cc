#include "core/tree/prefix_tree.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dta {

PrefixTreeBuilder::PrefixTreeBuilder(TokenStorage storage) : storage_(storage) {
  nodes_.push_back(
      Node{.tokens = nullptr, .length = 0, .depth = 0, .parent = kNoNode, .through = 0});
}

absl::StatusOr<int64_t> PrefixTreeBuilder::AddRollout(absl::Span<const TokenId> tokens) {
  if (tokens.empty()) {
    return absl::InvalidArgumentError("rollout has no tokens");
  }
  if (rollout_end_.size() >= static_cast<size_t>(std::numeric_limits<RolloutIndex>::max())) {
    return absl::ResourceExhaustedError("more than 2^31 - 1 rollouts in one tree");
  }

  // Walk down without touching the trie, to where the rollout leaves it: after `node`, either no
  // child continues it, or `partial` does for `matched` tokens and then differs (or it ends).
  const int64_t n = static_cast<int64_t>(tokens.size());
  NodeId node = kRootNode;
  int64_t pos = 0;
  NodeId partial = kNoNode;
  int64_t matched = 0;
  while (pos < n) {
    const auto it = child_of_.find(ChildKey(node, tokens[pos]));
    if (it == child_of_.end()) break;
    const Node& child = nodes_[it->second];
    const int64_t limit = std::min(child.length, n - pos);
    const int64_t same =
        std::mismatch(child.tokens, child.tokens + limit, tokens.data() + pos).first - child.tokens;
    if (same < child.length) {
      partial = it->second;
      matched = same;
      break;
    }
    node = it->second;
    pos += same;
  }
  // The shared tokens equal tokens checked when they were added; only the new ones need a check,
  // and it comes before any change so that a rejected rollout leaves no trace.
  const int64_t shared = pos + matched;
  for (int64_t i = shared; i < n; ++i) {
    if (tokens[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("token ", i, " has negative id ", tokens[i]));
    }
  }

  if (partial != kNoNode) {
    // Split: a new upper node takes the matched part; the child keeps its id for the lower part,
    // so its own children and the rollouts ending at it stay valid untouched.
    const NodeId upper = static_cast<NodeId>(nodes_.size());
    const Node lower = nodes_[partial];
    nodes_.push_back(Node{.tokens = lower.tokens,
                          .length = matched,
                          .depth = lower.depth,
                          .parent = lower.parent,
                          .through = lower.through});
    child_of_[ChildKey(lower.parent, lower.tokens[0])] = upper;  // same key: (parent, first token)
    Node& rest = nodes_[partial];
    rest.tokens += matched;
    rest.length -= matched;
    rest.depth += matched;
    rest.parent = upper;
    child_of_.emplace(ChildKey(upper, rest.tokens[0]), partial);
    node = upper;
  }
  if (shared < n) {
    // Nothing shares the rest: it becomes one new leaf segment.
    const TokenId* stored = tokens.data() + shared;
    if (storage_ == TokenStorage::kCopy) {
      owned_.push_back(std::make_unique_for_overwrite<TokenId[]>(n - shared));
      std::copy(tokens.begin() + shared, tokens.end(), owned_.back().get());
      stored = owned_.back().get();
    }
    const NodeId leaf = static_cast<NodeId>(nodes_.size());
    nodes_.push_back(Node{
        .tokens = stored, .length = n - shared, .depth = shared, .parent = node, .through = 0});
    child_of_.emplace(ChildKey(node, tokens[shared]), leaf);
    node = leaf;
  }
  for (NodeId v = node; v != kNoNode; v = nodes_[v].parent) nodes_[v].through++;
  rollout_end_.push_back(node);
  num_rollout_tokens_ += n;
  num_tree_tokens_ += n - shared;
  return n - shared;
}

PrefixTreeBuilder::ChildLists PrefixTreeBuilder::SortedChildren() const {
  // Children grouped by parent (counting sort), then each group sorted by its first token so that
  // preorder is lexicographic.
  const int32_t num_nodes = static_cast<int32_t>(nodes_.size());
  ChildLists lists;
  lists.offset.assign(num_nodes + 1, 0);
  for (NodeId v = 1; v < num_nodes; ++v) lists.offset[nodes_[v].parent + 1]++;
  for (int32_t v = 0; v < num_nodes; ++v) lists.offset[v + 1] += lists.offset[v];
  lists.children.resize(num_nodes - 1);
  std::vector<int32_t> fill(lists.offset.begin(), lists.offset.end() - 1);
  for (NodeId v = 1; v < num_nodes; ++v) lists.children[fill[nodes_[v].parent]++] = v;
  for (NodeId v = 0; v < num_nodes; ++v) {
    std::sort(lists.children.begin() + lists.offset[v],
              lists.children.begin() + lists.offset[v + 1],
              [&](NodeId a, NodeId b) { return nodes_[a].tokens[0] < nodes_[b].tokens[0]; });
  }
  return lists;
}

std::vector<NodeId> PrefixTreeBuilder::Preorder(const ChildLists& lists) const {
  std::vector<NodeId> preorder;
  preorder.reserve(nodes_.size());
  std::vector<NodeId> stack = {kRootNode};
  while (!stack.empty()) {
    const NodeId v = stack.back();
    stack.pop_back();
    preorder.push_back(v);
    // Push in reverse so the smallest first token is visited first.
    for (int32_t i = lists.offset[v + 1] - 1; i >= lists.offset[v]; --i)
      stack.push_back(lists.children[i]);
  }
  return preorder;
}

SortedRollouts PrefixTreeBuilder::SortRollouts() const {
  const int32_t num_nodes = static_cast<int32_t>(nodes_.size());
  const int32_t num_rollouts = static_cast<int32_t>(rollout_end_.size());
  // Rollouts ending at each node, in index order (counting sort is stable).
  std::vector<int32_t> ending_offset(num_nodes + 1, 0);
  for (NodeId end : rollout_end_) ending_offset[end + 1]++;
  for (int32_t v = 0; v < num_nodes; ++v) ending_offset[v + 1] += ending_offset[v];
  std::vector<RolloutIndex> ending(num_rollouts);
  {
    std::vector<int32_t> fill(ending_offset.begin(), ending_offset.end() - 1);
    for (RolloutIndex r = 0; r < num_rollouts; ++r) ending[fill[rollout_end_[r]]++] = r;
  }
  // In preorder, the LCP of two consecutive rollouts is the shallowest depth at which a node was
  // entered between them (where the second one's path left the first one's), or the first one's
  // length if none was (a duplicate or an extension of it).
  SortedRollouts sorted;
  sorted.order.reserve(num_rollouts);
  sorted.length.reserve(num_rollouts);
  sorted.lcp.reserve(num_rollouts);
  sorted.tree_tokens = num_tree_tokens_;
  int64_t shallowest = std::numeric_limits<int64_t>::max();
  for (NodeId v : Preorder(SortedChildren())) {
    const Node& node = nodes_[v];
    shallowest = std::min(shallowest, node.depth);
    for (int32_t i = ending_offset[v]; i < ending_offset[v + 1]; ++i) {
      const int64_t length = node.depth + node.length;
      sorted.lcp.push_back(sorted.order.empty() ? 0 : std::min(shallowest, length));
      sorted.order.push_back(ending[i]);
      sorted.length.push_back(length);
      shallowest = std::numeric_limits<int64_t>::max();
    }
  }
  return sorted;
}

PrefixTree PrefixTreeBuilder::Build() && {
  const int32_t num_nodes = static_cast<int32_t>(nodes_.size());
  const ChildLists lists = SortedChildren();
  const std::vector<NodeId> preorder = Preorder(lists);
  std::vector<NodeId> new_id(num_nodes);  // old id -> preorder id
  for (NodeId id = 0; id < num_nodes; ++id) new_id[preorder[id]] = id;
  const std::vector<int32_t>& child_count = lists.offset;
  const std::vector<NodeId>& children = lists.children;

  PrefixTree tree;
  tree.parent_.resize(num_nodes);
  tree.depth_.resize(num_nodes);
  tree.level_.resize(num_nodes);
  tree.token_offset_.resize(num_nodes + 1);
  tree.through_.resize(num_nodes);
  tree.tokens_.reserve(num_tree_tokens_);
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
    tree.tokens_.insert(tree.tokens_.end(), node.tokens, node.tokens + node.length);
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
  *this = PrefixTreeBuilder(storage_);
  return tree;
}

absl::StatusOr<PrefixTree> PrefixTree::FromRollouts(
    absl::Span<const std::vector<TokenId>> rollouts) {
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
