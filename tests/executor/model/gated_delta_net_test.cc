// Gated DeltaNet's pieces in float64: the chunked delta rule equals the token-by-token recurrence
// (outputs, final states and every input's gradient), a chain split anywhere and continued from
// its context (state and convolution rows) equals the whole chain, and a tree equals each of its
// root-to-leaf paths run alone. On a GPU (skipped without one), the chunked rule with the CUDA
// state-recurrence kernel equals the recurrence in float64, and the kernel's float32 results
// equal the ATen loop's.
#include "executor/model/ops/gated_delta_net.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include "executor/model/ops/gather_rows.h"
#include "kernels/chunk_state_recurrence.h"
#include "tests/testing/live_cpu_bytes.h"

namespace dta {
namespace {

using torch::autograd::variable_list;

const at::TensorOptions kDouble = at::TensorOptions().dtype(at::kDouble);

double RelativeError(const at::Tensor& actual, const at::Tensor& expected) {
  const double scale = expected.abs().max().item<double>();
  return (actual - expected).abs().max().item<double>() / std::max(scale, 1e-300);
}

struct RuleInputs {
  at::Tensor q, k, v, g, beta, state;
  std::vector<at::Tensor> all() const { return {q, k, v, g, beta, state}; }
};

RuleInputs RandomRuleInputs(int64_t t, int64_t heads, int64_t dk, int64_t dv, uint64_t seed) {
  at::manual_seed(seed);
  auto normalized = [&] {
    const at::Tensor x = at::randn({t, heads, dk}, kDouble);
    return x / x.norm(2, -1, /*keepdim=*/true);
  };
  RuleInputs in;
  in.q = normalized().requires_grad_(true);
  in.k = normalized().requires_grad_(true);
  in.v = at::randn({t, heads, dv}, kDouble).requires_grad_(true);
  // Log decays in [-1, 0), betas in (0, 1): the ranges Qwen3-Next's parameterisation produces.
  in.g = (-at::rand({t, heads}, kDouble)).requires_grad_(true);
  in.beta = at::sigmoid(at::randn({t, heads}, kDouble)).requires_grad_(true);
  in.state = (0.3 * at::randn({heads, dk, dv}, kDouble)).requires_grad_(true);
  return in;
}

// Gradients of sum(out * wo) + sum(final * ws) with respect to every input.
std::vector<at::Tensor> Gradients(const GatedDeltaOutput& r, const RuleInputs& in, uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor wo = at::randn(r.out.sizes(), kDouble);
  const at::Tensor ws = at::randn(r.final_state.sizes(), kDouble);
  const at::Tensor loss = (r.out * wo).sum() + (r.final_state * ws).sum();
  return torch::autograd::grad({loss}, in.all());
}

struct RuleCase {
  int64_t length, chunk;
};

class ChunkedRule : public ::testing::TestWithParam<RuleCase> {};

TEST_P(ChunkedRule, EqualsTheRecurrenceWithGradients) {
  const RuleCase c = GetParam();
  const RuleInputs in = RandomRuleInputs(c.length, /*heads=*/3, /*dk=*/8, /*dv=*/5, c.length);
  const GatedDeltaOutput chunked =
      ChunkedGatedDeltaRule(in.q, in.k, in.v, in.g, in.beta, in.state, c.chunk);
  const GatedDeltaOutput recurrent =
      RecurrentGatedDeltaRule(in.q, in.k, in.v, in.g, in.beta, in.state);
  EXPECT_LT(RelativeError(chunked.out, recurrent.out), 1e-12);
  EXPECT_LT(RelativeError(chunked.final_state, recurrent.final_state), 1e-12);
  const std::vector<at::Tensor> a = Gradients(chunked, in, 7), b = Gradients(recurrent, in, 7);
  const char* names[] = {"q", "k", "v", "g", "beta", "state"};
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LT(RelativeError(a[i], b[i]), 1e-11) << names[i];
}

INSTANTIATE_TEST_SUITE_P(Lengths, ChunkedRule,
                         ::testing::Values(RuleCase{1, 64}, RuleCase{5, 64}, RuleCase{64, 64},
                                           RuleCase{130, 64}, RuleCase{17, 1}, RuleCase{17, 3},
                                           RuleCase{40, 16}));

RuleInputs RuleInputsOn(const RuleInputs& in, at::TensorOptions o) {
  auto to = [&](const at::Tensor& t) { return t.detach().to(o).requires_grad_(true); };
  return {to(in.q), to(in.k), to(in.v), to(in.g), to(in.beta), to(in.state)};
}

TEST(ChunkedRuleOnCuda, KernelEqualsTheRecurrenceInFloat64) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t heads = 3, dk = 8, dv = 40;
  for (const RuleCase c :
       {RuleCase{1, 64}, RuleCase{130, 64}, RuleCase{200, 64}, RuleCase{17, 3}}) {
    const RuleInputs in = RandomRuleInputs(c.length, heads, dk, dv, 40 + c.length);
    const RuleInputs gpu = RuleInputsOn(in, kDouble.device(at::kCUDA));
    const int64_t chunks = (c.length + c.chunk - 1) / c.chunk;
    ASSERT_TRUE(kernels::ChunkStateUsesKernel(
        at::zeros({heads, chunks, c.chunk, dk}, kDouble.device(at::kCUDA)), dv));
    const GatedDeltaOutput chunked =
        ChunkedGatedDeltaRule(gpu.q, gpu.k, gpu.v, gpu.g, gpu.beta, gpu.state, c.chunk);
    const GatedDeltaOutput recurrent =
        RecurrentGatedDeltaRule(in.q, in.k, in.v, in.g, in.beta, in.state);
    EXPECT_LT(RelativeError(chunked.out.cpu(), recurrent.out), 1e-12) << c.length;
    EXPECT_LT(RelativeError(chunked.final_state.cpu(), recurrent.final_state), 1e-12) << c.length;
    at::manual_seed(7);
    const at::Tensor wo = at::randn(recurrent.out.sizes(), kDouble);
    const at::Tensor ws = at::randn(recurrent.final_state.sizes(), kDouble);
    const std::vector<at::Tensor> a = torch::autograd::grad(
        {(chunked.out * wo.cuda()).sum() + (chunked.final_state * ws.cuda()).sum()}, gpu.all());
    const std::vector<at::Tensor> b = torch::autograd::grad(
        {(recurrent.out * wo).sum() + (recurrent.final_state * ws).sum()}, in.all());
    const char* names[] = {"q", "k", "v", "g", "beta", "state"};
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_LT(RelativeError(a[i].cpu(), b[i]), 1e-11) << names[i] << " T " << c.length;
    }
  }
}

