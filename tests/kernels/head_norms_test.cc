// kernels/head_norms: the hand-written backward passes against autograd through the forward's
// ATen expressions in float64 (relative error 1e-12; head dims from 2: at 1 the gradient of x is
// all cancellation), the errors for bad shapes, and, on a GPU,
// the CUDA kernels against the same functions run on the CPU from the same inputs: float32
// results within 1e-5 (relative to the tensor's largest magnitude), bfloat16 results within one
// bfloat16 step, the weight gradient within 1e-4, backward bitwise deterministic. Shapes cover
// one row, more rows than the gated backward has blocks, row counts no block size divides, every
// kernel head dim (64, 128, 256), one the kernels leave to ATen (96), inputs read in place at a
// token stride wider than their heads (the q and k columns of the convolution's output), and a
// chunk of no tokens. The GPU tests skip without a CUDA device.
#include "kernels/head_norms.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/kernels/kernel_testing.h"

namespace dta::kernels {
namespace {

using testing::kFloat64;
using testing::RelativeError;

// The model's expressions before the kernels, differentiated by autograd.
at::Tensor L2Expression(const at::Tensor& x, double eps) {
  return x * at::rsqrt((x * x).sum(-1, true) + eps);
}
at::Tensor GatedExpression(const at::Tensor& x, const at::Tensor& w, const at::Tensor& z,
                           double eps) {
  const at::Tensor normed = x * at::rsqrt(x.pow(2).mean(-1, true) + eps);
  return normed * w * at::silu(z);
}

TEST(HeadNorms, L2NormBackwardIsTheGradientOfTheForward) {
  at::manual_seed(1);
  for (int64_t d : {2, 7, 128}) {
    const at::Tensor x = at::randn({5, 3, d}, kFloat64);
    const at::Tensor dy = at::randn({5, 3, d}, kFloat64);
    const HeadNormResult forward = L2NormForward(x, 1e-6);
    EXPECT_LT(RelativeError(forward.y, L2Expression(x, 1e-6)), 1e-14);
    at::Tensor xr = x.clone().requires_grad_(true);
    const at::Tensor expected =
        torch::autograd::grad({(L2Expression(xr, 1e-6) * dy).sum()}, {xr})[0];
    EXPECT_LT(RelativeError(L2NormBackward(dy, x, forward.rstd), expected), 1e-12) << "d " << d;
  }
}

TEST(HeadNorms, GatedRmsNormBackwardIsTheGradientOfTheForward) {
  at::manual_seed(2);
  for (int64_t d : {2, 7, 128}) {
    const at::Tensor x = at::randn({5, 3, d}, kFloat64);
    const at::Tensor w = 1 + 0.1 * at::randn({d}, kFloat64);
    const at::Tensor z = 2 * at::randn({5, 3, d}, kFloat64);
    const at::Tensor dy = at::randn({5, 3, d}, kFloat64);
    const HeadNormResult forward = GatedRmsNormForward(x, w, z, 1e-6, at::kDouble);
    EXPECT_LT(RelativeError(forward.y, GatedExpression(x, w, z, 1e-6)), 1e-14);
    at::Tensor weight_grad = at::full({d}, 0.5, kFloat64);  // added into, not overwritten
    const GatedRmsNormGrads found = GatedRmsNormBackward(dy, x, w, z, forward.rstd, weight_grad);
    at::Tensor xr = x.clone().requires_grad_(true), wr = w.clone().requires_grad_(true),
               zr = z.clone().requires_grad_(true);
    const std::vector<at::Tensor> expected =
        torch::autograd::grad({(GatedExpression(xr, wr, zr, 1e-6) * dy).sum()}, {xr, wr, zr});
    EXPECT_LT(RelativeError(found.dx, expected[0]), 1e-12) << "d " << d;
    EXPECT_LT(RelativeError(weight_grad - 0.5, expected[1]), 1e-12) << "d " << d;
    EXPECT_LT(RelativeError(found.dz, expected[2]), 1e-12) << "d " << d;
  }
}

TEST(HeadNorms, BadShapesAreNamed) {
  const at::Tensor x = at::randn({4, 2, 8}, kFloat64);
  const at::Tensor w = at::ones({8}, kFloat64);
  using ::testing::HasSubstr;
  using ::testing::ThrowsMessage;
  EXPECT_THAT(
      [&] {
        L2NormForward(x.view({8, 8}), 1e-6);
      },
      ThrowsMessage<c10::Error>(HasSubstr("x must be a floating [T, H, D] tensor")));
  EXPECT_THAT([&] { GatedRmsNormForward(x, at::ones({7}, kFloat64), x, 1e-6, at::kDouble); },
              ThrowsMessage<c10::Error>(HasSubstr("weight [7] must be [D]")));
  EXPECT_THAT([&] { GatedRmsNormForward(x, w, x.narrow(0, 0, 3), 1e-6, at::kDouble); },
              ThrowsMessage<c10::Error>(HasSubstr("z [3, 2, 8] must have x's shape")));
  const HeadNormResult n = L2NormForward(x, 1e-6);
  EXPECT_THAT([&] { L2NormBackward(x, x, n.rstd.narrow(0, 0, 2)); },
              ThrowsMessage<c10::Error>(HasSubstr("rstd [2, 2, 1] must be [4, 2, 1]")));
  at::Tensor small_grad = at::zeros({4}, kFloat64);
  EXPECT_THAT([&] { GatedRmsNormBackward(x, x, w, x, n.rstd, small_grad); },
              ThrowsMessage<c10::Error>(HasSubstr("weight_grad must have weight's shape")));
}

class HeadNormsCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device; the kernels need a GPU";
  }
};

