// The integer ids shared across layers: tokens, nodes of a prefix tree, rollouts of a batch.
#pragma once

#include <cstdint>

namespace dta {

// A token of the model's vocabulary.
using TokenId = int32_t;
// A node of a PrefixTree, numbered in lexicographic DFS preorder; the root is kRootNode.
using NodeId = int32_t;
// A rollout's index in the batch: the number of rollouts added to the builder before it.
using RolloutIndex = int32_t;

inline constexpr NodeId kRootNode = 0;
inline constexpr NodeId kNoNode = -1;

}  // namespace dta
