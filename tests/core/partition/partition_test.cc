#include "core/partition/partition.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <random>
#include <set>

#include "core/tree/leaf_order.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/tree/random_trees.h"

namespace dta {
namespace {

using Rollouts = std::vector<std::vector<TokenId>>;

// Tree tokens of a group, by building its own tree from scratch.
int64_t OwnTreeTokens(const Rollouts& rollouts, const std::vector<RolloutIndex>& group) {
  Rollouts subset;
  for (RolloutIndex r : group) subset.push_back(rollouts[r]);
  return PrefixTree::FromRollouts(subset)->num_tree_tokens();
}

// A group's cost under `cost` from first principles: its tree tokens are its rollouts' distinct
// prefixes, a token at depth d the end of one of d + 1 tokens, which attends to d + 1 keys.
int64_t OwnCost(const Rollouts& rollouts, const std::vector<RolloutIndex>& group,
                const BalanceCost& cost) {
  std::set<std::vector<TokenId>> prefixes;
  for (RolloutIndex r : group) {
    for (size_t n = 1; n <= rollouts[r].size(); ++n)
      prefixes.emplace(rollouts[r].begin(), rollouts[r].begin() + n);
  }
  int64_t total = 0;
  for (const auto& prefix : prefixes)
    total += cost.per_token + cost.per_key * static_cast<int64_t>(prefix.size());
  return total;
}

// The best largest-group cost over every cut of the lexicographic order into exactly k non-empty
// contiguous groups (k <= n), by exhaustive recursion.
int64_t BruteForceBest(const Rollouts& rollouts, const std::vector<RolloutIndex>& order, int k,
                       const BalanceCost& cost = {}) {
  const int n = static_cast<int>(order.size());
  const auto group_cost = [&](int begin, int end) {
    return OwnCost(rollouts, std::vector<RolloutIndex>(order.begin() + begin, order.begin() + end),
                   cost);
  };
  std::function<int64_t(int, int)> best = [&](int begin, int groups) -> int64_t {
    if (groups == 1) return group_cost(begin, n);
    int64_t result = std::numeric_limits<int64_t>::max();
    for (int end = begin + 1; end <= n - (groups - 1); ++end) {
      result = std::min(result, std::max(group_cost(begin, end), best(end, groups - 1)));
    }
    return result;
  };
  return best(0, k);
}

void CheckIsPartition(const PrefixTree& tree, const Partition& p, int k) {
  ASSERT_EQ(static_cast<int>(p.groups.size()), k);
  std::vector<int> seen(tree.num_rollouts(), 0);
  for (const auto& group : p.groups) {
    for (RolloutIndex r : group) seen[r]++;
  }
  for (int count : seen) ASSERT_EQ(count, 1);
}

TEST(Partition, OptimalAmongContiguousSplits) {
  for (uint64_t seed = 0; seed < 150; ++seed) {
    const Rollouts rollouts = testing::RandomRollouts(seed, {.max_rollouts = 9, .max_length = 12});
    const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
    const std::vector<RolloutIndex> order = LexicographicOrder(tree);
    for (int k = 1; k <= 4; ++k) {
      SCOPED_TRACE(::testing::Message() << "seed " << seed << " k " << k);
      const Partition p = *PartitionDfsContiguous(tree, k);
      CheckIsPartition(tree, p, k);
      // Contiguous in lexicographic order, and costs are the groups' own tree tokens.
      std::vector<RolloutIndex> joined;
      for (size_t g = 0; g < p.groups.size(); ++g) {
        joined.insert(joined.end(), p.groups[g].begin(), p.groups[g].end());
        EXPECT_EQ(p.cost[g], OwnTreeTokens(rollouts, p.groups[g]));
        EXPECT_EQ(p.tree_tokens[g], p.cost[g]);
        if (static_cast<int>(rollouts.size()) >= k) {
          EXPECT_FALSE(p.groups[g].empty());
        }
      }
      EXPECT_EQ(joined, order);
      EXPECT_EQ(p.max_cost, *std::max_element(p.cost.begin(), p.cost.end()));
      if (static_cast<int>(rollouts.size()) >= k) {
        EXPECT_EQ(p.max_cost, BruteForceBest(rollouts, order, k));
      }
      // Contiguous DFS groups duplicate at most (K - 1) x the longest rollout.
      int64_t longest = 0;
      for (const auto& r : rollouts) longest = std::max<int64_t>(longest, r.size());
      EXPECT_LE(p.extra_tokens, (k - 1) * longest);
      EXPECT_GE(p.extra_tokens, 0);
    }
  }
}

TEST(Partition, BalancesTokensAndAttendedKeysOptimally) {
  for (const BalanceCost cost : {BalanceCost{3, 2}, BalanceCost{0, 1}, BalanceCost{1000, 7}}) {
    for (uint64_t seed = 0; seed < 60; ++seed) {
      const Rollouts rollouts =
          testing::RandomRollouts(seed, {.max_rollouts = 8, .max_length = 12});
      const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
      const std::vector<RolloutIndex> order = LexicographicOrder(tree);
      for (int k = 1; k <= 3; ++k) {
        SCOPED_TRACE(::testing::Message() << "cost {" << cost.per_token << ", " << cost.per_key
                                          << "} seed " << seed << " k " << k);
        const Partition p = *PartitionDfsContiguous(tree, k, cost);
        CheckIsPartition(tree, p, k);
        for (size_t g = 0; g < p.groups.size(); ++g) {
          EXPECT_EQ(p.cost[g], OwnCost(rollouts, p.groups[g], cost));
          EXPECT_EQ(p.tree_tokens[g], OwnTreeTokens(rollouts, p.groups[g]));
        }
        if (static_cast<int>(rollouts.size()) >= k) {
          EXPECT_EQ(p.max_cost, BruteForceBest(rollouts, order, k, cost));
        }
        // The baselines are described in the same units.
        const Partition greedy = *PartitionGreedyByTreeTokens(tree, k, cost);
        for (size_t g = 0; g < greedy.groups.size(); ++g)
          EXPECT_EQ(greedy.cost[g], OwnCost(rollouts, greedy.groups[g], cost));
      }
    }
  }
}

TEST(Partition, BalancingTimeSplitsLongPathsThatTokensPairUp) {
  // Two 300-token paths first in lexicographic order, then 60 rollouts of 10 tokens: by tree
  // tokens the two long paths make one group (600) and the short ones the other (600); their
  // attention work is quadratic, so a time model puts one long path in each group.
  Rollouts rollouts = {std::vector<TokenId>(300, 1), std::vector<TokenId>(300, 2)};
  for (int i = 0; i < 60; ++i) {
    std::vector<TokenId> r(10, 10 + i);
    rollouts.push_back(r);
  }
  const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
  const BalanceCost time{.per_token = 1, .per_key = 1};
  const Partition by_tokens = *PartitionDfsContiguous(tree, 2);
  EXPECT_EQ(by_tokens.cost, (std::vector<int64_t>{600, 600}));
  const Partition by_time = *PartitionDfsContiguous(tree, 2, time);
  EXPECT_THAT(by_time.groups[0], ::testing::ElementsAre(0));
  // The token split's costlier group under the time model: both long paths.
  const Partition tokens_timed = DescribePartition(tree, by_tokens.groups, time);
  EXPECT_EQ(tokens_timed.max_cost, 2 * time.PathCost(300));
  EXPECT_EQ(by_time.max_cost, time.PathCost(300) + 60 * time.PathCost(10));
  EXPECT_LT(by_time.max_cost, tokens_timed.max_cost * 6 / 10);
  EXPECT_EQ(by_time.tree_tokens, (std::vector<int64_t>{300, 900}));
}

TEST(Partition, MoreGroupsThanRolloutsLeavesTrailingGroupsEmpty) {
  const PrefixTree tree = *PrefixTree::FromRollouts({{1, 2}, {1, 3}});
  const Partition p = *PartitionDfsContiguous(tree, 4);
  ASSERT_EQ(p.groups.size(), 4u);
  EXPECT_THAT(p.groups[0], ::testing::ElementsAre(0));
  EXPECT_THAT(p.groups[1], ::testing::ElementsAre(1));
  EXPECT_TRUE(p.groups[2].empty());
  EXPECT_TRUE(p.groups[3].empty());
  EXPECT_EQ(p.extra_tokens, 1);
}

TEST(Partition, SplitsIntoExactlyKEvenWhenFewerWouldDo) {
  // The 100-token rollout alone sets the optimum (100); two groups reach it, yet four are
  // returned, none empty and none costlier than 100.
  const PrefixTree tree = *PrefixTree::FromRollouts({std::vector<TokenId>(100, 5), {1}, {2}, {3}});
  const Partition p = *PartitionDfsContiguous(tree, 4);
  ASSERT_EQ(p.groups.size(), 4u);
  for (const auto& g : p.groups) EXPECT_EQ(g.size(), 1u);
  EXPECT_EQ(p.max_cost, 100);
  EXPECT_EQ(p.extra_tokens, 0);
}

TEST(Partition, GreedyBaselinesArePartitionsWithHonestCosts) {
  for (uint64_t seed = 0; seed < 100; ++seed) {
    const Rollouts rollouts = testing::RandomRollouts(seed);
    const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
    for (int k : {1, 2, 3, 5}) {
      for (const Partition& p :
           {*PartitionGreedyByRolloutTokens(tree, k), *PartitionGreedyByTreeTokens(tree, k)}) {
        CheckIsPartition(tree, p, k);
        for (size_t g = 0; g < p.groups.size(); ++g) {
          EXPECT_EQ(p.cost[g], p.groups[g].empty() ? 0 : OwnTreeTokens(rollouts, p.groups[g]));
        }
        EXPECT_GE(p.imbalance, 1.0 - 1e-12);
      }
    }
  }
}

TEST(Partition, BeatsGreedyBaselinesOnSharedPrefixes) {
  // 16 groups of 8 rollouts sharing a 200-token prompt each: contiguous cuts keep groups whole.
  std::mt19937_64 rng(7);
  Rollouts rollouts;
  for (int g = 0; g < 16; ++g) {
    std::vector<TokenId> prompt(200);
    for (auto& t : prompt) t = static_cast<TokenId>(rng() % 1000);
    prompt[0] = g;
    for (int s = 0; s < 8; ++s) {
      std::vector<TokenId> r = prompt;
      for (int i = 0; i < 20 + static_cast<int>(rng() % 50); ++i)
        r.push_back(static_cast<TokenId>(rng() % 1000));
      r[200] = 1000 + s;
      rollouts.push_back(r);
    }
  }
  // Shuffle arrival order, as from asynchronous rollout workers.
  std::shuffle(rollouts.begin(), rollouts.end(), rng);
  const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
  const Partition ours = *PartitionDfsContiguous(tree, 4);
  const Partition by_tokens = *PartitionGreedyByRolloutTokens(tree, 4);
  const Partition by_tree = *PartitionGreedyByTreeTokens(tree, 4);
  EXPECT_LT(ours.max_cost, by_tokens.max_cost);
  EXPECT_LE(ours.max_cost, by_tree.max_cost);
  EXPECT_LT(ours.extra_tokens, by_tokens.extra_tokens);
}

TEST(Partition, RejectsBadArguments) {
  const PrefixTree tree = *PrefixTree::FromRollouts({{1}});
  EXPECT_EQ(PartitionDfsContiguous(tree, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PartitionGreedyByRolloutTokens(tree, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PartitionGreedyByTreeTokens(tree, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<int64_t> lengths = {3, 2};
  EXPECT_EQ(CutContiguous(lengths, std::vector<int64_t>{0, 5}, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CutContiguous(lengths, std::vector<int64_t>{0}, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (const BalanceCost bad : {BalanceCost{0, 0}, BalanceCost{-1, 1}, BalanceCost{1, -2}}) {
    const absl::Status status = PartitionDfsContiguous(tree, 1, bad).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), ::testing::HasSubstr("per_key"));
  }
  // Costs beyond 2^62 are refused rather than wrapped.
  const absl::Status overflow =
      CutContiguous(std::vector<int64_t>{int64_t{1} << 30}, std::vector<int64_t>{0}, 1,
                    {.per_token = 1, .per_key = int64_t{1} << 10})
          .status();
  EXPECT_EQ(overflow.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(overflow.message(), ::testing::HasSubstr("overflows"));
  const ContiguousCut empty = *CutContiguous({}, {}, 3);
  EXPECT_EQ(empty.bounds, (std::vector<int64_t>{0, 0, 0, 0}));
}

}  // namespace
}  // namespace dta
