#include "core/tree/sharing_groups.h"

#include <algorithm>

#include "core/tree/leaf_order.h"

namespace dta {

std::vector<std::vector<RolloutIndex>> SharingGroups(const PrefixTree& tree,
                                                     const SharingOptions& options) {
  const SortedRollouts sorted = SortRollouts(tree);
  std::vector<std::vector<RolloutIndex>> groups;
  for (size_t i = 0; i < sorted.order.size(); ++i) {
    bool cut = i == 0;
    if (!cut && options.max_unshared_fraction > 0) {
      const int64_t shorter = std::min(sorted.length[i - 1], sorted.length[i]);
      const int64_t lcp = sorted.lcp[i];
      cut = static_cast<double>(lcp) <=
                options.max_unshared_fraction * static_cast<double>(shorter) &&
            shorter - lcp >= options.min_suffix;
    }
    if (cut) groups.emplace_back();
    groups.back().push_back(sorted.order[i]);
  }
  return groups;
}

}  // namespace dta
