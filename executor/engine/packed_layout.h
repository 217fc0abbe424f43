// Internal to executor/engine: a prefix tree's unique tokens laid out for one packed forward.
#pragma once

#include <cstdint>
#include <vector>

#include "executor/tree/prefix_tree.h"

namespace dta::engine {

// Tree Training's DFS serialization of a tree whose root sits at path position `offset` (0 for a
// whole batch, the shared depth for a packed step on top of a stack).
struct PackedLayout {
  std::vector<int64_t> tokens;     // serialized token ids
  std::vector<int64_t> positions;  // original position ids: offset + depth in the tree
  // Key t is visible to queries t .. key_end[t] - 1: the rest of its node and its subtree.
  std::vector<int64_t> key_end;
  // The serialized token whose hidden state predicts token t: the previous token on its path, or
  // -1 for the first token of a root child (predicted from whatever precedes the tree).
  std::vector<int64_t> previous;
  // paths[r][p]: the serialized index of position offset + p of rollout r.
  std::vector<std::vector<int64_t>> paths;
};

PackedLayout MakePackedLayout(const PrefixTree& tree, int64_t offset);

}  // namespace dta::engine
