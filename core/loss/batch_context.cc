#include "core/loss/batch_context.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dta {

namespace {

std::vector<const Rollout*> Pointers(absl::Span<const Rollout> rollouts) {
  std::vector<const Rollout*> pointers;
  pointers.reserve(rollouts.size());
  for (const Rollout& r : rollouts) pointers.push_back(&r);
  return pointers;
}

}  // namespace

BatchLossContext MakeBatchContext(absl::Span<const Rollout> rollouts) {
  return MakeBatchContext(Pointers(rollouts));
}

BatchLossContext MakeBatchContext(absl::Span<const Rollout* const> rollouts) {
  BatchLossContext context;
  for (const Rollout* r : rollouts) {
    for (uint8_t m : r->loss_mask) context.total_loss_tokens += m != 0 ? 1 : 0;
  }
  context.num_rollouts = static_cast<int64_t>(rollouts.size());
  return context;
}

absl::StatusOr<std::vector<std::vector<float>>> GroupAdvantages(absl::Span<const Rollout> rollouts,
                                                                bool normalize_std) {
  return GroupAdvantages(Pointers(rollouts), normalize_std);
}

absl::StatusOr<std::vector<std::vector<float>>> GroupAdvantages(
    absl::Span<const Rollout* const> rollouts, bool normalize_std) {
  absl::StatusOr<std::vector<float>> per_rollout = GroupRewardAdvantages(rollouts, normalize_std);
  if (!per_rollout.ok()) return per_rollout.status();
  std::vector<std::vector<float>> out;
  out.reserve(rollouts.size());
  for (size_t i = 0; i < rollouts.size(); ++i) {
    const Rollout& r = *rollouts[i];
    if (r.advantages.empty()) {
      out.emplace_back(r.tokens.size(), (*per_rollout)[i]);
    } else {
      out.push_back(r.advantages);
    }
  }
  return out;
}

absl::StatusOr<std::vector<float>> GroupRewardAdvantages(absl::Span<const Rollout* const> rollouts,
                                                         bool normalize_std) {
  struct GroupStats {
    std::vector<double> rewards;
    double mean = 0;
    double std = 0;
  };
  absl::flat_hash_map<std::string, GroupStats> groups;
  for (const Rollout* rollout : rollouts) {
    const Rollout& r = *rollout;
    if (!r.advantages.empty()) {
      if (r.advantages.size() != r.tokens.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("rollout '", r.id, "': field 'advantages': ", r.advantages.size(),
                         " values for ", r.tokens.size(), " tokens"));
      }
    } else if (!r.reward.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rollout '", r.id, "': has neither field 'reward' nor field 'advantages'"));
    }
    if (r.reward.has_value()) {
      if (!std::isfinite(*r.reward)) {
        return absl::InvalidArgumentError(
            absl::StrCat("rollout '", r.id, "': field 'reward' is ", *r.reward));
      }
      groups[r.group].rewards.push_back(*r.reward);
    }
  }
  for (auto& [name, g] : groups) {
    const std::vector<double>& x = g.rewards;
    const auto [lo, hi] = std::minmax_element(x.begin(), x.end());
    if (*lo == *hi) {  // all equal (or one): exact mean, std 0, advantages exactly 0
      g.mean = *lo;
      g.std = 0;
      continue;
    }
    double sum = 0;
    for (double v : x) sum += v;
    g.mean = sum / static_cast<double>(x.size());
    double sq = 0;
    for (double v : x) sq += (v - g.mean) * (v - g.mean);
    g.std = std::sqrt(sq / static_cast<double>(x.size() - 1));
  }
  std::vector<float> out;
  out.reserve(rollouts.size());
  for (const Rollout* rollout : rollouts) {
    const Rollout& r = *rollout;
    if (!r.advantages.empty()) {
      out.push_back(0);
      continue;
    }
    const GroupStats& g = groups.at(r.group);
    double a = *r.reward - g.mean;
    if (normalize_std) a /= g.std + 1e-6;
    // Rewards near the limits of double (or beyond float) give no usable advantage.
    if (!std::isfinite(static_cast<float>(a))) {
      return absl::InvalidArgumentError(absl::StrCat("rollout '", r.id, "': group '", r.group,
                                                     "': the advantage of reward ", *r.reward,
                                                     " is ", a, ", outside float's range"));
    }
    out.push_back(static_cast<float>(a));
  }
  return out;
}

}  // namespace dta