TEST(ChunkedRuleOnCuda, KernelEqualsTheAtenLoopInFloat32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  // Qwen3-Next's head dims, a few heads, four and a half chunks.
  const RuleInputs in = RandomRuleInputs(288, 4, 128, 128, 41);
  const RuleInputs gpu = RuleInputsOn(in, kDouble.dtype(at::kFloat).device(at::kCUDA));
  auto run = [&](bool kernel) {
    if (!kernel) setenv("DTA_LINEAR_ATTENTION_KERNEL", "0", 1);
    const GatedDeltaOutput r =
        ChunkedGatedDeltaRule(gpu.q, gpu.k, gpu.v, gpu.g, gpu.beta, gpu.state);
    at::manual_seed(8);
    const at::Tensor wo = at::randn(r.out.sizes(), r.out.options());
    const at::Tensor ws = at::randn(r.final_state.sizes(), r.out.options());
    std::vector<at::Tensor> all =
        torch::autograd::grad({(r.out * wo).sum() + (r.final_state * ws).sum()}, gpu.all());
    all.push_back(r.out.detach());
    all.push_back(r.final_state.detach());
    unsetenv("DTA_LINEAR_ATTENTION_KERNEL");
    return all;
  };
  const std::vector<at::Tensor> kernel = run(true), aten = run(false);
  const char* names[] = {"q", "k", "v", "g", "beta", "state", "out", "final_state"};
  for (size_t i = 0; i < kernel.size(); ++i) {
    EXPECT_LT(RelativeError(kernel[i].to(at::kDouble).cpu(), aten[i].to(at::kDouble).cpu()), 1e-4)
        << names[i];
  }
}

