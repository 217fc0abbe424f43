// kernels/fused_layers: the hand-written backward passes against autograd through the forward's
// ATen expressions in float64 (relative error 1e-12), the errors for bad shapes, and, on a GPU,
// the CUDA kernels against the same functions run on the CPU from the same inputs: float32
// results within 1e-5 (relative to the tensor's largest magnitude), bfloat16 results within one
// bfloat16 step of it; weight gradients within 1e-4; backward bitwise deterministic. Shapes cover
// one row, rows longer than a block, lengths that no block size divides, more rows than the
// backward has blocks of four rows, every fused head dim (64, 128, 192, 256) and the ones the
// kernels leave to ATen (96, rows longer than 8,192). RoPE alone is bitwise the CPU's; RMSNorm
// over strided rows (a head's half of wider rows) reads them in place, bitwise the contiguous
// copy's; with an addend it is bitwise ATen's add followed by the norm. The output gate's kernels
// are bitwise the ATen expressions on the same GPU; kernels launched after their predecessor give
// the bits of plain stream order. The GPU tests skip without a CUDA device.
#include "kernels/fused_layers.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <string>
#include <utility>
#include <vector>

#include "core/base/scoped_env.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/kernels/kernel_testing.h"

namespace dta::kernels {
namespace {

using testing::kFloat64;
using testing::RelativeError;

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// The forward expressions, differentiated by autograd.
at::Tensor RmsNormExpression(const at::Tensor& x, const at::Tensor& w, double eps) {
  return w * (x * at::rsqrt(x.pow(2).mean(-1, true) + eps));
}

std::pair<at::Tensor, at::Tensor> RopeTables(int64_t tokens, int64_t dim, at::TensorOptions o) {
  const at::Tensor inv =
      1.0 / at::pow(10000.0, at::arange(0, dim, 2, o) / static_cast<double>(dim));
  const at::Tensor freqs = at::arange(tokens, o).unsqueeze(1) * inv.unsqueeze(0);
  const at::Tensor angles = at::cat({freqs, freqs}, -1).unsqueeze(1);
  return {angles.cos(), angles.sin()};
}

// Gradients of (x, w) of sum(expression * dy) by autograd.
std::vector<at::Tensor> AutogradOf(const std::function<at::Tensor(at::Tensor, at::Tensor)>& f,
                                   const at::Tensor& x, const at::Tensor& w, const at::Tensor& dy) {
  at::Tensor xr = x.clone().requires_grad_(true);
  at::Tensor wr = w.clone().requires_grad_(true);
  return torch::autograd::grad({(f(xr, wr) * dy).sum()}, {xr, wr});
}

TEST(FusedLayers, RmsNormBackwardIsTheGradientOfTheForward) {
  at::manual_seed(1);
  for (int64_t n : {1, 7, 64}) {
    const at::Tensor x = at::randn({5, 3, n}, kFloat64);
    const at::Tensor w = 1 + 0.1 * at::randn({n}, kFloat64);
    const at::Tensor dy = at::randn({5, 3, n}, kFloat64);
    const RmsNormResult forward = RmsNormForward(x, w, 1e-6, at::kDouble);
    EXPECT_LT(RelativeError(forward.y, RmsNormExpression(x, w, 1e-6)), 1e-14);
    EXPECT_TRUE(at::equal(RmsNormApply(x, w, forward.rstd, at::kDouble), forward.y));
    at::Tensor weight_grad = at::full({n}, 0.5, kFloat64);  // added into, not overwritten
    const at::Tensor dx = RmsNormBackward(dy, x, w, forward.rstd, weight_grad);
    const auto expected = AutogradOf(
        [](at::Tensor a, at::Tensor b) { return RmsNormExpression(a, b, 1e-6); }, x, w, dy);
    EXPECT_LT(RelativeError(dx, expected[0]), 1e-12) << "n " << n;
    EXPECT_LT(RelativeError(weight_grad - 0.5, expected[1]), 1e-12) << "n " << n;
    // x feeding a residual connection as well: the residual's gradient added in, the weight's
    // gradient the same.
    const at::Tensor residual = at::randn({5, 3, n}, kFloat64);
    at::Tensor weight_grad_too = at::full({n}, 0.5, kFloat64);
    const at::Tensor dx_residual =
        RmsNormBackward(dy, x, w, forward.rstd, weight_grad_too, residual);
    EXPECT_TRUE(at::equal(dx_residual, dx + residual)) << "n " << n;
    EXPECT_TRUE(at::equal(weight_grad_too, weight_grad)) << "n " << n;
  }
}

TEST(FusedLayers, RmsNormRopeBackwardIsTheGradientOfTheForward) {
  at::manual_seed(2);
  for (int64_t d : {2, 8, 128}) {
    const at::Tensor x = at::randn({6, 4, d}, kFloat64);
    const at::Tensor w = 1 + 0.1 * at::randn({d}, kFloat64);
    const at::Tensor dy = at::randn({6, 4, d}, kFloat64);
    const auto [cos, sin] = RopeTables(6, d, kFloat64);
    auto expression = [&](const at::Tensor& a, const at::Tensor& b) {
      const at::Tensor n = RmsNormExpression(a, b, 1e-6);
      return n * cos + RotateHalf(n) * sin;
    };
    EXPECT_LT(RelativeError(RmsNormRopeForward(x, w, 1e-6, cos, sin).y, expression(x, w)), 1e-14);
    at::Tensor weight_grad = at::zeros({d}, kFloat64);
    const RmsNormResult forward = RmsNormRopeForward(x, w, 1e-6, cos, sin);
    const at::Tensor dx = RmsNormRopeBackward(dy, x, w, forward.rstd, cos, sin, weight_grad);
    const auto expected = AutogradOf(expression, x, w, dy);
    EXPECT_LT(RelativeError(dx, expected[0]), 1e-12) << "D " << d;
    EXPECT_LT(RelativeError(weight_grad, expected[1]), 1e-12) << "D " << d;
  }
}

// RoPE alone (Qwen2, Llama): the rotation and its transpose.
TEST(FusedLayers, RopeBackwardIsTheGradientOfTheForward) {
  at::manual_seed(12);
  for (int64_t d : {2, 8, 64}) {
    const at::Tensor x = at::randn({6, 4, d}, kFloat64);
    const at::Tensor dy = at::randn({6, 4, d}, kFloat64);
    const auto [cos, sin] = RopeTables(6, d, kFloat64);
    const at::Tensor expected_y = x * cos + RotateHalf(x) * sin;
    EXPECT_LT(RelativeError(RopeForward(x, cos, sin), expected_y), 1e-14) << "D " << d;
    at::Tensor xr = x.clone().requires_grad_(true);
    const at::Tensor expected_dx =
        torch::autograd::grad({((xr * cos + RotateHalf(xr) * sin) * dy).sum()}, {xr})[0];
    EXPECT_LT(RelativeError(RopeBackward(dy, cos, sin), expected_dx), 1e-12) << "D " << d;
  }
}

TEST(FusedLayers, SwiGluBackwardIsTheGradientOfTheForward) {
  at::manual_seed(3);
  const at::Tensor gate = 3 * at::randn({9, 17}, kFloat64);
  const at::Tensor up = at::randn({9, 17}, kFloat64);
  const at::Tensor d = at::randn({9, 17}, kFloat64);
  EXPECT_LT(RelativeError(SwiGluForward(gate, up), at::silu(gate) * up), 1e-15);
  const SwiGluGrads grads = SwiGluBackward(d, gate, up, /*with_product=*/true);
  const auto expected =
      AutogradOf([](at::Tensor g, at::Tensor u) { return at::silu(g) * u; }, gate, up, d);
  EXPECT_LT(RelativeError(grads.dgate, expected[0]), 1e-12);
  EXPECT_LT(RelativeError(grads.dup, expected[1]), 1e-12);
  EXPECT_TRUE(at::equal(grads.product, SwiGluForward(gate, up)));
  EXPECT_FALSE(SwiGluBackward(d, gate, up).product.defined());
}

TEST(FusedLayers, SigmoidGateBackwardIsTheGradientOfTheForward) {
  at::manual_seed(4);
  const at::Tensor attention = at::randn({9, 3, 16}, kFloat64);
  const at::Tensor rows = 3 * at::randn({9, 3, 32}, kFloat64);  // [query, gate] per head
  const at::Tensor gate = rows.narrow(-1, 16, 16);
  const at::Tensor d = at::randn({9, 3, 16}, kFloat64);
  const auto expression = [](at::Tensor a, at::Tensor g) { return a * at::sigmoid(g); };
  EXPECT_LT(RelativeError(SigmoidGateForward(attention, gate), expression(attention, gate)), 1e-15);
  const SigmoidGateGrads grads = SigmoidGateBackward(d, attention, gate);
  const auto expected = AutogradOf(expression, attention, gate, d);
  EXPECT_LT(RelativeError(grads.dattention, expected[0]), 1e-12);
  EXPECT_LT(RelativeError(grads.dgate, expected[1]), 1e-12);
  EXPECT_TRUE(grads.dgate.is_contiguous());
}

TEST(FusedLayers, SwiGluReadsAndWritesTheHalvesOfAStackedProjection) {
  at::manual_seed(4);
  const at::Tensor gate_up = at::randn({9, 2 * 17}, kFloat64);
  const at::Tensor gate = gate_up.narrow(1, 0, 17), up = gate_up.narrow(1, 17, 17);
  const at::Tensor d = at::randn({9, 17}, kFloat64);
  // (ATen's CPU kernels vectorize strided and contiguous operands differently: last-bit
  // differences.)
  EXPECT_LT(
      RelativeError(SwiGluForward(gate, up), SwiGluForward(gate.contiguous(), up.contiguous())),
      1e-15);
  const SwiGluGrads separate = SwiGluBackward(d, gate.contiguous(), up.contiguous());
  const SwiGluGrads stacked = SwiGluBackward(d, gate, up, /*with_product=*/false, /*stacked=*/true);
  ASSERT_EQ(stacked.stacked.sizes(), gate_up.sizes());
  EXPECT_LT(RelativeError(stacked.stacked, at::cat({separate.dgate, separate.dup}, 1)), 1e-15);
  // dgate and dup are the stacked tensor's halves, not copies.
  EXPECT_EQ(stacked.dgate.data_ptr(), stacked.stacked.data_ptr());
  EXPECT_EQ(stacked.dup.data_ptr<double>(), stacked.stacked.data_ptr<double>() + 17);
  EXPECT_FALSE(SwiGluBackward(d, gate, up).stacked.defined());
  EXPECT_THROW(SwiGluBackward(d.view({9, 1, 17}), gate.contiguous().view({9, 1, 17}),
                              up.contiguous().view({9, 1, 17}), false, /*stacked=*/true),
               c10::Error);
}

// With an addend the norm is of x + addend, the sum returned in x's dtype: bitwise adding first
// (float64; a float32 stream plus a bfloat16 block output), and an addend whose sum with x would
// change x's dtype, or of another shape, is refused by name.
TEST(FusedLayers, RmsNormWithAnAddendIsTheNormOfTheSum) {
  at::manual_seed(12);
  for (const auto& [x_type, addend_type] : std::vector<std::pair<at::ScalarType, at::ScalarType>>{
           {at::kDouble, at::kDouble}, {at::kFloat, at::kBFloat16}}) {
    const at::Tensor x = at::randn({6, 2, 40}).to(x_type);
    const at::Tensor addend = at::randn({6, 2, 40}).to(addend_type);
    const at::Tensor w = (1 + 0.1 * at::randn({40})).to(x_type);
    const RmsNormResult folded = RmsNormForward(x, w, 1e-6, at::kBFloat16, addend);
    const at::Tensor sum = x + addend;
    const RmsNormResult first = RmsNormForward(sum, w, 1e-6, at::kBFloat16);
    EXPECT_EQ(folded.sum.scalar_type(), x_type);
    EXPECT_TRUE(at::equal(folded.sum, sum));
    EXPECT_TRUE(at::equal(folded.y, first.y));
    EXPECT_TRUE(at::equal(folded.rstd, first.rstd));
  }
  EXPECT_FALSE(RmsNormForward(at::ones({2, 4}), at::ones({4}), 1e-6, at::kFloat).sum.defined());
  EXPECT_THAT(
      [&] {
        RmsNormForward(at::ones({2, 4}, at::kBFloat16), at::ones({4}), 1e-6, at::kFloat,
                       at::ones({2, 4}));
      },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("stays x's dtype")));
  EXPECT_THAT(
      [&] {
        RmsNormForward(at::ones({2, 4}), at::ones({4}), 1e-6, at::kFloat, at::ones({4, 2}));
      },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("addend [4, 2]")));
}

