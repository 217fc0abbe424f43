#include "core/tree/tree_partition.h"

#include <algorithm>
#include <bit>
#include <deque>
#include <functional>
#include <limits>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"

namespace dta {
namespace {

constexpr int kMaxExactLeaves = 16;

// The distinct leaf sequences: nodes without children (the root only when there are no rollouts,
// and then it is not a leaf sequence). In id order, which is lexicographic order.
std::vector<NodeId> LeafNodes(const PrefixTree& tree) {
  std::vector<NodeId> leaves;
  for (NodeId v = 1; v < tree.num_nodes(); ++v) {
    if (tree.is_leaf(v)) leaves.push_back(v);
  }
  return leaves;
}

absl::Status CheckCapacity(const PrefixTree& tree, absl::Span<const NodeId> leaves,
                           int64_t capacity) {
  if (capacity < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity must be at least 1 token, got ", capacity));
  }
  int64_t longest = 0;
  for (NodeId leaf : leaves) longest = std::max(longest, tree.end_depth(leaf));
  if (capacity < longest) {
    return absl::InvalidArgumentError(absl::StrCat("capacity ", capacity,
                                                   " is below the longest rollout (", longest,
                                                   " tokens), which then fits in no batch"));
  }
  return absl::OkStatus();
}

// Builds the partition from a grouping of the leaves: group_of[leaf node] is the leaf's group (any
// int32 label, other entries ignored). Each rollout goes to the group of its end node's first leaf
// (the end node itself when it is a leaf), which adds no tokens to that group. Batches are numbered
// in order of their first rollout in lexicographic order; tokens are counted exactly.
TreePartition BuildPartition(const PrefixTree& tree, absl::Span<const NodeId> leaves,
                             absl::Span<const int32_t> group_of) {
  const int32_t num_nodes = tree.num_nodes();
  TreePartition partition;
  partition.tree_tokens = tree.num_tree_tokens();
  for (NodeId leaf : leaves) partition.flattened_tokens += tree.end_depth(leaf);

  // The first leaf of every subtree, bottom-up (children have larger ids).
  std::vector<NodeId> first_leaf(num_nodes, kNoNode);
  for (NodeId v = num_nodes - 1; v >= 0; --v) {
    const auto kids = tree.children(v);
    first_leaf[v] = kids.empty() ? v : first_leaf[kids.front()];
  }
  // Nodes in id order and each node's rollouts in index order: every batch comes out sorted.
  absl::flat_hash_map<int32_t, int32_t> batch_of_label;
  for (NodeId v = 0; v < num_nodes; ++v) {
    const auto ending = tree.rollouts_ending_at(v);
    if (ending.empty()) continue;
    const int32_t label = group_of[first_leaf[v]];
    const auto [it, inserted] =
        batch_of_label.try_emplace(label, static_cast<int32_t>(partition.batches.size()));
    if (inserted) partition.batches.emplace_back();
    auto& rollouts = partition.batches[it->second].rollouts;
    rollouts.insert(rollouts.end(), ending.begin(), ending.end());
  }
  // Exact tokens: the union of the batch's root paths, each node counted once.
  std::vector<int32_t> stamp(num_nodes, -1);
  for (int32_t b = 0; b < static_cast<int32_t>(partition.batches.size()); ++b) {
    TreeBatch& batch = partition.batches[b];
    for (RolloutIndex r : batch.rollouts) {
      for (NodeId v = tree.end_node(r); v != kRootNode && stamp[v] != b; v = tree.parent(v)) {
        stamp[v] = b;
        batch.tokens += tree.length(v);
      }
    }
    partition.total_tokens += batch.tokens;
  }
  const int64_t redundant = partition.flattened_tokens - partition.tree_tokens;
  partition.effective_reuse_ratio =
      redundant > 0
          ? static_cast<double>(partition.flattened_tokens - partition.total_tokens) / redundant
          : 1.0;
  return partition;
}

// Bottom-up best-fit decreasing (see the header). Returns group labels per leaf node.
std::vector<int32_t> GroupBottomUp(const PrefixTree& tree, int64_t capacity) {
  const int32_t num_nodes = tree.num_nodes();
  // A partial batch: `total` bounds its tree's tokens from above (exact unless two partial batches
  // from the same child were merged, which is conservative); its leaves are a linked list.
  struct Bin {
    int64_t total;
    NodeId head;
    NodeId tail;
  };
  std::vector<Bin> bins;
  std::vector<NodeId> next_leaf(num_nodes, kNoNode);
  using BinSet = std::set<std::pair<int64_t, int32_t>>;  // (total, bin), the open bins of a subtree
  std::vector<BinSet> open(num_nodes);
  std::vector<std::pair<int64_t, int32_t>> items;
  for (NodeId v = num_nodes - 1; v >= 0; --v) {
    const auto kids = tree.children(v);
    if (kids.empty()) {
      if (v == kRootNode) break;  // no rollouts at all
      open[v].emplace(tree.end_depth(v), static_cast<int32_t>(bins.size()));
      bins.push_back({tree.end_depth(v), v, v});
      continue;
    }
    // Small to large: keep the child with the most open bins, place the others' bins into it.
    NodeId big = kids.front();
    for (NodeId kid : kids) {
      if (open[kid].size() > open[big].size()) big = kid;
    }
    BinSet set = std::move(open[big]);
    items.clear();
    for (NodeId kid : kids) {
      if (kid == big) continue;
      items.insert(items.end(), open[kid].begin(), open[kid].end());
      BinSet().swap(open[kid]);
    }
    // Largest first; each into the fullest bin it fits with. Merging at v shares v's root path.
    std::sort(items.begin(), items.end(), std::greater<>());
    const int64_t shared = tree.end_depth(v);
    for (const auto& [total, bin] : items) {
      auto fit = set.upper_bound({capacity + shared - total, std::numeric_limits<int32_t>::max()});
      if (fit == set.begin()) {
        set.emplace(total, bin);
        continue;
      }
      --fit;
      const int32_t target = fit->second;
      set.erase(fit);
      Bin& into = bins[target];
      into.total += total - shared;
      next_leaf[into.tail] = bins[bin].head;
      into.tail = bins[bin].tail;
      set.emplace(into.total, target);
    }
    open[v] = std::move(set);
  }
  std::vector<int32_t> group_of(num_nodes, -1);
  for (const auto& [total, bin] : open[kRootNode]) {
    for (NodeId leaf = bins[bin].head; leaf != kNoNode; leaf = next_leaf[leaf])
      group_of[leaf] = bin;
  }
  return group_of;
}

// The cheapest cut into contiguous batches of a DFS leaf order with children deepest first.
// Returns group labels per leaf node.
std::vector<int32_t> GroupContiguous(const PrefixTree& tree, int64_t capacity) {
  const int32_t num_nodes = tree.num_nodes();
  std::vector<int64_t> height(num_nodes, 0);  // the deepest leaf's end depth in the subtree
  for (NodeId v = num_nodes - 1; v >= 0; --v) {
    height[v] = tree.end_depth(v);
    for (NodeId kid : tree.children(v)) height[v] = std::max(height[v], height[kid]);
  }
  std::vector<NodeId> order;  // leaves
  std::vector<NodeId> stack = {kRootNode};
  std::vector<NodeId> kids;
  while (!stack.empty()) {
    const NodeId v = stack.back();
    stack.pop_back();
    if (tree.is_leaf(v)) {
      if (v != kRootNode) order.push_back(v);
      continue;
    }
    kids.assign(tree.children(v).begin(), tree.children(v).end());
    // Deepest first; pushed in reverse so that the deepest is visited first.
    std::sort(kids.begin(), kids.end(), [&](NodeId a, NodeId b) {
      return height[a] != height[b] ? height[a] > height[b] : a < b;
    });
    stack.insert(stack.end(), kids.rbegin(), kids.rend());
  }
  const int32_t n = static_cast<int32_t>(order.size());
  // cost(i..j) = s[j + 1] - s[i] + lcp[i], with s the prefix sums of length - lcp with the
  // previous.
  std::vector<int64_t> lcp(n, 0), s(n + 1, 0);
  for (int32_t i = 0; i < n; ++i) {
    if (i > 0) lcp[i] = tree.end_depth(tree.Lca(order[i - 1], order[i]));
    s[i + 1] = s[i] + tree.end_depth(order[i]) - lcp[i];
  }
  // f[j] = the cheapest cut of the first j leaves; the last batch [i, j) minimizes
  // f[i] - s[i] + lcp[i] over the feasible i, a window that only moves right: a monotone deque.
  std::vector<int64_t> f(n + 1, 0);
  std::vector<int32_t> start(n + 1, 0);
  std::deque<int32_t> window;
  auto key = [&](int32_t i) { return f[i] - s[i] + lcp[i]; };
  int32_t lo = 0;
  for (int32_t j = 0; j < n; ++j) {
    while (!window.empty() && key(window.back()) >= key(j)) window.pop_back();
    window.push_back(j);
    while (s[j + 1] - s[lo] + lcp[lo] > capacity) ++lo;
    while (window.front() < lo) window.pop_front();
    start[j + 1] = window.front();
    f[j + 1] = s[j + 1] + key(window.front());
  }
  std::vector<int32_t> group_of(num_nodes, -1);
  for (int32_t end = n; end > 0; end = start[end]) {
    for (int32_t i = start[end]; i < end; ++i) group_of[order[i]] = start[end];
  }
  return group_of;
}

}  // namespace

absl::StatusOr<TreePartition> PartitionTreeGreedy(const PrefixTree& tree, int64_t capacity) {
  const std::vector<NodeId> leaves = LeafNodes(tree);
  RETURN_IF_ERROR(CheckCapacity(tree, leaves, capacity));
  TreePartition packed = BuildPartition(tree, leaves, GroupBottomUp(tree, capacity));
  TreePartition cut = BuildPartition(tree, leaves, GroupContiguous(tree, capacity));
  if (cut.total_tokens < packed.total_tokens ||
      (cut.total_tokens == packed.total_tokens && cut.batches.size() < packed.batches.size())) {
    return cut;
  }
  return packed;
}

absl::StatusOr<TreePartition> PartitionTreeExact(const PrefixTree& tree, int64_t capacity) {
  const std::vector<NodeId> leaves = LeafNodes(tree);
  RETURN_IF_ERROR(CheckCapacity(tree, leaves, capacity));
  const int n = static_cast<int>(leaves.size());
  if (n > kMaxExactLeaves) {
    return absl::FailedPreconditionError(
        absl::StrCat("the exact partition handles at most ", kMaxExactLeaves,
                     " distinct leaf sequences, the tree has ", n));
  }
  std::vector<std::vector<int64_t>> lcp(n, std::vector<int64_t>(n, 0));
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) lcp[a][b] = tree.end_depth(tree.Lca(leaves[a], leaves[b]));
  }
  // cost[mask]: tokens of the leaves' own tree; leaves are in lexicographic order, so the highest
  // leaf adds its length minus its LCP with the next highest.
  const uint32_t full = (uint32_t{1} << n) - 1;
  std::vector<int64_t> cost(full + 1, 0);
  for (uint32_t mask = 1; mask <= full; ++mask) {
    const int high = std::bit_width(mask) - 1;
    const uint32_t rest = mask ^ (uint32_t{1} << high);
    cost[mask] = cost[rest] + tree.end_depth(leaves[high]) -
                 (rest ? lcp[std::bit_width(rest) - 1][high] : 0);
  }
  // best[mask]: the cheapest partition of the leaves in mask, as (tokens, batches); choice[mask]:
  // its batch holding the lowest leaf. A set that fits in one batch is best as one batch (a union
  // never costs more than its parts).
  using Cost = std::pair<int64_t, int32_t>;
  std::vector<Cost> best(full + 1, {std::numeric_limits<int64_t>::max(), 0});
  std::vector<uint32_t> choice(full + 1, 0);
  best[0] = {0, 0};
  for (uint32_t mask = 1; mask <= full; ++mask) {
    if (cost[mask] <= capacity) {
      best[mask] = {cost[mask], 1};
      choice[mask] = mask;
      continue;
    }
    const uint32_t low = mask & (~mask + 1);
    const uint32_t rest = mask ^ low;
    for (uint32_t sub = rest;; sub = (sub - 1) & rest) {
      const uint32_t batch = sub | low;
      if (cost[batch] <= capacity) {
        const Cost& others = best[mask ^ batch];
        const Cost candidate = {cost[batch] + others.first, others.second + 1};
        if (candidate < best[mask]) {
          best[mask] = candidate;
          choice[mask] = batch;
        }
      }
      if (sub == 0) break;
    }
  }
  std::vector<int32_t> group_of(tree.num_nodes(), -1);
  for (uint32_t mask = full; mask != 0; mask ^= choice[mask]) {
    for (int i = 0; i < n; ++i) {
      if (choice[mask] >> i & 1) group_of[leaves[i]] = static_cast<int32_t>(choice[mask]);
    }
  }
  return BuildPartition(tree, leaves, group_of);
}

}  // namespace dta