TEST(ChunkedRule, ZeroStateMeansNoState) {
  RuleInputs in = RandomRuleInputs(9, 2, 4, 4, 3);
  const GatedDeltaOutput none = ChunkedGatedDeltaRule(in.q, in.k, in.v, in.g, in.beta, {});
  const GatedDeltaOutput zero =
      ChunkedGatedDeltaRule(in.q, in.k, in.v, in.g, in.beta, at::zeros_like(in.state));
  EXPECT_LT(RelativeError(none.out, zero.out), 1e-15);
  // And a non-zero state matters (the comparison above can fail).
  const GatedDeltaOutput some = ChunkedGatedDeltaRule(in.q, in.k, in.v, in.g, in.beta, in.state);
  EXPECT_GT(RelativeError(some.out, zero.out), 1e-3);
}

TEST(ChunkedRule, RefusesBadShapes) {
  const RuleInputs in = RandomRuleInputs(4, 2, 4, 3, 1);
  EXPECT_THROW(ChunkedGatedDeltaRule(in.q, in.k.slice(1, 0, 1), in.v, in.g, in.beta, in.state),
               c10::Error);
  EXPECT_THROW(ChunkedGatedDeltaRule(in.q, in.k, in.v, in.g.t(), in.beta, in.state), c10::Error);
  EXPECT_THROW(ChunkedGatedDeltaRule(in.q, in.k, in.v, in.g, in.beta, in.state.transpose(1, 2)),
               c10::Error);
}

TEST(ChainRuns, SplitsAtBranchPoints) {
  // 0-1-2, 1-3, 3-4, 0-5 (DFS order), and 6 on the context.
  const std::vector<int64_t> parents = {-1, 0, 1, 1, 3, 0, -1};
  const std::vector<TokenRun> runs = ChainRuns(parents, 7);
  const int64_t expected[][3] = {{0, 1, -1}, {1, 2, 0}, {2, 3, 1},
                                 {3, 5, 1},  {5, 6, 0}, {6, 7, -1}};
  ASSERT_EQ(runs.size(), std::size(expected));
  for (size_t i = 0; i < runs.size(); ++i) {
    EXPECT_EQ(runs[i].begin, expected[i][0]) << i;
    EXPECT_EQ(runs[i].end, expected[i][1]) << i;
    EXPECT_EQ(runs[i].parent_run, expected[i][2]) << i;
  }
  EXPECT_EQ(ChainRuns({}, 5).size(), 1u);
  const std::vector<int64_t> later = {-1, 2, 0};
  EXPECT_THROW(ChainRuns(later, 3), c10::Error);
  const std::vector<int64_t> short_list = {-1};
  EXPECT_THROW(ChainRuns(short_list, 3), c10::Error);
}

// The tree's tokens in DFS order and each root-to-leaf path's token indices.
struct SmallTree {
  std::vector<int64_t> parents;
  std::vector<std::vector<int64_t>> paths;
};

SmallTree ExampleTree() {
  // 0 1 2 | 1 -> 3 4 | 4 -> 5 | 0 -> 6 7 8 (one-token and deep branches), and 9 on the context.
  SmallTree tree;
  tree.parents = {-1, 0, 1, 1, 3, 4, 0, 6, 7, -1};
  tree.paths = {{0, 1, 2}, {0, 1, 3, 4, 5}, {0, 6, 7, 8}, {9}};
  return tree;
}

TEST(TreeRule, EqualsEveryPathAlone) {
  const SmallTree tree = ExampleTree();
  const int64_t n = tree.parents.size();
  const RuleInputs in = RandomRuleInputs(n, 2, 6, 4, 11);
  const GatedDeltaOutput whole =
      TreeGatedDeltaRule(in.q, in.k, in.v, in.g, in.beta, ChainRuns(tree.parents, n), in.state, 2);
  for (const std::vector<int64_t>& path : tree.paths) {
    const at::Tensor index = at::tensor(path, at::TensorOptions().dtype(at::kLong));
    auto pick = [&](const at::Tensor& x) { return x.index_select(0, index); };
    const GatedDeltaOutput alone = RecurrentGatedDeltaRule(pick(in.q), pick(in.k), pick(in.v),
                                                           pick(in.g), pick(in.beta), in.state);
    EXPECT_LT(RelativeError(pick(whole.out), alone.out), 1e-12) << path.back();
  }
}

