// Per-position flags of a batch's rollouts merged over the tokens they share: a computation over
// the prefix tree computes a shared token once, for every rollout through it, so it must do what
// any of them asks there.
//
// Example (the executor's use: the positions whose log-probability some loss reads):
//   rollouts {1, 2, 3} with loss_mask {0, 0, 1} and {1, 2, 4} with {0, 1, 1} share tokens 1 and 2:
//   MarksOverSharedTokens gives {0, 1, 1} and {0, 1, 1} (position 1 is read by the second).
//
// Thread safety: a pure function.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/tree/prefix_tree.h"

namespace dta {

// Per tree token (in serialized_tokens() order): 1 when some rollout through it marks its position
// (marks[r] holds one flag per position of rollout r), else 0. O(rollout tokens). INVALID_ARGUMENT
// naming the rollout when a marks vector's length is not its rollout's, or when there is not one
// per rollout.
absl::StatusOr<std::vector<uint8_t>> MarksOfTreeTokens(
    const PrefixTree& tree, absl::Span<const absl::Span<const uint8_t>> marks);

// For each rollout r of `tree` and position p < rollout_length(r): 1 when marks[s][p] != 0 for some
// rollout s whose first p + 1 tokens are r's (r itself included), else 0: MarksOfTreeTokens read
// back along every rollout's path. Fails as MarksOfTreeTokens does.
absl::StatusOr<std::vector<std::vector<uint8_t>>> MarksOverSharedTokens(
    const PrefixTree& tree, absl::Span<const absl::Span<const uint8_t>> marks);

}  // namespace dta
