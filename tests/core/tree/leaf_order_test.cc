#include "core/tree/leaf_order.h"

#include <algorithm>
#include <numeric>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/tree/random_trees.h"

namespace dta {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(LeafOrder, LexicographicMatchesSortingTheSequences) {
  for (uint64_t seed = 0; seed < 500; ++seed) {
    const auto rollouts = testing::RandomRollouts(seed);
    const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
    std::vector<RolloutIndex> expected(rollouts.size());
    std::iota(expected.begin(), expected.end(), 0);
    std::stable_sort(expected.begin(), expected.end(),
                     [&](RolloutIndex a, RolloutIndex b) { return rollouts[a] < rollouts[b]; });
    EXPECT_EQ(LexicographicOrder(tree), expected) << "seed " << seed;
  }
}

TEST(LeafOrder, BothOrdersAreDfsLeafOrdersAndLcpsAreExact) {
  for (uint64_t seed = 0; seed < 500; ++seed) {
    const auto rollouts = testing::RandomRollouts(seed);
    const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
    for (const auto& order : {LexicographicOrder(tree), BackwardDfsOrder(tree)}) {
      ASSERT_TRUE(CheckDfsLeafOrder(tree, order).ok())
          << "seed " << seed << ": " << CheckDfsLeafOrder(tree, order);
      const std::vector<int64_t> lcp = ConsecutiveLcps(tree, order);
      ASSERT_EQ(lcp.size(), order.size());
      for (size_t i = 1; i < order.size(); ++i) {
        const auto& a = rollouts[order[i - 1]];
        const auto& b = rollouts[order[i]];
        const int64_t brute =
            std::mismatch(a.begin(), a.begin() + std::min(a.size(), b.size()), b.begin()).first -
            a.begin();
        EXPECT_EQ(lcp[i], brute);
      }
    }
  }
}

TEST(LeafOrder, SortRolloutsOfATreeEqualsTheBuildersWithoutATree) {
  for (uint64_t seed = 0; seed < 300; ++seed) {
    const auto rollouts = testing::RandomRollouts(seed);
    PrefixTreeBuilder builder;
    for (const auto& r : rollouts) ASSERT_TRUE(builder.AddRollout(r).ok());
    const SortedRollouts from_builder = builder.SortRollouts();
    const SortedRollouts from_tree = SortRollouts(std::move(builder).Build());
    EXPECT_EQ(from_tree.order, from_builder.order) << "seed " << seed;
    EXPECT_EQ(from_tree.length, from_builder.length) << "seed " << seed;
    EXPECT_EQ(from_tree.lcp, from_builder.lcp) << "seed " << seed;
    EXPECT_EQ(from_tree.tree_tokens, from_builder.tree_tokens) << "seed " << seed;
  }
}

TEST(LeafOrder, BackwardDfsOrderFollowsAlgorithm1) {
  // Root -> A = {9,9} with children: leaf L1 (end depth 4), internal I = {5} with leaves
  // L2 (end depth 6) and L3 (end depth 5), and leaf L4 (end depth 3).
  // A's child order: leaves by tail, L4 (3) then L1 (4); then I (tail = its first child's: L3, 5).
  // DFS: L4, L1, L3, L2; reversed: L2, L3, L1, L4.
  const std::vector<std::vector<TokenId>> rollouts = {
      {9, 9, 1, 1},        // 0: L1
      {9, 9, 5, 2, 2, 2},  // 1: L2
      {9, 9, 5, 3, 3},     // 2: L3
      {9, 9, 7},           // 3: L4
  };
  const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
  EXPECT_THAT(BackwardDfsOrder(tree), ElementsAre(1, 2, 0, 3));
  EXPECT_THAT(LexicographicOrder(tree), ElementsAre(0, 1, 2, 3));
}

TEST(LeafOrder, PrefixRolloutsFollowTheirExtensionsInBackwardOrder) {
  const PrefixTree tree = *PrefixTree::FromRollouts({{1, 2}, {1, 2, 3}, {1, 2}});
  EXPECT_THAT(BackwardDfsOrder(tree), ElementsAre(1, 0, 2));
  EXPECT_THAT(LexicographicOrder(tree), ElementsAre(0, 2, 1));
}

TEST(LeafOrder, RejectsOrdersThatAreNotDfsLeafOrders) {
  const PrefixTree tree = *PrefixTree::FromRollouts({{1, 2}, {1, 3}, {4}});
  EXPECT_TRUE(CheckDfsLeafOrder(tree, {2, 1, 0}).ok());
  const absl::Status split = CheckDfsLeafOrder(tree, {0, 2, 1});
  EXPECT_EQ(split.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(split.message()), HasSubstr("not a DFS leaf order"));
  EXPECT_THAT(std::string(CheckDfsLeafOrder(tree, {0, 1}).message()), HasSubstr("2 rollouts"));
  EXPECT_THAT(std::string(CheckDfsLeafOrder(tree, {0, 1, 1}).message()),
              HasSubstr("appears twice"));
  EXPECT_THAT(std::string(CheckDfsLeafOrder(tree, {0, 1, 7}).message()), HasSubstr("out of range"));
}

}  // namespace
}  // namespace dta