// Key heads that each serve several value heads (Qwen3-Next: 16 key, 32 value heads) equal the
// rule over key heads repeated to every value head, outputs and gradients, on a tree and a chain,
// and the token-by-token reference takes them too.
TEST(TreeRule, GroupedKeyHeadsEqualRepeatedOnes) {
  const SmallTree tree = ExampleTree();
  const int64_t n = tree.parents.size(), key_heads = 2, group = 3;
  const RuleInputs in = RandomRuleInputs(n, key_heads * group, 6, 4, 12);
  at::manual_seed(13);
  const at::Tensor qk = at::randn({n, key_heads, 6}, kDouble);
  const at::Tensor kk = at::randn({n, key_heads, 6}, kDouble);
  const at::Tensor weights = at::randn({n, key_heads * group, 4}, kDouble);
  for (const bool chain : {false, true}) {
    const std::vector<TokenRun> runs =
        chain ? std::vector<TokenRun>{{.begin = 0, .end = n}} : ChainRuns(tree.parents, n);
    auto run = [&](bool repeated) {
      const at::Tensor q = (qk / qk.norm(2, -1, true)).requires_grad_(true);
      const at::Tensor k = (kk / kk.norm(2, -1, true)).requires_grad_(true);
      const at::Tensor rq = repeated ? q.repeat_interleave(group, 1) : q;
      const at::Tensor rk = repeated ? k.repeat_interleave(group, 1) : k;
      const GatedDeltaOutput out =
          TreeGatedDeltaRule(rq, rk, in.v, in.g, in.beta, runs, in.state, 2);
      std::vector<at::Tensor> found =
          torch::autograd::grad({(out.out * weights).sum() + out.final_state.sum()},
                                {q, k, in.v, in.g, in.beta, in.state});
      found.push_back(out.out.detach());
      return found;
    };
    const std::vector<at::Tensor> grouped = run(false), repeated = run(true);
    for (size_t i = 0; i < grouped.size(); ++i) {
      EXPECT_LT(RelativeError(grouped[i], repeated[i]), 1e-13) << i << (chain ? " chain" : " tree");
    }
  }
  const GatedDeltaOutput reference =
      RecurrentGatedDeltaRule(qk, kk, in.v.detach(), in.g.detach(), in.beta.detach(), {});
  const GatedDeltaOutput expected =
      RecurrentGatedDeltaRule(qk.repeat_interleave(group, 1), kk.repeat_interleave(group, 1),
                              in.v.detach(), in.g.detach(), in.beta.detach(), {});
  EXPECT_TRUE(at::equal(reference.out, expected.out));
}

TEST(TreeCausalConv, EqualsTransformersConv1dOnAChain) {
  at::manual_seed(5);
  const int64_t t = 9, c = 6, kernel = 4;
  const at::Tensor x = at::randn({t, c}, kDouble);
  const at::Tensor weight = at::randn({c, 1, kernel}, kDouble);
  // transformers' causal_conv1d_fn: conv1d with kernel - 1 zeros of padding, the first T outputs.
  const at::Tensor expected =
      at::silu(at::conv1d(x.t().unsqueeze(0), weight, {}, 1, kernel - 1, 1, c)
                   .narrow(2, 0, t)
                   .squeeze(0)
                   .t());
  const at::Tensor index = ConvAncestorIndex({}, t, 0, kernel, at::kCPU);
  const at::Tensor ours = TreeCausalConv(x, weight.view({c, kernel}), {}, index);
  EXPECT_LT(RelativeError(ours, expected), 1e-14);
}

