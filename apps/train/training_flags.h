// The flags every training binary shares (model, loss, execution method, precision, optimizer),
// and their conversion into options. dta-train and dta-trainer link this, so a flag means the same
// in both.
//
// Errors: BadInput with a message naming the flag, e.g. "--method must be dta, dense or packed,
// got 'x'"; the binaries print it and exit with status 2.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "core/base/exit_codes.h"
#include "core/cli/bad_input.h"
#include "core/layout/memory_plan.h"
#include "core/progress/progress_line.h"
#include "core/schedule/lr_schedule.h"
#include "executor/distributed/parallel_groups.h"
#include "executor/distributed/sharded_adamw.h"
#include "executor/distributed/training_optimizer.h"
#include "executor/engine/executor.h"
#include "executor/loss/loss.h"
#include "executor/model/decoder.h"
#include "executor/model/hf_checkpoint.h"
#include "executor/optim/adamw.h"

ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, method);
ABSL_DECLARE_FLAG(std::string, dtype);

namespace dta {

LossOptions LossFromFlags();
ExecutorOptions ExecutorFromFlags();
at::TensorOptions TensorOptionsFromFlags();
AdamWOptions AdamWFromFlags();
// --lr_schedule, --warmup_steps, --decay_steps (0: `run_steps`, the run's last step) and
// --min_lr_ratio; BadInput naming the flag when they do not make a schedule.
LrSchedule LrScheduleFromFlags(int64_t run_steps);
// How checkpoints publish the model: --checkpoint_dtype, and --model's directory for the tokenizer
// and generation config (executor/model/hf_checkpoint.h).
ModelExportOptions ModelExportFromFlags();
// What the layout planner may know of the workload at start (0: not known).
struct PlannedWorkload {
  int64_t longest_rollout = 0;  // tokens
  int64_t tree_tokens = 0;      // the batch's unique tokens
};
// The layout (tensor parallelism, optimizer sharding and offload) for `world_size` ranks on
// `device`, from --tensor_parallel, --expert_parallel, --shard_optimizer, --offload_optimizer,
// --gpu_memory_gb and
// --activation_gb and the device's memory (core/layout's planner). Without --activation_gb the
// executor's memory is estimated from the executor flags and the longest rollout
// (--longest_rollout, else `workload`'s, else 8192 tokens). BadInput with the planner's message
// (naming the numbers) when nothing fits or an override is impossible.
LayoutPlan LayoutFromFlags(const ModelConfig& config, int world_size, const at::Device& device,
                           const PlannedWorkload& workload = {});
// --progress: progress lines with rate and ETA within long steps (core/progress/progress_line.h).
ProgressMode ProgressFromFlags();
// --offload_update: where an offloaded optimizer's update runs.
OffloadUpdate OffloadUpdateFromFlags();
// --nonfinite_gradients: raise (stop, naming the parameter) or skip a step whose gradient norm is
// NaN or infinite.
NonFiniteGradients NonFiniteGradientsFromFlags();
// The config of --model (its config.json) or --config (a preset or a config.json).
ModelConfig ConfigFromFlags();
// --model (a Hugging Face directory) or --config (random weights), this rank's parts under
// `tensor_parallel` and `expert_parallel`.
Decoder ModelFromFlags(const at::TensorOptions& options,
                       std::shared_ptr<const TensorParallelGroup> tensor_parallel = nullptr,
                       std::shared_ptr<const ExpertParallelGroup> expert_parallel = nullptr);

// Which of `model`'s parameters are this rank's experts, and the groups their optimizer runs over
// (TrainingOptimizer's ExpertParameters; empty without expert parallelism or without `groups`).
ExpertParameters ExpertParametersOf(const Decoder& model, const ParallelGroups* groups);

// Peak memory since the last reset: allocated GPU memory on CUDA, the process's peak RSS on the
// CPU.
double PeakMemoryGiB(const at::Device& device);
// Starts a new peak (GPU only: the CPU's peak RSS cannot be reset).
void ResetPeakMemory(const at::Device& device);

}  // namespace dta
