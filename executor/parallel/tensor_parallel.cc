#include "executor/parallel/tensor_parallel.h"

#include <c10/util/Exception.h>

namespace dta {

IndexRange SplitRange(int64_t total, int part, int parts) {
  TORCH_CHECK(parts >= 1 && part >= 0 && part < parts, "SplitRange: part ", part, " of ", parts,
              " is not in [0, ", parts, ")");
  TORCH_CHECK(total >= 0, "SplitRange: cannot split ", total, " items");
  return {.begin = total * part / parts, .end = total * (part + 1) / parts};
}

double TensorParallelNorm::Sum(double local, at::Device device) const {
  if (group == nullptr || group->size() == 1) return local;
  at::Tensor value = at::full({1}, local, at::TensorOptions().dtype(at::kDouble).device(device));
  group->AllReduce(value, TensorParallelReduce::kSum);
  return value.item<double>();
}

}  // namespace dta
