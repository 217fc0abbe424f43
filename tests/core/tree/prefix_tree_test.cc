#include "core/tree/prefix_tree.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/tree/random_trees.h"

namespace dta {
namespace {

using ::testing::ElementsAre;

using Rollouts = std::vector<std::vector<TokenId>>;

PrefixTree Build(const Rollouts& rollouts) {
  absl::StatusOr<PrefixTree> tree = PrefixTree::FromRollouts(rollouts);
  EXPECT_TRUE(tree.ok()) << tree.status();
  return *std::move(tree);
}

int64_t BruteLcp(const std::vector<TokenId>& a, const std::vector<TokenId>& b) {
  return std::mismatch(a.begin(), a.begin() + std::min(a.size(), b.size()), b.begin()).first -
         a.begin();
}

bool StartsWith(const std::vector<TokenId>& s, const std::vector<TokenId>& prefix) {
  return s.size() >= prefix.size() && std::equal(prefix.begin(), prefix.end(), s.begin());
}

std::vector<TokenId> PathTo(const PrefixTree& tree, NodeId node) {
  std::vector<TokenId> path(tree.end_depth(node));
  for (NodeId v = node; v != kRootNode; v = tree.parent(v)) {
    std::copy(tree.segment(v).begin(), tree.segment(v).end(), path.begin() + tree.depth(v));
  }
  return path;
}

TEST(PrefixTree, HeaderExample) {
  PrefixTreeBuilder builder;
  EXPECT_EQ(*builder.AddRollout({1, 2, 3}), 3);
  EXPECT_EQ(*builder.AddRollout({1, 2, 4}), 1);
  EXPECT_EQ(*builder.AddRollout({1, 2}), 0);
  PrefixTree tree = std::move(builder).Build();
  EXPECT_EQ(tree.num_tree_tokens(), 4);
  EXPECT_EQ(tree.num_rollout_tokens(), 8);
  ASSERT_EQ(tree.num_nodes(), 4);  // root, {1,2}, {3}, {4}
  EXPECT_THAT(tree.segment(1), ElementsAre(1, 2));
  EXPECT_THAT(tree.segment(2), ElementsAre(3));
  EXPECT_THAT(tree.segment(3), ElementsAre(4));
  EXPECT_THAT(tree.children(1), ElementsAre(2, 3));
  EXPECT_THAT(tree.rollouts_ending_at(1), ElementsAre(2));
  EXPECT_EQ(tree.num_rollouts_through(1), 3);
  EXPECT_EQ(tree.end_node(0), 2);
  EXPECT_EQ(tree.Lcp(0, 1), 2);
  EXPECT_EQ(tree.Lcp(0, 2), 2);
  EXPECT_THAT(tree.serialized_tokens(), ElementsAre(1, 2, 3, 4));
}

TEST(PrefixTree, EmptyBatch) {
  PrefixTree tree = Build({});
  EXPECT_EQ(tree.num_nodes(), 1);
  EXPECT_EQ(tree.num_rollouts(), 0);
  EXPECT_EQ(tree.num_tree_tokens(), 0);
  EXPECT_TRUE(tree.is_leaf(kRootNode));
}

TEST(PrefixTree, RejectsBadRolloutsAndStaysUnchanged) {
  PrefixTreeBuilder builder;
  ASSERT_TRUE(builder.AddRollout({5, 6}).ok());
  const absl::StatusOr<int64_t> empty = builder.AddRollout({});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  const absl::StatusOr<int64_t> negative = builder.AddRollout({5, -3});
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(negative.status().message()), ::testing::HasSubstr("token 1"));
  // A bad token after a shared part would have split {5, 6}: refused before anything changes.
  const absl::StatusOr<int64_t> after_split = builder.AddRollout({5, 7, -2});
  EXPECT_THAT(std::string(after_split.status().message()), ::testing::HasSubstr("token 2"));
  EXPECT_EQ(builder.num_rollouts(), 1);
  EXPECT_EQ(builder.num_tree_tokens(), 2);
  const PrefixTree unchanged = std::move(builder).Build();
  EXPECT_EQ(unchanged.num_nodes(), 2);
  EXPECT_EQ(unchanged.num_rollouts_through(kRootNode), 1);
  const absl::StatusOr<PrefixTree> from = PrefixTree::FromRollouts(Rollouts{{1}, {}});
  EXPECT_THAT(std::string(from.status().message()), ::testing::HasSubstr("rollout 1"));
}

TEST(PrefixTree, DuplicatesAndPrefixesAreFirstClass) {
  PrefixTree tree = Build({{7, 8, 9}, {7, 8, 9}, {7}, {7, 8, 9, 1}});
  EXPECT_EQ(tree.end_node(0), tree.end_node(1));
  EXPECT_THAT(tree.rollouts_ending_at(tree.end_node(0)), ElementsAre(0, 1));
  EXPECT_FALSE(tree.is_leaf(tree.end_node(0)));  // {7,8,9} is a prefix of rollout 3
  EXPECT_EQ(tree.length(tree.end_node(2)), 1);
  EXPECT_EQ(tree.num_tree_tokens(), 4);
  EXPECT_EQ(tree.Lcp(0, 1), 3);
  EXPECT_EQ(tree.Lcp(2, 3), 1);
}

// Checks every structural promise of PrefixTree against brute force on the original rollouts.
void CheckAgainstBruteForce(const Rollouts& rollouts) {
  PrefixTree tree = Build(rollouts);
  const int32_t n = static_cast<int32_t>(rollouts.size());
  ASSERT_EQ(tree.num_rollouts(), n);

  std::set<std::vector<TokenId>> prefixes;
  int64_t total = 0;
  for (const auto& r : rollouts) {
    total += r.size();
    for (size_t k = 1; k <= r.size(); ++k) prefixes.emplace(r.begin(), r.begin() + k);
  }
  EXPECT_EQ(tree.num_tree_tokens(), static_cast<int64_t>(prefixes.size()));
  EXPECT_EQ(tree.num_rollout_tokens(), total);

  std::vector<std::vector<TokenId>> preorder_paths;
  for (NodeId v = 0; v < tree.num_nodes(); ++v) {
    const std::vector<TokenId> path = PathTo(tree, v);
    preorder_paths.push_back(path);
    if (v != kRootNode) {
      ASSERT_GT(tree.length(v), 0);
      ASSERT_LT(tree.parent(v), v);
      EXPECT_EQ(tree.depth(v), tree.end_depth(tree.parent(v)));
      EXPECT_EQ(tree.level(v), tree.level(tree.parent(v)) + 1);
      // Radix compression: a node with one child must end a rollout.
      if (tree.children(v).size() == 1) {
        EXPECT_FALSE(tree.rollouts_ending_at(v).empty()) << v;
      }
      if (tree.is_leaf(v)) {
        EXPECT_FALSE(tree.rollouts_ending_at(v).empty()) << v;
      }
    }
    int32_t through = 0;
    for (const auto& r : rollouts) through += StartsWith(r, path);
    EXPECT_EQ(tree.num_rollouts_through(v), through) << "node " << v;
    const auto kids = tree.children(v);
    for (size_t i = 0; i < kids.size(); ++i) {
      EXPECT_EQ(tree.parent(kids[i]), v);
      if (i > 0) {
        EXPECT_LT(tree.segment(kids[i - 1])[0], tree.segment(kids[i])[0]);
      }
    }
    // The subtree is exactly the nodes whose paths extend this one.
    for (NodeId u = 0; u < tree.num_nodes(); ++u) {
      const bool descendant = u >= v && StartsWith(PathTo(tree, u), path) &&
                              (u == v || tree.end_depth(u) > tree.end_depth(v));
      EXPECT_EQ(tree.IsAncestorOrSelf(v, u), descendant) << v << " " << u;
    }
  }
  // Preorder is lexicographic.
  EXPECT_TRUE(std::is_sorted(preorder_paths.begin(), preorder_paths.end()));
  for (RolloutIndex r = 0; r < n; ++r) {
    EXPECT_EQ(tree.RolloutTokens(r), rollouts[r]);
    EXPECT_EQ(tree.rollout_length(r), static_cast<int64_t>(rollouts[r].size()));
    const auto ending = tree.rollouts_ending_at(tree.end_node(r));
    EXPECT_NE(std::find(ending.begin(), ending.end(), r), ending.end());
    for (int64_t p = 0; p < tree.rollout_length(r); ++p) {
      const NodeId v = tree.NodeAt(r, p);
      ASSERT_LE(tree.depth(v), p);
      ASSERT_LT(p, tree.end_depth(v));
      EXPECT_EQ(tree.serialized_tokens()[tree.token_offset(v) + p - tree.depth(v)], rollouts[r][p]);
    }
    for (RolloutIndex s = 0; s < n; ++s)
      EXPECT_EQ(tree.Lcp(r, s), BruteLcp(rollouts[r], rollouts[s]));
  }
}

TEST(PrefixTree, MatchesBruteForceOnRandomTrees) {
  for (uint64_t seed = 0; seed < 300; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    CheckAgainstBruteForce(testing::RandomRollouts(seed));
  }
}

// Borrowing the caller's tokens builds the same tree as copying them, and SortRollouts gives the
// sorted order, lengths and LCPs without building it.
TEST(PrefixTree, BorrowedTokensAndSortRolloutsMatchBruteForce) {
  for (uint64_t seed = 0; seed < 300; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    const Rollouts rollouts = testing::RandomRollouts(seed);
    PrefixTreeBuilder borrowing(TokenStorage::kBorrow);
    for (const auto& r : rollouts) ASSERT_TRUE(borrowing.AddRollout(r).ok());
    const SortedRollouts sorted = borrowing.SortRollouts();
    std::vector<RolloutIndex> order(rollouts.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](RolloutIndex a, RolloutIndex b) { return rollouts[a] < rollouts[b]; });
    EXPECT_EQ(sorted.order, order);
    ASSERT_EQ(sorted.lcp.size(), order.size());
    ASSERT_EQ(sorted.length.size(), order.size());
    int64_t unique = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      EXPECT_EQ(sorted.length[i], static_cast<int64_t>(rollouts[order[i]].size()));
      EXPECT_EQ(sorted.lcp[i], i == 0 ? 0 : BruteLcp(rollouts[order[i - 1]], rollouts[order[i]]));
      unique += sorted.length[i] - sorted.lcp[i];
    }
    EXPECT_EQ(sorted.tree_tokens, unique);

