#include "dispatcher/wire/trajectory.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

using ::testing::HasSubstr;

v1::Trajectory Valid() {
  v1::Trajectory t;
  t.set_id("task1-s0");
  t.set_group_id("task1");
  for (int32_t token : {5, 6, 7, 8}) t.add_tokens(token);
  for (bool m : {false, false, true, true}) t.add_loss_mask(m);
  for (float lp : {0.0f, -1.0f, -0.5f, -0.25f}) t.add_logprobs(lp);
  for (int32_t v : {-1, -1, 3, 3}) t.add_versions(v);
  t.set_reward(1.0);
  return t;
}

TEST(Trajectory, ValidOneConvertsAndRoundTrips) {
  absl::StatusOr<Rollout> rollout = CheckTrajectory(Valid(), {.vocab_size = 10});
  ASSERT_TRUE(rollout.ok()) << rollout.status();
  EXPECT_EQ(rollout->id, "task1-s0");
  EXPECT_EQ(rollout->group, "task1");
  EXPECT_EQ(rollout->tokens, (std::vector<TokenId>{5, 6, 7, 8}));
  EXPECT_EQ(rollout->loss_mask, (std::vector<uint8_t>{0, 0, 1, 1}));
  EXPECT_EQ(rollout->versions, (std::vector<int32_t>{-1, -1, 3, 3}));
  EXPECT_EQ(rollout->reward, 1.0);
  EXPECT_EQ(RolloutFromTrajectory(TrajectoryFromRollout(*rollout)), *rollout);
}

struct Case {
  const char* name;
  std::function<void(v1::Trajectory&)> edit;
  const char* field;
  const char* reason_part;
};

// Every admission rule, each refused with the field it names.
TEST(Trajectory, EveryRuleNamesItsField) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Case cases[] = {
      {"empty id", [](v1::Trajectory& t) { t.set_id(""); }, "id", "empty"},
      {"long id", [](v1::Trajectory& t) { t.set_id(std::string(300, 'x')); }, "id", "300 bytes"},
      {"long group", [](v1::Trajectory& t) { t.set_group_id(std::string(257, 'g')); }, "group_id",
       "257 bytes"},
      {"no tokens",
       [](v1::Trajectory& t) {
         t.clear_tokens();
         t.clear_loss_mask();
         t.clear_logprobs();
         t.clear_versions();
       },
       "tokens", "empty"},
      {"too many tokens",
       [](v1::Trajectory& t) {
         for (int i = 0; i < 20; ++i) t.add_tokens(1);
       },
       "tokens", "24 tokens, more than the limit of 16"},
      {"token above vocabulary", [](v1::Trajectory& t) { t.set_tokens(2, 10); }, "tokens",
       "token 2 = 10"},
      {"negative token", [](v1::Trajectory& t) { t.set_tokens(1, -3); }, "tokens", "token 1 = -3"},
      {"short loss_mask", [](v1::Trajectory& t) { t.mutable_loss_mask()->RemoveLast(); },
       "loss_mask", "3 values for 4 tokens"},
      {"first token trained", [](v1::Trajectory& t) { t.set_loss_mask(0, true); }, "loss_mask",
       "first token"},
      {"long logprobs", [](v1::Trajectory& t) { t.add_logprobs(0); }, "logprobs",
       "5 values for 4 tokens"},
      {"NaN logprob", [nan](v1::Trajectory& t) { t.set_logprobs(3, nan); }, "logprobs",
       "value 3 is not finite"},
      {"short versions", [](v1::Trajectory& t) { t.mutable_versions()->RemoveLast(); }, "versions",
       "3 values"},
      {"version below -1", [](v1::Trajectory& t) { t.set_versions(2, -2); }, "versions",
       "value 2 is -2"},
      {"short advantages", [](v1::Trajectory& t) { t.add_advantages(1); }, "advantages",
       "1 values for 4 tokens"},
      {"infinite advantage",
       [](v1::Trajectory& t) {
         for (int i = 0; i < 4; ++i) t.add_advantages(i == 1 ? INFINITY : 0);
       },
       "advantages", "value 1 is not finite"},
      {"short ref_logprobs", [](v1::Trajectory& t) { t.add_ref_logprobs(-1); }, "ref_logprobs",
       "1 values"},
      {"NaN reward", [](v1::Trajectory& t) { t.set_reward(std::nan("")); }, "reward", "not finite"},
      {"no reward nor advantages", [](v1::Trajectory& t) { t.clear_reward(); }, "reward",
       "missing"},
      {"huge reward", [](v1::Trajectory& t) { t.set_reward(-1e31); }, "reward", "beyond the limit"},
      {"large metadata",
       [](v1::Trajectory& t) { (*t.mutable_metadata())["k"] = std::string(100, 'v'); }, "metadata",
       "101 bytes"},
  };
  const TrajectoryLimits limits{.vocab_size = 10, .max_tokens = 16, .max_metadata_bytes = 64};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::Trajectory t = Valid();
    c.edit(t);
    absl::StatusOr<Rollout> rollout = CheckTrajectory(t, limits);
    ASSERT_FALSE(rollout.ok());
    EXPECT_EQ(rollout.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(FieldOfError(rollout.status()), c.field) << rollout.status();
    EXPECT_THAT(std::string(rollout.status().message()), HasSubstr(c.reason_part));
  }
}

TEST(Trajectory, AdvantagesAloneSufficeAndSftNeedsNeither) {
  v1::Trajectory t = Valid();
  t.clear_reward();
  for (int i = 0; i < 4; ++i) t.add_advantages(0.5f);
  EXPECT_TRUE(CheckTrajectory(t, {}).ok());
  t.clear_advantages();
  EXPECT_FALSE(CheckTrajectory(t, {}).ok());
  EXPECT_TRUE(CheckTrajectory(t, {.require_reward_or_advantages = false}).ok());
}

TEST(Trajectory, ReferenceLogprobsWhenTheLossNeedsThem) {
  v1::Trajectory t = Valid();
  absl::StatusOr<Rollout> missing = CheckTrajectory(t, {.require_ref_logprobs = true});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(FieldOfError(missing.status()), "ref_logprobs");
  for (int i = 0; i < 4; ++i) t.add_ref_logprobs(-1.0f);
  EXPECT_TRUE(CheckTrajectory(t, {.require_ref_logprobs = true}).ok());
}

TEST(Trajectory, FieldOfErrorNeedsTheFieldPrefix) {
  EXPECT_EQ(FieldOfError(absl::InvalidArgumentError("field 'tokens': empty")), "tokens");
  EXPECT_EQ(FieldOfError(absl::InvalidArgumentError("something else")), "");
  EXPECT_EQ(FieldOfError(absl::InvalidArgumentError("field 'unterminated")), "");
}

}  // namespace
}  // namespace dta
