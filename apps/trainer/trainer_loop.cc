#include "apps/trainer/trainer_loop.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "apps/train/training_flags.h"

namespace dta {
namespace {

// This rank's share's RL diagnostics, after the step's other figures.
std::string DiagnosticsSuffix(const LossDiagnostics& diagnostics) {
  const std::string summary = diagnostics.Summary();
  return summary.empty() ? "" : absl::StrCat(", ", summary);
}

template <typename T>
T OrRestart(absl::StatusOr<T> result, const char* what) {
  if (result.ok()) return *std::move(result);
  if (result.status().code() == absl::StatusCode::kAborted) {
    throw TrainerRestart{absl::StrCat(what, ": ", result.status().message())};
  }
  throw std::runtime_error(absl::StrCat(what, ": ", result.status().ToString()));
}

}  // namespace

int64_t RunTrainerSteps(TrainerSession& session, Decoder& model, TrainingOptimizer& optimizer,
                        const SyncGradients& sync_gradients, int64_t step,
                        const TrainerLoopOptions& options,
                        std::atomic<bool>* checkpoint_requested) {
  TORCH_CHECK(!options.checkpoint_dir.empty(), "RunTrainerSteps: checkpoint_dir is required");
  TORCH_CHECK(options.save_every >= 1, "RunTrainerSteps: save_every must be >= 1");
  const char* prefix = options.log_prefix.c_str();
  const int64_t max_steps = options.max_steps;
  int64_t checkpoint_step = step;
  while (max_steps == 0 || step < max_steps) {
    const auto start = std::chrono::steady_clock::now();
    const StepPartition partition = OrRestart(session.Fetch(step), "fetch");
    const std::vector<Rollout>& rollouts = partition.rollouts;
    // A rank may get nothing when there are fewer rollouts than ranks; under expert parallelism
    // it still takes part (options.collective_steps). The call replaces the gradients (no zero
    // fill of the experts' before it); a rank that makes none zeroes them.
    const bool computes = !rollouts.empty() || options.collective_steps;
    if (!computes) optimizer.ZeroGrad();
    ResetPeakMemory(options.device);
    GradientResult result;
    if (computes) {
      ProgressLine progress(absl::StrCat(options.log_prefix, ": step ", step), "tokens",
                            options.progress);
      ExecutorOptions executor = options.executor;
      executor.replace_gradients = true;
      executor.progress = [&progress](int64_t done, int64_t total) {
        progress.Update(done, total);
      };
      try {
        result = ComputeGradients(model, rollouts, options.loss, executor,
                                  {.total_loss_tokens = partition.total_loss_tokens,
                                   .num_rollouts = partition.num_rollouts});
      } catch (const std::exception& e) {
        progress.Finish();
        // Tell the dispatcher first, so that the other ranks abandon the step now instead of at
        // their collective's timeout.
        const c10::Error* error = dynamic_cast<const c10::Error*>(&e);
        const std::string what = error != nullptr ? error->what_without_backtrace() : e.what();
        session.Failed(step, what);
        throw std::runtime_error(absl::StrCat("step ", step, ": ", what));
      }
    }
    if (options.slow_step.count() > 0) std::this_thread::sleep_for(options.slow_step);
    try {
      sync_gradients();
    } catch (const c10::Error& e) {
      session.Failed(step, e.what_without_backtrace());  // abandons the step on every rank
      throw TrainerRestart{absl::StrCat("step ", step, ": ", e.what_without_backtrace())};
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    int64_t policy_version = 0;
    const StepDecision decision = OrRestart(
        session.Prepared(
            {.step = step,
             .loss = result.loss,
             .rollout_tokens = result.rollout_tokens,
             .forwarded_tokens = result.forwarded_tokens,
             .tree_tokens = partition.tree_tokens,
             .seconds = seconds,
             .peak_memory_bytes = static_cast<int64_t>(PeakMemoryGiB(options.device) * (1 << 30)),
             .checkpoint_step = checkpoint_step},
            &policy_version),
        "report");
    if (decision != StepDecision::kCommit)
      throw TrainerRestart{absl::StrCat("step ", step, " aborted")};
    const auto optimizer_start = std::chrono::steady_clock::now();
    const StepStats stats = optimizer.Step(options.nonfinite_gradients);
    const double optimizer_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - optimizer_start).count();
    ++step;
    const std::optional<double> router_aux_loss =
        options.loss.router_aux_loss_coef > 0 ? std::optional<double>(result.router_aux_loss)
                                              : std::nullopt;
    std::fprintf(
        stderr,
        "%s: step %lld%s: %d rollouts, loss %.6g%s%s, grad norm %.4g%s, lr %.4g, %.2f s, "
        "optimizer %.2f s%s\n",
        prefix, static_cast<long long>(step - 1), partition.replay ? " (replay)" : "",
        static_cast<int>(rollouts.size()), result.loss,
        router_aux_loss ? absl::StrFormat(" (router aux loss %.6g)", *router_aux_loss).c_str() : "",
        result.replay_split_tokens > 0
            ? absl::StrFormat(" (routing replay unshared %lld tokens)",
                              static_cast<long long>(result.replay_split_tokens))
                  .c_str()
            : "",
        stats.grad_norm, stats.skipped ? " (not finite: step skipped, nothing updated)" : "",
        stats.lr, seconds, optimizer_seconds, DiagnosticsSuffix(result.diagnostics).c_str());
    if (options.on_step) {
      options.on_step({.step = step - 1,
                       .replay = partition.replay,
                       .rollouts = static_cast<int>(rollouts.size()),
                       .rollout_tokens = result.rollout_tokens,
                       .forwarded_tokens = result.forwarded_tokens,
                       .tree_tokens = partition.tree_tokens,
                       .loss = result.loss,
                       .router_aux_loss = router_aux_loss,
                       .replay_split_tokens = result.replay_split_tokens,
                       .grad_norm = stats.grad_norm,
                       .lr = stats.lr,
                       .seconds = seconds,
                       .optimizer_seconds = optimizer_seconds,
                       .peak_memory_gib = PeakMemoryGiB(options.device),
                       .diagnostics = result.diagnostics,
                       .skipped = stats.skipped});
    }
    bool requested = checkpoint_requested != nullptr && checkpoint_requested->exchange(false);
    if (options.on_weights && options.on_weights(model, policy_version)) requested = true;
    ProcessGroup* world = options.ranks.world;
    if (world != nullptr && world->size() > 1) {  // every rank saves: they agree on a request
      requested = world->AllReduceScalars({requested ? 1.0 : 0.0})[0] > 0;
    }
    if (step % options.save_every == 0 || step == max_steps || requested) {
      const CheckpointInfo saved = SaveCheckpoint(
          options.checkpoint_dir, step, policy_version, model, optimizer, options.keep_checkpoints,
          options.ranks, options.model_export, options.publish_weight_delta);
      if (options.on_published && (world == nullptr || world->rank() == 0)) {
        options.on_published(saved, policy_version);
      }
      if (requested && (world == nullptr || world->rank() == 0)) {
        std::fprintf(stderr, "%s: saved a checkpoint after step %lld, as requested\n", prefix,
                     static_cast<long long>(step - 1));
      }
      checkpoint_step = step;
    }
  }
  return step;
}

}  // namespace dta