TEST(FusedLayers, BadShapesAreNamed) {
  const at::Tensor x = at::randn({4, 8}, kFloat64);
  EXPECT_THAT([&] { RmsNormForward(x, at::ones({7}, kFloat64), 1e-6, at::kDouble); },
              ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("weight [7] must be [n]")));
  const RmsNormResult r = RmsNormForward(x, at::ones({8}, kFloat64), 1e-6, at::kDouble);
  at::Tensor grad = at::zeros({8}, kFloat64);
  EXPECT_THAT(
      [&] {
        RmsNormBackward(at::ones({4, 7}, kFloat64), x, at::ones({8}, kFloat64), r.rstd, grad);
      },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("dy [4, 7]")));
  EXPECT_THAT(
      [&] {
        RmsNormBackward(at::ones({4, 8}, kFloat64), x, at::ones({8}, kFloat64), r.rstd, grad,
                        at::ones({8, 4}, kFloat64));
      },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("residual_grad [8, 4]")));
  EXPECT_THAT(
      [&] {
        RmsNormBackward(at::ones({4, 8}, kFloat64), x, at::ones({8}, kFloat64), r.rstd, grad,
                        at::ones({4, 8}));
      },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("residual_grad must be in")));
  EXPECT_THAT(
      [&] { RmsNormApply(x, at::ones({8}, kFloat64), at::ones({4}, kFloat64), at::kDouble); },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("rstd [4] must be [4, 1]")));
  const auto [cos, sin] = RopeTables(3, 8, kFloat64);
  EXPECT_THAT(
      [&] {
        RmsNormRopeForward(at::ones({4, 2, 8}, kFloat64), at::ones({8}, kFloat64), 1e-6, cos, sin);
      },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("cos and sin must be")));
  EXPECT_THAT(
      [&] {
        SwiGluForward(at::ones({2, 3}), at::ones({3, 2}));
      },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("up [3, 2]")));
}

