#include "core/tree/shared_marks.h"

#include <algorithm>
#include <random>

#include "gtest/gtest.h"
#include "tests/core/tree/random_trees.h"

namespace dta {
namespace {

using Marks = std::vector<std::vector<uint8_t>>;

absl::StatusOr<Marks> Merge(const std::vector<std::vector<TokenId>>& rollouts, const Marks& marks) {
  absl::StatusOr<PrefixTree> tree = PrefixTree::FromRollouts(rollouts);
  if (!tree.ok()) return tree.status();
  std::vector<absl::Span<const uint8_t>> spans(marks.begin(), marks.end());
  return MarksOverSharedTokens(*tree, spans);
}

TEST(MarksOverSharedTokens, ASharedTokenIsMarkedWhenAnyRolloutThroughItMarksIt) {
  const absl::StatusOr<Marks> merged = Merge({{1, 2, 3}, {1, 2, 4}}, {{0, 0, 1}, {0, 1, 1}});
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(*merged, (Marks{{0, 1, 1}, {0, 1, 1}}));
}

TEST(MarksOverSharedTokens, DuplicatesAndPrefixesMergeWhereTheyOverlapOnly) {
  // Rollout 1 duplicates 0; rollout 2 is a prefix of both; rollout 3 shares only token 5.
  const absl::StatusOr<Marks> merged =
      Merge({{5, 6, 7}, {5, 6, 7}, {5, 6}, {5, 8}}, {{0, 0, 1}, {0, 0, 0}, {0, 1}, {1, 0}});
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(*merged, (Marks{{1, 1, 1}, {1, 1, 1}, {1, 1}, {1, 0}}));
}

// Brute force: position p of r against every rollout whose first p + 1 tokens are r's.
TEST(MarksOverSharedTokens, MatchesEveryPairOfRolloutsOnRandomTrees) {
  for (uint64_t seed = 1; seed <= 300; ++seed) {
    const std::vector<std::vector<TokenId>> rollouts = testing::RandomRollouts(seed);
    std::mt19937_64 random(seed);
    Marks marks;
    for (const auto& rollout : rollouts) {
      marks.emplace_back();
      for (size_t p = 0; p < rollout.size(); ++p) marks.back().push_back(random() % 4 == 0);
    }
    const absl::StatusOr<Marks> merged = Merge(rollouts, marks);
    ASSERT_TRUE(merged.ok()) << merged.status();
    for (size_t r = 0; r < rollouts.size(); ++r) {
      ASSERT_EQ((*merged)[r].size(), rollouts[r].size());
      for (size_t p = 0; p < rollouts[r].size(); ++p) {
        uint8_t expected = 0;
        for (size_t s = 0; s < rollouts.size(); ++s) {
          if (p < rollouts[s].size() &&
              std::equal(rollouts[r].begin(), rollouts[r].begin() + p + 1, rollouts[s].begin()))
            expected |= marks[s][p];
        }
        ASSERT_EQ((*merged)[r][p], expected)
            << "seed " << seed << " rollout " << r << " position " << p;
      }
    }
  }
}

TEST(MarksOfTreeTokens, OneFlagPerUniqueTokenInSerializedOrder) {
  const PrefixTree tree = *PrefixTree::FromRollouts({{1, 2, 3}, {1, 2, 4}, {1, 5}});
  const std::vector<uint8_t> a = {0, 0, 1}, b = {0, 1, 0}, c = {0, 0};
  const std::vector<absl::Span<const uint8_t>> marks = {a, b, c};
  const absl::StatusOr<std::vector<uint8_t>> merged = MarksOfTreeTokens(tree, marks);
  ASSERT_TRUE(merged.ok()) << merged.status();
  ASSERT_EQ(merged->size(), static_cast<size_t>(tree.num_tree_tokens()));
  // Serialized: {1}, {2}, {3}, {4}, {5} (children in increasing first token).
  const auto serialized = tree.serialized_tokens();
  const std::vector<TokenId> tokens(serialized.begin(), serialized.end());
  ASSERT_EQ(tokens, (std::vector<TokenId>{1, 2, 3, 4, 5}));
  EXPECT_EQ(*merged, (std::vector<uint8_t>{0, 1, 1, 0, 0}));
}

TEST(MarksOverSharedTokens, RefusesMarksOfTheWrongLength) {
  const absl::StatusOr<Marks> short_marks = Merge({{1, 2, 3}}, {{0, 1}});
  EXPECT_EQ(short_marks.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(short_marks.status().message().find("rollout 0 has 2 marks for 3 tokens"),
            std::string::npos)
      << short_marks.status();
  const absl::StatusOr<Marks> missing = Merge({{1, 2, 3}, {4}}, {{0, 1, 1}});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dta
