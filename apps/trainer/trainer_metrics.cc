#include "apps/trainer/trainer_metrics.h"

#include <algorithm>

#include "core/metrics/prometheus_text.h"

namespace dta {

Scalars StepScalars(const StepReport& report) {
  Scalars scalars = {
      {"loss", report.loss},
      {"grad_norm", report.grad_norm},
      {"lr", report.lr},
      {"step_seconds", report.seconds},
      {"optimizer_seconds", report.optimizer_seconds},
      {"rollouts", report.rollouts},
      {"rollout_tokens", static_cast<double>(report.rollout_tokens)},
      {"forwarded_tokens", static_cast<double>(report.forwarded_tokens)},
      {"tree_tokens", static_cast<double>(report.tree_tokens)},
      {"rollout_tokens_per_second",
       report.seconds > 0 ? report.rollout_tokens / report.seconds : 0},
      {"compression", report.tree_tokens > 0
                          ? static_cast<double>(report.rollout_tokens) / report.tree_tokens
                          : 0},
      {"peak_memory_gib", report.peak_memory_gib},
      {"skipped", report.skipped ? 1.0 : 0.0}};
  if (report.router_aux_loss) scalars.emplace_back("router_aux_loss", *report.router_aux_loss);
  if (report.replay_split_tokens > 0) {
    scalars.emplace_back("replay_split_tokens", static_cast<double>(report.replay_split_tokens));
  }
  for (const auto& [name, value] : report.diagnostics.Applicable())
    scalars.emplace_back("rl/" + name, value);
  return scalars;
}

void TrainerMetrics::Record(const StepReport& report) {
  std::lock_guard<std::mutex> lock(mu_);
  ++steps_;
  rollouts_ += report.rollouts;
  rollout_tokens_ += report.rollout_tokens;
  forwarded_tokens_ += report.forwarded_tokens;
  seconds_ += report.seconds + report.optimizer_seconds;
  skipped_steps_ += report.skipped ? 1 : 0;
  last_ = report;
}

std::string TrainerMetrics::Prometheus() const {
  std::lock_guard<std::mutex> lock(mu_);
  const MetricLabels rank = {{"rank", std::to_string(rank_)}};
  PrometheusText text;
  text.Gauge("dta_trainer_attempt", "The launcher's restart count of this rank's process.",
             attempt_, rank);
  text.Counter("dta_trainer_steps_total", "Steps committed by this process.", steps_, rank);
  text.Counter("dta_trainer_rollouts_total", "Rollouts trained by this process.", rollouts_, rank);
  text.Counter("dta_trainer_rollout_tokens_total", "Rollout tokens trained by this process.",
               rollout_tokens_, rank);
  text.Counter("dta_trainer_forwarded_tokens_total",
               "Tokens this process ran through the model (shared prefixes once).",
               forwarded_tokens_, rank);
  text.Counter("dta_trainer_seconds_total", "Seconds in steps (gradients and optimizer).", seconds_,
               rank);
  text.Counter("dta_trainer_skipped_steps_total",
               "Committed steps whose gradient norm was not finite (nothing updated).",
               skipped_steps_, rank);
  if (last_) {
    text.Gauge("dta_trainer_last_step", "The last committed step.", last_->step, rank);
    for (auto [name, value] : StepScalars(*last_)) {
      std::replace(name.begin(), name.end(), '/', '_');
      text.Gauge("dta_trainer_" + name, "The last committed step's " + name + ".", value, rank);
    }
  }
  return text.Render();
}

}  // namespace dta
