#include "executor/distributed/parallel_groups.h"

#include <c10/util/Exception.h>

#include <string>

#include "executor/distributed/expert_parallel_group.h"
#include "executor/distributed/tensor_parallel_group.h"

namespace dta {
namespace {

std::unique_ptr<ProcessGroup> Subgroup(ProcessGroup& world, int rank, int size,
                                       ProcessGroupOptions options, const std::string& name) {
  options.group_name = name;
  absl::StatusOr<std::unique_ptr<ProcessGroup>> group =
      ProcessGroup::CreateWithStore(world.store(), rank, size, world.device(), options);
  TORCH_CHECK(group.ok(), "rank ", world.rank(), " of ", world.size(), ": cannot create the ", name,
              " group: ", group.status().message());
  return *std::move(group);
}

}  // namespace

ParallelGroups::ParallelGroups(ProcessGroup& world, int tensor_parallel, int expert_parallel,
                               ProcessGroupOptions options)
    : world_(world),
      tensor_parallel_size_(tensor_parallel),
      expert_parallel_size_(expert_parallel) {
  TORCH_CHECK(tensor_parallel >= 1 && world.size() % tensor_parallel == 0,
              "tensor parallelism over ", tensor_parallel, " ranks does not divide the world of ",
              world.size(), " ranks");
  TORCH_CHECK(expert_parallel >= 1 && data_parallel_size() % expert_parallel == 0,
              "expert parallelism over ", expert_parallel, " replicas does not divide the ",
              data_parallel_size(), " data-parallel replicas");
  const std::string base = options.group_name;
  const std::string t = std::to_string(tensor_parallel_rank());
  // Every rank creates its own groups; the names keep their store keys apart.
  if (tensor_parallel > 1) {
    tensor_parallel_ = Subgroup(world, tensor_parallel_rank(), tensor_parallel, options,
                                base + "-tp" + std::to_string(data_parallel_rank()));
    data_parallel_ =
        Subgroup(world, data_parallel_rank(), data_parallel_size(), options, base + "-dp" + t);
    collectives_ = std::make_shared<TensorParallelOverProcessGroup>(*tensor_parallel_);
  }
  if (expert_parallel > 1) {
    expert_parallel_ =
        Subgroup(world, expert_parallel_rank(), expert_parallel, options,
                 base + "-ep" + std::to_string(expert_data_parallel_rank()) + "." + t);
    expert_data_parallel_ =
        Subgroup(world, expert_data_parallel_rank(), expert_data_parallel_size(), options,
                 base + "-edp" + std::to_string(expert_parallel_rank()) + "." + t);
    expert_collectives_ = std::make_shared<ExpertParallelOverProcessGroup>(*expert_parallel_);
  }
}

}  // namespace dta