// The log-probability head's pieces are the log-softmax's values and its gradient (float64
// autograd): log p(target), the entropy, and d/dz of g_logprob log p + g_entropy H, with a target
// weight (tensor parallelism: the ranks not holding a row's target weigh it 0) and a scale.
TEST(FusedLayers, LogitHeadIsTheLogSoftmaxAndItsGradient) {
  at::manual_seed(11);
  const int64_t rows = 7, vocab = 23;
  const at::Tensor z = 3 * at::randn({rows, vocab}, kFloat64);
  const at::Tensor targets = at::randint(vocab, {rows}, at::kLong);
  const at::Tensor weight = at::tensor({1., 0., 1., 1., 0., 1., 1.}, kFloat64);
  const at::Tensor g_logprob = at::randn({rows}, kFloat64), g_entropy = at::randn({rows}, kFloat64);
  const LogitRowStats stats = LogitRowStatsForward(z, targets, /*with_mean=*/true);
  const at::Tensor zg = z.clone().requires_grad_(true);
  const at::Tensor logp = at::log_softmax(zg, -1);
  const at::Tensor target_logp = logp.gather(1, targets.unsqueeze(1)).squeeze(1);
  const at::Tensor entropy = -(logp.exp() * logp).sum(-1);
  EXPECT_LT(RelativeError(stats.target - stats.lse, target_logp.detach()), 1e-14);
  EXPECT_LT(RelativeError(stats.lse - stats.mean, entropy.detach()), 1e-14);
  EXPECT_FALSE(LogitRowStatsForward(z, targets, /*with_mean=*/false).mean.defined());
  const double scale = 0.7;
  for (const bool with_entropy : {false, true}) {
    SCOPED_TRACE(with_entropy ? "with entropy" : "log p only");
    at::Tensor objective = (g_logprob * weight * target_logp).sum();
    if (with_entropy) objective = objective + (g_entropy * entropy).sum();
    const at::Tensor expected =
        scale * torch::autograd::grad({objective}, {zg}, {}, /*retain_graph=*/true)[0];
    // The unweighted targets' softmax part stays: the weight only drops the one-hot term.
    const at::Tensor softmax_part = -at::softmax(z, -1) * (g_logprob * (1 - weight)).unsqueeze(1);
    const at::Tensor got = LogitGradient(
        z, stats.lse, targets, weight, g_logprob, with_entropy ? stats.mean : at::Tensor(),
        with_entropy ? g_entropy : at::Tensor(), scale, at::kDouble);
    EXPECT_LT(RelativeError(got, expected + scale * softmax_part), 1e-13);
    // Into rows of a larger tensor (how SlicedLogprobs gathers several slices): the same values.
    at::Tensor gathered = at::full({z.size(0) + 2, z.size(1)}, 7.0, z.options());
    const at::Tensor into = LogitGradient(z, stats.lse, targets, weight, g_logprob,
                                          with_entropy ? stats.mean : at::Tensor(),
                                          with_entropy ? g_entropy : at::Tensor(), scale,
                                          at::kDouble, gathered.narrow(0, 1, z.size(0)));
    EXPECT_TRUE(at::equal(into, got));
    EXPECT_TRUE(at::equal(gathered.narrow(0, 1, z.size(0)), got));
    EXPECT_TRUE(at::equal(gathered[0], at::full({z.size(1)}, 7.0, z.options())));
  }
  EXPECT_THAT(
      [&] {
        LogitGradient(z, stats.lse, targets, {}, g_logprob, {}, {}, 1.0, at::kDouble,
                      at::empty({z.size(0), z.size(1)}, z.options().dtype(at::kFloat)));
      },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("out must be a contiguous")));
  EXPECT_THAT([&] { LogitRowStatsForward(z, targets.to(at::kInt), true); },
              ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("targets must be int64")));
  EXPECT_THAT(
      [&] {
        LogitGradient(z, stats.lse, targets, {}, g_logprob, stats.mean, {}, 1.0, at::kDouble);
      },
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr("go together")));
}

class FusedLayersCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device; the kernels need a GPU";
  }
};

// One bfloat16 step at the tensor's largest magnitude, plus float32 rounding.
double Tolerance(at::ScalarType type) { return type == at::kFloat ? 1e-5 : 1.0 / 128; }

at::Tensor Cuda(const at::Tensor& t) { return t.to(at::kCUDA); }

TEST_F(FusedLayersCuda, RmsNormMatchesTheCpu) {
  at::manual_seed(4);
  struct Case {
    int64_t rows, n;
    at::ScalarType x_type, out_type;
  };
  const std::vector<Case> cases = {
      {1, 2048, at::kFloat, at::kBFloat16},
      {3000, 2048, at::kFloat, at::kBFloat16},
      {37, 1000, at::kFloat, at::kFloat},
      {513, 5120, at::kBFloat16, at::kBFloat16},
      {64, 8192, at::kFloat, at::kBFloat16},
      {5, 9000, at::kFloat, at::kBFloat16},
      {700, 4096, at::kFloat, at::kFloat},
      {2, 2560, at::kFloat, at::kBFloat16},
      // More rows than the backward has blocks of four: five rows a block, the last one short.
      {5001, 1536, at::kFloat, at::kBFloat16},
  };
  for (const Case& c : cases) {
    const std::string name = std::to_string(c.rows) + " x " + std::to_string(c.n) + " " +
                             std::string(c10::toString(c.x_type)) + " -> " +
                             c10::toString(c.out_type);
    const at::Tensor x = (3 * at::randn({c.rows, c.n})).to(c.x_type);
    const at::Tensor w = (1 + 0.1 * at::randn({c.n})).to(at::kBFloat16);
    const at::Tensor dy = at::randn({c.rows, c.n});
    const RmsNormResult cpu = RmsNormForward(x, w, 1e-6, c.out_type);
    const RmsNormResult gpu = RmsNormForward(Cuda(x), Cuda(w), 1e-6, c.out_type);
    EXPECT_LT(RelativeError(gpu.y, cpu.y), Tolerance(c.out_type)) << name;
    EXPECT_LT(RelativeError(gpu.rstd, cpu.rstd), 1e-5) << name;
    EXPECT_TRUE(at::equal(RmsNormApply(Cuda(x), Cuda(w), gpu.rstd, c.out_type), gpu.y)) << name;
    at::Tensor cpu_grad = at::zeros({c.n});
    const at::Tensor cpu_dx = RmsNormBackward(dy, x, w, cpu.rstd, cpu_grad);
    at::Tensor gpu_grad = at::ones({c.n}, at::kCUDA);
    const at::Tensor gpu_dx = RmsNormBackward(Cuda(dy), Cuda(x), Cuda(w), gpu.rstd, gpu_grad);
    EXPECT_LT(RelativeError(gpu_dx, cpu_dx), 1e-5) << name;
    EXPECT_LT(RelativeError(gpu_grad - 1, cpu_grad), 1e-4) << name;
    at::Tensor again = at::ones({c.n}, at::kCUDA);
    EXPECT_TRUE(at::equal(RmsNormBackward(Cuda(dy), Cuda(x), Cuda(w), gpu.rstd, again), gpu_dx));
    EXPECT_TRUE(at::equal(again, gpu_grad)) << name << ": the weight gradient is not deterministic";
    // The residual's gradient summed in the kernel: the bits of the separate add.
    const at::Tensor residual = at::randn({c.rows, c.n}, at::kCUDA);
    at::Tensor with_residual = at::ones({c.n}, at::kCUDA);
    EXPECT_TRUE(
        at::equal(RmsNormBackward(Cuda(dy), Cuda(x), Cuda(w), gpu.rstd, with_residual, residual),
                  gpu_dx + residual))
        << name;
    EXPECT_TRUE(at::equal(with_residual, gpu_grad)) << name;
  }
}

