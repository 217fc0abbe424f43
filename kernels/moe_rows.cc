#include "kernels/moe_rows.h"

#include <c10/util/Exception.h>

#include "kernels/cuda_dispatch.h"
#include "kernels/moe_rows_internal.h"

namespace dta::kernels {
namespace {

using internal::Dense;

// Whether the CUDA kernels run for operands on t's device (see the header).
bool KernelsFor(const at::Tensor& t) { return internal::CudaKernelsFor(t, "DTA_MOE_ROWS"); }

}  // namespace

at::Tensor CombinePairs(const at::Tensor& rows, const at::Tensor& inverse,
                        const at::Tensor& weights) {
  const int64_t t = weights.size(0), k = weights.size(1), hidden = rows.size(1);
  TORCH_CHECK(inverse.numel() == t * k, "CombinePairs: ", inverse.numel(), " pairs for ", t,
              " tokens of ", k);
  const at::Device device = rows.device();
  if (t > 0 && KernelsFor(rows) && rows.dim() == 2 && Dense(rows, at::kBFloat16, device) &&
      Dense(inverse, at::kLong, device) && Dense(weights, at::kFloat, device)) {
    at::Tensor y = at::empty({t, hidden}, weights.options());
    internal::LaunchCombinePairs(rows, inverse, weights, y);
    return y;
  }
  return (rows.to(weights.scalar_type()).index_select(0, inverse).view({t, k, hidden}) *
          weights.unsqueeze(2))
      .sum(1);
}

PairGradients GatherPairs(const at::Tensor& dy, const at::Tensor& token, const at::Tensor& w,
                          at::ScalarType type) {
  const at::Device device = dy.device();
  if (token.numel() > 0 && type == at::kBFloat16 && KernelsFor(dy) && dy.dim() == 2 &&
      Dense(dy, at::kFloat, device) && Dense(token, at::kLong, device) &&
      Dense(w, at::kFloat, device)) {
    const auto options = dy.options().dtype(type);
    PairGradients out{.rows = at::empty({token.numel(), dy.size(1)}, options),
                      .scaled = at::empty({token.numel(), dy.size(1)}, options)};
    internal::LaunchGatherPairs(dy, token, w, out.rows, out.scaled);
    return out;
  }
  const at::Tensor pairs = dy.index_select(0, token);
  return {.rows = pairs.to(type), .scaled = (pairs * w.reshape({-1, 1})).to(type)};
}

at::Tensor SumPairs(const at::Tensor& a, const at::Tensor& b, const at::Tensor& inverse,
                    int64_t top_k, at::ScalarType out_type) {
  const int64_t t = inverse.numel() / top_k, hidden = a.size(1);
  const at::Device device = a.device();
  if (t > 0 && out_type == at::kFloat && KernelsFor(a) && a.dim() == 2 &&
      Dense(a, at::kBFloat16, device) && Dense(inverse, at::kLong, device) &&
      (!b.defined() || (Dense(b, at::kBFloat16, device) && b.sizes() == a.sizes()))) {
    at::Tensor dx = at::empty({t, hidden}, a.options().dtype(at::kFloat));
    internal::LaunchSumPairs(a, b, inverse, top_k, dx);
    return dx;
  }
  at::Tensor sum = a.to(out_type);
  if (b.defined()) sum = sum.add(b.to(out_type));
  return sum.index_select(0, inverse).view({t, top_k, hidden}).sum(1);
}

}  // namespace dta::kernels
