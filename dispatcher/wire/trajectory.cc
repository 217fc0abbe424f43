#include "dispatcher/wire/trajectory.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/base/field_error.h"
#include "core/base/status_macros.h"

namespace dta {

Rollout RolloutFromTrajectory(const v1::Trajectory& t) {
  Rollout r;
  r.id = t.id();
  r.group = t.group_id();
  r.tokens.assign(t.tokens().begin(), t.tokens().end());
  r.loss_mask.assign(t.loss_mask().begin(), t.loss_mask().end());
  r.logprobs.assign(t.logprobs().begin(), t.logprobs().end());
  r.versions.assign(t.versions().begin(), t.versions().end());
  if (t.has_reward()) r.reward = t.reward();
  r.advantages.assign(t.advantages().begin(), t.advantages().end());
  r.ref_logprobs.assign(t.ref_logprobs().begin(), t.ref_logprobs().end());
  return r;
}

v1::Trajectory TrajectoryFromRollout(const Rollout& r) {
  v1::Trajectory t;
  t.set_id(r.id);
  t.set_group_id(r.group);
  t.mutable_tokens()->Assign(r.tokens.begin(), r.tokens.end());
  for (uint8_t m : r.loss_mask) t.add_loss_mask(m != 0);
  t.mutable_logprobs()->Assign(r.logprobs.begin(), r.logprobs.end());
  t.mutable_versions()->Assign(r.versions.begin(), r.versions.end());
  if (r.reward.has_value()) t.set_reward(*r.reward);
  t.mutable_advantages()->Assign(r.advantages.begin(), r.advantages.end());
  t.mutable_ref_logprobs()->Assign(r.ref_logprobs.begin(), r.ref_logprobs.end());
  return t;
}

absl::StatusOr<Rollout> CheckTrajectory(const v1::Trajectory& t, const TrajectoryLimits& limits) {
  // Size limits first, so that an oversized message is refused before anything is copied.
  if (static_cast<int64_t>(t.id().size()) > limits.max_id_bytes) {
    return FieldError(
        "id", absl::StrCat(t.id().size(), " bytes, more than the limit of ", limits.max_id_bytes));
  }
  if (static_cast<int64_t>(t.group_id().size()) > limits.max_id_bytes) {
    return FieldError(
        "group_id",
        absl::StrCat(t.group_id().size(), " bytes, more than the limit of ", limits.max_id_bytes));
  }
  if (t.tokens_size() > limits.max_tokens) {
    return FieldError("tokens", absl::StrCat(t.tokens_size(), " tokens, more than the limit of ",
                                             limits.max_tokens));
  }
  int64_t metadata_bytes = 0;
  for (const auto& [key, value] : t.metadata()) metadata_bytes += key.size() + value.size();
  if (metadata_bytes > limits.max_metadata_bytes) {
    return FieldError("metadata", absl::StrCat(metadata_bytes, " bytes, more than the limit of ",
                                               limits.max_metadata_bytes));
  }
  Rollout rollout = RolloutFromTrajectory(t);
  RETURN_IF_ERROR(ValidateRollout(rollout, limits.vocab_size));
  if (limits.require_ref_logprobs && rollout.ref_logprobs.empty()) {
    return FieldError("ref_logprobs", "missing: the trainers' loss has a KL penalty");
  }
  if (rollout.reward.has_value() && std::abs(*rollout.reward) > limits.max_abs_reward) {
    return FieldError("reward", absl::StrCat(*rollout.reward, " is beyond the limit of +-",
                                             limits.max_abs_reward));
  }
  if (limits.require_reward_or_advantages && !rollout.reward.has_value() &&
      rollout.advantages.empty()) {
    return FieldError("reward", "missing: a trajectory needs a reward or per-token advantages");
  }
  return rollout;
}

}  // namespace dta
