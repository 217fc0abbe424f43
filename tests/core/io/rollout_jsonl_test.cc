#include "core/io/rollout_jsonl.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/", name);
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

Rollout Example() {
  Rollout r;
  r.id = "task\"3\"-s1";
  r.group = "task3";
  r.tokens = {151644, 0, 7, 2147483647};
  r.loss_mask = {0, 0, 1, 1};
  r.logprobs = {0.0f, -0.1f, -1e-30f, -3.4028235e38f};
  r.versions = {-1, -1, 4, 4};
  r.reward = 0.1;
  r.advantages = {0.0f, 0.5f, -0.25f, 1.0f / 3.0f};
  r.ref_logprobs = {0.0f, -0.2f, -0.3f, -7.0f};
  // Three rows (the last token has none) of two layers x top-2; row 1's second layer unrecorded.
  r.routed_experts =
      RoutedExperts{.layers = 2, .top_k = 2, .ids = {3, 0, 7, 1, 2, 5, -1, -1, 4, 6, 6, 0}};
  return r;
}

TEST(RolloutJsonl, RoundTripIsBitExact) {
  Rollout minimal;
  minimal.id = "m";
  minimal.group = "g";
  minimal.tokens = {1};
  minimal.loss_mask = {0};
  minimal.logprobs = {0.0f};
  const std::vector<Rollout> rollouts = {Example(), minimal};
  const std::string path = TempPath("round_trip.jsonl");
  ASSERT_TRUE(WriteRolloutsJsonl(path, rollouts).ok());
  const absl::StatusOr<std::vector<Rollout>> back = ReadRolloutsJsonl(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, rollouts);
}

// Doubles whose shortest form is a long integer (to_chars writes -2^70 in fixed notation) come back
// too: written with ".0", they are not read as integers beyond 64 bits (a finding of the fuzzer).
TEST(RolloutJsonl, HugeIntegralRewardsRoundTrip) {
  for (double reward : {-std::ldexp(1.0, 70), std::ldexp(1.0, 64), 1e22, 123.0, -0.0}) {
    Rollout r = Example();
    r.reward = reward;
    const absl::StatusOr<Rollout> back = ParseRolloutJson(RolloutToJson(r));
    ASSERT_TRUE(back.ok()) << reward << ": " << back.status();
    EXPECT_EQ(*back, r) << reward;
  }
}

TEST(RolloutJsonl, AcceptsIntegerIdsBooleanMasksBlankLinesAndCrlf) {
  const std::string path = TempPath("lenient.jsonl");
  WriteFile(path,
            "\n{\"id\": 17, \"group\": 3, \"tokens\": [1, 2], \"loss_mask\": [false, true], "
            "\"logprobs\": [0, -1], \"metadata\": {\"turn\": 2}}\r\n   \n");
  const absl::StatusOr<std::vector<Rollout>> rollouts = ReadRolloutsJsonl(path);
  ASSERT_TRUE(rollouts.ok()) << rollouts.status();
  ASSERT_EQ(rollouts->size(), 1u);
  EXPECT_EQ((*rollouts)[0].id, "17");
  EXPECT_EQ((*rollouts)[0].group, "3");
  EXPECT_EQ((*rollouts)[0].loss_mask, (std::vector<uint8_t>{0, 1}));
}

// The hand-written form [rows][layers][top_k] reads as the engines' base64 does.
TEST(RolloutJsonl, RoutedExpertsAsIdsOrBase64) {
  const std::string head =
      R"({"id": "a", "group": "g", "tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [0, -1, -2], )";
  const absl::StatusOr<Rollout> ids = ParseRolloutJson(absl::StrCat(
      head, R"("routed_experts": {"layers": 2, "top_k": 1, "ids": [[[4], [0]], [[2], [-1]]]}})"));
  ASSERT_TRUE(ids.ok()) << ids.status();
  ASSERT_TRUE(ids->routed_experts.has_value());
  EXPECT_EQ(ids->routed_experts->ids, (std::vector<int32_t>{4, 0, 2, -1}));
  const absl::StatusOr<Rollout> base64 = ParseRolloutJson(absl::StrCat(
      head, R"("routed_experts": {"layers": 2, "top_k": 1, "dtype": "int32", "base64": ")",
      EncodeRoutedExperts(*ids->routed_experts), R"("}})"));
  ASSERT_TRUE(base64.ok()) << base64.status();
  EXPECT_EQ(base64->routed_experts, ids->routed_experts);
}

struct BadCase {
  std::string name;
  std::string line;
  std::string expected;  // substrings of the message, beyond the file and line
};

