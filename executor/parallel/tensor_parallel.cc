#include "executor/parallel/tensor_parallel.h"

#include <c10/util/Exception.h>

namespace dta {

IndexRange SplitRange(int64_t total, int part, int parts) {
  TORCH_CHECK(parts >= 1 && part >= 0 && part < parts, "SplitRange: part ", part, " of ", parts,
              " is not in [0, ", parts, ")");
  TORCH_CHECK(total >= 0, "SplitRange: cannot split ", total, " items");
  return {.begin = total * part / parts, .end = total * (part + 1) / parts};
}

int64_t LeastOverRanks(const TensorParallelGroup* group, int64_t value, at::Device device) {
  if (group == nullptr || group->size() == 1) return value;
  at::Tensor negated = at::full({1}, -value, at::TensorOptions().dtype(at::kLong).device(device));
  group->AllReduce(negated, TensorParallelReduce::kMax);
  return -negated.item<int64_t>();
}

double TensorParallelNorm::Sum(double local, at::Device device) const {
  if (group == nullptr || group->size() == 1) return local;
  at::Tensor value = at::full({1}, local, at::TensorOptions().dtype(at::kDouble).device(device));
  group->AllReduce(value, TensorParallelReduce::kSum);
  return value.item<double>();
}

}  // namespace dta
