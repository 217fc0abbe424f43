// kernels/tree_causal_conv.h: the CUDA forward and backward against autograd through the plain
// operations in float64 (a table of zeros, context and x; the gathered taps times the weight,
// summed, silu), on trees with branch points, context rows, tokens that read zeros, kernel sizes 1
// to 4 and 8, and enough tokens for several of the weight gradient's partial sums and for every
// block to loop over tokens; float32 inputs within 1e-5 and bfloat16 within 1e-2 of the largest
// magnitude, bitwise equal across runs; 8 channels a thread bitwise a channel a thread; which
// operands the kernels take. Only the CPU's dispatch runs without a CUDA device.
#include "kernels/tree_causal_conv.h"

#include <torch/autograd.h>
#include <torch/cuda.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace dta::kernels {
namespace {

// index [T, kernel]: token t's taps, oldest first: its kernel - 1 nearest ancestors (by parents,
// -1 = the chunk's root row) and itself, as table rows (1 + P + token); above the chunk the
// context's rows from its last, then row 0 (zeros).
at::Tensor AncestorIndex(const std::vector<int64_t>& parents, int64_t context_rows,
                         int64_t kernel) {
  const int64_t tokens = static_cast<int64_t>(parents.size());
  std::vector<int64_t> index(tokens * kernel, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    int64_t node = t;
    int64_t context_row = -1;
    for (int64_t i = kernel - 1; i >= 0; --i) {
      if (node >= 0) {
        index[t * kernel + i] = 1 + context_rows + node;
        if (parents[node] < 0) context_row = context_rows - 1;
        node = parents[node];
      } else {
        index[t * kernel + i] = context_row >= 0 ? 1 + context_row : 0;
        if (context_row >= 0) --context_row;
      }
    }
  }
  return at::tensor(index, at::TensorOptions().dtype(at::kLong)).view({tokens, kernel});
}

// A tree of `tokens` tokens: chains with branch points (a token's parent is the previous token,
// or, one time in `branching`, an earlier one), the first token at the root.
std::vector<int64_t> RandomParents(int64_t tokens, int branching, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int64_t> parents(tokens, -1);
  for (int64_t t = 1; t < tokens; ++t) {
    parents[t] = t - 1;
    if (branching > 0 && rng() % branching == 0)
      parents[t] = static_cast<int64_t>(rng() % (t + 1)) - 1;  // -1: a second root
  }
  return parents;
}

struct Reference {
  at::Tensor out, dx, dweight, dcontext;
};

// Autograd through the plain operations in float64 on the CPU.
Reference PlainConvolution(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& context,
                           const at::Tensor& index, const at::Tensor& grad_out) {
  auto leaf = [](const at::Tensor& t) {
    return t.cpu().to(at::kDouble).detach().requires_grad_(true);
  };
  const at::Tensor x64 = leaf(x), w64 = leaf(weight), c64 = leaf(context);
  const int64_t tokens = x.size(0), channels = x.size(1), kernel = weight.size(1);
  const at::Tensor table = at::cat({at::zeros({1, channels}, x64.options()), c64, x64});
  const at::Tensor taps =
      table.index_select(0, index.cpu().reshape({-1})).view({tokens, kernel, channels});
  const at::Tensor out = at::silu((taps * w64.t().unsqueeze(0)).sum(1));
  const auto grads = torch::autograd::grad({out}, {x64, w64, c64}, {grad_out.cpu().to(at::kDouble)},
                                           /*retain_graph=*/std::nullopt, /*create_graph=*/false,
                                           /*allow_unused=*/true);
  return {out.detach(), grads[0], grads[1], grads[2]};
}

double RelativeError(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor w = want.cpu().to(at::kDouble);
  const double scale = std::max(w.abs().max().item<double>(), 1e-30);
  return (got.cpu().to(at::kDouble) - w).abs().max().item<double>() / scale;
}

struct Case {
  int64_t tokens, channels, context_rows, kernel;
  int branching;  // 0: one chain
  std::string Name() const {
    return "T=" + std::to_string(tokens) + " C=" + std::to_string(channels) +
           " P=" + std::to_string(context_rows) + " K=" + std::to_string(kernel) +
           " branching=" + std::to_string(branching);
  }
};

void CheckCase(const Case& c, at::ScalarType type, double tolerance, uint32_t seed) {
  SCOPED_TRACE(c.Name() + " " + std::string(c10::toString(type)));
  at::manual_seed(seed);
  const auto on_gpu = at::TensorOptions(at::kCUDA).dtype(type);
  const at::Tensor x = at::randn({c.tokens, c.channels}).to(on_gpu);
  const at::Tensor weight = (at::randn({c.channels, c.kernel}) * 0.5).to(on_gpu);
  const at::Tensor context = at::randn({c.context_rows, c.channels}).to(on_gpu);
  const at::Tensor index =
      AncestorIndex(RandomParents(c.tokens, c.branching, seed), c.context_rows, c.kernel)
          .to(at::kCUDA);
  const at::Tensor grad_out = at::randn({c.tokens, c.channels}).to(on_gpu);
  ASSERT_TRUE(TreeCausalConvKernelRuns(x, weight, context, index));

  const Reference want = PlainConvolution(x, weight, context, index, grad_out);
  const at::Tensor out = TreeCausalConvForward(x, weight, context, index);
  ASSERT_EQ(out.scalar_type(), type);
  EXPECT_LE(RelativeError(out, want.out), tolerance);
  const TreeCausalConvGrads got = TreeCausalConvBackward(grad_out, x, weight, context, index);
  ASSERT_EQ(got.x.scalar_type(), type);
  ASSERT_EQ(got.weight.scalar_type(), type);
  ASSERT_EQ(got.context.sizes(), context.sizes());
  EXPECT_LE(RelativeError(got.x, want.dx), tolerance);
  EXPECT_LE(RelativeError(got.weight, want.dweight), tolerance);
  if (c.context_rows > 0) {
    EXPECT_LE(RelativeError(got.context, want.dcontext), tolerance);
  }

  const TreeCausalConvGrads again = TreeCausalConvBackward(grad_out, x, weight, context, index);
  EXPECT_TRUE(at::equal(got.x, again.x) && at::equal(got.weight, again.weight) &&
              at::equal(got.context, again.context))
      << "the backward is not deterministic";
  EXPECT_TRUE(at::equal(out, TreeCausalConvForward(x, weight, context, index)));
}

class TreeCausalConvGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device; the kernels need a GPU";
    const at::Tensor probe = at::zeros({1, 1}, at::TensorOptions(at::kCUDA));
    if (!TreeCausalConvKernelRuns(probe, at::zeros({1, 1}, probe.options()),
                                  at::zeros({0, 1}, probe.options()),
                                  at::zeros({1, 1}, probe.options().dtype(at::kLong)))) {
      GTEST_SKIP() << "a build without the CUDA kernels, or DTA_CONV_KERNEL=0";
    }
  }
};