    const PrefixTree borrowed = std::move(borrowing).Build();
    const PrefixTree copied = Build(rollouts);
    EXPECT_EQ(sorted.tree_tokens, copied.num_tree_tokens());
    ASSERT_EQ(borrowed.num_nodes(), copied.num_nodes());
    EXPECT_TRUE(std::ranges::equal(borrowed.serialized_tokens(), copied.serialized_tokens()));
    for (NodeId v = 0; v < copied.num_nodes(); ++v) {
      EXPECT_EQ(borrowed.parent(v), copied.parent(v));
      EXPECT_EQ(borrowed.length(v), copied.length(v));
      EXPECT_EQ(borrowed.num_rollouts_through(v), copied.num_rollouts_through(v));
    }
    for (RolloutIndex r = 0; r < copied.num_rollouts(); ++r)
      EXPECT_EQ(borrowed.end_node(r), copied.end_node(r));
  }
}

TEST(PrefixTree, AddedTokensAreLengthMinusLongestEarlierLcp) {
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const Rollouts rollouts = testing::RandomRollouts(seed);
    PrefixTreeBuilder builder;
    for (size_t r = 0; r < rollouts.size(); ++r) {
      int64_t longest = 0;
      for (size_t s = 0; s < r; ++s)
        longest = std::max(longest, BruteLcp(rollouts[r], rollouts[s]));
      EXPECT_EQ(*builder.AddRollout(rollouts[r]),
                static_cast<int64_t>(rollouts[r].size()) - longest);
    }
  }
}

