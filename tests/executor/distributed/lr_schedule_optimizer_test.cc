// TrainingOptimizer under a learning-rate schedule: every step uses peak x LrFactor(step), in each
// optimizer layout, as an AdamW whose rate is set by hand before each step; a resumed
// optimizer continues on the same curve; set_lr moves the peak.
#include <ATen/ATen.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "core/base/remove_tree.h"
#include "core/schedule/lr_schedule.h"
#include "executor/distributed/training_optimizer.h"
#include "executor/optim/adamw.h"
#include "gtest/gtest.h"

namespace dta {
namespace {

constexpr LrSchedule kSchedule = {
    .decay = LrDecay::kCosine, .warmup_steps = 2, .total_steps = 6, .min_lr_ratio = 0.1};
constexpr double kPeak = 0.05;

std::vector<std::pair<std::string, at::Tensor>> Parameters() {
  at::manual_seed(3);
  return {{"a", at::randn({5, 3}, at::kDouble).requires_grad_(true)},
          {"b", at::randn({7}, at::kDouble).requires_grad_(true)}};
}

// Deterministic gradients for step `s`.
void SetGradients(const std::vector<std::pair<std::string, at::Tensor>>& params, int s) {
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i].second;
    p.mutable_grad() = at::sin(at::arange(p.numel(), at::kDouble).reshape(p.sizes()) * (s + 1) +
                               static_cast<double>(i));
  }
}

class ScheduleTest : public ::testing::TestWithParam<bool> {};  // offloaded (sharded) or not

TEST_P(ScheduleTest, EveryStepUsesThePeakTimesTheFactorAndResumesOnTheCurve) {
  const TrainingLayout layout = {.offload_optimizer = GetParam()};
  const AdamWOptions adamw = {.lr = kPeak, .weight_decay = 0.1, .max_grad_norm = 0.0};

  // By hand: plain AdamW, its rate set before each step.
  auto by_hand = Parameters();
  AdamW reference(by_hand, adamw);
  // Scheduled, saved after 3 steps and resumed by a fresh optimizer.
  auto scheduled = Parameters();
  auto optimizer = std::make_unique<TrainingOptimizer>(scheduled, nullptr, layout, adamw);
  optimizer->set_schedule(kSchedule);
  const std::string dir = ::testing::TempDir() + "/lr_schedule_" + std::to_string(::getpid()) +
                          (GetParam() ? "_offload" : "");
  for (int s = 0; s < 9; ++s) {
    if (s == 3) {
      optimizer->SaveState(dir);
      optimizer = std::make_unique<TrainingOptimizer>(scheduled, nullptr, layout, adamw);
      optimizer->LoadState(dir);
      optimizer->set_schedule(kSchedule);
    }
    reference.set_lr(kPeak * LrFactor(kSchedule, s));
    SetGradients(by_hand, s);
    reference.Step();
    SetGradients(scheduled, s);
    optimizer->SyncGradients();  // into the sharded optimizer's flat buffer
    const StepStats stats = optimizer->Step();
    EXPECT_EQ(stats.lr, kPeak * LrFactor(kSchedule, s)) << "step " << s;
    EXPECT_EQ(stats.step, s + 1);
    for (size_t i = 0; i < by_hand.size(); ++i) {
      // Bit for bit when replicated (the same AdamW); the host update of offloaded state orders
      // its float64 arithmetic differently (sharded_adamw_test: 1e-12).
      const double error = (scheduled[i].second - by_hand[i].second).abs().max().item<double>();
      EXPECT_LE(error, GetParam() ? 1e-12 : 0.0) << "step " << s << " parameter " << i;
    }
  }
  EXPECT_EQ(optimizer->options().lr, kPeak * kSchedule.min_lr_ratio);  // the floor, after the end
  // set_lr moves the peak: the next step uses the new peak times the factor.
  optimizer->set_lr(2 * kPeak);
  SetGradients(scheduled, 9);
  optimizer->SyncGradients();
  EXPECT_EQ(optimizer->Step().lr, 2 * kPeak * kSchedule.min_lr_ratio);
  RemoveTree(dir);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ScheduleTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Offloaded" : "Replicated"; });

TEST(TrainingOptimizerSchedule, AnInvalidScheduleIsRefusedNamingTheField) {
  auto params = Parameters();
  TrainingOptimizer optimizer(params, nullptr, {}, {});
  try {
    optimizer.set_schedule({.decay = LrDecay::kLinear, .warmup_steps = 4, .total_steps = 4});
    ADD_FAILURE() << "accepted a decay that ends before it starts";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("field 'total_steps'"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace
}  // namespace dta
