// Trajectories on the wire (dta.v1.Trajectory) and the executor's Rollout: conversion and the
// dispatcher's admission rules.
//
// CheckTrajectory is the single gate every trajectory passes before the dispatcher acknowledges
// it: the executor's rules (ValidateRollout: vocabulary range, consistent lengths, finite numbers,
// loss_mask 0/1 with loss_mask[0] = 0, versions >= -1, routed experts' shape) plus the service's
// size limits, routed experts that fit the trainers' model and, for the RL losses, a reward or
// per-token advantages. Duplicate ids are the dispatcher's to judge
// (they need its history).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/base/field_error.h"  // FieldOfError reads the field an error names
#include "core/io/rollout.h"
#include "proto/dta/v1/dispatcher.pb.h"

namespace dta {

struct TrajectoryLimits {
  // Token ids must be below this; 0 checks only that they are non-negative.
  int64_t vocab_size = 0;
  // The most tokens in one trajectory.
  int64_t max_tokens = 1 << 17;
  // The most bytes of `id` and of `group_id`.
  int64_t max_id_bytes = 256;
  // The most bytes of all metadata keys and values together.
  int64_t max_metadata_bytes = 1 << 16;
  // Every trajectory needs a reward or per-token advantages (the RL losses); off for SFT.
  bool require_reward_or_advantages = true;
  // Every trajectory needs reference log-probabilities (trainers with a KL penalty need them).
  bool require_ref_logprobs = false;
  // The largest |reward|; a rollout never carries more than kMaxAbsReward (see rollout.h).
  double max_abs_reward = kMaxAbsReward;
  // The routing of the trainers' mixture-of-experts model, which routed_experts must fit; unset:
  // trajectories carrying routed experts are refused (nothing would check them before a trainer
  // failed on them).
  std::optional<RoutingShape> routing;
  // Every trajectory needs routed experts (routing replay is on).
  bool require_routed_experts = false;
  // The most bytes of routed_experts' ids: a trajectory must fit one record of the dispatcher's
  // log (64 MiB) with its other fields.
  int64_t max_routed_experts_bytes = 48 << 20;
};

// Routed experts on the wire (the narrowest id type that holds them) and back. INVALID_ARGUMENT
// naming the field "routed_experts" for an unspecified id type or bytes that are not whole rows.
v1::RoutedExperts RoutedExpertsToProto(const RoutedExperts& routed);
absl::StatusOr<RoutedExperts> RoutedExpertsFromProto(const v1::RoutedExperts& proto);

// The Rollout a valid trajectory describes, or INVALID_ARGUMENT whose message starts with
// "field '<name>': " (see FieldOfError), e.g. "field 'loss_mask': 5 values for 6 tokens".
absl::StatusOr<Rollout> CheckTrajectory(const v1::Trajectory& trajectory,
                                        const TrajectoryLimits& limits);

// The rollout as a trajectory (metadata empty). RolloutFromTrajectory(TrajectoryFromRollout(r))
// == r for every valid rollout.
v1::Trajectory TrajectoryFromRollout(const Rollout& rollout);

// The conversion alone, without any check (routed experts that do not decode come back with
// layers = 0, which ValidateRollout refuses).
Rollout RolloutFromTrajectory(const v1::Trajectory& trajectory);

}  // namespace dta
