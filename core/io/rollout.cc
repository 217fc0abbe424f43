#include "core/io/rollout.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/base/field_error.h"

namespace dta {
namespace {

template <typename T>
absl::Status CheckLength(const char* field, const std::vector<T>& values, size_t tokens,
                         bool optional) {
  if (optional && values.empty()) return absl::OkStatus();
  if (values.size() != tokens) {
    return FieldError(field, absl::StrCat(values.size(), " values for ", tokens, " tokens"));
  }
  return absl::OkStatus();
}

absl::Status CheckFinite(const char* field, const std::vector<float>& values) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) {
      return FieldError(field, absl::StrCat("value ", i, " is not finite"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateRollout(const Rollout& rollout, int64_t vocab_size) {
  if (rollout.id.empty()) return FieldError("id", "empty");
  const size_t n = rollout.tokens.size();
  if (n == 0) return FieldError("tokens", "empty rollout");
  for (size_t i = 0; i < n; ++i) {
    const TokenId token = rollout.tokens[i];
    if (token < 0 || (vocab_size > 0 && token >= vocab_size)) {
      return FieldError("tokens",
                        absl::StrCat("token ", i, " = ", token, " is outside [0, ",
                                     vocab_size > 0 ? absl::StrCat(vocab_size) : "2^31", ")"));
    }
  }
  for (const absl::Status& status :
       {CheckLength("loss_mask", rollout.loss_mask, n, false),
        CheckLength("logprobs", rollout.logprobs, n, false),
        CheckLength("versions", rollout.versions, n, true),
        CheckLength("advantages", rollout.advantages, n, true),
        CheckLength("ref_logprobs", rollout.ref_logprobs, n, true),
        CheckFinite("logprobs", rollout.logprobs), CheckFinite("advantages", rollout.advantages),
        CheckFinite("ref_logprobs", rollout.ref_logprobs)}) {
    if (!status.ok()) return status;
  }
  for (size_t i = 0; i < n; ++i) {
    if (rollout.loss_mask[i] > 1) {
      return FieldError("loss_mask",
                        absl::StrCat("value ", i, " is ", rollout.loss_mask[i], ", not 0 or 1"));
    }
  }
  if (rollout.loss_mask[0] != 0) {
    return FieldError("loss_mask",
                      "value 0 is 1, but the first token has no context to be predicted from");
  }
  for (size_t i = 0; i < rollout.versions.size(); ++i) {
    if (rollout.versions[i] < -1) {
      return FieldError("versions",
                        absl::StrCat("value ", i, " is ", rollout.versions[i], " (must be >= -1)"));
    }
  }
  if (rollout.reward && !std::isfinite(*rollout.reward)) {
    return FieldError("reward", "not finite");
  }
  if (rollout.reward && std::abs(*rollout.reward) > kMaxAbsReward) {
    return FieldError("reward",
                      absl::StrCat(*rollout.reward, " is beyond the limit of +-", kMaxAbsReward));
  }
  if (rollout.routed_experts) return ValidateRoutedExperts(*rollout.routed_experts, n);
  return absl::OkStatus();
}

}  // namespace dta
