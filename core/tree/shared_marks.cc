#include "core/tree/shared_marks.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dta {

absl::StatusOr<std::vector<uint8_t>> MarksOfTreeTokens(
    const PrefixTree& tree, absl::Span<const absl::Span<const uint8_t>> marks) {
  if (static_cast<int64_t>(marks.size()) != tree.num_rollouts()) {
    return absl::InvalidArgumentError(absl::StrCat("MarksOfTreeTokens: ", marks.size(),
                                                   " marks vectors for ", tree.num_rollouts(),
                                                   " rollouts"));
  }
  for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
    if (static_cast<int64_t>(marks[r].size()) != tree.rollout_length(r)) {
      return absl::InvalidArgumentError(absl::StrCat("MarksOfTreeTokens: rollout ", r, " has ",
                                                     marks[r].size(), " marks for ",
                                                     tree.rollout_length(r), " tokens"));
    }
  }
  // Every rollout walks its nodes from its end up to the root (whose segment is empty).
  std::vector<uint8_t> merged(tree.num_tree_tokens(), 0);
  for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
    for (NodeId v = tree.end_node(r); v != kNoNode; v = tree.parent(v)) {
      const int64_t depth = tree.depth(v), offset = tree.token_offset(v);
      for (int64_t i = 0; i < tree.length(v); ++i) merged[offset + i] |= marks[r][depth + i] != 0;
    }
  }
  return merged;
}

absl::StatusOr<std::vector<std::vector<uint8_t>>> MarksOverSharedTokens(
    const PrefixTree& tree, absl::Span<const absl::Span<const uint8_t>> marks) {
  absl::StatusOr<std::vector<uint8_t>> merged = MarksOfTreeTokens(tree, marks);
  if (!merged.ok()) return merged.status();
  std::vector<std::vector<uint8_t>> out(tree.num_rollouts());
  for (RolloutIndex r = 0; r < tree.num_rollouts(); ++r) {
    out[r].resize(tree.rollout_length(r));
    for (NodeId v = tree.end_node(r); v != kNoNode; v = tree.parent(v)) {
      const int64_t depth = tree.depth(v), offset = tree.token_offset(v);
      for (int64_t i = 0; i < tree.length(v); ++i) out[r][depth + i] = (*merged)[offset + i];
    }
  }
  return out;
}

}  // namespace dta
