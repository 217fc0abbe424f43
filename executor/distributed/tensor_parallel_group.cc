#include "executor/distributed/tensor_parallel_group.h"

#include <c10/util/Exception.h>

#include <vector>

namespace dta {

void TensorParallelOverProcessGroup::AllReduce(at::Tensor& tensor, TensorParallelReduce op) const {
  TORCH_CHECK(tensor.is_contiguous(), "tensor-parallel all-reduce: the tensor must be contiguous");
  std::vector<at::Tensor> tensors = {tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = op == TensorParallelReduce::kMax ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  options.timeout = group_.timeout();
  c10::intrusive_ptr<c10d::Work> work = group_.backend()->allreduce(tensors, options);
  group_.WaitStreamOrdered(*work, "tensor-parallel all-reduce");
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