TEST(PrefixTree, MillionTokenChainAndDeepTreesNeedNoRecursion) {
  std::vector<TokenId> chain(1'000'000);
  for (size_t i = 0; i < chain.size(); ++i) chain[i] = static_cast<TokenId>(i % 1000);
  PrefixTree single = Build({chain});
  EXPECT_EQ(single.num_tree_tokens(), 1'000'000);
  EXPECT_EQ(single.num_nodes(), 2);

  // A comb: one spine with a one-token branch at each of 5,000 depths: 5,001 levels deep.
  Rollouts comb;
  std::vector<TokenId> spine(5000, 1);
  for (int d = 1; d <= 5000; ++d) {
    std::vector<TokenId> r(spine.begin(), spine.begin() + d);
    r.push_back(2);
    comb.push_back(std::move(r));
  }
  PrefixTree tree = Build(comb);
  EXPECT_EQ(tree.num_tree_tokens(), 5000 + 5000);
  int32_t max_level = 0;
  for (NodeId v = 0; v < tree.num_nodes(); ++v) max_level = std::max(max_level, tree.level(v));
  EXPECT_EQ(max_level, 5000);
  EXPECT_EQ(tree.Lcp(0, 4999), 1);
  EXPECT_EQ(tree.RolloutTokens(4999), comb[4999]);
}

TEST(PrefixTree, WideBranch) {
  Rollouts rollouts;
  for (int i = 0; i < 512; ++i) rollouts.push_back({0, 0, 0, 1000 - i, i});
  PrefixTree tree = Build(rollouts);
  EXPECT_EQ(tree.children(1).size(), 512u);
  EXPECT_EQ(tree.num_tree_tokens(), 3 + 512 * 2);
  // Children sorted by first token: the last rollout (first token 489) comes first.
  EXPECT_EQ(tree.rollouts_ending_at(tree.children(1)[0])[0], 511);
}

}  // namespace
}  // namespace dta
