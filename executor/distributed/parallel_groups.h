// The tensor-, data- and expert-parallel process groups of a world of TP x DP ranks. World rank
// w = d TP + t: the TP ranks of replica d are consecutive, so with torchrun's numbering they are
// one node's GPUs (tensor parallelism stays inside a node, on NVLink), and TP rank t of every
// replica forms a DP group (the ranks holding the same parameter parts, whose gradients are summed
// and whose optimizer state is sharded). Expert parallelism lives inside the DP group, as in
// Megatron-Core: DP rank d = f EP + e, the EP consecutive replicas f EP .. f EP + EP - 1 (same TP
// rank) spread every sparse layer's experts over their EP ranks e (ExpertRange) and exchange
// tokens; the ranks holding the same experts (same e and t) form the expert-data-parallel (EDP)
// group, over which expert gradients are summed. Every group is built over the world's store.
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
#include <utility>

#include "executor/distributed/process_group.h"
#include "executor/parallel/expert_parallel.h"
#include "executor/parallel/tensor_parallel.h"

namespace dta {

class ParallelGroups {
 public:
  // `world` must outlive this object. TORCH_CHECK when tensor_parallel < 1 or does not divide the
  // world's size. `options`: for the new groups (timeout, Gloo host, ...); their names are derived
  // from options.group_name. With tensor_parallel 1 no group is created: the world is the DP group.
  ParallelGroups(ProcessGroup& world, int tensor_parallel, ProcessGroupOptions options)
      : ParallelGroups(world, tensor_parallel, /*expert_parallel=*/1, std::move(options)) {}
  // With experts spread over `expert_parallel` replicas: TORCH_CHECK that it is >= 1 and divides
  // the number of replicas (DP). With expert_parallel 1 no EP or EDP group is created.
  ParallelGroups(ProcessGroup& world, int tensor_parallel, int expert_parallel,
                 ProcessGroupOptions options);

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

  int expert_parallel_size() const { return expert_parallel_size_; }
  int expert_parallel_rank() const { return data_parallel_rank() % expert_parallel_size_; }
  int expert_data_parallel_size() const { return data_parallel_size() / expert_parallel_size_; }
  int expert_data_parallel_rank() const { return data_parallel_rank() / expert_parallel_size_; }
  // The EP ranks sharing this rank's sparse layers (null with expert_parallel 1).
  ProcessGroup* expert_parallel() const { return expert_parallel_.get(); }
  // The model's collectives over expert_parallel() (null with expert_parallel 1).
  std::shared_ptr<const ExpertParallelGroup> expert_parallel_collectives() const {
    return expert_collectives_;
  }
  // The ranks holding this rank's experts (data_parallel() with expert_parallel 1).
  ProcessGroup& expert_data_parallel() const {
    return expert_data_parallel_ ? *expert_data_parallel_ : data_parallel();
  }

 private:
  ProcessGroup& world_;
  int tensor_parallel_size_;
  std::unique_ptr<ProcessGroup> tensor_parallel_;
  std::unique_ptr<ProcessGroup> data_parallel_;
  std::shared_ptr<const TensorParallelGroup> collectives_;
  int expert_parallel_size_ = 1;
  std::unique_ptr<ProcessGroup> expert_parallel_;
  std::unique_ptr<ProcessGroup> expert_data_parallel_;
  std::shared_ptr<const ExpertParallelGroup> expert_collectives_;
};

}  // namespace dta
