#include "core/tree/tree_partition.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>

#include "core/tree/tree_stats.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/tree/random_trees.h"

namespace dta {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using Rollouts = std::vector<std::vector<TokenId>>;

// Every invariant of the contract, checked from the rollouts themselves.
void CheckPartition(const Rollouts& rollouts, const PrefixTree& tree, int64_t capacity,
                    const TreePartition& partition, const std::string& label) {
  SCOPED_TRACE(label);
  std::vector<int> seen(rollouts.size(), 0);
  int64_t total = 0;
  for (const TreeBatch& batch : partition.batches) {
    ASSERT_FALSE(batch.rollouts.empty());
    Rollouts sequences;
    for (RolloutIndex r : batch.rollouts) {
      ASSERT_GE(r, 0);
      ASSERT_LT(r, static_cast<RolloutIndex>(rollouts.size()));
      seen[r]++;
      sequences.push_back(rollouts[r]);
    }
    // Lexicographic order: by sequence, equal sequences by index.
    std::vector<RolloutIndex> sorted = batch.rollouts;
    std::stable_sort(sorted.begin(), sorted.end());
    std::stable_sort(sorted.begin(), sorted.end(),
                     [&](RolloutIndex a, RolloutIndex b) { return rollouts[a] < rollouts[b]; });
    EXPECT_EQ(batch.rollouts, sorted);
    // Honest tokens: the batch's own prefix tree.
    const PrefixTree own = *PrefixTree::FromRollouts(sequences);
    EXPECT_EQ(batch.tokens, own.num_tree_tokens());
    EXPECT_LE(batch.tokens, capacity);
    total += batch.tokens;
  }
  for (size_t r = 0; r < rollouts.size(); ++r) EXPECT_EQ(seen[r], 1) << "rollout " << r;
  EXPECT_EQ(partition.total_tokens, total);
  EXPECT_EQ(partition.tree_tokens, tree.num_tree_tokens());
  EXPECT_EQ(partition.flattened_tokens, ComputeTreeStats(tree).leaf_tokens);
  EXPECT_GE(partition.total_tokens, partition.tree_tokens);
  EXPECT_LE(partition.total_tokens, partition.flattened_tokens);  // never worse than flattening
  const int64_t redundant = partition.flattened_tokens - partition.tree_tokens;
  const double err =
      redundant > 0
          ? static_cast<double>(partition.flattened_tokens - partition.total_tokens) / redundant
          : 1.0;
  EXPECT_DOUBLE_EQ(partition.effective_reuse_ratio, err);
  EXPECT_GE(partition.effective_reuse_ratio, 0.0);
  EXPECT_LE(partition.effective_reuse_ratio, 1.0);
}

int64_t LongestRollout(const Rollouts& rollouts) {
  int64_t longest = 0;
  for (const auto& r : rollouts) longest = std::max<int64_t>(longest, r.size());
  return longest;
}

// Capacities from the tightest (the longest rollout) to more than the whole tree.
std::vector<int64_t> Capacities(int64_t longest, int64_t tree) {
  std::set<int64_t> c = {longest,
                         longest + 1,
                         longest + (tree - longest) / 4,
                         (longest + tree) / 2,
                         std::max(longest, tree - 1),
                         tree,
                         2 * tree};
  return {c.begin(), c.end()};
}

// Trees shaped like agentic rollouts: a long shared prompt, then turns that branch 2..max_children
// ways with segments of 1..max_segment fresh tokens, up to max_leaves leaves. Bin packing matters
// here: the prompt is paid once per batch.
Rollouts PromptTree(uint64_t seed, int max_leaves, int max_children, int max_segment,
                    int max_prompt) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](int lo, int hi) {
    return lo + static_cast<int>(rng() % static_cast<uint64_t>(hi - lo + 1));
  };
  TokenId fresh = 0;
  Rollouts leaves, open = {std::vector<TokenId>(uniform(1, max_prompt), fresh++)};
  while (!open.empty()) {
    std::vector<TokenId> path = std::move(open.back());
    open.pop_back();
    const int children = uniform(0, max_children);
    if (children < 2 || static_cast<int>(leaves.size() + open.size()) + children + 1 > max_leaves) {
      leaves.push_back(std::move(path));
      continue;
    }
    for (int c = 0; c < children; ++c) {
      std::vector<TokenId> child = path;
      child.insert(child.end(), uniform(1, max_segment), fresh++);
      open.push_back(std::move(child));
    }
  }
  return leaves;
}