TEST(TreeCausalConv, ContextAndTreeEqualEachPath) {
  at::manual_seed(6);
  const SmallTree tree = ExampleTree();
  const int64_t n = tree.parents.size(), c = 5, kernel = 4;
  // Two context rows: paths reach into them, then into zeros.
  const at::Tensor context = at::randn({2, c}, kDouble);
  const at::Tensor x = at::randn({n, c}, kDouble);
  const at::Tensor weight = at::randn({c, kernel}, kDouble);
  const at::Tensor ours =
      TreeCausalConv(x, weight, context, ConvAncestorIndex(tree.parents, n, 2, kernel, at::kCPU));
  for (const std::vector<int64_t>& path : tree.paths) {
    const at::Tensor index = at::tensor(path, at::TensorOptions().dtype(at::kLong));
    const at::Tensor chain = at::cat({context, x.index_select(0, index)});
    const at::Tensor alone = TreeCausalConv(
        chain, weight, {}, ConvAncestorIndex({}, chain.size(0), 0, kernel, at::kCPU));
    EXPECT_LT(RelativeError(ours.index_select(0, index), alone.narrow(0, 2, path.size())), 1e-14)
        << path.back();
  }
}

// The convolution's operations as autograd would keep them (TreeCausalConv recomputes them in
// backward instead).
at::Tensor PlainConv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& context,
                     const at::Tensor& index) {
  const at::ScalarType type = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor table =
      at::cat({at::zeros({1, x.size(1)}, x.options().dtype(type)), context.to(type), x.to(type)});
  const at::Tensor taps =
      GatherRows(table, index.reshape({-1})).view({x.size(0), weight.size(1), x.size(1)});
  return at::silu((taps * weight.to(type).t().unsqueeze(0)).sum(1)).to(x.scalar_type());
}

// Backward recomputes the taps from the inputs: the same operations, so the same gradients bit
// for bit, while the graph keeps the inputs only (not the kernel gathered rows and the
// pre-activation in float32).
TEST(TreeCausalConv, KeepsItsInputsNotItsTapsAndGivesTheSameGradients) {
  const SmallTree tree = ExampleTree();
  const int64_t n = tree.parents.size(), kernel = 4;
  for (const at::ScalarType dtype : {at::kDouble, at::kFloat, at::kBFloat16}) {
    at::manual_seed(7);
    const at::TensorOptions o = at::TensorOptions().dtype(dtype);
    const int64_t c = 48;
    const at::Tensor index = ConvAncestorIndex(tree.parents, n, 2, kernel, at::kCPU);
    const at::Tensor x = at::randn({n, c}, o).requires_grad_();
    const at::Tensor weight = at::randn({c, kernel}, o.dtype(at::kFloat)).requires_grad_();
    const at::Tensor context = at::randn({2, c}, o).requires_grad_();
    const at::Tensor seed = at::randn({n, c}, o);
    const variable_list plain =
        torch::autograd::grad({PlainConv(x, weight, context, index)}, {x, weight, context}, {seed});
    const variable_list ours = torch::autograd::grad({TreeCausalConv(x, weight, context, index)},
                                                     {x, weight, context}, {seed});
    for (size_t i = 0; i < plain.size(); ++i)
      EXPECT_TRUE(at::equal(ours[i], plain[i])) << dtype << " input " << i;
    // Without a context (the root chunk) and with only the weight asking for its gradient.
    const at::Tensor root = ConvAncestorIndex({}, n, 0, kernel, at::kCPU);
    const at::Tensor empty = at::empty({0, c}, o);
    EXPECT_TRUE(at::equal(
        torch::autograd::grad({TreeCausalConv(x.detach(), weight, {}, root)}, {weight}, {seed})[0],
        torch::autograd::grad({PlainConv(x.detach(), weight, empty, root)}, {weight}, {seed})[0]))
        << dtype;
  }

  // What a kept graph holds: a long chain in float32, with x and the weight held outside.
  const int64_t t = 4096, c = 64;
  const at::Tensor x = at::randn({t, c}).requires_grad_();
  const at::Tensor weight = at::randn({c, kernel}).requires_grad_();
  const at::Tensor index = ConvAncestorIndex({}, t, 0, kernel, at::kCPU);
  auto kept_bytes = [&](auto convolve) {
    const auto live = std::make_shared<testing::LiveCpuBytes>();
    c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, live);
    const at::Tensor out = convolve();
    return live->live() - out.nbytes();
  };
  const int64_t plain = kept_bytes([&] { return PlainConv(x, weight, at::empty({0, c}), index); });
  const int64_t ours = kept_bytes([&] { return TreeCausalConv(x, weight, {}, index); });
  // The plain graph keeps the taps and the pre-activation, (kernel + 1) values per channel and
  // token (and the gathered table); this one keeps x itself, allocated before.
  EXPECT_GE(plain, (kernel + 1) * t * c * 4);
  EXPECT_LT(ours, t * c * 4 / 4) << "the taps were kept";
}

