// What a loss needs to know about the whole batch before any rollout runs: the normaliser and the
// GRPO group advantages. Torch-free, so the dispatcher computes both for the whole batch before
// it splits the batch across trainers (a group's rollouts may land on different ranks, and the
// ranks' losses must sum to the single-process batch loss).
#pragma once

#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/io/rollout.h"

namespace dta {

// The batch's normalisers. With data parallelism both are global (over every rank's rollouts), so
// that the ranks' losses sum to the global batch loss.
struct BatchLossContext {
  double total_loss_tokens = 0;  // N: sum over rollouts of sum(loss_mask)
  int64_t num_rollouts = 0;      // R

  friend bool operator==(const BatchLossContext&, const BatchLossContext&) = default;
};

// N = total number of tokens with loss_mask = 1, R = rollouts.size().
BatchLossContext MakeBatchContext(absl::Span<const Rollout> rollouts);
// The same over rollouts held elsewhere (the dispatcher's batch: no copy).
BatchLossContext MakeBatchContext(absl::Span<const Rollout* const> rollouts);

// How rewards become advantages when a rollout carries none of its own.
enum class AdvantageLevel {
  kGroup,  // over the rollouts of the batch with the same `group` string (GRPO)
  kBatch,  // over every rollout of the batch that has a reward
  kNone,   // no centring (mean) / no scaling (std)
};

struct AdvantageOptions {
  // The reward is first shaped as AReaL's PPO actor does:
  //   r' = clamp((reward + reward_bias) * reward_scaling, -reward_clip, reward_clip).
  double reward_bias = 0.0;
  double reward_scaling = 1.0;
  double reward_clip = std::numeric_limits<double>::infinity();  // > 0
  // A = (r' - mean) / (std + std_eps), mean and std over the level's rollouts (mean 0 and no
  // division, eps included, at kNone). The defaults are GRPO's group normalisation.
  AdvantageLevel mean_level = AdvantageLevel::kGroup;
  AdvantageLevel std_level = AdvantageLevel::kGroup;
  double std_eps = 1e-6;  // >= 0
  // false: each rollout counts once (GRPO). true: each rollout counts once per loss token, as
  // AReaL's adv_norm does over a padded batch's tokens (a rollout's tokens all carry its reward
  // when the discount and GAE lambda are 1): mean = sum_i M_i r'_i / sum_i M_i, and the unbiased
  // std divides by sum_i M_i - 1. Rollouts without loss tokens then weigh nothing.
  bool token_weighted = false;

  friend bool operator==(const AdvantageOptions&, const AdvantageOptions&) = default;
};

// INVALID_ARGUMENT naming the field if an option is out of range (a reward_clip or std_eps that
// is not positive/non-negative, a non-finite bias or scaling).
absl::Status ValidateAdvantageOptions(const AdvantageOptions& options);

// The names flags and Python give the levels: "group", "batch", "none".
std::string_view AdvantageLevelName(AdvantageLevel level);
absl::StatusOr<AdvantageLevel> ParseAdvantageLevel(std::string_view name);

// Per-token advantages for every rollout, aligned with its tokens.
//
// A rollout with per-token `advantages` keeps them (copied). Otherwise it must have a `reward`,
// and gets the advantage of its shaped reward (AdvantageOptions) broadcast to every token; with
// the defaults, GRPO's
//   A = (reward - mean_g) / (std_g + 1e-6)
// where mean_g and std_g (unbiased, n - 1 denominator, as torch.std) are over the rewards of all
// rollouts of the batch with the same `group` string and a reward, wherever they sit in the batch
// order. Rewards that are all equal over the statistics' rollouts (including a single rollout)
// have std exactly 0 and, centred, advantages exactly 0. Rollouts with their own advantages still
// count in the statistics with their reward, if they have one.
// INVALID_ARGUMENT naming the rollout if a rollout has neither reward nor advantages, advantages of
// the wrong length, a non-finite reward, or an advantage that is not finite in float (rewards
// near the limits of double); naming the field for invalid options.
absl::StatusOr<std::vector<std::vector<float>>> GroupAdvantages(
    absl::Span<const Rollout> rollouts, const AdvantageOptions& options = {});
absl::StatusOr<std::vector<std::vector<float>>> GroupAdvantages(
    absl::Span<const Rollout* const> rollouts, const AdvantageOptions& options = {});

// The same advantages, one value per rollout instead of one per token (what the dispatcher logs
// and sends: a batch of 16K-token rollouts would otherwise expand into hundreds of megabytes of
// copies). A rollout with per-token `advantages` gets 0 here and keeps its own. Same rules and
// errors as GroupAdvantages.
absl::StatusOr<std::vector<float>> GroupRewardAdvantages(absl::Span<const Rollout* const> rollouts,
                                                         const AdvantageOptions& options = {});

}  // namespace dta
