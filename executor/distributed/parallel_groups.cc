#include "executor/distributed/parallel_groups.h"

#include <c10/util/Exception.h>

#include <string>

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

ParallelGroups::ParallelGroups(ProcessGroup& world, int tensor_parallel,
                               ProcessGroupOptions options)
    : world_(world), tensor_parallel_size_(tensor_parallel) {
  TORCH_CHECK(tensor_parallel >= 1 && world.size() % tensor_parallel == 0,
              "tensor parallelism over ", tensor_parallel, " ranks does not divide the world of ",
              world.size(), " ranks");
  if (tensor_parallel == 1) return;
  const std::string base = options.group_name;
  // Every rank creates its own two groups; the names keep their store keys apart.
  tensor_parallel_ = Subgroup(world, tensor_parallel_rank(), tensor_parallel, options,
                              base + "-tp" + std::to_string(data_parallel_rank()));
  data_parallel_ = Subgroup(world, data_parallel_rank(), data_parallel_size(), options,
                            base + "-dp" + std::to_string(tensor_parallel_rank()));
  collectives_ = std::make_shared<TensorParallelOverProcessGroup>(*tensor_parallel_);
}

}  // namespace dta