TEST(ConvAncestorIndex, RefusesBadParents) {
  const std::vector<int64_t> parents = {-1, 1};
  EXPECT_THROW(ConvAncestorIndex(parents, 2, 0, 4, at::kCPU), c10::Error);
  EXPECT_THROW(ConvAncestorIndex({}, 2, 0, 0, at::kCPU), c10::Error);
}

TEST(GradientInto, AddsTheGradientIntoTheAccumulator) {
  const at::Tensor constant = at::randn({3, 2}, kDouble);
  const at::Tensor accumulator = at::ones({3, 2}, kDouble);
  const at::Tensor leaf = GradientInto(constant, accumulator);
  ASSERT_TRUE(leaf.requires_grad());
  (leaf * 2.0).sum().backward();
  EXPECT_TRUE(at::equal(accumulator, at::full({3, 2}, 3.0, kDouble)));
  {
    at::AutoGradMode no_grad(false);
    EXPECT_FALSE(GradientInto(constant, accumulator).requires_grad());
  }
  EXPECT_FALSE(GradientInto(constant, at::Tensor()).requires_grad());
}

// A small layer: 2 key heads, 4 value heads.
struct LayerFixture {
  GatedDeltaNetShape shape{.key_heads = 2,
                           .value_heads = 4,
                           .key_head_dim = 4,
                           .value_head_dim = 3,
                           .conv_kernel = 4,
                           .eps = 1e-6};
  int64_t hidden = 10;
  GatedDeltaNetWeights w;

  explicit LayerFixture(uint64_t seed) {
    at::manual_seed(seed);
    auto param = [](std::vector<int64_t> shape, double scale) {
      return (scale * at::randn(shape, kDouble)).requires_grad_(true);
    };
    w.in_proj_qkvz = param({2 * shape.key_dim() + 2 * shape.value_dim(), hidden}, 0.4);
    w.in_proj_ba = param({2 * shape.value_heads, hidden}, 0.4);
    w.conv1d = param({shape.conv_dim(), 1, shape.conv_kernel}, 0.5);
    w.dt_bias = param({shape.value_heads}, 0.5);
    w.a_log = param({shape.value_heads}, 0.5);
    w.norm = (1.0 + 0.1 * at::randn({shape.value_head_dim}, kDouble)).requires_grad_(true);
    w.out_proj = param({hidden, shape.value_dim()}, 0.4);
  }
  std::vector<at::Tensor> parameters() const {
    return {w.in_proj_qkvz, w.in_proj_ba, w.conv1d, w.dt_bias, w.a_log, w.norm, w.out_proj};
  }
  LinearMixerOutput Run(const at::Tensor& x, const LinearContext& context,
                        int64_t context_rows) const {
    return GatedDeltaNetForward(
        w, shape, x, ConvAncestorIndex({}, x.size(0), context_rows, shape.conv_kernel, at::kCPU),
        ChainRuns({}, x.size(0)), context);
  }
};

