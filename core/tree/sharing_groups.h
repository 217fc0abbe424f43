// Which rollouts of a batch share their prefixes in one push/pop pass, and which run apart.
//
// Sharing a prefix saves its forward and backward once for every extra rollout through it, but
// every chunk above it then runs on a cached prefix. For a long causal chain that costs more than
// a short prefix saves: on a prefix its attention runs in two parts merged afterwards
// (kernels/chunk_attention.h), without one in a single call of the fastest causal kernel, as dense
// training runs it. A short prompt before long answers (AIME-like batches: ~100 shared tokens,
// 16K-token rollouts, C ~ 1.01) is cheaper recomputed for each rollout.
//
// Usage:
//   for (const std::vector<RolloutIndex>& group : SharingGroups(tree, {.min_suffix = 4096}))
//     ... a tree of the group's rollouts, one push/pop pass over it ...
//
// Thread safety: a pure function of an immutable tree.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tree/prefix_tree.h"

namespace dta {

struct SharingOptions {
  // A prefix two rollouts share is recomputed for each when it is at most this fraction of the
  // shorter one (and min_suffix holds); 0 shares every prefix.
  double max_unshared_fraction = 1.0 / 64;
  // ... and the shorter one continues past it for at least this many tokens (a chain long enough
  // that running it without a prefix pays).
  int64_t min_suffix = 4096;
};

// The batch's rollouts in lexicographic order, cut between consecutive rollouts a and b where
// LCP(a, b) <= max_unshared_fraction * min(|a|, |b|) and min(|a|, |b|) - LCP(a, b) >= min_suffix.
// Rollouts of different groups share at most the prefix at the cut between them (consecutive LCPs
// in lexicographic order bound every LCP across them), which each group recomputes: every group is
// its own tree. One group, the whole lexicographic order, when nothing is cut; none for an empty
// tree. O(nodes + rollouts).
std::vector<std::vector<RolloutIndex>> SharingGroups(const PrefixTree& tree,
                                                     const SharingOptions& options);

}  // namespace dta
