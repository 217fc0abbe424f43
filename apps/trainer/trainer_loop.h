// The trainer daemon's step loop, apart from its process: fetch this rank's partition from a
// TrainerSession, compute its gradients with the executor under the whole batch's normalisers,
// synchronise them with the other ranks, report PREPARED and step the optimizer only on COMMIT;
// save checkpoints, every rank writing what it owns. dta-trainer (trainer_main.cc) builds the
// model, the optimizer, the session and the process group, then calls RunTrainerSteps; tests drive
// it with a fake session.
//
//   std::atomic<bool> requested{false};
//   RunTrainerSteps(*session, model, optimizer, [&] { optimizer.SyncGradients(); }, resume_step,
//                   {.loss = loss, .executor = executor, .device = device,
//                    .checkpoint_dir = dir, .max_steps = 100}, &requested);
//
// Errors (thrown; the caller maps them to exit statuses):
//   TrainerRestart      the group must restart: the dispatcher answered ABORT or ABORTED (the
//                       generation is over), or synchronising gradients failed (a peer died). The
//                       step was reported FAILED when this rank could still say so.
//   std::runtime_error  anything else: a failed fetch or report, a gradient computation that threw
//                       (reported FAILED first, so the other ranks abandon the step at once).
//
// Thread safety: one call at a time; `checkpoint_requested` may be set from a signal handler.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "apps/trainer/checkpoints.h"
#include "core/progress/progress_line.h"
#include "dispatcher/client/trainer_session.h"
#include "executor/distributed/process_group.h"
#include "executor/distributed/training_optimizer.h"
#include "executor/engine/executor.h"
#include "executor/loss/loss.h"
#include "executor/model/decoder.h"

namespace dta {

struct TrainerRestart {
  std::string why;
};

// What a committed step did on this rank, for its metrics (apps/trainer/trainer_metrics.h).
struct StepReport {
  int64_t step = 0;
  bool replay = false;  // a committed step served again after a restart
  int rollouts = 0;
  int64_t rollout_tokens = 0;
  int64_t forwarded_tokens = 0;
  int64_t tree_tokens = 0;  // of this rank's partition
  double loss = 0;          // this rank's share
  // This rank's share of the router load-balancing loss that `loss` includes (mixture-of-experts
  // models with --router_aux_loss_coef > 0); unset when the loss has none.
  std::optional<double> router_aux_loss;
  // Routing replay: unique tokens this rank's tree gained because its rollouts were routed
  // differently on shared tokens (GradientResult::replay_split_tokens).
  int64_t replay_split_tokens = 0;
  double grad_norm = 0;  // of the whole model, after synchronisation
  double lr = 0;
  double seconds = 0;  // fetch to gradients synchronised
  double optimizer_seconds = 0;
  double peak_memory_gib = 0;
  LossDiagnostics diagnostics;  // this rank's share
  bool skipped = false;         // the gradient norm was not finite: nothing was updated
};

struct TrainerLoopOptions {
  LossOptions loss;
  ExecutorOptions executor;
  // Where the model lives: peak memory is reported for it.
  at::Device device = at::kCPU;
  // Checkpoints (apps/trainer/checkpoints.h), written by rank 0; required.
  std::string checkpoint_dir;
  // Save after every this many committed steps (>= 1), after the last step and on request.
  int64_t save_every = 1;
  int keep_checkpoints = 2;
  // How checkpoints publish the model (dtype, the source model's tokenizer and generation config).
  ModelExportOptions model_export;
  // Each checkpoint also publishes the delta from the previous one's weights (SaveCheckpoint).
  bool publish_weight_delta = false;
  // Called on world rank 0 once each checkpoint is in place (e.g. EngineNotifier::Publish of its
  // model/ directory); the policy version is the one its weights produce.
  std::function<void(const CheckpointInfo& checkpoint, int64_t policy_version)> on_published;
  // Called on every rank after each committed step's optimizer update, before its checkpoint
  // (the weight sync, apps/engines/weight_sync.h). Returning true on any rank saves this step's
  // checkpoint (so that engines the sync failed can reload it from disk through on_published).
  std::function<bool(const Decoder& model, int64_t policy_version)> on_weights;
  // Called after each committed step's optimizer update, before its checkpoint (metrics).
  std::function<void(const StepReport&)> on_step;
  // Stop once this many steps are committed in all; 0: run until stopped.
  int64_t max_steps = 0;
  // The ranks that save checkpoints together (apps/trainer/checkpoints.h). With several ranks they
  // also agree on a requested checkpoint through ranks.world, so a request on any rank saves one.
  CheckpointRanks ranks;
  // Every rank computes every step, with or without rollouts (expert parallelism: a replica's
  // experts serve the other replicas' tokens, and the executor's calls are collective).
  bool collective_steps = false;
  // Testing: sleep this long before synchronising gradients (fault-injection tests).
  std::chrono::milliseconds slow_step{0};
  // Starts every progress line on stderr.
  std::string log_prefix = "dta-trainer";
  // Progress lines within a step (tokens done, rate, ETA).
  ProgressMode progress = ProgressMode::kNever;
  // A committed step whose gradient norm is not finite: kRaise stops the loop (the step is
  // committed without an update, and a restart would replay it into the same error); kSkip goes
  // on without an update, as AReaL and Megatron do, so the batch counts as consumed.
  NonFiniteGradients nonfinite_gradients = NonFiniteGradients::kRaise;
};

// Synchronises (averages or sums) the gradients across ranks; throws c10::Error when a peer is
// gone or a collective times out.
using SyncGradients = std::function<void()>;

// Runs steps from `step` (the committed steps the weights include) until options.max_steps;
// returns the number of committed steps reached. `checkpoint_requested` (may be null): set it on
// any rank to save after the step in progress commits (it is cleared on every rank).
int64_t RunTrainerSteps(TrainerSession& session, Decoder& model, TrainingOptimizer& optimizer,
                        const SyncGradients& sync_gradients, int64_t step,
                        const TrainerLoopOptions& options,
                        std::atomic<bool>* checkpoint_requested = nullptr);

}  // namespace dta
