#include "core/schedule/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "core/base/field_error.h"

namespace dta {

absl::StatusOr<LrDecay> ParseLrDecay(std::string_view name) {
  if (name == "constant") return LrDecay::kConstant;
  if (name == "linear") return LrDecay::kLinear;
  if (name == "cosine") return LrDecay::kCosine;
  return absl::InvalidArgumentError(absl::StrCat("lr schedule '",
                                                 absl::string_view(name.data(), name.size()),
                                                 "' is not constant, linear or cosine"));
}

std::string_view LrDecayName(LrDecay decay) {
  switch (decay) {
    case LrDecay::kConstant:
      return "constant";
    case LrDecay::kLinear:
      return "linear";
    case LrDecay::kCosine:
      return "cosine";
  }
  return "?";
}

absl::Status ValidateLrSchedule(const LrSchedule& schedule) {
  if (schedule.warmup_steps < 0) {
    return FieldError("warmup_steps", absl::StrCat(schedule.warmup_steps, " is negative"));
  }
  if (schedule.total_steps < 0) {
    return FieldError("total_steps", absl::StrCat(schedule.total_steps, " is negative"));
  }
  if (!(schedule.min_lr_ratio >= 0.0 && schedule.min_lr_ratio <= 1.0)) {
    return FieldError("min_lr_ratio", absl::StrCat(schedule.min_lr_ratio, " is not in [0, 1]"));
  }
  if (schedule.decay != LrDecay::kConstant && schedule.total_steps <= schedule.warmup_steps) {
    return FieldError(
        "total_steps",
        absl::StrCat(schedule.total_steps, " must be above warmup_steps (", schedule.warmup_steps,
                     ") for a ", std::string(LrDecayName(schedule.decay)),
                     " decay: it says where it ends"));
  }
  return absl::OkStatus();
}

double LrFactor(const LrSchedule& schedule, int64_t step) {
  if (step < schedule.warmup_steps) {
    return static_cast<double>(step + 1) / static_cast<double>(schedule.warmup_steps);
  }
  if (schedule.decay == LrDecay::kConstant) return 1.0;
  const double progress =
      std::clamp(static_cast<double>(step - schedule.warmup_steps) /
                     static_cast<double>(schedule.total_steps - schedule.warmup_steps),
                 0.0, 1.0);
  const double m = schedule.min_lr_ratio;
  if (schedule.decay == LrDecay::kLinear) return m + (1.0 - m) * (1.0 - progress);
  return m + (1.0 - m) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace dta
