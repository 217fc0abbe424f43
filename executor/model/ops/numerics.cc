#include "executor/model/ops/numerics.h"

#include <torch/csrc/autograd/grad_mode.h>

#include "kernels/tuned_matmul.h"

namespace dta {

using torch::autograd::AutogradContext;

at::ScalarType ComputeType(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

at::ScalarType AccumulatorType(at::ScalarType dtype) { return ComputeType(dtype); }

at::Tensor& GradAccumulator(const at::Tensor& parameter) {
  at::Tensor& grad = const_cast<at::Tensor&>(parameter).mutable_grad();
  if (!grad.defined())
    grad = at::zeros(parameter.sizes(),
                     parameter.options().dtype(AccumulatorType(parameter.scalar_type())));
  return grad;
}

void AddMatmul(at::Tensor& accumulator, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == accumulator.scalar_type()) {
    accumulator.addmm_(a, b);
  } else if (accumulator.is_cuda()) {
    // bfloat16 products into float32: the tuned GEMM where it applies (the same bits).
    if (!kernels::AddMatmulTuned(accumulator, a, b))
      at::addmm_out(accumulator, accumulator, a, b, accumulator.scalar_type());
  } else {
    accumulator.addmm_(a.to(accumulator.scalar_type()), b.to(accumulator.scalar_type()));
  }
}

at::Tensor MatmulTo(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype) {
  if (a.scalar_type() == dtype) return at::mm(a, b);
  if (a.is_cuda()) return at::mm(a, b, dtype);
  return at::mm(a.to(dtype), b.to(dtype));  // the CPU has no mixed-precision mm
}

int64_t GroupHandle(const TensorParallelGroup* group) {
  return group != nullptr && group->size() > 1 ? reinterpret_cast<int64_t>(group) : 0;
}

const TensorParallelGroup* GroupOf(int64_t handle) {
  return reinterpret_cast<const TensorParallelGroup*>(handle);
}

int64_t ExpertGroupHandle(const ExpertParallelGroup* group) {
  return group != nullptr && group->size() > 1 ? reinterpret_cast<int64_t>(group) : 0;
}

const ExpertParallelGroup* ExpertGroupOf(int64_t handle) {
  return reinterpret_cast<const ExpertParallelGroup*>(handle);
}

const TensorParallelGroup* GroupOf(AutogradContext* ctx) {
  return GroupOf(ctx->saved_data["tensor_parallel"].toInt());
}

std::unique_ptr<PendingCollective> StartSumOverRanks(const TensorParallelGroup* group,
                                                     at::Tensor& tensor) {
  if (group == nullptr) return nullptr;
  if (!tensor.is_contiguous()) tensor = tensor.contiguous();
  return group->StartAllReduce(tensor, TensorParallelReduce::kSum);
}

void SumOverRanks(const TensorParallelGroup* group, at::Tensor& tensor) {
  if (std::unique_ptr<PendingCollective> sum = StartSumOverRanks(group, tensor)) sum->Wait();
}

VocabularyRows RowsOfSlice(const at::Tensor& ids, int64_t first, int64_t rows, bool split) {
  if (!split) return {ids, at::Tensor()};
  const at::Tensor local = ids - first;
  const at::Tensor owned = local.ge(0).logical_and_(local.lt(rows));
  return {at::where(owned, local, 0), owned};
}

at::Tensor NormWeightAccumulator(AutogradContext* ctx, const at::Tensor& weight) {
  at::Tensor accumulator = ctx->saved_data["accumulator"].toTensor();
  return accumulator.defined() ? accumulator : GradAccumulator(weight);
}

NormScale NormScaleOf(const at::Tensor& norm_weight, bool zero_centred) {
  if (!zero_centred) return {norm_weight, at::Tensor()};
  // 1 + w in the compute dtype (transformers' (1.0 + weight.float())): d(1 + w)/dw = 1, so the
  // norm's weight gradient goes straight into w's accumulator.
  const at::ScalarType ct = ComputeType(norm_weight.scalar_type());
  return {norm_weight.detach().to(ct) + 1.0,
          at::GradMode::is_enabled() ? GradAccumulator(norm_weight) : at::Tensor()};
}

std::optional<at::Tensor> Optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

}  // namespace dta
