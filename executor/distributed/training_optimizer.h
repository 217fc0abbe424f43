// The optimizer of one training layout, behind the one interface the training binaries use:
//   replicated  AdamW on every rank, gradients summed by GradientSynchronizer's all-reduce
//               (the file: optimizer.safetensors, written by rank 0);
//   sharded     ShardedAdamW: state split across the data-parallel ranks and/or offloaded to the
//               host, gradients reduce-scattered (the files: optimizer-RRRRR-of-WWWWW.safetensors,
//               one per rank).
// core/layout's TrainingLayout says which (shard_optimizer or offload_optimizer: sharded).
// Under expert parallelism the experts' parameters have an optimizer of the same kind over the
// expert-data-parallel ranks (the ranks holding the same experts), beside the dense parameters'
// over the data-parallel ranks (Megatron's chained dense and expert optimizers), and both clip by
// one global norm; the experts' state files go to experts/ep-EE-of-NN/ under the state directory.
//
//   TrainingOptimizer optimizer(model.named_parameters(), group.get(), layout, adamw_options);
//   optimizer.ZeroGrad();  ComputeGradients(...);  optimizer.SyncGradients();  optimizer.Step();
//   optimizer.SaveState(dir);   // every rank calls it; each writes what it owns
//
// Errors: c10::Error (TORCH_CHECK) naming the file, the parameter or the layout.
// Thread safety: none.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/layout/memory_plan.h"
#include "core/schedule/lr_schedule.h"
#include "executor/distributed/grad_sync.h"
#include "executor/distributed/process_group.h"
#include "executor/distributed/sharded_adamw.h"
#include "executor/optim/adamw.h"

namespace dta {

// Under expert parallelism (parallel_groups.h): which of the optimizer's parameters are this
// rank's experts (Decoder::parameter_splits()[i].expert_parallel()).
struct ExpertParameters {
  ProcessGroup* expert_data_parallel = nullptr;  // null: no expert parallelism
  int expert_parallel_rank = 0;
  int expert_parallel_size = 1;
  std::vector<bool> expert;  // per parameter, in the optimizer's order
};

class TrainingOptimizer {
 public:
  // `group`: the data-parallel ranks (null: one process). Under tensor parallelism
  // `named_parameters` are this TP rank's parts, `group` the DP ranks holding the same parts, and
  // `tensor_parallel` (Decoder::gradient_norm_scope) lets the clipping norm span the TP ranks;
  // layout.tensor_parallel must be its group's size. TORCH_CHECK when the layout cannot be built
  // (e.g. sharding across ranks without a group). `experts`: see ExpertParameters.
  TrainingOptimizer(std::vector<std::pair<std::string, at::Tensor>> named_parameters,
                    ProcessGroup* group, const TrainingLayout& layout, AdamWOptions options,
                    int64_t bucket_bytes = int64_t{25} << 20,
                    TensorParallelNorm tensor_parallel = {},
                    OffloadUpdate offload_update = OffloadUpdate::kOnDevice,
                    ExpertParameters experts = {});
  ~TrainingOptimizer();
  TrainingOptimizer(const TrainingOptimizer&) = delete;
  TrainingOptimizer& operator=(const TrainingOptimizer&) = delete;

  void ZeroGrad();
  // Sums the gradients over the data-parallel ranks (all-reduce, or reduce-scatter when sharded;
  // nothing on one replicated process).
  void SyncGradients();
  // One step of the layout's optimizer (see NonFiniteGradients for a gradient that is not
  // finite: nothing is updated, and the learning rate a schedule would set is not consumed).
  StepStats Step(NonFiniteGradients on_nonfinite = NonFiniteGradients::kRaise);
  // After weights were written into the parameters by other means: the master weights follow.
  void ResetMasterFromParameters();
  int64_t step() const;
  bool sharded() const;
  // Where the last offloaded step spent its time (zeros when not offloaded).
  OffloadTimes offload_times() const;
  // With offload, one line saying where the update runs ("streamed through the GPU from
  // page-locked host memory", or on how many host threads and why); empty otherwise.
  std::string DescribeOffload() const;
  const AdamWOptions& options() const;
  // The learning rate (with a schedule: its peak); TORCH_CHECK lr >= 0 and finite.
  void set_lr(double lr);
  // From now on every Step() first sets the learning rate to the current one (the peak) times
  // LrFactor(schedule, step()) (core/schedule/lr_schedule.h), so a resumed optimizer, which knows
  // its step, continues on the same curve. TORCH_CHECK naming the field of an invalid schedule.
  void set_schedule(const LrSchedule& schedule);

  // Writes this rank's part of the state into `directory` (created if missing): rank 0 the
  // replicated file, every rank its slice when sharded. Under tensor parallelism each TP rank's
  // files go to `directory`/tp-RR-of-TT/ (a state resumes only with the TP size it was saved
  // with; LoadState refuses another, naming what it found). Every rank calls it.
  void SaveState(const std::string& directory) const;
  // Reads the state a SaveState of the same kind wrote into `path`, a directory (sharded: by any
  // number of ranks) or one state file. TORCH_CHECK naming the directory when it holds the other
  // kind's files, with the flags that resume it.
  void LoadState(const std::string& path);
  // Whether `directory` holds state this optimizer can load (its kind's files).
  bool HasState(const std::string& directory) const;

  static constexpr char kReplicatedFile[] = "optimizer.safetensors";

 private:
  // The optimizer of the dense parameters or of the experts (training_optimizer.cc).
  class Part;

  // Sets the optimizer's current learning rate (a schedule's peak stays).
  void ApplyLr(double lr);
  // `directory`, or its subdirectory for this tensor-parallel rank; the experts' (part 1) under
  // experts/ep-EE-of-NN/.
  std::string StateDirectory(const std::string& directory, size_t part = 0) const;

  ProcessGroup* group_ = nullptr;
  TensorParallelNorm tensor_parallel_;        // what the global norm sums over besides `group_`
  at::Device device_ = at::kCPU;              // the parameters' (for the norm's collectives)
  std::string tensor_parallel_subdirectory_;  // "tp-RR-of-TT", empty without tensor parallelism
  std::string expert_subdirectory_;  // "experts/ep-EE-of-NN", empty without expert parallelism
  std::vector<std::unique_ptr<Part>> parts_;  // the dense parameters', then the experts'
  std::optional<LrSchedule> schedule_;
  double peak_lr_ = 0.0;
};

}  // namespace dta
