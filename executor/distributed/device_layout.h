// The training layout for ranks of one kind of device: core/layout's planner fed with what this
// machine has (the GPU's memory, or the host's for CPU ranks; the host's memory for offloaded
// state; the ranks per node as torchrun exports them). The training binaries' flags and dta.Trainer
// both plan through it, so that one request means one layout everywhere.
//
//   absl::StatusOr<LayoutPlan> plan =
//       PlanDeviceLayout(config, world_size, at::Device(at::kCUDA, 0), at::kBFloat16, {});
//
// Errors: absl::Status, PlanLayout's (naming the field or the numbers).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "absl/status/statusor.h"
#include "core/layout/memory_plan.h"
#include "core/model/model_config.h"

namespace dta {

struct LayoutOverrides {
  int tensor_parallel = 1;              // 0: the planner's choice
  int expert_parallel = 1;              // 0: the planner's choice (mixture-of-experts models)
  std::optional<bool> shard_optimizer;  // nullopt: the planner's choice
  std::optional<bool> offload_optimizer;
  // With offload: GB (1e9 bytes) of the optimizer's state per GPU kept there; nullopt: what the GPU
  // holds beside the rest (LayoutRequest::offload_resident_bytes).
  std::optional<double> offload_resident_gb;
  // Whether an offloaded optimizer streams through the GPU (OffloadUpdate::kOnDevice); updated on
  // the host instead, none of its state stays on the GPU.
  bool offload_streamed = true;
  double gpu_memory_gb = 0;  // memory each GPU may use, GB (1e9 bytes); 0: the device's
  // Reserve for the executor, GB; negative (the default): the executor's own peak, estimated from
  // the model's shape at each TP degree and `executor` (core/layout/executor_memory.h).
  double activation_gb = -1;
  // The executor's options and workload as the estimate sees them. Default: ExecutorOptions'
  // defaults (dta, automatic block size and graph budget) on rollouts of up to 8,192 tokens.
  ExecutorMemoryOptions executor;
};

// The layout of `world_size` ranks on devices like `device`, holding weights of `dtype`.
// LOCAL_WORLD_SIZE (torchrun) bounds the tensor parallelism (a node's ranks); without it the
// whole world is one node. INVALID_ARGUMENT naming the field for a negative size or executor
// options out of range.
absl::StatusOr<LayoutPlan> PlanDeviceLayout(const ModelConfig& config, int world_size,
                                            const at::Device& device, at::ScalarType dtype,
                                            const LayoutOverrides& overrides);

}  // namespace dta
