#include "dispatcher/wire/trajectory.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/field_error.h"
#include "core/base/status_macros.h"

namespace dta {
namespace {

// Bytes per id of each wire type, and its "not recorded" value.
struct IdWidth {
  int bytes;
  uint32_t not_recorded;
};

absl::StatusOr<IdWidth> WidthOf(v1::RoutedExperts::IdType type) {
  switch (type) {
    case v1::RoutedExperts::UINT8:
      return IdWidth{1, 0xff};
    case v1::RoutedExperts::UINT16:
      return IdWidth{2, 0xffff};
    case v1::RoutedExperts::INT32:
      return IdWidth{4, 0xffffffff};
    default:
      return FieldError("routed_experts", absl::StrCat("id_type ", static_cast<int>(type),
                                                       " is not UINT8, UINT16 or INT32"));
  }
}

}  // namespace

v1::RoutedExperts RoutedExpertsToProto(const RoutedExperts& routed) {
  int32_t largest = 0;
  for (const int32_t id : routed.ids) largest = std::max(largest, id);
  v1::RoutedExperts proto;
  proto.set_layers(routed.layers);
  proto.set_top_k(routed.top_k);
  proto.set_id_type(largest < 0xff     ? v1::RoutedExperts::UINT8
                    : largest < 0xffff ? v1::RoutedExperts::UINT16
                                       : v1::RoutedExperts::INT32);
  const IdWidth width = *WidthOf(proto.id_type());
  std::string& bytes = *proto.mutable_ids();
  bytes.resize(routed.ids.size() * width.bytes);
  for (size_t i = 0; i < routed.ids.size(); ++i) {
    const uint32_t id =
        routed.ids[i] == kNotRecorded ? width.not_recorded : static_cast<uint32_t>(routed.ids[i]);
    for (int b = 0; b < width.bytes; ++b)
      bytes[i * width.bytes + b] = static_cast<char>((id >> (8 * b)) & 0xff);
  }
  return proto;
}

absl::StatusOr<RoutedExperts> RoutedExpertsFromProto(const v1::RoutedExperts& proto) {
  ASSIGN_OR_RETURN(const IdWidth width, WidthOf(proto.id_type()));
  if (proto.layers() <= 0 || proto.top_k() <= 0) {
    return FieldError("routed_experts", absl::StrCat("layers (", proto.layers(), ") and top_k (",
                                                     proto.top_k(), ") must be positive"));
  }
  const std::string& bytes = proto.ids();
  const size_t row_bytes = static_cast<size_t>(proto.layers()) * proto.top_k() * width.bytes;
  if (bytes.size() % row_bytes != 0) {
    return FieldError(
        "routed_experts",
        absl::StrCat(bytes.size(), " bytes are not whole rows of ", proto.layers(), " layers x ",
                     proto.top_k(), " ids of ", width.bytes, " bytes (", row_bytes, " bytes)"));
  }
  RoutedExperts routed{.layers = proto.layers(), .top_k = proto.top_k(), .ids = {}};
  routed.ids.resize(bytes.size() / width.bytes);
  for (size_t i = 0; i < routed.ids.size(); ++i) {
    uint32_t id = 0;
    for (int b = 0; b < width.bytes; ++b)
      id |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[i * width.bytes + b])) << (8 * b);
    routed.ids[i] = id == width.not_recorded ? kNotRecorded : static_cast<int32_t>(id);
  }
  return routed;
}

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
  if (t.has_routed_experts()) {
    absl::StatusOr<RoutedExperts> routed = RoutedExpertsFromProto(t.routed_experts());
    r.routed_experts = routed.ok() ? *std::move(routed) : RoutedExperts{};
  }
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
  if (r.routed_experts) *t.mutable_routed_experts() = RoutedExpertsToProto(*r.routed_experts);
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
  if (t.has_routed_experts()) {
    const int64_t bytes = static_cast<int64_t>(t.routed_experts().ids().size());
    if (bytes > limits.max_routed_experts_bytes) {
      return FieldError(
          "routed_experts",
          absl::StrCat(bytes, " bytes of ids, more than the limit of ",
                       limits.max_routed_experts_bytes, " (one record of the dispatcher's log)"));
    }
    RETURN_IF_ERROR(RoutedExpertsFromProto(t.routed_experts()).status());
  }
  Rollout rollout = RolloutFromTrajectory(t);
  RETURN_IF_ERROR(ValidateRollout(rollout, limits.vocab_size));
  if (rollout.routed_experts) {
    if (!limits.routing) {
      return FieldError("routed_experts",
                        "the dispatcher does not know the model they route: start dta-dispatcher "
                        "with --routed_experts_model");
    }
    RETURN_IF_ERROR(ValidateRoutedExperts(
        *rollout.routed_experts, static_cast<int64_t>(rollout.tokens.size()), *limits.routing));
  } else if (limits.require_routed_experts) {
    return FieldError("routed_experts", "missing: routing replay is on (--require_routed_experts)");
  }
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
