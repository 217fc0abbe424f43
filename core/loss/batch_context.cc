#include "core/loss/batch_context.h"

#include <algorithm>
#include <cmath>
#include <optional>
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

absl::Status ValidateAdvantageOptions(const AdvantageOptions& o) {
  if (!std::isfinite(o.reward_bias)) {
    return absl::InvalidArgumentError(
        absl::StrCat("reward_bias must be finite, got ", o.reward_bias));
  }
  if (!std::isfinite(o.reward_scaling)) {
    return absl::InvalidArgumentError(
        absl::StrCat("reward_scaling must be finite, got ", o.reward_scaling));
  }
  if (!(o.reward_clip > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("reward_clip must be positive (infinity: no clip), got ", o.reward_clip));
  }
  if (!(o.std_eps >= 0) || !std::isfinite(o.std_eps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("std_eps must be finite and >= 0, got ", o.std_eps));
  }
  return absl::OkStatus();
}

std::string_view AdvantageLevelName(AdvantageLevel level) {
  switch (level) {
    case AdvantageLevel::kGroup:
      return "group";
    case AdvantageLevel::kBatch:
      return "batch";
    case AdvantageLevel::kNone:
      return "none";
  }
  return "unknown";
}

absl::StatusOr<AdvantageLevel> ParseAdvantageLevel(std::string_view name) {
  for (AdvantageLevel level :
       {AdvantageLevel::kGroup, AdvantageLevel::kBatch, AdvantageLevel::kNone}) {
    if (name == AdvantageLevelName(level)) return level;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("an advantage level is group, batch or none, got '", std::string(name), "'"));
}

absl::StatusOr<std::vector<std::vector<float>>> GroupAdvantages(absl::Span<const Rollout> rollouts,
                                                                const AdvantageOptions& options) {
  return GroupAdvantages(Pointers(rollouts), options);
}

absl::StatusOr<std::vector<std::vector<float>>> GroupAdvantages(
    absl::Span<const Rollout* const> rollouts, const AdvantageOptions& options) {
  absl::StatusOr<std::vector<float>> per_rollout = GroupRewardAdvantages(rollouts, options);
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

namespace {

// Weighted statistics of the shaped rewards of some rollouts.
struct RewardStats {
  std::vector<double> rewards, weights;
  double mean = 0;
  double std = 0;

  void Add(double reward, double weight) {
    rewards.push_back(reward);
    weights.push_back(weight);
  }
  // The weighted mean, and the unbiased std (sum of weights - 1 in the denominator; exactly 0
  // when the rewards that weigh anything are all equal, so that centred advantages are exactly 0).
  void Finish() {
    double total = 0, sum = 0;
    std::optional<double> lo, hi;
    for (size_t i = 0; i < rewards.size(); ++i) {
      if (weights[i] == 0) continue;
      total += weights[i];
      sum += weights[i] * rewards[i];
      lo = lo ? std::min(*lo, rewards[i]) : rewards[i];
      hi = hi ? std::max(*hi, rewards[i]) : rewards[i];
    }
    if (!lo) return;
    if (*lo == *hi) {
      mean = *lo;
      return;
    }
    mean = sum / total;
    double sq = 0;
    for (size_t i = 0; i < rewards.size(); ++i) {
      sq += weights[i] * (rewards[i] - mean) * (rewards[i] - mean);
    }
    std = total > 1 ? std::sqrt(sq / (total - 1)) : 0;
  }
};

double LossTokens(const Rollout& r) {
  double m = 0;
  for (uint8_t v : r.loss_mask) m += v != 0 ? 1 : 0;
  return m;
}

}  // namespace

absl::StatusOr<std::vector<float>> GroupRewardAdvantages(absl::Span<const Rollout* const> rollouts,
                                                         const AdvantageOptions& options) {
  if (absl::Status status = ValidateAdvantageOptions(options); !status.ok()) return status;
  absl::flat_hash_map<std::string, RewardStats> groups;
  RewardStats batch;
  const auto shaped = [&](double reward) {
    return std::clamp((reward + options.reward_bias) * options.reward_scaling, -options.reward_clip,
                      options.reward_clip);
  };
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
      const double weight = options.token_weighted ? LossTokens(r) : 1.0;
      groups[r.group].Add(shaped(*r.reward), weight);
      batch.Add(shaped(*r.reward), weight);
    }
  }
  for (auto& [name, g] : groups) g.Finish();
  batch.Finish();
  const auto stats = [&](AdvantageLevel level, const Rollout& r) -> const RewardStats* {
    if (level == AdvantageLevel::kNone) return nullptr;
    return level == AdvantageLevel::kBatch ? &batch : &groups.at(r.group);
  };
  std::vector<float> out;
  out.reserve(rollouts.size());
  for (const Rollout* rollout : rollouts) {
    const Rollout& r = *rollout;
    if (!r.advantages.empty()) {
      out.push_back(0);
      continue;
    }
    double a = shaped(*r.reward);
    if (const RewardStats* s = stats(options.mean_level, r)) a -= s->mean;
    if (const RewardStats* s = stats(options.std_level, r)) a /= s->std + options.std_eps;
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
