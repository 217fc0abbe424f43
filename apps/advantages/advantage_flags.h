// The flags that say how rewards become advantages (core/loss/batch_context.h AdvantageOptions),
// shared by the programs that compute advantages: dta-dispatcher (for the trainers it serves) and
// dta-train. Not dta-trainer: its advantages come from the dispatcher.
#pragma once

#include "absl/status/statusor.h"
#include "core/loss/batch_context.h"

namespace dta {

// --reward_bias, --reward_scaling, --reward_clip, --advantage_mean_level, --advantage_std_level,
// --advantage_std_eps, --advantage_token_weighted. INVALID_ARGUMENT naming the flag when a value
// is out of range.
absl::StatusOr<AdvantageOptions> AdvantageOptionsFromFlags();

}  // namespace dta
