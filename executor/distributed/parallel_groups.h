// The tensor- and data-parallel process groups of a world of TP x DP ranks. World rank
// w = d TP + t: the TP ranks of replica d are consecutive, so with torchrun's numbering they are
// one node's GPUs (tensor parallelism stays inside a node, on NVLink), and TP rank t of every
// replica forms a DP group (the ranks holding the same parameter parts, whose gradients are summed
// and whose optimizer state is sharded). Both groups are built over the world's store.
//
// Example:
//   ParallelGroups groups(*world, /*tensor_parallel=*/2, options);
//   Decoder model(config, options, groups.tensor_parallel_collectives());
//   TrainingOptimizer optimizer(model.named_parameters(), &groups.data_parallel(), layout, ...);
//
// Errors: c10::Error (TORCH_CHECK) naming the group when it cannot be created.
// Thread safety: none; create on every rank in the same order.
#pragma once

#include <memory>

#include "executor/distributed/process_group.h"
#include "executor/parallel/tensor_parallel.h"

namespace dta {

class ParallelGroups {
 public:
  // `world` must outlive this object. TORCH_CHECK when tensor_parallel < 1 or does not divide the
  // world's size. `options`: for the new groups (timeout, Gloo host, ...); their names are derived
  // from options.group_name. With tensor_parallel 1 no group is created: the world is the DP group.
  ParallelGroups(ProcessGroup& world, int tensor_parallel, ProcessGroupOptions options);

  ProcessGroup& world() const { return world_; }
  int tensor_parallel_size() const { return tensor_parallel_size_; }
  int tensor_parallel_rank() const { return world_.rank() % tensor_parallel_size_; }
  int data_parallel_size() const { return world_.size() / tensor_parallel_size_; }
  int data_parallel_rank() const { return world_.rank() / tensor_parallel_size_; }
  // The TP ranks of this replica (null with tensor_parallel 1).
  ProcessGroup* tensor_parallel() const { return tensor_parallel_.get(); }
  // The model's collectives over tensor_parallel() (null with tensor_parallel 1).
  std::shared_ptr<const TensorParallelGroup> tensor_parallel_collectives() const {
    return collectives_;
  }
  // The DP ranks holding this rank's parameter parts (the world with tensor_parallel 1).
  ProcessGroup& data_parallel() const { return data_parallel_ ? *data_parallel_ : world_; }

 private:
  ProcessGroup& world_;
  int tensor_parallel_size_;
  std::unique_ptr<ProcessGroup> tensor_parallel_;
  std::unique_ptr<ProcessGroup> data_parallel_;
  std::shared_ptr<const TensorParallelGroup> collectives_;
};

}  // namespace dta