struct RatioStats {
  double sum = 0, worst = 1;
  int cases = 0, optimal = 0;
};

// Checks both algorithms on one tree at several capacities and accumulates greedy / exact.
void CompareWithExact(const Rollouts& rollouts, const std::string& name, RatioStats& stats) {
  const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
  const int64_t tree_tokens = tree.num_tree_tokens();
  for (int64_t capacity : Capacities(LongestRollout(rollouts), tree_tokens)) {
    const std::string label = name + ", capacity " + std::to_string(capacity);
    const absl::StatusOr<TreePartition> greedy = PartitionTreeGreedy(tree, capacity);
    const absl::StatusOr<TreePartition> exact = PartitionTreeExact(tree, capacity);
    ASSERT_TRUE(greedy.ok()) << label << ": " << greedy.status();
    ASSERT_TRUE(exact.ok()) << label << ": " << exact.status();
    CheckPartition(rollouts, tree, capacity, *greedy, "greedy, " + label);
    CheckPartition(rollouts, tree, capacity, *exact, "exact, " + label);
    EXPECT_GE(greedy->total_tokens, exact->total_tokens) << label;
    EXPECT_GE(exact->total_tokens, tree_tokens) << label;
    if (capacity >= tree_tokens) {
      EXPECT_EQ(exact->total_tokens, tree_tokens) << label;
      EXPECT_EQ(greedy->total_tokens, tree_tokens) << label;
      EXPECT_EQ(greedy->batches.size(), 1u) << label;
      EXPECT_DOUBLE_EQ(greedy->effective_reuse_ratio, 1.0) << label;
    }
    const double ratio = static_cast<double>(greedy->total_tokens) / exact->total_tokens;
    stats.sum += ratio;
    stats.worst = std::max(stats.worst, ratio);
    stats.optimal += greedy->total_tokens == exact->total_tokens;
    stats.cases++;
  }
}

void Report(const char* name, const RatioStats& stats) {
  std::printf(
      "%s: greedy / exact total tokens over %d cases: mean %.4f, worst %.4f, optimal in %.1f%%\n",
      name, stats.cases, stats.sum / stats.cases, stats.worst, 100.0 * stats.optimal / stats.cases);
}

TEST(TreePartition, RandomTreesHonourTheContractAndGreedyIsNearOptimal) {
  RatioStats stats;
  for (uint64_t seed = 0; seed < 400; ++seed) {
    CompareWithExact(testing::RandomRollouts(seed), "seed " + std::to_string(seed), stats);
  }
  for (uint64_t seed = 0; seed < 100; ++seed) {
    CompareWithExact(
        testing::RandomRollouts(seed, {.max_rollouts = 14, .max_length = 12, .vocab = 2}),
        "binary seed " + std::to_string(seed), stats);
  }
  Report("RandomRollouts", stats);
  EXPECT_LE(stats.sum / stats.cases, 1.25);
}

TEST(TreePartition, PromptTreesGreedyIsNearOptimal) {
  RatioStats stats;
  for (uint64_t seed = 0; seed < 150; ++seed) {
    CompareWithExact(PromptTree(seed, 12, 4, 30, 150), "prompt tree " + std::to_string(seed),
                     stats);
  }
  Report("PromptTree", stats);
  EXPECT_LE(stats.sum / stats.cases, 1.25);
}

