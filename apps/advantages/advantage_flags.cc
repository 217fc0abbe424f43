#include "apps/advantages/advantage_flags.h"

#include <cmath>
#include <limits>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(double, reward_bias, 0.0, "rewards are shaped as clip((reward + bias) * scaling)");
ABSL_FLAG(double, reward_scaling, 1.0, "rewards are shaped as clip((reward + bias) * scaling)");
ABSL_FLAG(double, reward_clip, std::numeric_limits<double>::infinity(),
          "shaped rewards are clipped to [-clip, clip] (inf: no clip; AReaL's default is 20)");
ABSL_FLAG(std::string, advantage_mean_level, "group",
          "advantages are centred over the rollout's group, the batch, or not at all (none)");
ABSL_FLAG(std::string, advantage_std_level, "group",
          "advantages are divided by the std over the group, the batch, or not at all (none)");
ABSL_FLAG(double, advantage_std_eps, 1e-6, "A = (r - mean) / (std + eps)");
ABSL_FLAG(bool, advantage_token_weighted, false,
          "mean and std count each rollout once per loss token (AReaL's adv_norm) instead of once");

namespace dta {

absl::StatusOr<AdvantageOptions> AdvantageOptionsFromFlags() {
  AdvantageOptions options;
  options.reward_bias = absl::GetFlag(FLAGS_reward_bias);
  options.reward_scaling = absl::GetFlag(FLAGS_reward_scaling);
  options.reward_clip = absl::GetFlag(FLAGS_reward_clip);
  options.std_eps = absl::GetFlag(FLAGS_advantage_std_eps);
  options.token_weighted = absl::GetFlag(FLAGS_advantage_token_weighted);
  const auto level = [](const char* flag, const std::string& name) {
    absl::StatusOr<AdvantageLevel> parsed = ParseAdvantageLevel(name);
    if (parsed.ok()) return parsed;
    return absl::StatusOr<AdvantageLevel>(
        absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", parsed.status().message())));
  };
  absl::StatusOr<AdvantageLevel> mean =
      level("advantage_mean_level", absl::GetFlag(FLAGS_advantage_mean_level));
  if (!mean.ok()) return mean.status();
  absl::StatusOr<AdvantageLevel> std =
      level("advantage_std_level", absl::GetFlag(FLAGS_advantage_std_level));
  if (!std.ok()) return std.status();
  options.mean_level = *mean;
  options.std_level = *std;
  if (!(options.std_eps >= 0) || !std::isfinite(options.std_eps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--advantage_std_eps must be finite and >= 0, got ", options.std_eps));
  }
  // The other fields' messages start with their names, which are the flags'.
  if (absl::Status status = ValidateAdvantageOptions(options); !status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", status.message()));
  }
  return options;
}

}  // namespace dta
