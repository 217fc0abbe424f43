#include "core/tree/sharing_groups.h"
#include "core/tree/leaf_order.h"

#include <algorithm>
#include <numeric>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/tree/random_trees.h"

namespace dta {
namespace {

using ::testing::ElementsAre;

// `length` tokens: `prefix`, then `fill` repeated.
std::vector<TokenId> Rollout(const std::vector<TokenId>& prefix, TokenId fill, int64_t length) {
  std::vector<TokenId> tokens = prefix;
  tokens.resize(length, fill);
  return tokens;
}

int64_t BruteLcp(const std::vector<TokenId>& a, const std::vector<TokenId>& b) {
  const auto [end_a, end_b] = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  return end_a - a.begin();
}

TEST(SharingGroups, ShortPromptBeforeLongAnswersIsNotShared) {
  const std::vector<TokenId> prompt(100, 7);
  // Indices out of lexicographic order: the groups come in it.
  const PrefixTree tree = *PrefixTree::FromRollouts(
      {Rollout(prompt, 3, 16384), Rollout(prompt, 1, 16384), Rollout(prompt, 2, 15000)});
  EXPECT_THAT(SharingGroups(tree, {}), ElementsAre(ElementsAre(1), ElementsAre(2), ElementsAre(0)));
  // Sharing everything, or answers too short to pay, keeps one tree.
  EXPECT_THAT(SharingGroups(tree, {.max_unshared_fraction = 0}), ElementsAre(ElementsAre(1, 2, 0)));
  EXPECT_THAT(SharingGroups(tree, {.min_suffix = 16384}), ElementsAre(ElementsAre(1, 2, 0)));
}

TEST(SharingGroups, LongSharedPrefixesDuplicatesAndPrefixRolloutsStayShared) {
  const std::vector<TokenId> system(2000, 5);
  const std::vector<TokenId> answer = Rollout({}, 4, 9000);
  const PrefixTree tree = *PrefixTree::FromRollouts({
      Rollout(system, 1, 8000), Rollout(system, 2, 8000),  // 25% shared
      answer, answer,                                      // duplicates
      Rollout({}, 4, 5000),                                // a prefix of both
  });
  EXPECT_THAT(SharingGroups(tree, {}), ElementsAre(ElementsAre(4, 2, 3), ElementsAre(0, 1)));
}

TEST(SharingGroups, CutsExactlyWhereTheRuleSaysOnRandomTrees) {
  for (uint64_t seed = 0; seed < 500; ++seed) {
    const auto rollouts = testing::RandomRollouts(seed, {.max_rollouts = 14, .max_length = 30});
    const PrefixTree tree = *PrefixTree::FromRollouts(rollouts);
    const SharingOptions options{.max_unshared_fraction = 0.25 * static_cast<double>(seed % 5),
                                 .min_suffix = static_cast<int64_t>(seed % 7)};
    const std::vector<std::vector<RolloutIndex>> groups = SharingGroups(tree, options);
    std::vector<RolloutIndex> joined;
    for (const auto& group : groups) {
      ASSERT_FALSE(group.empty()) << "seed " << seed;
      joined.insert(joined.end(), group.begin(), group.end());
    }
    ASSERT_EQ(joined, LexicographicOrder(tree)) << "seed " << seed;
    // Each boundary between consecutive rollouts is a cut exactly when the rule holds.
    size_t group = 0, within = 0;
    for (size_t i = 1; i < joined.size(); ++i) {
      const int64_t a = static_cast<int64_t>(rollouts[joined[i - 1]].size());
      const int64_t b = static_cast<int64_t>(rollouts[joined[i]].size());
      const int64_t lcp = BruteLcp(rollouts[joined[i - 1]], rollouts[joined[i]]);
      const int64_t shorter = std::min(a, b);
      const bool rule = options.max_unshared_fraction > 0 &&
                        static_cast<double>(lcp) <=
                            options.max_unshared_fraction * static_cast<double>(shorter) &&
                        shorter - lcp >= options.min_suffix;
      const bool cut = ++within == groups[group].size();
      if (cut) ++group, within = 0;
      EXPECT_EQ(cut, rule) << "seed " << seed << " between positions " << i - 1 << " and " << i;
    }
  }
  EXPECT_TRUE(SharingGroups(*PrefixTree::FromRollouts({}), {}).empty());
}

}  // namespace
}  // namespace dta
