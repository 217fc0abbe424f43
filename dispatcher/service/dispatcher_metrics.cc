#include "dispatcher/service/dispatcher_metrics.h"

#include <map>
#include <string>

#include "core/metrics/prometheus_text.h"
#include "dispatcher/service/dispatcher_service.h"

namespace dta {

std::string DispatcherPrometheus(const v1::GetStatusResponse& status,
                                 const v1::GetStatisticsResponse& statistics,
                                 const IngestMemory* ingest) {
  struct Metric {
    MetricType type;
    const char* name;
    const char* help;
    double value;
  };
  constexpr MetricType kGauge = MetricType::kGauge, kCounter = MetricType::kCounter;
  const Metric metrics[] = {
      {kGauge, "dta_dispatcher_serving", "1 while the log accepts writes.",
       static_cast<double>(status.serving())},
      {kGauge, "dta_dispatcher_pending_trajectories",
       "Trajectories accepted and not yet trained (the queue depth).",
       static_cast<double>(status.pending_trajectories())},
      {kGauge, "dta_dispatcher_policy_version", "The policy version committed steps reached.",
       static_cast<double>(status.policy_version())},
      {kGauge, "dta_dispatcher_generation", "The trainers' generation (grows on each restart).",
       static_cast<double>(status.generation())},
      {kGauge, "dta_dispatcher_registered_trainers", "Trainers registered in this generation.",
       static_cast<double>(status.registered_trainers())},
      {kGauge, "dta_dispatcher_world_size", "Trainers a step needs.",
       static_cast<double>(status.world_size())},
      {kCounter, "dta_dispatcher_accepted_total", "Trajectories accepted (logged).",
       static_cast<double>(statistics.accepted())},
      {kCounter, "dta_dispatcher_already_accepted_total",
       "Resent trajectories acknowledged again without a second copy.",
       static_cast<double>(statistics.already_accepted())},
      {kCounter, "dta_dispatcher_dropped_stale_total", "Trajectories dropped as too stale.",
       static_cast<double>(statistics.dropped_stale())},
      {kCounter, "dta_dispatcher_committed_steps_total", "Steps committed.",
       static_cast<double>(statistics.committed_steps())},
      {kCounter, "dta_dispatcher_aborted_steps_total", "Steps abandoned (a trainer failed).",
       static_cast<double>(statistics.aborted_steps())},
      {kCounter, "dta_dispatcher_trained_rollouts_total", "Rollouts in committed steps.",
       static_cast<double>(statistics.trained_rollouts())},
      {kGauge, "dta_dispatcher_wal_bytes", "Size of the write-ahead log.",
       static_cast<double>(statistics.wal_bytes())},
      {kCounter, "dta_dispatcher_wal_syncs_total", "Syncs of the log (group commits).",
       static_cast<double>(statistics.wal_syncs())},
      {kCounter, "dta_dispatcher_wal_compactions_total", "Compactions of the log since this start.",
       static_cast<double>(statistics.wal_compactions())},
  };
  PrometheusText text;
  for (const Metric& metric : metrics)
    text.Add(metric.type, metric.name, metric.help, metric.value);
  // Rejections by field, sorted so that scrapes list them in one order (0 before the first).
  const char* kRejected = "dta_dispatcher_rejected_total";
  const char* kRejectedHelp = "Trajectories rejected, by offending field.";
  const std::map<std::string, int64_t> by_field(statistics.rejected_by_field().begin(),
                                                statistics.rejected_by_field().end());
  if (by_field.empty()) text.Counter(kRejected, kRejectedHelp, 0);
  for (const auto& [field, count] : by_field)
    text.Counter(kRejected, kRejectedHelp, count, {{"field", field}});
  if (ingest != nullptr) {
    text.Gauge("dta_dispatcher_held_bytes",
               "Bytes of received trajectories not yet answered (at most --max_held_mb).",
               static_cast<double>(ingest->held_bytes));
    text.Gauge("dta_dispatcher_held_trajectories", "Received trajectories not yet answered.",
               static_cast<double>(ingest->held_trajectories));
    text.Gauge("dta_dispatcher_held_bytes_peak", "The most held_bytes has been since the start.",
               static_cast<double>(ingest->peak_held_bytes));
    text.Gauge("dta_dispatcher_ingest_streams", "Ingest streams open.",
               static_cast<double>(ingest->open_streams));
    const char* kRefused = "dta_dispatcher_ingest_refused_total";
    const char* kRefusedHelp = "Ingest streams ended RESOURCE_EXHAUSTED, by the limit reached.";
    text.Counter(kRefused, kRefusedHelp, static_cast<double>(ingest->refused_over_held_bytes),
                 {{"limit", "max_held_mb"}});
    text.Counter(kRefused, kRefusedHelp, static_cast<double>(ingest->refused_over_streams),
                 {{"limit", "max_ingest_streams"}});
  }
  if (statistics.recent_steps_size() > 0) {
    const v1::StepStatistics& last = statistics.recent_steps(statistics.recent_steps_size() - 1);
    text.Gauge("dta_dispatcher_last_step", "The last committed step.", last.step());
    for (const auto& [name, value] : StepStatisticsScalars(last, status.pending_trajectories())) {
      if (name == "pending_trajectories") continue;  // the live gauge above
      text.Gauge("dta_step_" + name, "The last committed step's " + name + ".", value);
    }
  }
  return text.Render();
}

Scalars StepStatisticsScalars(const v1::StepStatistics& step, int64_t pending_trajectories) {
  return {{"rollouts", static_cast<double>(step.rollouts())},
          {"rollout_tokens", static_cast<double>(step.rollout_tokens())},
          {"tree_tokens", static_cast<double>(step.tree_tokens())},
          {"compression", step.compression()},
          {"imbalance", step.imbalance()},
          {"extra_tokens", static_cast<double>(step.extra_tokens())},
          {"seconds", step.seconds()},
          {"tokens_per_second", step.tokens_per_second()},
          {"loss", step.loss()},
          {"dropped_stale", static_cast<double>(step.dropped_stale())},
          {"pending_trajectories", static_cast<double>(pending_trajectories)}};
}

}  // namespace dta
