// Random rollout batches whose prefix trees have the shapes that break tree code: duplicates,
// rollouts that are prefixes of others, one-token segments, deep chains and wide branches.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tree/prefix_tree.h"

namespace dta::testing {

struct RandomTreeOptions {
  int max_rollouts = 12;  // 1..max_rollouts rollouts
  int max_length = 24;    // lengths of fresh suffixes are 1..max_length
  int vocab = 3;          // a tiny vocabulary makes accidental sharing and 1-token segments common
};

std::vector<std::vector<TokenId>> RandomRollouts(uint64_t seed,
                                                 const RandomTreeOptions& options = {});

}  // namespace dta::testing