// The push/pop contract: a chain run as [0, m) and then [m, T) on the first part's context (its
// last kernel - 1 convolution inputs and its final state, as constants with accumulators) gives
// the whole chain's outputs, and backpropagating the second part first (filling the
// accumulators) and then the first part seeded with them gives every gradient of the whole.
TEST(GatedDeltaNetLayer, SplitChainWithContextEqualsTheWhole) {
  const LayerFixture f(21);
  const int64_t t = 11;
  at::manual_seed(22);
  const at::Tensor x = at::randn({t, f.hidden}, kDouble).requires_grad_(true);
  const at::Tensor seed = at::randn({t, f.hidden}, kDouble);

  const LinearMixerOutput whole = f.Run(x, {}, 0);
  const std::vector<at::Tensor> params = f.parameters();
  std::vector<at::Tensor> inputs = params;
  inputs.push_back(x);
  const std::vector<at::Tensor> expected =
      torch::autograd::grad({(whole.out * seed).sum()}, inputs);

  for (int64_t m : {1, 2, 5, 10}) {
    const at::Tensor x1 = x.detach().slice(0, 0, m).requires_grad_(true);
    const at::Tensor x2 = x.detach().slice(0, m, t).requires_grad_(true);
    const LinearMixerOutput first = f.Run(x1, {}, 0);
    const int64_t rows = std::min<int64_t>(m, f.shape.conv_kernel - 1);
    const at::Tensor conv_rows = first.conv_inputs.detach().slice(0, m - rows, m);
    const at::Tensor state = first.final_state.detach();
    const LinearContext context{.conv_inputs = conv_rows,
                                .grad_conv_inputs = at::zeros_like(conv_rows),
                                .state = state,
                                .grad_state = at::zeros_like(state)};
    const LinearMixerOutput second = f.Run(x2, context, rows);
    EXPECT_LT(RelativeError(at::cat({first.out, second.out}), whole.out), 1e-13) << m;
    EXPECT_LT(RelativeError(second.final_state, whole.final_state), 1e-13) << m;

    // backward (as the executor runs it), not grad(): the context's accumulators fill only when
    // backward reaches their leaves.
    for (const at::Tensor& p : params) p.mutable_grad() = at::Tensor();
    torch::autograd::backward({(second.out * seed.slice(0, m, t)).sum()});
    EXPECT_GT(context.grad_state.abs().max().item<double>(), 0.0);
    // The first part: its own loss plus what the second part sent back through the context.
    const at::Tensor conv_grad =
        at::zeros_like(first.conv_inputs)
            .index_put_({at::indexing::Slice(m - rows, m)}, context.grad_conv_inputs);
    torch::autograd::backward({first.out, first.conv_inputs, first.final_state},
                              {seed.slice(0, 0, m), conv_grad, context.grad_state});
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_LT(RelativeError(params[i].grad(), expected[i]), 1e-11)
          << "parameter " << i << " m " << m;
    const std::vector<at::Tensor> g1 = {x1.grad()}, g2 = {x2.grad()};
    EXPECT_LT(RelativeError(at::cat({g1.back(), g2.back()}), expected.back()), 1e-11) << m;
  }
}

// Qwen3.5's separate projections of the layer `grouped` holds as Qwen3-Next's: the rows of
// in_proj_qkvz and in_proj_ba regrouped (all q, all k, all v; all z; all b; all a), the other
// parameters copies. `swap_gates` exchanges b and a (a wrong layout, for the test to fail on).
GatedDeltaNetWeights SeparateProjections(const LayerFixture& grouped, bool swap_gates = false) {
  const GatedDeltaNetShape& s = grouped.shape;
  const int64_t kh = s.key_heads, vh = s.value_heads, dk = s.key_head_dim, dv = s.value_head_dim;
  const int64_t g = vh / kh, hidden = grouped.hidden;
  const std::vector<at::Tensor> qkvz = grouped.w.in_proj_qkvz.detach()
                                           .view({kh, 2 * dk + 2 * g * dv, hidden})
                                           .split_with_sizes({dk, dk, g * dv, g * dv}, 1);
  const std::vector<at::Tensor> ba =
      grouped.w.in_proj_ba.detach().view({kh, 2 * g, hidden}).split_with_sizes({g, g}, 1);
  auto leaf = [](const at::Tensor& t) { return t.detach().clone().requires_grad_(true); };
  GatedDeltaNetWeights w;
  w.in_proj_qkv =
      leaf(at::cat({qkvz[0].reshape({kh * dk, hidden}), qkvz[1].reshape({kh * dk, hidden}),
                    qkvz[2].reshape({vh * dv, hidden})}));
  w.in_proj_z = leaf(qkvz[3].reshape({vh * dv, hidden}));
  w.in_proj_b = leaf(ba[swap_gates ? 1 : 0].reshape({vh, hidden}));
  w.in_proj_a = leaf(ba[swap_gates ? 0 : 1].reshape({vh, hidden}));
  for (at::Tensor GatedDeltaNetWeights::*p :
       {&GatedDeltaNetWeights::conv1d, &GatedDeltaNetWeights::dt_bias, &GatedDeltaNetWeights::a_log,
        &GatedDeltaNetWeights::norm, &GatedDeltaNetWeights::out_proj}) {
    w.*p = leaf(grouped.w.*p);
  }
  return w;
}

