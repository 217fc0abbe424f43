// What a training step's loss says about the policy update, as AReaL's PPO actor logs it: the
// fraction of tokens whose PPO ratio was clipped, the approximate KL and importance ratios between
// the current policy and the one the ratio is taken against, the entropy, and how many stale tokens
// rejection sampling dropped.
//
// The executor gathers them on the device while the losses run (DiagnosticsAccumulator: no host
// synchronisation per rollout) and reads them once per step. Data-parallel ranks add their sums
// (LossDiagnostics::Sums / FromSums) and take the extremes' max.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace dta {

struct LossDiagnostics {
  // Sums over the batch's loss tokens (loss_mask 1).
  double loss_tokens = 0;
  double clipped_tokens = 0;       // PPO / GSPO: the clipped branch of the surrogate was the max
  double dual_clipped_tokens = 0;  // the dual clip bounded the loss
  double approx_kl = 0;            // sum of log pi - log pi_base (k1)
  double ratio = 0;                // sum of pi / pi_base (GSPO: the sequence ratio, per token)
  double entropy = 0;              // when the entropy was computed
  double entropy_tokens = 0;
  double rejected_tokens = 0;   // rejection sampling: masked out (kMask) or clamped (kClamp)
  double behave_weight = 0;     // decoupled PPO: sum of pi_prox / pi_behave over the kept tokens
  double behave_approx_kl = 0;  // ... and of log pi_prox - log pi_behave
  double behave_tokens = 0;     // the kept tokens
  // Over the loss tokens (pi_base: pi_prox for decoupled PPO, the behaviour policy otherwise).
  double ratio_max = -std::numeric_limits<double>::infinity();
  double ratio_min = std::numeric_limits<double>::infinity();

  // The sums, in a fixed order, and back: what ranks all-reduce.
  static constexpr int kSums = 11;
  std::array<double, kSums> Sums() const;
  static LossDiagnostics FromSums(const std::array<double, kSums>& sums, double ratio_max,
                                  double ratio_min);

  // Means over the tokens they are counted on (NaN when there are none).
  double clip_fraction() const { return clipped_tokens / loss_tokens; }
  double dual_clip_fraction() const { return dual_clipped_tokens / loss_tokens; }
  double approx_kl_mean() const { return approx_kl / loss_tokens; }
  double ratio_mean() const { return ratio / loss_tokens; }
  double entropy_mean() const { return entropy / entropy_tokens; }
  double rejected_fraction() const { return rejected_tokens / loss_tokens; }
  double behave_weight_mean() const { return behave_weight / behave_tokens; }
  double behave_approx_kl_mean() const { return behave_approx_kl / behave_tokens; }

  // The means that apply, named as dta-train's JSON fields, TrainStats and the metrics name them:
  // clip_fraction, dual_clip_fraction, approx_kl, ratio_mean, ratio_max, ratio_min (where a ratio
  // was taken), entropy (where computed), rejected_fraction, behave_imp_weight, behave_approx_kl
  // (decoupled PPO).
  std::vector<std::pair<std::string, double>> Applicable() const;

  // What applies, for a progress line: e.g. "clip 0.031, approx kl 0.0012, ratio 0.71-1.4,
  // entropy 2.3, rejected 0.02"; empty when nothing does (SFT without entropy).
  std::string Summary() const;
};

// Device-side running sums of LossDiagnostics, filled by AddLossDiagnostics.
class DiagnosticsAccumulator {
 public:
  // Adds one rollout's sums (a float64 [kSums] tensor) and its ratio extremes (0-d; undefined
  // when it has no loss tokens).
  void Add(const at::Tensor& sums, const at::Tensor& ratio_max, const at::Tensor& ratio_min);
  // Adds what `other` gathered, as if its rollouts had been added here one by one after this one's
  // (the sums in the same order: merging one-rollout accumulators in rollout order gives the bits
  // of adding the rollouts here).
  void Merge(const DiagnosticsAccumulator& other);
  // The totals, read with one copy to the host; zeros when nothing was added.
  LossDiagnostics Read() const;

 private:
  at::Tensor sums_;
  at::Tensor extremes_;  // [max ratio, -min ratio]
};

}  // namespace dta
