// What the kernel tests share: float64 options and the max-norm relative error they compare with.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>

namespace dta::kernels::testing {

inline const at::TensorOptions kFloat64 = at::TensorOptions().dtype(at::kDouble);

// max |actual - expected| / max |expected| (on the host, in float64).
inline double RelativeError(const at::Tensor& actual, const at::Tensor& expected) {
  const at::Tensor a = actual.to(at::kDouble).cpu();
  const at::Tensor e = expected.to(at::kDouble).cpu();
  const double scale = std::max(e.abs().max().item<double>(), 1e-30);
  return (a - e).abs().max().item<double>() / scale;
}

}  // namespace dta::kernels::testing
