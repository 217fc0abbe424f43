#include "dispatcher/batch/batch_plan.h"

#include <algorithm>
#include <set>
#include <string>

#include "gtest/gtest.h"

namespace dta {
namespace {

Rollout Make(const std::string& id, const std::string& group, std::vector<TokenId> tokens,
             double reward, std::vector<int32_t> versions = {}) {
  Rollout r;
  r.id = id;
  r.group = group;
  r.tokens = std::move(tokens);
  r.loss_mask.assign(r.tokens.size(), 1);
  r.loss_mask[0] = 0;
  r.logprobs.assign(r.tokens.size(), -1.0f);
  r.versions = std::move(versions);
  r.reward = reward;
  return r;
}

std::vector<const Rollout*> Pointers(const std::vector<Rollout>& rollouts) {
  std::vector<const Rollout*> out;
  for (const Rollout& r : rollouts) out.push_back(&r);
  return out;
}

TEST(BatchPlan, OptionsNeedExactlyOneSize) {
  EXPECT_FALSE(ValidateBatchOptions({}).ok());
  EXPECT_FALSE(ValidateBatchOptions({.rollouts = 2, .tokens = 5}).ok());
  EXPECT_FALSE(ValidateBatchOptions({.rollouts = 2, .max_staleness = -2}).ok());
  EXPECT_TRUE(ValidateBatchOptions({.tokens = 5}).ok());
}

TEST(BatchPlan, SelectsTheOldestByCountOrTokens) {
  const std::vector<Rollout> pending = {Make("a", "g", {1, 2, 3}, 0), Make("b", "g", {1, 2}, 1),
                                        Make("c", "g", {4, 5, 6, 7}, 0)};
  BatchSelection two = SelectBatch(Pointers(pending), 0, {.rollouts = 2});
  ASSERT_TRUE(two.ready);
  EXPECT_EQ(two.batch, (std::vector<int64_t>{0, 1}));
  BatchSelection four = SelectBatch(Pointers(pending), 0, {.rollouts = 4});
  EXPECT_FALSE(four.ready);
  EXPECT_TRUE(four.batch.empty());
  EXPECT_EQ(four.fresh_rollouts, 3);
  EXPECT_EQ(four.fresh_tokens, 9);
  // 3 + 2 = 5 tokens reach 4: the batch closes at the rollout that crosses the threshold.
  BatchSelection tokens = SelectBatch(Pointers(pending), 0, {.tokens = 4});
  ASSERT_TRUE(tokens.ready);
  EXPECT_EQ(tokens.batch, (std::vector<int64_t>{0, 1}));
}

TEST(BatchPlan, DropsStaleTrajectoriesMetOnTheWay) {
  const std::vector<Rollout> pending = {
      Make("old", "g", {1, 2}, 0, {-1, 2}), Make("new", "g", {1, 3}, 0, {-1, 5}),
      Make("prompt-only", "g", {1, 4}, 0, {-1, -1}), Make("old2", "g", {1, 5}, 0, {-1, 1})};
  EXPECT_EQ(Staleness(pending[0], 5), 3);
  EXPECT_EQ(Staleness(pending[2], 5), 0);
  BatchSelection selection = SelectBatch(Pointers(pending), 5, {.rollouts = 2, .max_staleness = 2});
  ASSERT_TRUE(selection.ready);
  EXPECT_EQ(selection.batch, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(selection.stale,
            (std::vector<int64_t>{0}));  // old2 comes after the batch: not judged yet
  BatchSelection unlimited = SelectBatch(Pointers(pending), 5, {.rollouts = 2});
  EXPECT_EQ(unlimited.batch, (std::vector<int64_t>{0, 1}));
  EXPECT_TRUE(unlimited.stale.empty());
}

// Group advantages and normalisers come from the whole batch, whatever the split.
TEST(BatchPlan, AdvantagesAndNormalisersCoverTheWholeBatch) {
  std::vector<Rollout> batch;
  for (int i = 0; i < 7; ++i) {
    // Groups interleave with the lexicographic order, so a group spans ranks.
    batch.push_back(
        Make("r" + std::to_string(i), i % 2 ? "odd" : "even", {1, 2, i % 3 + 3, i + 10}, 0.3 * i));
  }
  // One rollout brings per-token advantages of its own: they are kept, and its reward still counts
  // towards its group's statistics.
  batch[4].advantages = {0.5f, -1.5f, 2.0f, 0.25f};
  absl::StatusOr<std::vector<std::vector<float>>> whole = GroupAdvantages(batch);
  ASSERT_TRUE(whole.ok());
  for (int world : {1, 2, 3, 7, 9}) {
    SCOPED_TRACE(world);
    absl::StatusOr<PartitionPlan> plan = PlanPartitions(Pointers(batch), world, true, {});
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (int i = 0; i < 7; ++i) EXPECT_EQ(PlannedAdvantages(*plan, i, batch[i]), (*whole)[i]) << i;
    EXPECT_EQ(plan->context, MakeBatchContext(batch));
    ASSERT_EQ(plan->ranks.size(), static_cast<size_t>(world));
    std::multiset<int64_t> seen;
    for (const auto& rank : plan->ranks) {
      seen.insert(rank.begin(), rank.end());
      // Lexicographic within a rank.
      for (size_t j = 1; j < rank.size(); ++j)
        EXPECT_LE(batch[rank[j - 1]].tokens, batch[rank[j]].tokens);
    }
    EXPECT_EQ(seen, (std::multiset<int64_t>{0, 1, 2, 3, 4, 5, 6}));
    EXPECT_GE(plan->partition.imbalance, 1.0);
  }
}

TEST(BatchPlan, SplitsBalancingTheGivenCost) {
  // Two 40-token paths first in lexicographic order, then ten of 8 tokens: tree tokens pair the
  // long paths up; a cost with attended keys gives each rank one of them.
  std::vector<Rollout> batch = {Make("long-a", "g", std::vector<TokenId>(40, 1), 1),
                                Make("long-b", "g", std::vector<TokenId>(40, 2), 0)};
  for (int i = 0; i < 10; ++i)
    batch.push_back(Make("short-" + std::to_string(i), "g", std::vector<TokenId>(8, 10 + i), i));
  const absl::StatusOr<PartitionPlan> by_tokens = PlanPartitions(Pointers(batch), 2, true, {});
  ASSERT_TRUE(by_tokens.ok()) << by_tokens.status();
  EXPECT_EQ(by_tokens->ranks[0], (std::vector<int64_t>{0, 1}));
  const BalanceCost time{.per_token = 1, .per_key = 1};
  const absl::StatusOr<PartitionPlan> by_time = PlanPartitions(Pointers(batch), 2, true, {}, time);
  ASSERT_TRUE(by_time.ok()) << by_time.status();
  EXPECT_EQ(by_time->ranks[0], (std::vector<int64_t>{0}));
  EXPECT_EQ(by_time->partition.tree_tokens, (std::vector<int64_t>{40, 120}));
  EXPECT_EQ(by_time->partition.max_cost, time.PathCost(40) + 10 * time.PathCost(8));
  const absl::StatusOr<PartitionPlan> invalid =
      PlanPartitions(Pointers(batch), 2, true, {}, {.per_token = 0, .per_key = 0});
  ASSERT_FALSE(invalid.ok());
  EXPECT_NE(invalid.status().message().find("per_token"), absl::string_view::npos);
}

TEST(BatchPlan, PlanErrorsNameTheRollout) {
  std::vector<Rollout> batch = {Make("ok", "g", {1, 2}, 1)};
  batch.push_back(Make("bad", "g", {1, 3}, 0));
  batch.back().reward.reset();
  absl::StatusOr<PartitionPlan> plan = PlanPartitions(Pointers(batch), 2, true, {});
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("'bad'"), absl::string_view::npos);
  EXPECT_TRUE(PlanPartitions(Pointers(batch), 2, /*with_advantages=*/false, {}).ok());
  // Rewards whose advantages leave float's range are refused, not turned into infinities (a
  // finding of the fuzzer).
  std::vector<Rollout> huge = {Make("big", "h", {1, 2}, 1e39),
                               Make("small", "h", {1, 3}, -1e39 - 1)};
  absl::StatusOr<PartitionPlan> refused =
      PlanPartitions(Pointers(huge), 1, true, {.std_level = AdvantageLevel::kNone});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("outside float's range"), absl::string_view::npos);
  EXPECT_FALSE(PlanPartitions(Pointers(batch), 0, false, {}).ok());
}

}  // namespace
}  // namespace dta