// The exact DP against brute force over every set partition of the leaf sequences, with each
// batch's cost counted as its distinct non-empty prefixes.
TEST(TreePartition, ExactMatchesBruteForceOverSetPartitions) {
  int checked = 0;
  for (uint64_t seed = 1000; seed < 1300; ++seed) {
    const Rollouts rollouts = testing::RandomRollouts(seed, {.max_rollouts = 8, .max_length = 10});
    const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
    // Leaf sequences: rollouts that are not a prefix of another, deduplicated.
    std::set<std::vector<TokenId>> leaf_set;
    for (const auto& a : rollouts) {
      const bool prefix = std::any_of(rollouts.begin(), rollouts.end(), [&](const auto& b) {
        return b.size() > a.size() && std::equal(a.begin(), a.end(), b.begin());
      });
      if (!prefix) leaf_set.insert(a);
    }
    const Rollouts leaves(leaf_set.begin(), leaf_set.end());
    const int n = static_cast<int>(leaves.size());
    if (n > 7) continue;
    std::vector<int64_t> cost(1 << n, 0);
    for (int mask = 1; mask < (1 << n); ++mask) {
      std::set<std::vector<TokenId>> prefixes;
      for (int i = 0; i < n; ++i) {
        if (!(mask >> i & 1)) continue;
        for (size_t k = 1; k <= leaves[i].size(); ++k)
          prefixes.emplace(leaves[i].begin(), leaves[i].begin() + k);
      }
      cost[mask] = static_cast<int64_t>(prefixes.size());
    }
    const int64_t longest = LongestRollout(rollouts);
    for (int64_t capacity : Capacities(longest, tree.num_tree_tokens())) {
      // Every set partition, as a list of blocks built leaf by leaf.
      int64_t brute = std::numeric_limits<int64_t>::max();
      std::vector<int> blocks;
      std::function<void(int)> place = [&](int i) {
        if (i == n) {
          int64_t total = 0;
          for (int b : blocks) {
            if (cost[b] > capacity) return;
            total += cost[b];
          }
          brute = std::min(brute, total);
          return;
        }
        for (size_t b = 0; b < blocks.size(); ++b) {
          blocks[b] |= 1 << i;
          place(i + 1);
          blocks[b] &= ~(1 << i);
        }
        blocks.push_back(1 << i);
        place(i + 1);
        blocks.pop_back();
      };
      place(0);
      const absl::StatusOr<TreePartition> exact = PartitionTreeExact(tree, capacity);
      ASSERT_TRUE(exact.ok()) << exact.status();
      EXPECT_EQ(exact->total_tokens, brute) << "seed " << seed << ", capacity " << capacity;
      ++checked;
    }
  }
  EXPECT_GT(checked, 500);
}

