// Learning-rate schedules: constant, or a linear or cosine decay, each after an optional linear
// warmup; a function of the optimizer step alone, so a run resumed from a checkpoint (whose
// optimizer knows its step) continues on the same curve.
//
//   factor(s) = (s + 1) / warmup_steps                          for s < warmup_steps
//             = 1                                               constant, after the warmup
//             = m + (1 - m) * (1 - p)                           linear
//             = m + (1 - m) * (1 + cos(pi * p)) / 2             cosine
//   with p = (s - warmup_steps) / (total_steps - warmup_steps), clamped to [0, 1], and
//   m = min_lr_ratio; the learning rate of optimizer step s (0: the first) is lr * factor(s).
//
// The warmup counts from the first step (never a step at lr 0, unlike a scheduler stepped after
// the optimizer); after total_steps the rate stays at lr * m.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dta {

enum class LrDecay { kConstant, kLinear, kCosine };

struct LrSchedule {
  LrDecay decay = LrDecay::kConstant;
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;    // where the decay ends; needed (> warmup_steps) by linear and cosine
  double min_lr_ratio = 0.0;  // in [0, 1]

  bool operator==(const LrSchedule&) const = default;
};

// "constant", "linear" or "cosine"; INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<LrDecay> ParseLrDecay(std::string_view name);
std::string_view LrDecayName(LrDecay decay);

// INVALID_ARGUMENT naming the field: warmup_steps < 0, total_steps < 0, min_lr_ratio outside
// [0, 1], or a decay whose total_steps is not above warmup_steps.
absl::Status ValidateLrSchedule(const LrSchedule& schedule);

// The factor of the peak learning rate for optimizer step `step` (>= 0) of a valid schedule.
double LrFactor(const LrSchedule& schedule, int64_t step);

}  // namespace dta
