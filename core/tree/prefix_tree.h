// The prefix tree (radix trie) of a batch of rollouts: every token shared by several rollouts is
// stored, and later computed, once.
//
// A tree is built incrementally with PrefixTreeBuilder (rollouts can arrive one at a time, as
// from a stream) and then frozen into an immutable PrefixTree whose nodes are numbered in
// lexicographic DFS preorder. That numbering gives three properties the rest of the system uses:
//   * a node's subtree is the contiguous id range [v, subtree_end(v));
//   * visiting nodes in id order is a lexicographic DFS, and the nodes' token segments laid end to
//     end in that order are the DFS serialization of Tree Training (serialized_tokens());
//   * parents have smaller ids than their children, so bottom-up passes are a reverse loop.
//
// Rollouts are first-class whatever their shape: duplicates end at the same node, and a rollout
// that is a prefix of another ends at an internal node (the builder splits segments so that every
// rollout ends exactly at a node boundary). The root is an empty node (depth 0, no tokens).
//
// Example:
//   PrefixTreeBuilder builder;
//   builder.AddRollout({1, 2, 3});   // rollout 0
//   builder.AddRollout({1, 2, 4});   // rollout 1: shares {1, 2}
//   builder.AddRollout({1, 2});      // rollout 2: a prefix of both, ends at the {1, 2} node
//   PrefixTree tree = std::move(builder).Build();
//   tree.num_tree_tokens();          // 4: {1, 2}, {3}, {4}
//
// Thread safety: PrefixTree is immutable and safe to share across threads; the builder is not.
// Both are movable, not copyable. Everything is iterative: no recursion, no stack-depth limit.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/base/ids.h"

namespace dta {

class PrefixTree {
 public:
  PrefixTree(PrefixTree&&) = default;
  PrefixTree& operator=(PrefixTree&&) = default;
  PrefixTree(const PrefixTree&) = delete;
  PrefixTree& operator=(const PrefixTree&) = delete;

  // Builds the tree of `rollouts` in one call. Fails like PrefixTreeBuilder::AddRollout, naming
  // the rollout's index.
  static absl::StatusOr<PrefixTree> FromRollouts(absl::Span<const std::vector<TokenId>> rollouts);

  // Nodes, the root included.
  int32_t num_nodes() const { return static_cast<int32_t>(parent_.size()); }
  int32_t num_rollouts() const { return static_cast<int32_t>(end_node_.size()); }
  // Unique tokens: the sum of all segment lengths.
  int64_t num_tree_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  // Sum of all rollout lengths, shared tokens counted once per rollout.
  int64_t num_rollout_tokens() const { return num_rollout_tokens_; }

  // The node's parent (kNoNode for the root).
  NodeId parent(NodeId node) const { return parent_[node]; }
  // Offset of the node's first token in every rollout that passes through it.
  int64_t depth(NodeId node) const { return depth_[node]; }
  int64_t length(NodeId node) const { return token_offset_[node + 1] - token_offset_[node]; }
  // depth + length: the length of the path from the root to the end of this node.
  int64_t end_depth(NodeId node) const { return depth_[node] + length(node); }
  // Number of nodes on the path from the root to `node`, excluding the root.
  int32_t level(NodeId node) const { return level_[node]; }
  // The node's tokens.
  absl::Span<const TokenId> segment(NodeId node) const {
    return absl::MakeConstSpan(tokens_).subspan(token_offset_[node], length(node));
  }
  // Offset of the node's first token in serialized_tokens().
  int64_t token_offset(NodeId node) const { return token_offset_[node]; }
  // Children in increasing order of their first token (lexicographic order).
  absl::Span<const NodeId> children(NodeId node) const {
    return absl::MakeConstSpan(children_).subspan(child_offset_[node],
                                                  child_offset_[node + 1] - child_offset_[node]);
  }
  bool is_leaf(NodeId node) const { return child_offset_[node] == child_offset_[node + 1]; }
  // One past the last node of the subtree of `node`: the subtree is [node, subtree_end(node)).
  NodeId subtree_end(NodeId node) const { return subtree_end_[node]; }
  bool IsAncestorOrSelf(NodeId ancestor, NodeId node) const {
    return ancestor <= node && node < subtree_end_[ancestor];
  }
  // Rollouts that pass through (or end at) the node; the root counts every rollout.
  int32_t num_rollouts_through(NodeId node) const { return through_[node]; }
  // Rollouts that end exactly at the end of this node, in increasing index order.
  absl::Span<const RolloutIndex> rollouts_ending_at(NodeId node) const {
    return absl::MakeConstSpan(ending_).subspan(ending_offset_[node],
                                                ending_offset_[node + 1] - ending_offset_[node]);
  }

  // The node at which rollout `r` ends, and its length.
  NodeId end_node(RolloutIndex r) const { return end_node_[r]; }
  int64_t rollout_length(RolloutIndex r) const { return end_depth(end_node_[r]); }

  // Every node's tokens, laid end to end in node id (DFS preorder) order.
  absl::Span<const TokenId> serialized_tokens() const { return tokens_; }