// One layer in both layouts computes the same outputs, state and cache rows, and the same
// gradients (the projections' regrouped alike): the mixer reads both as one.
TEST(GatedDeltaNetLayer, Qwen35sSeparateProjectionsAreQwen3NextsRegrouped) {
  const LayerFixture grouped(41);
  LayerFixture separate(41);
  separate.w = SeparateProjections(grouped);
  const int64_t t = 9;
  at::manual_seed(42);
  const at::Tensor x = at::randn({t, grouped.hidden}, kDouble);
  const at::Tensor seed = at::randn({t, grouped.hidden}, kDouble);
  const LinearMixerOutput a = grouped.Run(x, {}, 0);
  const LinearMixerOutput b = separate.Run(x, {}, 0);
  EXPECT_LT(RelativeError(b.out, a.out), 1e-14);
  EXPECT_LT(RelativeError(b.final_state, a.final_state), 1e-14);
  EXPECT_LT(RelativeError(b.conv_inputs, a.conv_inputs), 1e-14);
  torch::autograd::backward({(a.out * seed).sum()});
  torch::autograd::backward({(b.out * seed).sum()});
  // The grouped gradients regrouped as the separate weights are.
  LayerFixture grads(41);
  grads.w.in_proj_qkvz = grouped.w.in_proj_qkvz.grad();
  grads.w.in_proj_ba = grouped.w.in_proj_ba.grad();
  const GatedDeltaNetWeights expected = SeparateProjections(grads);
  EXPECT_LT(RelativeError(separate.w.in_proj_qkv.grad(), expected.in_proj_qkv), 1e-13);
  EXPECT_LT(RelativeError(separate.w.in_proj_z.grad(), expected.in_proj_z), 1e-13);
  EXPECT_LT(RelativeError(separate.w.in_proj_b.grad(), expected.in_proj_b), 1e-13);
  EXPECT_LT(RelativeError(separate.w.in_proj_a.grad(), expected.in_proj_a), 1e-13);
  EXPECT_LT(RelativeError(separate.w.conv1d.grad(), grouped.w.conv1d.grad()), 1e-13);
  EXPECT_LT(RelativeError(separate.w.a_log.grad(), grouped.w.a_log.grad()), 1e-13);
  EXPECT_LT(RelativeError(separate.w.norm.grad(), grouped.w.norm.grad()), 1e-13);
  // A wrong regrouping computes something else.
  separate.w = SeparateProjections(grouped, /*swap_gates=*/true);
  EXPECT_GT(RelativeError(separate.Run(x, {}, 0).out, a.out), 1e-3);
}

TEST(GatedDeltaNetLayer, ContextMatters) {
  // Without its context the second part computes something else: the split test can fail.
  const LayerFixture f(31);
  at::manual_seed(32);
  const at::Tensor x = at::randn({8, f.hidden}, kDouble);
  const LinearMixerOutput whole = f.Run(x, {}, 0);
  const LinearMixerOutput alone = f.Run(x.slice(0, 4, 8), {}, 0);
  EXPECT_GT(RelativeError(alone.out, whole.out.slice(0, 4, 8)), 1e-3);
}

}  // namespace
}  // namespace dta
