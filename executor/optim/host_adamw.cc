#include "executor/optim/host_adamw.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <utility>

#include "core/base/parallel_for.h"

namespace dta {
namespace {

template <typename Out>
void Update(float* w, float* m, float* v, const float* g, Out* out, int64_t n, float clip,
            const AdamWStepScalars& s) {
  // The constants as ATen's float kernels see them: each double scalar rounded to float once.
  const float decay = static_cast<float>(1 - s.lr * s.weight_decay);
  const float beta1 = static_cast<float>(s.beta1);
  const float one_minus_beta1 = static_cast<float>(1 - s.beta1);
  const float beta2 = static_cast<float>(s.beta2);
  const float one_minus_beta2 = static_cast<float>(1 - s.beta2);
  const float bias_correction2_sqrt = static_cast<float>(s.bias_correction2_sqrt);
  const float eps = static_cast<float>(s.eps);
  const float minus_step_size = static_cast<float>(-s.step_size);
  ParallelFor(n, int64_t{1} << 16, at::get_num_threads(), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float grad = g[i] * clip;
      const float weight = w[i] * decay;
      const float mean = m[i] * beta1 + grad * one_minus_beta1;
      const float second = v[i] * beta2 + one_minus_beta2 * (grad * grad);
      const float denom = std::sqrt(second) / bias_correction2_sqrt + eps;
      const float updated = weight + minus_step_size * (mean / denom);
      m[i] = mean;
      v[i] = second;
      w[i] = updated;
      out[i] = static_cast<Out>(updated);
    }
  });
}

}  // namespace

void HostAdamWUpdate(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                     const at::Tensor& grad, double clip_coef, const AdamWStepScalars& scalars,
                     at::Tensor& rounded) {
  const int64_t n = master.numel();
  for (const at::Tensor* t :
       {&std::as_const(master), &std::as_const(exp_avg), &std::as_const(exp_avg_sq), &grad}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous() &&
                    t->numel() == n,
                "HostAdamWUpdate: every state tensor must be a contiguous float32 CPU tensor of ",
                n, " elements");
  }
  TORCH_CHECK(rounded.device().is_cpu() && rounded.is_contiguous() && rounded.numel() == n,
              "HostAdamWUpdate: the rounded weights must be a contiguous CPU tensor of ", n,
              " elements");
  float* w = master.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const float* g = grad.const_data_ptr<float>();
  const float clip = static_cast<float>(clip_coef);
  switch (rounded.scalar_type()) {
    case at::kFloat:
      Update(w, m, v, g, rounded.data_ptr<float>(), n, clip, scalars);
      break;
    case at::kBFloat16:
      Update(w, m, v, g, rounded.data_ptr<c10::BFloat16>(), n, clip, scalars);
      break;
    case at::kHalf:
      Update(w, m, v, g, rounded.data_ptr<c10::Half>(), n, clip, scalars);
      break;
    default:
      TORCH_CHECK(false, "HostAdamWUpdate: cannot round to ", rounded.scalar_type());
  }
}

}  // namespace dta
