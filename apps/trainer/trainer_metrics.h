// A trainer rank's metrics: each committed step's figures as TensorBoard scalars, and running
// totals plus the last step's figures as Prometheus text (labelled with the rank, so one scrape
// configuration covers every rank of a host: dta-trainer listens on --metrics_listen's port plus
// LOCAL_RANK).
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "apps/trainer/trainer_loop.h"
#include "core/metrics/tensorboard_writer.h"

namespace dta {

// The step's scalars: loss, grad_norm, lr, step_seconds, optimizer_seconds, rollouts,
// rollout_tokens, forwarded_tokens, tree_tokens, rollout_tokens_per_second, compression (rollout
// over tree tokens of this rank's partition), peak_memory_gib, skipped, router_aux_loss when the
// loss has one, replay_split_tokens when routing replay unshared any, and the RL diagnostics that
// apply as "rl/<name>" (LossDiagnostics::Applicable).
Scalars StepScalars(const StepReport& report);

class TrainerMetrics {
 public:
  // `attempt`: the launcher's restart count, shown as a gauge.
  TrainerMetrics(int rank, int attempt) : rank_(rank), attempt_(attempt) {}

  // Thread-safe: the step loop records, the /metrics thread renders.
  void Record(const StepReport& report);
  std::string Prometheus() const;

 private:
  const int rank_;
  const int attempt_;
  mutable std::mutex mu_;
  int64_t steps_ = 0;
  int64_t rollouts_ = 0;
  int64_t rollout_tokens_ = 0;
  int64_t forwarded_tokens_ = 0;
  double seconds_ = 0;
  int64_t skipped_steps_ = 0;
  std::optional<StepReport> last_;
};

}  // namespace dta
