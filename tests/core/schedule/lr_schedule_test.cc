#include "core/schedule/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

using ::testing::HasSubstr;

TEST(LrSchedule, ConstantWithAndWithoutWarmup) {
  EXPECT_EQ(LrFactor({}, 0), 1.0);
  EXPECT_EQ(LrFactor({}, 1000), 1.0);
  const LrSchedule warm = {.warmup_steps = 4};
  // The first step already learns: (s + 1) / warmup, never 0.
  EXPECT_EQ(LrFactor(warm, 0), 0.25);
  EXPECT_EQ(LrFactor(warm, 1), 0.5);
  EXPECT_EQ(LrFactor(warm, 3), 1.0);
  EXPECT_EQ(LrFactor(warm, 4), 1.0);
  EXPECT_EQ(LrFactor(warm, 100), 1.0);
}

TEST(LrSchedule, LinearDecayAfterWarmup) {
  const LrSchedule linear = {
      .decay = LrDecay::kLinear, .warmup_steps = 2, .total_steps = 12, .min_lr_ratio = 0.1};
  EXPECT_EQ(LrFactor(linear, 0), 0.5);
  EXPECT_EQ(LrFactor(linear, 1), 1.0);
  EXPECT_EQ(LrFactor(linear, 2), 1.0);  // the decay starts at the peak
  EXPECT_DOUBLE_EQ(LrFactor(linear, 7), 0.1 + 0.9 * 0.5);
  EXPECT_DOUBLE_EQ(LrFactor(linear, 12), 0.1);
  EXPECT_DOUBLE_EQ(LrFactor(linear, 50), 0.1);  // stays at the floor
}

TEST(LrSchedule, CosineDecayFollowsHalfAPeriod) {
  const LrSchedule cosine = {.decay = LrDecay::kCosine, .total_steps = 8};
  for (int s = 0; s <= 10; ++s) {
    const double p = std::min(1.0, s / 8.0);
    EXPECT_DOUBLE_EQ(LrFactor(cosine, s), 0.5 * (1.0 + std::cos(std::numbers::pi * p))) << s;
  }
  EXPECT_EQ(LrFactor(cosine, 0), 1.0);
  EXPECT_NEAR(LrFactor(cosine, 8), 0.0, 1e-15);
  // Monotone non-increasing after the warmup, down to the floor.
  const LrSchedule warm = {
      .decay = LrDecay::kCosine, .warmup_steps = 3, .total_steps = 30, .min_lr_ratio = 0.2};
  for (int s = 3; s < 40; ++s) EXPECT_LE(LrFactor(warm, s + 1), LrFactor(warm, s)) << s;
  EXPECT_DOUBLE_EQ(LrFactor(warm, 30), 0.2);
}

TEST(LrSchedule, ParsesNamesAndRefusesBadSchedulesNamingTheField) {
  for (LrDecay d : {LrDecay::kConstant, LrDecay::kLinear, LrDecay::kCosine}) {
    EXPECT_EQ(*ParseLrDecay(LrDecayName(d)), d);
  }
  EXPECT_EQ(*ParseLrDecay("cosine"), LrDecay::kCosine);
  const absl::StatusOr<LrDecay> bad = ParseLrDecay("step");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("'step' is not constant, linear or cosine"));

  EXPECT_TRUE(ValidateLrSchedule({}).ok());
  EXPECT_TRUE(ValidateLrSchedule({.warmup_steps = 5}).ok());  // constant needs no end
  struct Case {
    LrSchedule schedule;
    const char* field;
  };
  for (const Case& c :
       {Case{{.warmup_steps = -1}, "warmup_steps"}, Case{{.total_steps = -1}, "total_steps"},
        Case{{.min_lr_ratio = 1.5}, "min_lr_ratio"},
        Case{{.min_lr_ratio = std::nan("")}, "min_lr_ratio"},
        Case{{.decay = LrDecay::kCosine}, "total_steps"},
        Case{{.decay = LrDecay::kLinear, .warmup_steps = 5, .total_steps = 5}, "total_steps"}}) {
    const absl::Status status = ValidateLrSchedule(c.schedule);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(status.message()), HasSubstr(std::string("field '") + c.field + "'"));
  }
}

}  // namespace
}  // namespace dta
