#include "executor/distributed/tensor_parallel_group.h"

#include <c10/util/Exception.h>

#include <string_view>
#include <vector>

#include "executor/distributed/pending_work.h"

namespace dta {

namespace {

constexpr std::string_view kAllReduce = "tensor-parallel all-reduce";

}  // namespace

std::unique_ptr<PendingCollective> TensorParallelOverProcessGroup::StartAllReduce(
    at::Tensor& tensor, TensorParallelReduce op) const {
  TORCH_CHECK(tensor.is_contiguous(), kAllReduce, ": the tensor must be contiguous");
  std::vector<at::Tensor> tensors = {tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = op == TensorParallelReduce::kMax ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  options.timeout = group_.timeout();
  return std::make_unique<PendingWork>(group_, group_.backend()->allreduce(tensors, options),
                                       kAllReduce);
}

void TensorParallelOverProcessGroup::AllReduce(at::Tensor& tensor, TensorParallelReduce op) const {
  StartAllReduce(tensor, op)->Wait();
}

at::Tensor TensorParallelOverProcessGroup::AllGather(const at::Tensor& tensor) const {
  TORCH_CHECK(tensor.is_contiguous(), "tensor-parallel all-gather: the tensor must be contiguous");
  std::vector<int64_t> shape = tensor.sizes().vec();
  TORCH_CHECK(!shape.empty(), "tensor-parallel all-gather: the tensor must have a dimension");
  shape[0] *= group_.size();
  at::Tensor out = at::empty(shape, tensor.options());
  c10d::AllgatherOptions options;
  options.timeout = group_.timeout();
  at::Tensor input = tensor;
  c10::intrusive_ptr<c10d::Work> work = group_.backend()->_allgather_base(out, input, options);
  group_.WaitStreamOrdered(*work, "tensor-parallel all-gather");
  return out;
}

}  // namespace dta
