#include "executor/distributed/tensor_parallel_group.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <string_view>
#include <utility>
#include <vector>

namespace dta {

namespace {

constexpr std::string_view kAllReduce = "tensor-parallel all-reduce";

class PendingWork final : public PendingCollective {
 public:
  PendingWork(const ProcessGroup& group, c10::intrusive_ptr<c10d::Work> work)
      : group_(group), work_(std::move(work)) {}
  ~PendingWork() override {
    if (work_ == nullptr) return;
    try {
      Wait();
    } catch (const std::exception& e) {
      // Only reached while another error unwinds: that error is the one reported.
      LOG(ERROR) << e.what();
    }
  }
  void Wait() override {
    if (work_ == nullptr) return;
    const c10::intrusive_ptr<c10d::Work> work = std::move(work_);
    group_.WaitStreamOrdered(*work, kAllReduce);
  }

 private:
  const ProcessGroup& group_;
  c10::intrusive_ptr<c10d::Work> work_;
};

}  // namespace

std::unique_ptr<PendingCollective> TensorParallelOverProcessGroup::StartAllReduce(
    at::Tensor& tensor, TensorParallelReduce op) const {
  TORCH_CHECK(tensor.is_contiguous(), kAllReduce, ": the tensor must be contiguous");
  std::vector<at::Tensor> tensors = {tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = op == TensorParallelReduce::kMax ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  options.timeout = group_.timeout();
  return std::make_unique<PendingWork>(group_, group_.backend()->allreduce(tensors, options));
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