TEST(RolloutJsonl, BadInputNamesFileLineRolloutAndField) {
  const std::string good =
      R"("group": "g", "tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [0, -1, -2])";
  const std::vector<BadCase> cases = {
      {"malformed", R"({"id": "a", "tokens": [1, 2)", "malformed JSON"},
      {"not_object", R"([1, 2, 3])", "must be a JSON object"},
      {"missing_id", absl::StrCat("{", good, "}"), "field 'id': missing"},
      {"mask_length",
       R"({"id": "a", "group": "g", "tokens": [1, 2, 3], "loss_mask": [0, 1], "logprobs": [0, -1, -2]})",
       "rollout 'a': field 'loss_mask': 2 values for 3 tokens"},
      {"logprob_length",
       R"({"id": "a", "group": "g", "tokens": [1, 2], "loss_mask": [0, 1], "logprobs": [0]})",
       "rollout 'a': field 'logprobs': 1 values for 2 tokens"},
      {"negative_token",
       R"({"id": "a", "group": "g", "tokens": [1, -2], "loss_mask": [0, 1], "logprobs": [0, -1]})",
       "rollout 'a': field 'tokens': value 1 = -2"},
      {"huge_token",
       R"({"id": "a", "group": "g", "tokens": [1, 3000000000], "loss_mask": [0, 1], "logprobs": [0, -1]})",
       "field 'tokens': value 1"},
      {"float_token",
       R"({"id": "a", "group": "g", "tokens": [1, 2.5], "loss_mask": [0, 1], "logprobs": [0, -1]})",
       "field 'tokens': value 1 is not an integer"},
      {"non_finite",
       R"({"id": "a", "group": "g", "tokens": [1, 2], "loss_mask": [0, 1], "logprobs": [0, -1e39]})",
       "rollout 'a': field 'logprobs': value 1 = -1e+39 is not finite in float32"},
      {"empty", R"({"id": "a", "group": "g", "tokens": [], "loss_mask": [], "logprobs": []})",
       "rollout 'a': field 'tokens': empty rollout"},
      {"mask_value",
       R"({"id": "a", "group": "g", "tokens": [1, 2], "loss_mask": [0, 2], "logprobs": [0, -1]})",
       "field 'loss_mask': value 1 = 2"},
      {"first_trained",
       R"({"id": "a", "group": "g", "tokens": [1, 2], "loss_mask": [1, 1], "logprobs": [0, -1]})",
       "field 'loss_mask': value 0 is 1"},
      {"unknown_field", absl::StrCat(R"({"id": "a", "advantage": [0, 1, 2], )", good, "}"),
       "rollout 'a': field 'advantage': unknown field"},
      {"missing_group", R"({"id": "a", "tokens": [1], "loss_mask": [0], "logprobs": [0]})",
       "field 'group': missing"},
      {"bad_reward", absl::StrCat(R"({"id": "a", "reward": "high", )", good, "}"),
       "field 'reward': must be a number"},
      {"huge_reward", absl::StrCat(R"({"id": "a", "reward": 1e308, )", good, "}"),
       "rollout 'a': field 'reward': 1e+308 is beyond the limit of +-1e+30"},
      {"bad_versions", absl::StrCat(R"({"id": "a", "versions": [0, -2, 1], )", good, "}"),
       "field 'versions': value 1 = -2"},
      {"advantages_length", absl::StrCat(R"({"id": "a", "advantages": [0.5], )", good, "}"),
       "field 'advantages': 1 values for 3 tokens"},
      {"routed_not_object", absl::StrCat(R"({"id": "a", "routed_experts": [1], )", good, "}"),
       "rollout 'a': field 'routed_experts': must be an object"},
      {"routed_no_top_k",
       absl::StrCat(R"({"id": "a", "routed_experts": {"layers": 1, "ids": []}, )", good, "}"),
       "field 'routed_experts': 'top_k' is missing"},
      {"routed_unknown_member",
       absl::StrCat(R"({"id": "a", "routed_experts": {"layers": 1, "top_k": 1, "idz": []}, )", good,
                    "}"),
       "field 'routed_experts': unknown member 'idz'"},
      {"routed_dtype",
       absl::StrCat(
           R"({"id": "a", "routed_experts": {"layers": 1, "top_k": 1, "dtype": "int64", "base64": ""}, )",
           good, "}"),
       "'dtype' must be \"int32\""},
      {"routed_rows",
       absl::StrCat(R"({"id": "a", "routed_experts": {"layers": 1, "top_k": 1, "ids": [[[0]]]}, )",
                    good, "}"),
       "rollout 'a': field 'routed_experts': 1 rows for 3 tokens"},
      {"routed_ragged",
       absl::StrCat(
           R"({"id": "a", "routed_experts": {"layers": 2, "top_k": 1, "ids": [[[0], [1]], [[0]]]}, )",
           good, "}"),
       "field 'routed_experts': ids row 1 must be an array of 2 layers"},
      {"routed_negative",
       absl::StrCat(
           R"({"id": "a", "routed_experts": {"layers": 1, "top_k": 2, "ids": [[[5, -5]], [[0, 1]]]}, )",
           good, "}"),
       "field 'routed_experts': ids row 0, layer 0 must be 2 integers >= -1"},
  };
  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = TempPath(c.name + ".jsonl");
    // The bad rollout sits on line 2 after a good one.
    WriteFile(path, absl::StrCat(R"({"id": "ok", )", good, "}\n", c.line, "\n"));
    const absl::StatusOr<std::vector<Rollout>> result = ReadRolloutsJsonl(path);
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(result.status().message()),
                AllOf(HasSubstr(absl::StrCat(path, ":2:")), HasSubstr(c.expected)));
  }
}

TEST(RolloutJsonl, DuplicateIdsNameBothLines) {
  const std::string path = TempPath("duplicate.jsonl");
  const std::string line =
      R"({"id": "x", "group": "g", "tokens": [1], "loss_mask": [0], "logprobs": [0]})";
  WriteFile(path, absl::StrCat(line, "\n", line, "\n"));
  const absl::StatusOr<std::vector<Rollout>> result = ReadRolloutsJsonl(path);
  EXPECT_THAT(std::string(result.status().message()),
              HasSubstr(":2: rollout 'x': field 'id': duplicate of line 1"));
}

TEST(RolloutJsonl, VocabularyBound) {
  const absl::StatusOr<Rollout> r = ParseRolloutJson(
      R"({"id": "v", "group": "g", "tokens": [1, 99], "loss_mask": [0, 1], "logprobs": [0, -1]})",
      {.vocab_size = 50});
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("rollout 'v': field 'tokens': token 1 = 99 is outside [0, 50)"));
}

TEST(RolloutJsonl, MissingFileIsNotFound) {
  EXPECT_EQ(ReadRolloutsJsonl(TempPath("does_not_exist.jsonl")).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace dta
