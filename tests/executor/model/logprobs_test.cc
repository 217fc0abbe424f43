// SlicedLogprobs against autograd through log_softmax: log-probabilities, entropy and the
// gradients of the hidden states and the LM head's weight, with slices that do not divide the rows
// and the weight gradient gathered over several slices (two a matmul in float64 and float32, the
// last group and slice partial), in float64 (1e-12) and float32 (1e-5).
#include "executor/model/ops/logprobs.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cstdlib>

#include "gtest/gtest.h"

namespace dta {
namespace {

double RelativeError(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  return (x - y).abs().max().item<double>() / std::max(1e-300, y.abs().max().item<double>());
}

void ExpectEqualsLogSoftmax(at::ScalarType type, int64_t rows, int64_t vocab, int64_t slice_rows,
                            double tolerance) {
  at::manual_seed(3);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor hidden = at::randn({rows, 5}, f64);
  const at::Tensor weight = at::randn({vocab, 5}, f64);
  const at::Tensor targets = at::randint(vocab, {rows}, f64.dtype(at::kLong));
  const at::Tensor up_logprob = at::randn({rows}, f64), up_entropy = at::randn({rows}, f64);

  const at::Tensor h = hidden.to(type).requires_grad_(true);
  const at::Tensor w = weight.to(type).requires_grad_(true);
  const torch::autograd::variable_list out =
      SlicedLogprobs::apply(h, w, targets, slice_rows, /*inverse_temperature=*/1.0,
                            /*want_entropy=*/true, /*group=*/0, /*vocab_first=*/0);
  ((out[0] * up_logprob.to(out[0].scalar_type())).sum() +
   (out[1] * up_entropy.to(out[1].scalar_type())).sum())
      .backward();

  const at::Tensor rh = hidden.to(type).to(at::kDouble).requires_grad_(true);
  const at::Tensor rw = weight.to(type).to(at::kDouble).requires_grad_(true);
  const at::Tensor logp = at::log_softmax(rh.mm(rw.t()), 1);
  const at::Tensor target_logp = logp.gather(1, targets.unsqueeze(1)).squeeze(1);
  const at::Tensor entropy = -(logp.exp() * logp).sum(1);
  ((target_logp * up_logprob).sum() + (entropy * up_entropy).sum()).backward();

  EXPECT_LT(RelativeError(out[0], target_logp), tolerance) << type;
  EXPECT_LT(RelativeError(out[1], entropy), tolerance) << type;
  EXPECT_LT(RelativeError(h.grad(), rh.grad()), tolerance) << type;
  EXPECT_LT(RelativeError(w.grad(), rw.grad()), tolerance) << type;
}

TEST(SlicedLogprobs, EqualsLogSoftmaxInFloat64) {
  // Slices of 3: weight-gradient groups of 6 rows ([0, 6), then [6, 10) ending in a 1-row slice).
  ExpectEqualsLogSoftmax(at::kDouble, /*rows=*/10, /*vocab=*/7, /*slice_rows=*/3, 1e-12);
  // One slice larger than the rows; one row a slice.
  ExpectEqualsLogSoftmax(at::kDouble, /*rows=*/4, /*vocab=*/7, /*slice_rows=*/16, 1e-12);
  ExpectEqualsLogSoftmax(at::kDouble, /*rows=*/5, /*vocab=*/7, /*slice_rows=*/1, 1e-12);
}

TEST(SlicedLogprobs, EqualsLogSoftmaxInFloat32) {
  ExpectEqualsLogSoftmax(at::kFloat, /*rows=*/10, /*vocab=*/7, /*slice_rows=*/3, 1e-5);
}

// DTA_LOGPROB_GROUPS=0: one weight-gradient matmul per slice, the same gradients.
TEST(SlicedLogprobs, OneSliceAMatmulWithTheSwitchOff) {
  setenv("DTA_LOGPROB_GROUPS", "0", 1);
  ExpectEqualsLogSoftmax(at::kDouble, /*rows=*/10, /*vocab=*/7, /*slice_rows=*/3, 1e-12);
  unsetenv("DTA_LOGPROB_GROUPS");
}

}  // namespace
}  // namespace dta