  // Deepest common ancestor of two nodes. Cost: the number of levels walked up from `a`.
  NodeId Lca(NodeId a, NodeId b) const;
  // Length of the longest common prefix of two rollouts.
  int64_t Lcp(RolloutIndex a, RolloutIndex b) const {
    return end_depth(Lca(end_node_[a], end_node_[b]));
  }
  // The node holding position `position` (0-based) of rollout `r`, found by walking up from its
  // end node. Requires 0 <= position < rollout_length(r). For tests and tools, not hot paths.
  NodeId NodeAt(RolloutIndex r, int64_t position) const;
  // Rollout `r`'s tokens, gathered from the segments on its path. O(length + levels).
  std::vector<TokenId> RolloutTokens(RolloutIndex r) const;

 private:
  friend class PrefixTreeBuilder;
  PrefixTree() = default;

  std::vector<NodeId> parent_;
  std::vector<int64_t> depth_;
  std::vector<int32_t> level_;
  std::vector<int64_t> token_offset_;  // num_nodes + 1 entries
  std::vector<TokenId> tokens_;
  std::vector<int32_t> child_offset_;  // num_nodes + 1 entries
  std::vector<NodeId> children_;
  std::vector<NodeId> subtree_end_;
  std::vector<int32_t> through_;
  std::vector<int32_t> ending_offset_;  // num_nodes + 1 entries
  std::vector<RolloutIndex> ending_;
  std::vector<NodeId> end_node_;
  int64_t num_rollout_tokens_ = 0;
};

// Rollouts in lexicographic order with each one's longest common prefix with the one before it:
// all that the DFS-contiguous split (core/partition) needs to know about a tree.
struct SortedRollouts {
  std::vector<RolloutIndex> order;  // lexicographic; equal rollouts by index (= LexicographicOrder)
  std::vector<int64_t> length;      // length[i]: the length of rollout order[i]
  std::vector<int64_t> lcp;         // lcp[i]: LCP(order[i - 1], order[i]); lcp[0] = 0
  int64_t tree_tokens = 0;          // unique tokens: sum of length - lcp
};

// Where a PrefixTreeBuilder keeps the tokens of the rollouts it is given.
enum class TokenStorage {
  // Copies every new segment: rollouts may be temporaries, as from a stream.
  kCopy,
  // Points into the caller's rollouts, copying nothing: the caller keeps every added rollout's
  // tokens alive and unchanged until Build or SortRollouts returns. For the dispatcher, which
  // holds a batch in memory and needs only its order and split.
  kBorrow,
};

// Grows a radix trie one rollout at a time, in time linear in the tokens it shares with earlier
// rollouts plus its new ones (plus one hash lookup per node it passes). Not thread-safe.
class PrefixTreeBuilder {
 public:
  explicit PrefixTreeBuilder(TokenStorage storage = TokenStorage::kCopy);
  PrefixTreeBuilder(PrefixTreeBuilder&&) = default;
  PrefixTreeBuilder& operator=(PrefixTreeBuilder&&) = default;
  PrefixTreeBuilder(const PrefixTreeBuilder&) = delete;
  PrefixTreeBuilder& operator=(const PrefixTreeBuilder&) = delete;

  // Adds the next rollout (its index is num_rollouts() before the call) and returns how many new
  // tree tokens it added, i.e. its length minus its longest common prefix with earlier rollouts.
  // Fails with INVALID_ARGUMENT, leaving the builder unchanged, if `tokens` is empty or holds a
  // negative token id; RESOURCE_EXHAUSTED past 2^31 - 1 rollouts.
  absl::StatusOr<int64_t> AddRollout(absl::Span<const TokenId> tokens);

  int32_t num_rollouts() const { return static_cast<int32_t>(rollout_end_.size()); }
  int64_t num_rollout_tokens() const { return num_rollout_tokens_; }
  int64_t num_tree_tokens() const { return num_tree_tokens_; }

  // The rollouts' lexicographic order and consecutive LCPs, without freezing the trie: time linear
  // in nodes and rollouts plus n log n in each node's number of children; no token is copied.
  SortedRollouts SortRollouts() const;

  // Freezes the trie into a PrefixTree (renumbering nodes in lexicographic DFS preorder). Time
  // linear in tree tokens plus n log n in each node's number of children.
  PrefixTree Build() &&;

 private:
  struct Node {
    const TokenId* tokens;  // the segment: in owned_ (kCopy) or in a caller's rollout (kBorrow)
    int64_t length;         // tokens in the segment
    int64_t depth;          // offset of the first token along the path
    NodeId parent;
    int32_t through;  // rollouts passing through
  };
  // Each node's children (CSR: children[offset[v]..offset[v + 1])), sorted by first token.
  struct ChildLists {
    std::vector<int32_t> offset;
    std::vector<NodeId> children;
  };
  static uint64_t ChildKey(NodeId parent, TokenId first_token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) |
           static_cast<uint32_t>(first_token);
  }
  ChildLists SortedChildren() const;
  // Nodes in lexicographic DFS preorder.
  std::vector<NodeId> Preorder(const ChildLists& lists) const;

  TokenStorage storage_;
  std::vector<Node> nodes_;
  // kCopy: one block per leaf segment (a split only moves pointers within a block).
  std::vector<std::unique_ptr<TokenId[]>> owned_;
  // (parent, first token of the child's segment) -> child. Splitting a node keeps the lower half
  // under the old id, so its children's keys never change and a split costs O(1).
  absl::flat_hash_map<uint64_t, NodeId> child_of_;
  std::vector<NodeId> rollout_end_;
  int64_t num_rollout_tokens_ = 0;
  int64_t num_tree_tokens_ = 0;
};

}  // namespace dta