// Kernels launched after their predecessor (kernels/dependent_launch.cuh) wait for it before they
// touch memory: a chain of norms, each reading the one before, with each backward reading its
// forward's rstd and the column sums reading the backward's partials (each a dependent launch of
// the kernel before it, on outputs of 64 MiB), gives the bits of the same chain in plain stream
// order. A kernel that read before its wait would see a buffer its predecessor was still writing.
TEST_F(FusedLayersCuda, DependentLaunchesSeeTheirPredecessorsWrites) {
  at::manual_seed(11);
  const int64_t rows = 8192, n = 2048;
  const at::Tensor x0 = at::randn({rows, n}, at::kCUDA);
  const at::Tensor w = (1 + 0.1 * at::randn({n})).to(at::kCUDA);
  auto chain = [&] {
    at::Tensor x = x0;
    at::Tensor grad = at::zeros({n}, at::kCUDA);
    at::Tensor dx_sum = at::zeros({rows, n}, at::kCUDA);
    for (int i = 0; i < 24; ++i) {
      const RmsNormResult norm = RmsNormForward(x, w, 1e-6, at::kFloat);
      dx_sum += RmsNormBackward(norm.y, x, w, norm.rstd, grad);
      x = norm.y;
    }
    return std::vector<at::Tensor>{x, grad, dx_sum};
  };
  std::vector<at::Tensor> ordered;
  {
    const ScopedEnv plain("DTA_DEPENDENT_LAUNCH", "0");
    ordered = chain();
  }
  const std::vector<at::Tensor> dependent = chain();
  ASSERT_GT(ordered[1].abs().max().item<float>(), 0.0f);  // the chain carries values
  EXPECT_TRUE(at::equal(dependent[0], ordered[0])) << "the last norm's output";
  EXPECT_TRUE(at::equal(dependent[1], ordered[1])) << "the weight gradient";
  EXPECT_TRUE(at::equal(dependent[2], ordered[2])) << "the input gradients";
}

// The residual add folded into the norm's kernel (an addend) is bitwise ATen's add followed by the
// kernel: the sum, y and rstd, for a float32 stream plus a bfloat16 or float32 addend, a bfloat16
// stream plus a bfloat16 addend (the sum rounded to bfloat16 before the norm reads it), strided
// rows, one row and no rows.
TEST_F(FusedLayersCuda, RmsNormWithAnAddendIsBitwiseAddingFirst) {
  at::manual_seed(9);
  struct Case {
    int64_t rows, n;
    at::ScalarType x_type, addend_type;
  };
  for (const Case& c : std::vector<Case>{{1, 2048, at::kFloat, at::kBFloat16},
                                         {3000, 2048, at::kFloat, at::kBFloat16},
                                         {37, 1000, at::kFloat, at::kFloat},
                                         {513, 5120, at::kBFloat16, at::kBFloat16},
                                         {0, 4096, at::kFloat, at::kBFloat16}}) {
    const std::string name = std::to_string(c.rows) + " x " + std::to_string(c.n);
    const at::Tensor x = (3 * at::randn({c.rows, c.n}, at::kCUDA)).to(c.x_type);
    const at::Tensor addend = at::randn({c.rows, c.n}, at::kCUDA).to(c.addend_type);
    const at::Tensor w = Cuda((1 + 0.1 * at::randn({c.n})).to(at::kBFloat16));
    const RmsNormResult folded = RmsNormForward(x, w, 1e-6, at::kBFloat16, addend);
    const at::Tensor sum = x + addend;
    const RmsNormResult first = RmsNormForward(sum, w, 1e-6, at::kBFloat16);
    EXPECT_TRUE(at::equal(folded.sum, sum)) << name;
    EXPECT_TRUE(at::equal(folded.y, first.y)) << name;
    EXPECT_TRUE(at::equal(folded.rstd, first.rstd)) << name;
  }
  const at::Tensor wide = at::randn({37, 8, 256}, at::kCUDA);
  const at::Tensor x = wide.slice(-1, 0, 128);  // rows 256 apart
  const at::Tensor addend = at::randn({37, 8, 128}, at::kCUDA).to(at::kBFloat16);
  const at::Tensor w = Cuda(1 + 0.1 * at::randn({128}));
  const RmsNormResult folded = RmsNormForward(x, w, 1e-6, at::kBFloat16, addend);
  EXPECT_TRUE(at::equal(folded.sum, x + addend));
  EXPECT_TRUE(at::equal(folded.y, RmsNormForward(x + addend, w, 1e-6, at::kBFloat16).y));
}

// A norm over each head's first half of wider rows (gated attention's queries, [q, gate] per
// head) reads the rows in place: bitwise what the kernels give the same rows copied contiguous.
TEST_F(FusedLayersCuda, RmsNormReadsStridedRowsInPlace) {
  at::manual_seed(6);
  for (const int64_t dim : {128, 256}) {
    const at::Tensor wide = at::randn({37, 16, 2 * dim}, at::kCUDA).to(at::kBFloat16);
    const at::Tensor x = wide.slice(-1, 0, dim);  // [37, 16, dim], rows 2 dim apart
    ASSERT_FALSE(x.is_contiguous());
    const at::Tensor copied = x.contiguous();
    const at::Tensor w = Cuda(1 + 0.1 * at::randn({dim}));
    const at::Tensor dy = at::randn({37, 16, dim}, at::kCUDA).to(at::kBFloat16);
    const RmsNormResult strided = RmsNormForward(x, w, 1e-6, at::kBFloat16);
    const RmsNormResult contiguous = RmsNormForward(copied, w, 1e-6, at::kBFloat16);
    EXPECT_TRUE(at::equal(strided.y, contiguous.y)) << dim;
    EXPECT_TRUE(at::equal(strided.rstd, contiguous.rstd)) << dim;
    EXPECT_TRUE(at::equal(RmsNormApply(x, w, strided.rstd, at::kBFloat16), contiguous.y)) << dim;
    at::Tensor grad_strided = at::zeros({dim}, at::kCUDA),
               grad_contiguous = at::zeros_like(grad_strided);
    EXPECT_TRUE(at::equal(RmsNormBackward(dy, x, w, strided.rstd, grad_strided),
                          RmsNormBackward(dy, copied, w, contiguous.rstd, grad_contiguous)))
        << dim;
    EXPECT_TRUE(at::equal(grad_strided, grad_contiguous)) << dim;
  }
}