// Tree Training's Figure 5 numbers, in units of 1k tokens: 4 trajectories, 83 tree tokens, 164
// flattened (POR 0.49); the capacity lies between the longest path (41) and the tree (83), and the
// partition is two traversals, one per branch, of 51 each: 102 tokens, ERR (164 - 102) / 81.
TEST(TreePartition, Figure5Example) {
  auto seq = [](std::initializer_list<std::pair<TokenId, int>> runs) {
    std::vector<TokenId> out;
    for (const auto& [token, count] : runs) out.insert(out.end(), count, token);
    return out;
  };
  // A (19 shared), then branch B or C (12), then a 10-token leaf.
  const Rollouts rollouts = {
      seq({{1, 19}, {2, 12}, {3, 10}}),  // 0: A B L1
      seq({{1, 19}, {5, 12}, {6, 10}}),  // 1: A C L3
      seq({{1, 19}, {2, 12}, {4, 10}}),  // 2: A B L2
      seq({{1, 19}, {5, 12}, {7, 10}}),  // 3: A C L4
  };
  const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
  ASSERT_EQ(tree.num_tree_tokens(), 83);
  for (int64_t capacity : {51, 64, 82}) {
    for (const auto& partition :
         {PartitionTreeGreedy(tree, capacity), PartitionTreeExact(tree, capacity)}) {
      ASSERT_TRUE(partition.ok()) << partition.status();
      CheckPartition(rollouts, tree, capacity, *partition, "capacity " + std::to_string(capacity));
      EXPECT_EQ(partition->flattened_tokens, 164);
      EXPECT_EQ(partition->tree_tokens, 83);
      ASSERT_EQ(partition->batches.size(), 2u);
      EXPECT_THAT(partition->batches[0].rollouts, ElementsAre(0, 2));
      EXPECT_THAT(partition->batches[1].rollouts, ElementsAre(1, 3));
      EXPECT_EQ(partition->batches[0].tokens, 51);
      EXPECT_EQ(partition->batches[1].tokens, 51);
      EXPECT_EQ(partition->total_tokens, 102);
      EXPECT_NEAR(partition->effective_reuse_ratio, 62.0 / 81.0, 1e-12);
    }
  }
  // With room for the whole tree, one batch; at the longest path, one leaf per batch (flattening).
  const TreePartition whole = *PartitionTreeGreedy(tree, 83);
  ASSERT_EQ(whole.batches.size(), 1u);
  EXPECT_THAT(whole.batches[0].rollouts, ElementsAre(0, 2, 1, 3));
  EXPECT_DOUBLE_EQ(whole.effective_reuse_ratio, 1.0);
  const TreePartition flat = *PartitionTreeGreedy(tree, 41);
  EXPECT_EQ(flat.batches.size(), 4u);
  EXPECT_EQ(flat.total_tokens, 164);
  EXPECT_DOUBLE_EQ(flat.effective_reuse_ratio, 0.0);
}

TEST(TreePartition, PrefixRolloutsAndDuplicatesRideWithALeafBelow) {
  // {1,2} twice is a prefix of both leaves; {1,2,4} is duplicated. Capacity 3 holds one leaf.
  const Rollouts rollouts = {{1, 2}, {1, 2, 3}, {1, 2}, {1, 2, 4}, {1, 2, 4}, {5}};
  const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
  for (const auto& partition : {PartitionTreeGreedy(tree, 3), PartitionTreeExact(tree, 3)}) {
    ASSERT_TRUE(partition.ok()) << partition.status();
    CheckPartition(rollouts, tree, 3, *partition, "capacity 3");
    ASSERT_EQ(partition->batches.size(), 3u);
    EXPECT_THAT(partition->batches[0].rollouts, ElementsAre(0, 2, 1));
    EXPECT_THAT(partition->batches[1].rollouts, ElementsAre(3, 4));
    EXPECT_THAT(partition->batches[2].rollouts, ElementsAre(5));
    EXPECT_EQ(partition->total_tokens, 7);
    EXPECT_EQ(partition->flattened_tokens, 7);
    EXPECT_DOUBLE_EQ(partition->effective_reuse_ratio, 0.0);
  }
  // Capacity 4: both {1,2,x} leaves share {1,2}; {5} goes alone or with them (5 > 4: alone).
  const TreePartition four = *PartitionTreeGreedy(tree, 4);
  CheckPartition(rollouts, tree, 4, four, "capacity 4");
  ASSERT_EQ(four.batches.size(), 2u);
  EXPECT_THAT(four.batches[0].rollouts, ElementsAre(0, 2, 1, 3, 4));
  EXPECT_EQ(four.total_tokens, 5);
  EXPECT_DOUBLE_EQ(four.effective_reuse_ratio, 1.0);
}

// A shared prompt with many equal branches is plain bin packing: k branches per batch.
TEST(TreePartition, WideTreePacksBranchesEvenly) {
  Rollouts rollouts;
  for (int leaf = 0; leaf < 1000; ++leaf) {
    std::vector<TokenId> r(100, 7);  // the prompt
    r.push_back(1000 + leaf);
    r.insert(r.end(), 9, 3);
    rollouts.push_back(std::move(r));
  }
  const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
  for (int k : {1, 3, 7, 64, 1000}) {
    const int64_t capacity = 100 + 10 * k;
    const absl::StatusOr<TreePartition> partition = PartitionTreeGreedy(tree, capacity);
    ASSERT_TRUE(partition.ok()) << partition.status();
    const int64_t batches = (1000 + k - 1) / k;
    EXPECT_EQ(static_cast<int64_t>(partition->batches.size()), batches) << "k " << k;
    EXPECT_EQ(partition->total_tokens, 100 * batches + 10000) << "k " << k;
  }
}

