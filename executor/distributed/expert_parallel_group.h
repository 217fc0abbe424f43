// ExpertParallelGroup (executor/parallel/expert_parallel.h) over a ProcessGroup: the collectives
// of sparse layers whose experts are spread across the ranks of `group` (the expert-parallel
// ranks: ParallelGroups' expert-parallel group).
//
// On NCCL a collective is stream-ordered (the current stream waits for it, the host does not); on
// Gloo (CPU tensors) it blocks until done or the group's timeout, as the tensor-parallel
// collectives (tensor_parallel_group.h).
//
// Errors: c10::Error (TORCH_CHECK) naming the rank and the collective.
// Thread safety: as ProcessGroup's: one collective at a time on the group.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "executor/distributed/process_group.h"
#include "executor/parallel/expert_parallel.h"

namespace dta {

class ExpertParallelOverProcessGroup final : public ExpertParallelGroup {
 public:
  // `group` must outlive this object (and every model built on it).
  explicit ExpertParallelOverProcessGroup(ProcessGroup& group) : group_(group) {}

  int rank() const override { return group_.rank(); }
  int size() const override { return group_.size(); }
  at::Tensor AllGather(const at::Tensor& tensor) const override;
  std::unique_ptr<PendingCollective> StartAllToAll(
      at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& receive_splits,
      const std::vector<int64_t>& send_splits) const override;

 private:
  ProcessGroup& group_;
};

}  // namespace dta