TEST_F(FusedLayersCuda, RmsNormRopeMatchesTheCpu) {
  at::manual_seed(5);
  struct Case {
    int64_t tokens, heads, dim;
  };
  for (const Case& c : std::vector<Case>{{1, 1, 128},
                                         {19, 16, 128},
                                         {700, 8, 128},
                                         {33, 4, 64},
                                         {5, 3, 192},
                                         {9, 2, 256},
                                         {11, 4, 96},
                                         {2100, 8, 128}}) {
    const std::string name = "T " + std::to_string(c.tokens) + " H " + std::to_string(c.heads) +
                             " D " + std::to_string(c.dim);
    const at::Tensor x = (2 * at::randn({c.tokens, c.heads, c.dim})).to(at::kBFloat16);
    const at::Tensor w = (1 + 0.1 * at::randn({c.dim})).to(at::kBFloat16);
    const at::Tensor dy = at::randn({c.tokens, c.heads, c.dim}).to(at::kBFloat16);
    const auto [cos, sin] = RopeTables(c.tokens, c.dim, at::TensorOptions().dtype(at::kFloat));
    const RmsNormResult cpu = RmsNormRopeForward(x, w, 1e-6, cos, sin);
    const RmsNormResult gpu = RmsNormRopeForward(Cuda(x), Cuda(w), 1e-6, Cuda(cos), Cuda(sin));
    EXPECT_EQ(gpu.y.scalar_type(), at::kBFloat16);
    EXPECT_LT(RelativeError(gpu.y, cpu.y), Tolerance(at::kBFloat16)) << name;
    EXPECT_LT(RelativeError(gpu.rstd, cpu.rstd), 1e-5) << name;
    at::Tensor cpu_grad = at::zeros({c.dim});
    const at::Tensor cpu_dx = RmsNormRopeBackward(dy, x, w, cpu.rstd, cos, sin, cpu_grad);
    at::Tensor gpu_grad = at::zeros({c.dim}, at::kCUDA);
    const at::Tensor gpu_dx =
        RmsNormRopeBackward(Cuda(dy), Cuda(x), Cuda(w), gpu.rstd, Cuda(cos), Cuda(sin), gpu_grad);
    EXPECT_EQ(gpu_dx.scalar_type(), at::kBFloat16);
    EXPECT_LT(RelativeError(gpu_dx, cpu_dx), Tolerance(at::kBFloat16)) << name;
    EXPECT_LT(RelativeError(gpu_grad, cpu_grad), 1e-4) << name;
    at::Tensor again = at::zeros({c.dim}, at::kCUDA);
    RmsNormRopeBackward(Cuda(dy), Cuda(x), Cuda(w), gpu.rstd, Cuda(cos), Cuda(sin), again);
    EXPECT_TRUE(at::equal(again, gpu_grad)) << name << ": the weight gradient is not deterministic";
  }
}

// RoPE alone has no sums: the kernels' rounded float32 operations give the ATen path's bits, in
// bfloat16 and float32, at every fused head dim and the ATen fallback's (96).
TEST_F(FusedLayersCuda, RopeIsBitwiseTheCpu) {
  at::manual_seed(13);
  struct Case {
    int64_t tokens, heads, dim;
    at::ScalarType type;
  };
  for (const Case& c : std::vector<Case>{{1, 1, 128, at::kBFloat16},
                                         {37, 5, 128, at::kBFloat16},
                                         {700, 8, 64, at::kBFloat16},
                                         {19, 3, 192, at::kFloat},
                                         {9, 2, 256, at::kBFloat16},
                                         {11, 4, 96, at::kBFloat16},
                                         {2100, 8, 128, at::kFloat}}) {
    const std::string name = "T " + std::to_string(c.tokens) + " H " + std::to_string(c.heads) +
                             " D " + std::to_string(c.dim) + " " + c10::toString(c.type);
    const at::Tensor x = (2 * at::randn({c.tokens, c.heads, c.dim})).to(c.type);
    const at::Tensor dy = at::randn({c.tokens, c.heads, c.dim}).to(c.type);
    const auto [cos, sin] = RopeTables(c.tokens, c.dim, at::TensorOptions().dtype(at::kFloat));
    const at::Tensor gpu_y = RopeForward(Cuda(x), Cuda(cos), Cuda(sin));
    const at::Tensor gpu_dx = RopeBackward(Cuda(dy), Cuda(cos), Cuda(sin));
    EXPECT_EQ(gpu_y.scalar_type(), c.type) << name;
    EXPECT_EQ(gpu_dx.scalar_type(), c.type) << name;
    const at::Tensor cpu_y = RopeForward(x, cos, sin);
    const at::Tensor cpu_dx = RopeBackward(dy, cos, sin);
    EXPECT_TRUE(at::equal(gpu_y.cpu(), cpu_y))
        << name << ": forward differs by " << RelativeError(gpu_y, cpu_y);
    EXPECT_TRUE(at::equal(gpu_dx.cpu(), cpu_dx))
        << name << ": backward differs by " << RelativeError(gpu_dx, cpu_dx);
  }
}

