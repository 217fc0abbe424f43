#include "core/tree/tree_stats.h"

#include "gtest/gtest.h"

namespace dta {
namespace {

PrefixTree Build(const std::vector<std::vector<TokenId>>& rollouts) {
  return *PrefixTree::FromRollouts(rollouts);
}

TEST(TreeStats, HandComputedExample) {
  // {1,2,3} and {1,2,4} share {1,2}; {1,2} is a prefix of both; {1,2,4} appears twice.
  const TreeStats s = ComputeTreeStats(Build({{1, 2, 3}, {1, 2, 4}, {1, 2}, {1, 2, 4}}));
  EXPECT_EQ(s.num_rollouts, 4);
  EXPECT_EQ(s.num_nodes, 3);
  EXPECT_EQ(s.num_leaves, 2);
  EXPECT_EQ(s.num_prefix_rollouts, 1);
  EXPECT_EQ(s.num_duplicate_rollouts, 1);
  EXPECT_EQ(s.rollout_tokens, 11);
  EXPECT_EQ(s.tree_tokens, 4);
  EXPECT_EQ(s.leaf_tokens, 6);
  EXPECT_EQ(s.longest_rollout, 3);
  EXPECT_EQ(s.max_children, 2);
  EXPECT_EQ(s.max_level, 2);
  EXPECT_DOUBLE_EQ(s.compression, 11.0 / 4);
  EXPECT_DOUBLE_EQ(s.prefix_sharing, 1 - 4.0 / 11);
  EXPECT_DOUBLE_EQ(s.leaf_compression, 6.0 / 4);
  EXPECT_DOUBLE_EQ(s.potential_overlap_ratio, 1 - 4.0 / 6);
  // Dense: three rollouts of 3 tokens (1+2+3) and one of 2 (1+2). Tree: 1+2 for {1,2}, 3 and 3.
  EXPECT_DOUBLE_EQ(s.dense_attention_work, 3 * 6 + 3);
  EXPECT_DOUBLE_EQ(s.tree_attention_work, 3 + 3 + 3);
  EXPECT_DOUBLE_EQ(s.attention_compression, 21.0 / 9);
}

TEST(TreeStats, NoSharingMeansOne) {
  const TreeStats s = ComputeTreeStats(Build({{1, 2}, {2, 1}, {3}}));
  EXPECT_DOUBLE_EQ(s.compression, 1.0);
  EXPECT_DOUBLE_EQ(s.prefix_sharing, 0.0);
  EXPECT_DOUBLE_EQ(s.potential_overlap_ratio, 0.0);
  EXPECT_DOUBLE_EQ(s.attention_compression, 1.0);
}

TEST(TreeStats, EmptyTreeHasNoRatios) {
  const TreeStats s = ComputeTreeStats(Build({}));
  EXPECT_EQ(s.tree_tokens, 0);
  EXPECT_EQ(s.compression, 0.0);
}

}  // namespace
}  // namespace dta
