// One trajectory as produced by a rollout worker, and the rules every consumer checks it against.
//
// Per-token fields are aligned with `tokens`: logprobs[t] is the behaviour policy's
// log p(tokens[t] | tokens[0..t-1]), loss_mask[t] says whether token t is trained. The first token
// has no context, so loss_mask[0] must be 0.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/io/routed_experts.h"
#include "core/tree/prefix_tree.h"

namespace dta {

struct Rollout {
  std::string id;     // unique within a batch
  std::string group;  // rollouts sampled from the same prompt (GRPO's group)
  std::vector<TokenId> tokens;
  std::vector<uint8_t> loss_mask;  // 0 or 1 per token
  std::vector<float> logprobs;     // behaviour policy, per token
  std::vector<int32_t> versions;   // optional: policy version that produced each token (-1: prompt)
  std::optional<double> reward;    // optional: the trajectory's reward
  std::vector<float> advantages;   // optional: per-token advantages
  std::vector<float> ref_logprobs;  // optional: reference policy, per token (for a KL penalty)
  // Optional, for routing replay: the experts the inference engine routed each token to at every
  // mixture-of-experts layer (routed_experts.h; row t = token t, the last token may have none).
  // The trainer then routes those tokens the same way (docs/architecture.md, "Routing replay").
  std::optional<RoutedExperts> routed_experts;

  friend bool operator==(const Rollout&, const Rollout&) = default;
};

// The largest |reward| a rollout may carry: beyond it GRPO group advantages could leave float's
// range (or a group's sum of squares overflow), which would make a whole batch untrainable.
inline constexpr double kMaxAbsReward = 1e30;

// OK if the rollout is well formed: non-empty tokens with ids in [0, vocab_size) (vocab_size <= 0
// skips the upper bound), per-token fields of the same length as tokens, loss_mask values 0/1
// with loss_mask[0] = 0, finite logprobs, advantages and ref_logprobs, |reward| <= kMaxAbsReward,
// versions >= -1, routed_experts as ValidateRoutedExperts checks them without a model (rows for the
// tokens, k distinct ids per row and layer), a non-empty id. Otherwise
// INVALID_ARGUMENT whose message starts with "field '<name>': " and gives the offending position,
// e.g. "field 'loss_mask': 5 values for 6 tokens" (the dispatcher reports the field separately).
absl::Status ValidateRollout(const Rollout& rollout, int64_t vocab_size = 0);

}  // namespace dta