// A chunk of no tokens: every fused layer returns empty results of the right shape and dtype and
// adds nothing to the weights' gradients (the rotary tables are [0, 1, D]).
TEST_F(FusedLayersCuda, EveryLayerTakesAChunkOfNoTokens) {
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  const at::Tensor x = at::empty({0, 4, 128}, bf16);
  const at::Tensor w = at::ones({128}, bf16);
  const auto [cos, sin] = RopeTables(0, 128, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor y = RopeForward(x, Cuda(cos), Cuda(sin));
  const at::Tensor dx = RopeBackward(x, Cuda(cos), Cuda(sin));
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_EQ(dx.sizes(), x.sizes());
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  const RmsNormResult normed = RmsNormRopeForward(x, w, 1e-6, Cuda(cos), Cuda(sin));
  EXPECT_EQ(normed.y.sizes(), x.sizes());
  at::Tensor grad = at::zeros({128}, at::kCUDA);
  const at::Tensor norm_dx = RmsNormRopeBackward(x, x, w, normed.rstd, Cuda(cos), Cuda(sin), grad);
  EXPECT_EQ(norm_dx.sizes(), x.sizes());
  EXPECT_TRUE(at::equal(grad, at::zeros_like(grad)));
  const at::Tensor h = at::empty({0, 256}, bf16.dtype(at::kFloat));
  const at::Tensor hw = at::ones({256}, bf16);
  const RmsNormResult n = RmsNormForward(h, hw, 1e-6, at::kBFloat16);
  EXPECT_EQ(n.y.sizes(), h.sizes());
  at::Tensor hgrad = at::zeros({256}, at::kCUDA);
  const at::Tensor residual = at::empty({0, 256}, h.options());
  EXPECT_EQ(RmsNormBackward(n.y, h, hw, n.rstd, hgrad, residual).sizes(), h.sizes());
  EXPECT_TRUE(at::equal(hgrad, at::zeros_like(hgrad)));
}

TEST_F(FusedLayersCuda, SwiGluMatchesTheCpu) {
  at::manual_seed(6);
  // 8-element vectors (sizes that 8 divides, aligned), elementwise otherwise; d in float32 (as the
  // model passes it) and in bfloat16; one gate that starts 2 bytes into its storage.
  struct Case {
    int64_t n;
    at::ScalarType d_type;
    bool misaligned;
  };
  for (const Case& c : std::vector<Case>{{1, at::kFloat, false},
                                         {1000, at::kFloat, false},
                                         {1003, at::kFloat, false},
                                         {2048 * 6144, at::kFloat, false},
                                         {4096, at::kBFloat16, false},
                                         {4096, at::kFloat, true}}) {
    const std::string name =
        std::to_string(c.n) + (c.misaligned ? " misaligned" : "") + " d " + c10::toString(c.d_type);
    const at::Tensor storage = (3 * at::randn({c.n + 1})).to(at::kBFloat16);
    const at::Tensor gate = c.misaligned ? storage.slice(0, 1) : storage.slice(0, 0, c.n);
    const at::Tensor up = at::randn({c.n}).to(at::kBFloat16);
    const at::Tensor d = at::randn({c.n}).to(c.d_type);
    const at::Tensor gpu_gate = c.misaligned ? Cuda(storage).slice(0, 1) : Cuda(gate);
    const at::Tensor gpu_product = SwiGluForward(gpu_gate, Cuda(up));
    EXPECT_LT(RelativeError(gpu_product, SwiGluForward(gate, up)), Tolerance(at::kBFloat16))
        << name;
    const SwiGluGrads cpu = SwiGluBackward(d, gate, up);
    const SwiGluGrads gpu = SwiGluBackward(Cuda(d), gpu_gate, Cuda(up), /*with_product=*/true);
    EXPECT_LT(RelativeError(gpu.dgate, cpu.dgate), Tolerance(at::kBFloat16)) << name;
    EXPECT_LT(RelativeError(gpu.dup, cpu.dup), Tolerance(at::kBFloat16)) << name;
    EXPECT_TRUE(at::equal(gpu.product, gpu_product)) << name;
  }
}

TEST_F(FusedLayersCuda, SwiGluOnAStackedProjectionIsBitwiseTheSeparateOne) {
  at::manual_seed(7);
  // Rows of 8-element vectors (cols 3,072 and 24) and of single elements (cols 13); one row.
  for (const auto& [rows, cols] :
       std::vector<std::pair<int64_t, int64_t>>{{300, 3072}, {5, 24}, {7, 13}, {1, 3072}}) {
    const std::string name = std::to_string(rows) + " x " + std::to_string(cols);
    const at::Tensor gate_up = Cuda((3 * at::randn({rows, 2 * cols})).to(at::kBFloat16));
    const at::Tensor gate = gate_up.narrow(1, 0, cols), up = gate_up.narrow(1, cols, cols);
    const at::Tensor d = Cuda(at::randn({rows, cols}));
    EXPECT_TRUE(
        at::equal(SwiGluForward(gate, up), SwiGluForward(gate.contiguous(), up.contiguous())))
        << name;
    const SwiGluGrads separate =
        SwiGluBackward(d, gate.contiguous(), up.contiguous(), /*with_product=*/true);
    const SwiGluGrads stacked =
        SwiGluBackward(d, gate, up, /*with_product=*/true, /*stacked=*/true);
    EXPECT_TRUE(at::equal(stacked.stacked, at::cat({separate.dgate, separate.dup}, 1))) << name;
    EXPECT_TRUE(at::equal(stacked.product, separate.product)) << name;
  }
}

// The output gate's kernels against the ATen expressions on the same GPU, bitwise (they compute
// the same float32 operations in the same order): bfloat16 and float32, the gate read in place
// from a head's [query, gate] rows (8-element vectors, head dims 256 and 24) or contiguous, odd
// widths that take the scalar loads, and no tokens.
TEST_F(FusedLayersCuda, SigmoidGateIsBitwiseTheAtenExpressions) {
  at::manual_seed(8);
  for (const at::ScalarType type : {at::kBFloat16, at::kFloat}) {
    for (const auto& [tokens, dim] : std::vector<std::pair<int64_t, int64_t>>{
             {300, 256}, {5, 24}, {7, 13}, {1, 256}, {0, 256}}) {
      const std::string name = std::string(c10::toString(type)) + " " + std::to_string(tokens) +
                               " x 4 x " + std::to_string(dim);
      const at::Tensor attention = Cuda(at::randn({tokens, 4, dim})).to(type);
      const at::Tensor rows = Cuda(3 * at::randn({tokens, 4, 2 * dim})).to(type);
      const at::Tensor dy = Cuda(at::randn({tokens, 4, dim}));
      for (const at::Tensor& gate :
           {rows.narrow(-1, dim, dim), rows.narrow(-1, dim, dim).clone()}) {
        at::Tensor a = attention.detach().requires_grad_(true);
        at::Tensor g = gate.detach().requires_grad_(true);
        const at::Tensor expected = (a.to(at::kFloat) * at::sigmoid(g.to(at::kFloat))).to(type);
        EXPECT_TRUE(at::equal(SigmoidGateForward(attention, gate), expected)) << name;
        if (tokens == 0) continue;
        const auto autograd = torch::autograd::grad({expected}, {a, g}, {dy.to(type)});
        const SigmoidGateGrads grads = SigmoidGateBackward(dy.to(type), attention, gate);
        EXPECT_TRUE(at::equal(grads.dattention, autograd[0])) << name;
        EXPECT_TRUE(at::equal(grads.dgate, autograd[1])) << name;
      }
    }
  }
}

// The log-probability head's kernels against the ATen path on the CPU (float32 logits from a
// bfloat16 model's lm_head, 151,936-wide rows and an odd width that takes the scalar loads): the
// statistics up to the sums' order, the gradient elementwise, in float32 and rounded to bfloat16.
TEST_F(FusedLayersCuda, LogitHeadMatchesTheCpu) {
  at::manual_seed(12);
  for (const int64_t vocab : {int64_t{151936}, int64_t{1001}}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    const int64_t rows = 37;
    const at::Tensor z = 4 * at::randn({rows, vocab});
    const at::Tensor targets = at::randint(vocab, {rows}, at::kLong);
    const at::Tensor weight = (at::rand({rows}) > 0.3).to(at::kFloat);
    const at::Tensor g_logprob = at::randn({rows}), g_entropy = at::randn({rows});
    const LogitRowStats cpu = LogitRowStatsForward(z, targets, true);
    const LogitRowStats gpu = LogitRowStatsForward(Cuda(z), Cuda(targets), true);
    EXPECT_TRUE(gpu.lse.is_cuda());
    EXPECT_LT(RelativeError(gpu.lse.cpu(), cpu.lse), 1e-6);
    EXPECT_TRUE(at::equal(gpu.target.cpu(), cpu.target));
    EXPECT_LT(RelativeError(gpu.mean.cpu(), cpu.mean), 1e-5);
    EXPECT_FALSE(LogitRowStatsForward(Cuda(z), Cuda(targets), false).mean.defined());
    for (const bool with_entropy : {false, true}) {
      SCOPED_TRACE(with_entropy ? "with entropy" : "log p only");
      const at::Tensor mean = with_entropy ? cpu.mean : at::Tensor();
      const at::Tensor g_ent = with_entropy ? g_entropy : at::Tensor();
      const at::Tensor expected =
          LogitGradient(z, cpu.lse, targets, weight, g_logprob, mean, g_ent, 0.5, at::kFloat);
      const auto cuda_or_undefined = [](const at::Tensor& t) { return t.defined() ? Cuda(t) : t; };
      const at::Tensor got =
          LogitGradient(Cuda(z), Cuda(cpu.lse), Cuda(targets), Cuda(weight), Cuda(g_logprob),
                        cuda_or_undefined(mean), cuda_or_undefined(g_ent), 0.5, at::kFloat);
      EXPECT_LT((got.cpu() - expected).abs().max().item<double>(),
                1e-6 * expected.abs().max().item<double>());
      const at::Tensor bf16 =
          LogitGradient(Cuda(z), Cuda(cpu.lse), Cuda(targets), Cuda(weight), Cuda(g_logprob),
                        cuda_or_undefined(mean), cuda_or_undefined(g_ent), 0.5, at::kBFloat16);
      EXPECT_TRUE(at::equal(bf16, got.to(at::kBFloat16))) << "rounded once from float32";
      // The kernel writes into rows of a larger tensor in place.
      at::Tensor gathered = at::zeros({rows + 3, vocab}, bf16.options());
      LogitGradient(Cuda(z), Cuda(cpu.lse), Cuda(targets), Cuda(weight), Cuda(g_logprob),
                    cuda_or_undefined(mean), cuda_or_undefined(g_ent), 0.5, at::kBFloat16,
                    gathered.narrow(0, 2, rows));
      EXPECT_TRUE(at::equal(gathered.narrow(0, 2, rows), bf16));
      EXPECT_EQ(gathered[0].abs().sum().item<double>(), 0.0);
    }
  }
}

}  // namespace
}  // namespace dta::kernels
