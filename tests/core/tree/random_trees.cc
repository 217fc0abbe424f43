#include "tests/core/tree/random_trees.h"

#include <random>

namespace dta::testing {

std::vector<std::vector<TokenId>> RandomRollouts(uint64_t seed, const RandomTreeOptions& options) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); };
  auto fresh = [&](std::vector<TokenId>& out, int64_t length) {
    for (int64_t i = 0; i < length; ++i)
      out.push_back(static_cast<TokenId>(uniform(options.vocab)));
  };
  const int count = 1 + static_cast<int>(uniform(options.max_rollouts));
  std::vector<std::vector<TokenId>> rollouts;
  for (int r = 0; r < count; ++r) {
    std::vector<TokenId> rollout;
    const int kind = rollouts.empty() ? 0 : static_cast<int>(uniform(6));
    const std::vector<TokenId>* base =
        rollouts.empty() ? nullptr : &rollouts[uniform(rollouts.size())];
    switch (kind) {
      case 1:  // an exact duplicate
        rollout = *base;
        break;
      case 2:  // a prefix of an earlier rollout
        rollout.assign(base->begin(), base->begin() + 1 + uniform(base->size()));
        break;
      case 3:  // an extension of an earlier rollout
        rollout = *base;
        fresh(rollout, 1 + uniform(options.max_length));
        break;
      case 4:
      case 5:  // branch off an earlier rollout at a random point
        rollout.assign(base->begin(), base->begin() + uniform(base->size() + 1));
        fresh(rollout, 1 + uniform(options.max_length));
        break;
      default:  // a fresh rollout (still shares with others through the tiny vocabulary)
        fresh(rollout, 1 + uniform(options.max_length));
    }
    rollouts.push_back(std::move(rollout));
  }
  return rollouts;
}

}  // namespace dta::testing
