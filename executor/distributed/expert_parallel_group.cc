#include "executor/distributed/expert_parallel_group.h"

#include <c10/util/Exception.h>

#include <numeric>
#include <string_view>

#include "executor/distributed/pending_work.h"

namespace dta {
namespace {

constexpr std::string_view kAllToAll = "expert-parallel all-to-all";

}  // namespace

at::Tensor ExpertParallelOverProcessGroup::AllGather(const at::Tensor& tensor) const {
  TORCH_CHECK(tensor.is_contiguous(), "expert-parallel all-gather: the tensor must be contiguous");
  std::vector<int64_t> shape = tensor.sizes().vec();
  shape.insert(shape.begin(), group_.size());
  at::Tensor out = at::empty(shape, tensor.options());
  c10d::AllgatherOptions options;
  options.timeout = group_.timeout();
  // _allgather_base concatenates along dimension 0: a flat view of the [size, ...] result.
  at::Tensor flat = out.view({-1});
  at::Tensor input = tensor.reshape({-1});
  c10::intrusive_ptr<c10d::Work> work = group_.backend()->_allgather_base(flat, input, options);
  group_.WaitStreamOrdered(*work, "expert-parallel all-gather");
  return out;
}

std::unique_ptr<PendingCollective> ExpertParallelOverProcessGroup::StartAllToAll(
    at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& receive_splits,
    const std::vector<int64_t>& send_splits) const {
  const size_t ranks = static_cast<size_t>(group_.size());
  TORCH_CHECK(receive_splits.size() == ranks && send_splits.size() == ranks, kAllToAll,
              ": one split per rank (", ranks, "), got ", receive_splits.size(), " and ",
              send_splits.size());
  TORCH_CHECK(input.is_contiguous() && output.is_contiguous(), kAllToAll,
              ": the tensors must be contiguous");
  TORCH_CHECK(input.dim() >= 1 && output.dim() == input.dim() &&
                  input.sizes().slice(1) == output.sizes().slice(1) &&
                  input.scalar_type() == output.scalar_type(),
              kAllToAll, ": input ", input.sizes(), " ", input.scalar_type(), " and output ",
              output.sizes(), " ", output.scalar_type(), " differ beyond their rows");
  const int64_t sent = std::accumulate(send_splits.begin(), send_splits.end(), int64_t{0});
  const int64_t received =
      std::accumulate(receive_splits.begin(), receive_splits.end(), int64_t{0});
  TORCH_CHECK(sent == input.size(0) && received == output.size(0), kAllToAll, ": splits of ", sent,
              " and ", received, " rows for tensors of ", input.size(0), " and ", output.size(0));
  c10d::AllToAllOptions options;
  options.timeout = group_.timeout();
  std::vector<int64_t> out_splits = receive_splits;
  std::vector<int64_t> in_splits = send_splits;
  at::Tensor in = input;
  return std::make_unique<PendingWork>(
      group_, group_.backend()->alltoall_base(output, in, out_splits, in_splits, options),
      kAllToAll);
}

}  // namespace dta