const Case kCases[] = {
    {1, 8, 0, 4, 0},        // one token: three taps of zeros
    {5, 16, 2, 4, 0},       // the first tokens read the context, then zeros
    {37, 64, 3, 4, 3},      // branch points: rows read by several children
    {200, 96, 0, 3, 5},     // several roots
    {700, 128, 5, 1, 4},    // kernel size 1: each row read once
    {1000, 40, 7, 8, 6},    // the largest kernel
    {2100, 320, 3, 4, 50},  // nine partial sums of the weight's gradient
    {9000, 24, 2, 4, 40},   // more tokens than the grid has rows of blocks: each loops
    {300, 12, 2, 4, 5},     // channels that are not whole vectors of 8: a thread a channel
};

TEST_F(TreeCausalConvGpu, Float32MatchesTheFloat64Operations) {
  uint32_t seed = 1;
  for (const Case& c : kCases) CheckCase(c, at::kFloat, 1e-5, seed++);
}

TEST_F(TreeCausalConvGpu, BFloat16MatchesTheFloat64Operations) {
  uint32_t seed = 11;
  for (const Case& c : kCases) CheckCase(c, at::kBFloat16, 1e-2, seed++);
}

// The kernels take 8 channels a thread where the rows allow it (whole vectors, 16-byte aligned) and
// a channel a thread otherwise; both compute the same sums in the same order: the same bits. (The
// misaligned inputs switch the forward, the pre-activation gradient and the weight's gradient; the
// table's gradient reads and writes fresh tensors: its scalar path runs in the 12-channel case.)
TEST_F(TreeCausalConvGpu, EightChannelsAThreadIsBitwiseAChannelAThread) {
  for (const at::ScalarType type : {at::kBFloat16, at::kFloat}) {
    SCOPED_TRACE(c10::toString(type));
    at::manual_seed(21);
    const int64_t tokens = 500, channels = 64, context_rows = 3, kernel = 4;
    const auto on_gpu = at::TensorOptions(at::kCUDA).dtype(type);
    // Each tensor also as a view one element into a larger buffer: not 16-byte aligned.
    const auto misaligned = [](const at::Tensor& t) {
      at::Tensor buffer = at::empty({t.numel() + 1}, t.options());
      at::Tensor view = buffer.narrow(0, 1, t.numel()).view(t.sizes());
      view.copy_(t);
      return view;
    };
    const at::Tensor x = at::randn({tokens, channels}).to(on_gpu);
    const at::Tensor weight = (at::randn({channels, kernel}) * 0.5).to(on_gpu);
    const at::Tensor context = at::randn({context_rows, channels}).to(on_gpu);
    const at::Tensor index =
        AncestorIndex(RandomParents(tokens, 7, 21), context_rows, kernel).to(at::kCUDA);
    const at::Tensor grad_out = at::randn({tokens, channels}).to(on_gpu);
    const at::Tensor out = TreeCausalConvForward(x, weight, context, index);
    const TreeCausalConvGrads grads = TreeCausalConvBackward(grad_out, x, weight, context, index);
    const at::Tensor x1 = misaligned(x), context1 = misaligned(context),
                     grad_out1 = misaligned(grad_out);
    ASSERT_TRUE(TreeCausalConvKernelRuns(x1, weight, context1, index));
    EXPECT_TRUE(at::equal(out, TreeCausalConvForward(x1, weight, context1, index)));
    const TreeCausalConvGrads scalar =
        TreeCausalConvBackward(grad_out1, x1, weight, context1, index);
    EXPECT_TRUE(at::equal(grads.x, scalar.x));
    EXPECT_TRUE(at::equal(grads.weight, scalar.weight));
    EXPECT_TRUE(at::equal(grads.context, scalar.context));
  }
}

