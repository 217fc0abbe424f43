// TensorParallelGroup (executor/parallel) over a ProcessGroup: the collectives of a model whose
// weights are split across the ranks of `group` (the tensor-parallel ranks of one replica).
//
// On NCCL a collective is stream-ordered: it runs after the current stream's work, the current
// stream waits for it, and the host goes on without waiting (the DFS loop adds no host
// synchronisation); a hang surfaces through NCCL's watchdog after the group's timeout; a started
// one (StartAllReduce) runs on NCCL's stream beside the compute stream until Wait(). On Gloo (CPU
// tensors) a collective runs on Gloo's threads, and AllReduce or Wait() blocks until it is done or
// the group's timeout.
//
// Example:
//   auto tp = std::make_shared<TensorParallelOverProcessGroup>(*tp_group);
//   Decoder model(config, options, tp);
//
// Errors: c10::Error (TORCH_CHECK) naming the rank and the collective.
// Thread safety: as ProcessGroup's: one collective at a time on the group.
#pragma once

#include <ATen/ATen.h>

#include "executor/distributed/process_group.h"
#include "executor/parallel/tensor_parallel.h"

namespace dta {

class TensorParallelOverProcessGroup final : public TensorParallelGroup {
 public:
  // `group` must outlive this object (and every model built on it).
  explicit TensorParallelOverProcessGroup(ProcessGroup& group) : group_(group) {}

  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  void AllReduce(at::Tensor& tensor, TensorParallelReduce op) const override;
  std::unique_ptr<PendingCollective> StartAllReduce(at::Tensor& tensor,
                                                    TensorParallelReduce op) const override;
  at::Tensor AllGather(const at::Tensor& tensor) const override;

  ProcessGroup& group() const { return group_; }

 private:
  ProcessGroup& group_;
};

}  // namespace dta
