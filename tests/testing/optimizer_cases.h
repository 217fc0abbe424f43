// What the distributed optimizer tests share: every optimizer layout, and one process's clipped
// AdamW steps on the whole batch (the reference every layout is compared with).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/layout/memory_plan.h"
#include "core/loss/batch_context.h"
#include "executor/engine/executor.h"
#include "executor/optim/adamw.h"
#include "tests/testing/executor_cases.h"

namespace dta::testing {

// Sets every rollout's per-token advantages to its GRPO group's over the whole batch, as the
// dispatcher sends them to each replica (a replica's own groups would give others).
inline void SetBatchAdvantages(std::vector<Rollout>& rollouts) {
  absl::StatusOr<std::vector<std::vector<float>>> advantages = GroupAdvantages(rollouts);
  ASSERT_TRUE(advantages.ok()) << advantages.status();
  for (size_t r = 0; r < rollouts.size(); ++r) rollouts[r].advantages = (*advantages)[r];
}

// Replicated, ZeRO-1 sharded, and sharded and offloaded, on tp x dp ranks.
inline std::vector<TrainingLayout> OptimizerLayouts(int tp, int dp) {
  return {{.tensor_parallel = tp, .data_parallel = dp},
          {.tensor_parallel = tp, .data_parallel = dp, .shard_optimizer = true},
          {.tensor_parallel = tp,
           .data_parallel = dp,
           .shard_optimizer = true,
           .offload_optimizer = true}};
}

inline std::string OptimizerLayoutName(const TrainingLayout& layout) {
  return std::string("shard ") + (layout.shard_optimizer ? "on" : "off") + " offload " +
         (layout.offload_optimizer ? "on" : "off");
}

// `steps` AdamW steps of `whole` on all of `rollouts`, each expected to clip.
inline void TrainOneProcess(const Decoder& whole, const std::vector<Rollout>& rollouts,
                            const LossOptions& loss, const ExecutorOptions& executor,
                            const BatchLossContext& batch, const AdamWOptions& adamw, int steps) {
  AdamW reference(whole.named_parameters(), adamw);
  for (int step = 0; step < steps; ++step) {
    reference.ZeroGrad();
    ComputeGradients(whole, rollouts, loss, executor, batch);
    const StepStats stats = reference.Step();
    EXPECT_LT(stats.clip_coef, 1.0) << "the test means to clip; the norm is " << stats.grad_norm;
  }
}

// Every parameter of `model` (one rank's parts) within `tolerance` of `whole`'s, relative.
inline void ExpectPartsOf(const Decoder& model, const Decoder& whole, double tolerance, int rank) {
  for (size_t i = 0; i < model.named_parameters().size(); ++i) {
    const auto& [name, parameter] = model.named_parameters()[i];
    EXPECT_LE(RelativeError(parameter, model.LocalPart(i, whole.named_parameters()[i].second)),
              tolerance)
        << name << " on rank " << rank;
  }
}

}  // namespace dta::testing