// One bfloat16 step at the tensor's largest magnitude, plus float32 rounding.
double Tolerance(at::ScalarType type) { return type == at::kFloat ? 1e-5 : 1.0 / 128; }

at::Tensor Cuda(const at::Tensor& t) { return t.to(at::kCUDA); }

struct Case {
  int64_t tokens, heads, dim;
  at::ScalarType x_type;
  int64_t token_stride;  // > heads * dim: x is a view into wider rows
};

std::string NameOf(const Case& c) {
  return std::to_string(c.tokens) + " x " + std::to_string(c.heads) + " x " +
         std::to_string(c.dim) + " " + c10::toString(c.x_type) + " stride " +
         std::to_string(c.token_stride);
}

// x [T, H, D] of x_type, a view at token_stride (on the CPU; .to(kCUDA) keeps no strides, so the
// GPU's view is cut from the GPU copy of the wide rows).
std::pair<at::Tensor, at::Tensor> Inputs(const Case& c, double scale) {
  const at::Tensor wide = (scale * at::randn({c.tokens, c.token_stride})).to(c.x_type);
  auto view = [&](const at::Tensor& w) {
    return w.narrow(1, 0, c.heads * c.dim).view({c.tokens, c.heads, c.dim});
  };
  return {view(wide), view(Cuda(wide))};
}

const std::vector<Case> kCases = {
    {1, 1, 128, at::kBFloat16, 128},
    {37, 16, 128, at::kBFloat16, 8192},  // q's columns of the convolution's output
    {1000, 32, 128, at::kFloat, 4096},
    {3001, 5, 64, at::kBFloat16, 320},
    {700, 3, 256, at::kFloat, 800},
    {9, 4, 96, at::kBFloat16, 384},  // a head dim the kernels leave to ATen
    {0, 32, 128, at::kFloat, 4096},  // a chunk of no tokens
};