TEST(TreePartition, LargeTreesAreFast) {
  // A 3000-level comb (each spine node has a 50-token leaf) and a random tree of 20000 rollouts.
  Rollouts comb;
  std::vector<TokenId> spine;
  for (int level = 0; level < 3000; ++level) {
    spine.push_back(1);
    std::vector<TokenId> leaf = spine;
    leaf.insert(leaf.end(), 50, 2);
    comb.push_back(std::move(leaf));
  }
  const PrefixTree comb_tree = *PrefixTree::FromRollouts(comb);
  for (int64_t capacity : {3050, 4000, 20000}) {
    const absl::StatusOr<TreePartition> partition = PartitionTreeGreedy(comb_tree, capacity);
    ASSERT_TRUE(partition.ok()) << partition.status();
    EXPECT_LE(partition->total_tokens, partition->flattened_tokens);
    int64_t total = 0;
    for (const TreeBatch& batch : partition->batches) {
      EXPECT_LE(batch.tokens, capacity);
      total += batch.tokens;
    }
    EXPECT_EQ(total, partition->total_tokens);
  }
  const Rollouts big =
      testing::RandomRollouts(7, {.max_rollouts = 20000, .max_length = 200, .vocab = 50});
  const PrefixTree big_tree = *PrefixTree::FromRollouts(big);
  const absl::StatusOr<TreePartition> partition =
      PartitionTreeGreedy(big_tree, 4 * LongestRollout(big));
  ASSERT_TRUE(partition.ok()) << partition.status();
  size_t placed = 0;
  for (const TreeBatch& batch : partition->batches) placed += batch.rollouts.size();
  EXPECT_EQ(placed, big.size());
  std::printf("random tree of %zu rollouts: %zu batches, ERR %.3f\n", big.size(),
              partition->batches.size(), partition->effective_reuse_ratio);
}

TEST(TreePartition, Errors) {
  const PrefixTree tree = *PrefixTree::FromRollouts({{1, 2, 3}, {1, 4}});
  for (const auto& fn : {PartitionTreeGreedy, PartitionTreeExact}) {
    const absl::Status small = fn(tree, 2).status();
    EXPECT_EQ(small.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(small.message()), HasSubstr("longest rollout (3 tokens)"));
    EXPECT_EQ(fn(tree, 0).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(fn(tree, -5).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(fn(tree, 3).ok());
  }
  Rollouts many;
  for (TokenId t = 0; t < 17; ++t) many.push_back({t});
  const PrefixTree wide = *PrefixTree::FromRollouts(many);
  const absl::Status too_big = PartitionTreeExact(wide, 5).status();
  EXPECT_EQ(too_big.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(too_big.message()), HasSubstr("17"));
  many.pop_back();  // 16 leaves: still exact
  const TreePartition sixteen = *PartitionTreeExact(*PrefixTree::FromRollouts(many), 5);
  EXPECT_EQ(sixteen.batches.size(), 4u);
  EXPECT_EQ(sixteen.total_tokens, 16);
}

TEST(TreePartition, EmptyTree) {
  const PrefixTree tree = *PrefixTree::FromRollouts({});
  for (const auto& partition : {PartitionTreeGreedy(tree, 1), PartitionTreeExact(tree, 1)}) {
    ASSERT_TRUE(partition.ok()) << partition.status();
    EXPECT_TRUE(partition->batches.empty());
    EXPECT_EQ(partition->total_tokens, 0);
    EXPECT_DOUBLE_EQ(partition->effective_reuse_ratio, 1.0);
  }
}

}  // namespace
}  // namespace dta
