// What a loss needs to know about the whole batch before any rollout runs: the normaliser and the
// GRPO group advantages. Torch-free, so the dispatcher computes both for the whole batch before
// it splits the batch across trainers (a group's rollouts may land on different ranks, and the
// ranks' losses must sum to the single-process batch loss).
#pragma once

#include <cstdint>
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

// Per-token advantages for every rollout, aligned with its tokens.
//
// A rollout with per-token `advantages` keeps them (copied). Otherwise it must have a `reward`,
// and gets the GRPO group advantage broadcast to every token:
//   A = (reward - mean_g) / (std_g + 1e-6)     (normalize_std = true)
//   A = reward - mean_g                         (normalize_std = false)
// where mean_g and std_g (unbiased, n - 1 denominator, as torch.std) are over the rewards of all
// rollouts of the batch with the same `group` string and a reward, wherever they sit in the batch
// order. A group whose rewards are all equal (including a group of one) gets exactly 0.
// INVALID_ARGUMENT naming the rollout if a rollout has neither reward nor advantages, advantages of
// the wrong length, a non-finite reward, or an advantage that is not finite in float (rewards
// near the limits of double).
absl::StatusOr<std::vector<std::vector<float>>> GroupAdvantages(absl::Span<const Rollout> rollouts,
                                                                bool normalize_std = true);
absl::StatusOr<std::vector<std::vector<float>>> GroupAdvantages(
    absl::Span<const Rollout* const> rollouts, bool normalize_std = true);

// The same GRPO group advantages, one value per rollout instead of one per token (what the
// dispatcher logs and sends: a batch of 16K-token rollouts would otherwise expand into hundreds of
// megabytes of copies). A rollout with per-token `advantages` gets 0 here and keeps its own. Same
// rules and errors as GroupAdvantages.
absl::StatusOr<std::vector<float>> GroupRewardAdvantages(absl::Span<const Rollout* const> rollouts,
                                                         bool normalize_std = true);

}  // namespace dta
