#include "dispatcher/wire/trajectory.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>

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

// A model of 3 decoder layers, layers 1 and 2 sparse, top 2 of `experts`.
RoutingShape Routing(int64_t experts) {
  return {.num_hidden_layers = 3, .sparse_layers = {1, 2}, .top_k = 2, .num_experts = experts};
}

// Three rows (the last token routes itself) of every decoder layer; row 1's layer 2 unrecorded.
RoutedExperts ThreeRows(int32_t offset) {
  return {.layers = 3,
          .top_k = 2,
          .ids = {0, 0, 1, 2, 3, 4, 5, 6, 7, offset, -1, -1, 8, 9, 1, 0, offset + 1, 2}};
}

// Each id type round-trips: the narrowest that holds the largest id, its all-ones value "not
// recorded".
TEST(Trajectory, RoutedExpertsTravelInTheNarrowestIdType) {
  for (const auto& [offset, type] :
       {std::pair{10, v1::RoutedExperts::UINT8}, std::pair{253, v1::RoutedExperts::UINT8},
        std::pair{254, v1::RoutedExperts::UINT16}, std::pair{65533, v1::RoutedExperts::UINT16},
        std::pair{65534, v1::RoutedExperts::INT32}, std::pair{1 << 20, v1::RoutedExperts::INT32}}) {
    SCOPED_TRACE(offset);
    Rollout rollout = *CheckTrajectory(Valid(), {});
    rollout.routed_experts = ThreeRows(offset);
    const v1::Trajectory t = TrajectoryFromRollout(rollout);
    EXPECT_EQ(t.routed_experts().id_type(), type);
    const int width = type == v1::RoutedExperts::UINT8    ? 1
                      : type == v1::RoutedExperts::UINT16 ? 2
                                                          : 4;
    EXPECT_EQ(t.routed_experts().ids().size(), 18u * width);
    const absl::StatusOr<Rollout> back =
        CheckTrajectory(t, {.routing = Routing(int64_t{offset} + 2)});
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, rollout);
  }
}

TEST(Trajectory, RoutedExpertsAreCheckedAgainstTheTrainersModel) {
  Rollout rollout = *CheckTrajectory(Valid(), {});
  rollout.routed_experts = ThreeRows(10);
  const v1::Trajectory routed = TrajectoryFromRollout(rollout);
  const auto refusal = [](const v1::Trajectory& t, const TrajectoryLimits& limits) {
    const absl::StatusOr<Rollout> result = CheckTrajectory(t, limits);
    EXPECT_FALSE(result.ok());
    EXPECT_EQ(FieldOfError(result.status()), "routed_experts") << result.status();
    return std::string(result.status().message());
  };
  EXPECT_THAT(refusal(routed, {}), HasSubstr("start dta-dispatcher with --routed_experts_model"));
  EXPECT_THAT(refusal(routed, {.routing = Routing(10)}),
              HasSubstr("row 1, layer 1: [7, 10]: expert 10 is not in [0, 10)"));
  EXPECT_THAT(refusal(Valid(), {.routing = Routing(16), .require_routed_experts = true}),
              HasSubstr("missing: routing replay is on"));
  EXPECT_TRUE(CheckTrajectory(Valid(), {.routing = Routing(16)}).ok());  // replay is optional

  v1::Trajectory t = routed;
  t.mutable_routed_experts()->mutable_ids()->pop_back();
  EXPECT_THAT(refusal(t, {.routing = Routing(16)}),
              HasSubstr("17 bytes are not whole rows of 3 layers x 2 ids of 1 bytes"));
  t = routed;
  t.mutable_routed_experts()->set_id_type(v1::RoutedExperts::ID_TYPE_UNSPECIFIED);
  EXPECT_THAT(refusal(t, {.routing = Routing(16)}), HasSubstr("is not UINT8, UINT16 or INT32"));
  t = routed;
  t.mutable_routed_experts()->set_top_k(4);
  EXPECT_THAT(refusal(t, {.routing = Routing(16)}), HasSubstr("are not whole rows"));
  Rollout top_3 = rollout;
  top_3.routed_experts = RoutedExperts{.layers = 3, .top_k = 3, .ids = {}};
  for (int i = 0; i < 27; ++i) top_3.routed_experts->ids.push_back(i % 3);
  EXPECT_THAT(refusal(TrajectoryFromRollout(top_3), {.routing = Routing(16)}),
              HasSubstr("top_k is 3 but the model routes each token to 2 experts"));
  EXPECT_THAT(refusal(routed, {.routing = Routing(16), .max_routed_experts_bytes = 17}),
              HasSubstr("18 bytes of ids, more than the limit of 17"));
  // Unchecked conversion of bytes that do not decode: ValidateRollout refuses the result.
  t = routed;
  t.mutable_routed_experts()->mutable_ids()->pop_back();
  EXPECT_FALSE(ValidateRollout(RolloutFromTrajectory(t)).ok());
}

TEST(Trajectory, FieldOfErrorNeedsTheFieldPrefix) {
  EXPECT_EQ(FieldOfError(absl::InvalidArgumentError("field 'tokens': empty")), "tokens");
  EXPECT_EQ(FieldOfError(absl::InvalidArgumentError("something else")), "");
  EXPECT_EQ(FieldOfError(absl::InvalidArgumentError("field 'unterminated")), "");
}

}  // namespace
}  // namespace dta