TEST_F(HeadNormsCuda, L2NormMatchesTheCpu) {
  at::manual_seed(3);
  for (const Case& c : kCases) {
    const auto [x, x_gpu] = Inputs(c, 1.0);
    const at::Tensor dy = at::randn({c.tokens, c.heads, c.dim});
    const HeadNormResult cpu = L2NormForward(x, 1e-6);
    const HeadNormResult gpu = L2NormForward(x_gpu, 1e-6);
    if (c.tokens == 0) {
      EXPECT_EQ(gpu.y.numel(), 0);
      EXPECT_EQ(L2NormBackward(Cuda(dy), x_gpu, gpu.rstd).numel(), 0);
      continue;
    }
    EXPECT_EQ(gpu.y.scalar_type(), at::kFloat) << NameOf(c);
    EXPECT_LT(RelativeError(gpu.y, cpu.y), 1e-5) << NameOf(c);
    EXPECT_LT(RelativeError(gpu.rstd, cpu.rstd), 1e-5) << NameOf(c);
    const at::Tensor cpu_dx = L2NormBackward(dy, x, cpu.rstd);
    const at::Tensor gpu_dx = L2NormBackward(Cuda(dy), x_gpu, gpu.rstd);
    EXPECT_EQ(gpu_dx.scalar_type(), c.x_type) << NameOf(c);
    EXPECT_LT(RelativeError(gpu_dx, cpu_dx), Tolerance(c.x_type)) << NameOf(c);
    EXPECT_TRUE(at::equal(L2NormBackward(Cuda(dy), x_gpu, gpu.rstd), gpu_dx)) << NameOf(c);
  }
}

TEST_F(HeadNormsCuda, GatedRmsNormMatchesTheCpu) {
  at::manual_seed(4);
  for (const Case& c : kCases) {
    const auto [x, x_gpu] = Inputs(c, 3.0);
    const auto [z, z_gpu] = Inputs({c.tokens, c.heads, c.dim, at::kBFloat16, c.token_stride}, 2.0);
    const at::Tensor w = 1 + 0.1 * at::randn({c.dim});
    const at::Tensor dy = at::randn({c.tokens, c.heads, c.dim}).to(at::kBFloat16);
    const HeadNormResult cpu = GatedRmsNormForward(x, w, z, 1e-6, at::kBFloat16);
    const HeadNormResult gpu = GatedRmsNormForward(x_gpu, Cuda(w), z_gpu, 1e-6, at::kBFloat16);
    at::Tensor cpu_grad = at::zeros({c.dim});
    const GatedRmsNormGrads cpu_dx = GatedRmsNormBackward(dy, x, w, z, cpu.rstd, cpu_grad);
    at::Tensor gpu_grad = at::ones({c.dim}, at::kCUDA);
    const GatedRmsNormGrads gpu_dx =
        GatedRmsNormBackward(Cuda(dy), x_gpu, Cuda(w), z_gpu, gpu.rstd, gpu_grad);
    if (c.tokens == 0) {
      EXPECT_EQ(gpu.y.numel() + gpu_dx.dx.numel() + gpu_dx.dz.numel(), 0);
      EXPECT_TRUE(at::equal(gpu_grad, at::ones({c.dim}, at::kCUDA)));
      continue;
    }
    EXPECT_LT(RelativeError(gpu.y, cpu.y), Tolerance(at::kBFloat16)) << NameOf(c);
    EXPECT_LT(RelativeError(gpu.rstd, cpu.rstd), 1e-5) << NameOf(c);
    EXPECT_EQ(gpu_dx.dx.scalar_type(), at::kFloat) << NameOf(c);
    EXPECT_EQ(gpu_dx.dz.scalar_type(), at::kBFloat16) << NameOf(c);
    EXPECT_LT(RelativeError(gpu_dx.dx, cpu_dx.dx), 1e-5) << NameOf(c);
    EXPECT_LT(RelativeError(gpu_dx.dz, cpu_dx.dz), Tolerance(at::kBFloat16)) << NameOf(c);
    EXPECT_LT(RelativeError(gpu_grad - 1, cpu_grad), 1e-4) << NameOf(c);
    at::Tensor again = at::ones({c.dim}, at::kCUDA);
    const GatedRmsNormGrads repeat =
        GatedRmsNormBackward(Cuda(dy), x_gpu, Cuda(w), z_gpu, gpu.rstd, again);
    EXPECT_TRUE(at::equal(repeat.dx, gpu_dx.dx) && at::equal(repeat.dz, gpu_dx.dz) &&
                at::equal(again, gpu_grad))
        << NameOf(c) << ": backward is not deterministic";
  }
}

}  // namespace
}  // namespace dta::kernels