// On the CPU (or without the kernels) nothing is taken: the caller's ATen path runs.
TEST(TreeCausalConv, TakesNothingOnTheCpu) {
  EXPECT_FALSE(TreeCausalConvKernelRuns(at::zeros({4, 8}), at::zeros({8, 4}), at::zeros({0, 8}),
                                        at::zeros({4, 4}, at::kLong)));
}

TEST_F(TreeCausalConvGpu, TakesOnlyTheOperandsItCovers) {
  const auto gpu = [](const at::Tensor& t) { return t.to(at::kCUDA); };
  const at::Tensor x = gpu(at::zeros({4, 8}));
  const at::Tensor w = gpu(at::zeros({8, 4}));
  const at::Tensor ctx = gpu(at::zeros({0, 8}));
  const at::Tensor index = gpu(at::zeros({4, 4}, at::kLong));
  EXPECT_TRUE(TreeCausalConvKernelRuns(x, w, ctx, index));
  EXPECT_FALSE(TreeCausalConvKernelRuns(x.to(at::kDouble), w, ctx.to(at::kDouble),
                                        index));  // float64: the exact ATen path
  EXPECT_FALSE(TreeCausalConvKernelRuns(x, gpu(at::zeros({8, 9})), ctx,
                                        gpu(at::zeros({4, 9}, at::kLong))));  // 9 taps
  EXPECT_FALSE(TreeCausalConvKernelRuns(gpu(at::zeros({8, 4})).t(), w, ctx,
                                        index));  // not contiguous
  EXPECT_FALSE(TreeCausalConvKernelRuns(x, w, ctx.to(at::kBFloat16), index));
  EXPECT_FALSE(TreeCausalConvKernelRuns(x, w, ctx, index.to(at::kInt)));
  EXPECT_FALSE(TreeCausalConvKernelRuns(x, w, ctx, gpu(at::zeros({4, 3}, at::kLong))));
  setenv("DTA_CONV_KERNEL", "0", 1);
  EXPECT_FALSE(TreeCausalConvKernelRuns(x, w, ctx, index));
  unsetenv("DTA_CONV_KERNEL");
  EXPECT_TRUE(TreeCausalConvKernelRuns(x, w, ctx, index));
}

}  // namespace
}  // namespace dta::kernels
